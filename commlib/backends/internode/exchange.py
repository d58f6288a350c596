"""The count exchange of an internode dispatch: the row every rank all-gathers, what the host reads
of it (the digest), and the checks that raise alike on every rank.

Engine-free. The row (int64, ``row_len`` words), per rank:
  [error | signature (SIG_FIELDS) | rows per destination rank [R] | tokens over the node limit |
   expert ids out of range | rows per destination node [M] | rows per (destination node, chunk,
   local rank there) [M, Kc, P] | tokens per expert [E] | tokens T]
The device path writes it with one launch (kernels.meta); ``exchange_row`` is its torch spec.

Legend: T tokens here, R ranks, M nodes, P ranks per node, me = (node, loc), Kc the most network
chunks a call may use, E experts, Lx experts per rank.
"""
from __future__ import annotations

import torch

from commlib.backends.common import HOST, SIG_FIELDS, check_agreement, check_counts

# The reference's signature plus the network ring (it sets the chunk geometry every rank must share).
INTERNODE_SIG_FIELDS = SIG_FIELDS + ("rdma_recv_tokens",)
N_SIG = 1 + len(INTERNODE_SIG_FIELDS)   # error word + signature


def row_len(R: int, M: int, P: int, Kc: int, E: int) -> int:
    """Words of the exchange row (module docstring)."""
    return N_SIG + R + 2 + M + M * Kc * P + E + 1


def exchange_row(head: torch.Tensor, is_tir: torch.Tensor, topk, experts_in, *, M: int, P: int, E: int, Kc: int,
                 ring: int, max_nodes: int) -> tuple:
    """This rank's exchange row on ``is_tir``'s device (``head``: [error] + signature, int64 there),
    from is_token_in_rank ``is_tir`` [T, R] bool and ``topk`` [T, K] int64 (or, without top-k,
    ``experts_in`` [E]: tokens per expert). Returns (row, in_node [T, M] bool, spos [T, M] int64: a
    pair's row in its node's stream, chunk [T, M]: its network chunk)."""
    T = is_tir.shape[0]
    dev = is_tir.device
    in_node = is_tir.view(T, M, P).any(dim=2)                                   # [T, M]
    per_rank = is_tir.sum(dim=0)                                                 # [R]
    send1 = in_node.sum(dim=0)                                                   # [M]
    excess = (in_node.sum(dim=1) > max_nodes).sum().view(1)
    if topk is not None:
        bad_ids = ((topk < -1) | (topk >= E)).sum().view(1)
        ids = torch.where((topk >= 0) & (topk < E), topk, torch.full_like(topk, E)).flatten()
        per_expert = torch.zeros(E + 1, dtype=torch.int64, device=dev)
        per_expert.scatter_add_(0, ids, torch.ones_like(ids))
        per_expert = per_expert[:E]
    else:
        bad_ids = excess * 0
        per_expert = experts_in.to(dev, torch.int64)
    # per destination node m, chunk k, local rank p: rows the forwarder (m, l) passes to p
    spos = torch.cumsum(in_node.to(torch.int64), dim=0) - 1                     # [T, M]
    crows = torch.clamp((send1 + Kc - 1) // Kc, min=ring)                        # [M] rows per chunk
    chunk = torch.where(in_node, spos // crows, torch.zeros_like(spos))         # [T, M]
    slot = ((torch.arange(M, device=dev).view(1, M) * Kc + chunk) * P).unsqueeze(2) + \
        torch.arange(P, device=dev).view(1, 1, P)                               # [T, M, P]
    blocks = torch.zeros(M * Kc * P, dtype=torch.int64, device=dev)
    blocks.scatter_add_(0, slot.flatten(), is_tir.to(torch.int64).flatten())
    row = torch.cat([head, per_rank, excess, bad_ids, send1, blocks, per_expert, per_rank.new_full((1,), T)])
    return row, in_node, spos, chunk


def exchange_digest(g: torch.Tensor, *, n_sig: int, me: int, node: int, loc: int, M: int, P: int, Kc: int,
                    ring: int, Lx: int) -> torch.Tensor:
    """What the host needs of the gathered exchange ``g`` [R, row_len], as one int64 vector, so the
    one host read of a dispatch does not grow with ranks x experts: [error (a refused row, ranks
    disagreeing on the op, ids out of range, tokens over the node limit), network chunks (the most
    of any rank's stream to any node), rows received here, the most rows a rank of this node
    receives] + this rank's rows per node [M] + rows each rail peer (node order) sends this node [M]
    + this forwarder's rows per (chunk, local rank) [Kc, P] + rows each forwarder of this node passes
    here per (chunk, forwarder) [Kc, P] + tokens per expert of this rank [Lx]. The device path
    computes it with one launch (``kernels.digest``); this is its spec."""
    R = g.shape[0]
    width = n_sig + R + 2 + M   # the row up to the (node, chunk, local rank) blocks
    error = ((g[:, 0] != 0) | (g[:, 1:n_sig] != g[me, 1:n_sig]).any(dim=1)
             | (g[:, n_sig + R:n_sig + R + 2] > 0).any(dim=1)).any()
    send1 = g[:, width - M:width]                                                   # [R, M]
    rows = torch.clamp((send1 + Kc - 1) // Kc, min=max(1, ring))
    chunks = ((send1 + rows - 1) // rows).max()
    totals = g[:, n_sig + node * P:n_sig + (node + 1) * P].sum(dim=0)               # [P]
    blocks = g[:, width + node * Kc * P:width + (node + 1) * Kc * P].reshape(M, P, Kc, P).sum(dim=0)   # [q, k, p]
    ex = width + M * Kc * P + me * Lx
    head = torch.stack([error.to(torch.int64), chunks, totals[loc], totals.max()])
    return torch.cat([head, send1[me], send1[loc::P, node], blocks[loc].flatten(), blocks[:, :, loc].t().flatten(),
                      g[:, ex:ex + Lx].sum(dim=0)])


def parse_digest(d: list, M: int, P: int, Kc: int, Lx: int) -> dict:
    """The digest (host ints, ``exchange_digest``'s order) by name."""
    i, j = 4 + 2 * M, 4 + 2 * M + Kc * P
    if Kc == 1:
        fan_send, fan_recv = [d[i:j]], [d[j:j + P]]
    else:
        fan_send = [d[i + k * P:i + (k + 1) * P] for k in range(Kc)]
        fan_recv = [d[j + k * P:j + (k + 1) * P] for k in range(Kc)]
    return {"error": d[0], "num_chunks": d[1], "num_recv": d[2], "node_rows": d[3], "mine": d[4:4 + M],
            "rail_in": d[4 + M:i], "fan_send": fan_send, "fan_recv": fan_recv, "experts": d[j + Kc * P:j + Kc * P + Lx]}


def check_exchange(gh, sig: list, *, me: int, R: int, E: int, max_nodes: int) -> None:
    """The count exchange's errors, raised alike on every rank (they all read the same rows ``gh``:
    the gathered rows on the host, a tensor or lists): a refused input or disagreeing ranks, expert
    ids out of range, tokens over the node limit. Plain list reads: no torch op per element."""
    rows = gh.tolist() if isinstance(gh, torch.Tensor) else gh
    check_agreement(me, rows, sig, INTERNODE_SIG_FIELDS, N_SIG)
    wrong_ids = [(r, row[N_SIG + R + 1]) for r, row in enumerate(rows) if row[N_SIG + R + 1] > 0]
    if wrong_ids:
        raise ValueError(f"[commlib rank {me}] dispatch aborted: topk_idx holds expert ids outside [-1, {E}) "
                         f"(rank, ids out of range): {wrong_ids}; nothing was sent")
    if any(row[N_SIG + R] > 0 for row in rows):
        check_counts(me, max_nodes, [row[N_SIG + R] for row in rows], None, 0)


def head_words(sig: list, error: int = 0) -> list:
    """[error] + the signature: the row's first N_SIG words."""
    return [int(error)] + list(sig)


def host_longs(values: list) -> torch.Tensor:
    """A small int64 host tensor (named device: a caller's default device must not move it)."""
    return torch.tensor(values, dtype=torch.int64, device=HOST)


__all__ = ["INTERNODE_SIG_FIELDS", "N_SIG", "row_len", "exchange_row", "exchange_digest", "parse_digest",
           "check_exchange", "head_words", "host_longs"]
