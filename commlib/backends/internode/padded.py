"""The internode engine's num_worst_tokens path: a dispatch that reads nothing to the host, its
cached dispatch and combine.

Every rank may send cap = num_worst_tokens // R tokens, so every (rank, node) stream is padded to
cap rows and every size the collectives need is known on the host: chunks of
``geometry.chunk_rows(cap)`` rows, each (token, node) pair a fixed slot; the node step hands each
landed chunk to every rank of the node, which keeps the rows whose position for it is set.

Cost against the counted path: the network carries cap rows per (rank, node) instead of the rows
that go there, and the node step P x the landed rows. Errors (ranks disagreeing, expert ids out of
range, too many nodes per token) are found on the device: on CPU ranks every rank raises as usual;
on a GPU a device-side assert stops the process (there is no host read to raise from).

Legend: T tokens here, H hidden, K top-k, R ranks, M nodes, P ranks per node, W bytes of a packed
row, per = M x rows per chunk (the rows of one chunk).
"""
from __future__ import annotations

import torch

from commlib import layout as L
from commlib.backends.base import CombineRequest, CombineResult, DispatchRequest, DispatchResult
from commlib.backends.common import bias_start
from commlib.backends.internode.counted import exchange, expert_columns, finish
from commlib.backends.internode.exchange import N_SIG
from commlib.backends.internode.geometry import Plan, padded_plan
from commlib.backends.internode.network import stream
from commlib.backends.internode.rows import area_row, combine_packer, payload, rows_on
from commlib.backends.internode.wiring import Wiring
from commlib.handle import DispatchHandle


def dispatch(w: Wiring, req: DispatchRequest, sig: list, ring: int, name: str) -> DispatchResult:
    """A dispatch with ``num_worst_tokens`` rows out: one collective for the counts, no host read."""
    topo = w.topology
    me, R = topo.rank, topo.num_ranks
    x, scales = req.x, req.x_scales
    T, H = x.shape
    E = req.num_experts
    worst, dev, out_device = req.num_worst_tokens, w.device, x.device
    over_cap = T > worst // R
    g, is_tir, in_node, spos, _, topk = exchange(w, req, sig, ring, error=int(over_cap))
    if over_cap:
        raise ValueError(f"[commlib rank {me}] dispatch with num_worst_tokens={worst} sends at most "
                         f"num_worst_tokens // num_ranks = {worst // R} tokens per rank (the padded streams "
                         f"that need no host read); this rank has {T}")
    K = topk.shape[1] if topk is not None else 0
    has_w = req.topk_weights is not None
    if dev.type == "cpu":   # the host has the counts for free: the counted path's checks and messages
        w.check(g, sig, E)
    else:   # every rank's signature against this rank's own row
        problems = ((g[:, 0] != 0).any() | (g[:, 1:N_SIG] != g[me, 1:N_SIG].view(1, -1)).any()
                    | (g[:, N_SIG + R] > 0).any() | (g[:, N_SIG + R + 1] > 0).any())
        torch._assert_async(~problems, "commlib internode dispatch (num_worst_tokens): ranks disagree on the "
                            "op, an expert id is out of range, or a token reaches too many nodes")
    rank_prefix = torch.cumsum(g[:, N_SIG:N_SIG + R], dim=0).to(torch.int32)
    C = req.config.num_channels
    chan_prefix = L.channel_prefix_matrix(is_tir, C)
    send_head = L.send_head(is_tir, rank_prefix, me)
    plan = padded_plan(in_node, spos, worst, R, ring, w.max_chunks)
    plan.node_rows = worst
    plan.num_recv_dev = rank_prefix[-1, me].to(torch.int64)
    packer, tensors = payload(x, scales, topk, req.topk_weights, dev)
    plan.area_row = area_row(packer, H, K)
    cols = packer.unpack(move(w, packer, tensors, send_head, plan, cached=False))
    recv_topk_idx, recv_topk_w = expert_columns(cols, me, E // R, K, has_w, out_device)
    recv_chan_prefix = L.recv_channel_prefix(cols["src_idx"], rank_prefix[:, me], g[:, -1], C)
    handle = DispatchHandle(
        rank_prefix_matrix=rank_prefix.to(out_device), channel_prefix_matrix=chan_prefix.to(out_device),
        recv_channel_prefix_matrix=recv_chan_prefix.to(out_device), recv_src_idx=cols["src_idx"].to(out_device),
        is_token_in_rank=is_tir.to(out_device), send_head=send_head.to(out_device),
        topology=topo, num_tokens=T, hidden=H, num_experts=E, num_channels=C,
        num_recv_tokens=None, num_worst_tokens=worst, backend=name,
        extra={"plan": plan, "num_recv": worst})
    return DispatchResult(cols["x"].to(out_device), cols["scales"].to(out_device) if scales is not None else None,
                          recv_topk_idx, recv_topk_w, [], handle)


def move(w: Wiring, packer, tensors: list, send_head: torch.Tensor, plan: Plan, cached: bool) -> torch.Tensor:
    """The data steps of a num_worst_tokens dispatch (fresh or cached): [rows, packer.row_bytes]."""
    topo = w.topology
    M, P = topo.num_nodes, topo.ranks_per_node
    dev, W, T = w.device, packer.row_bytes, send_head.shape[0]
    send = torch.zeros(plan.slots + 1, W + 4 * P, dtype=torch.uint8, device=dev)
    send[:, W:] = 0xFF                                                          # no position: -1
    if T:
        row = torch.empty(T, W + 4 * P, dtype=torch.uint8, device=dev)
        row[:, :W] = packer.pack(tensors)
        heads = send_head.view(T, M, P)
        for m in range(M):   # a token's row once per destination node, with its positions there
            row[:, W:] = heads[:, m].contiguous().view(torch.uint8).view(T, 4 * P)
            send.index_copy_(0, plan.slot[:, m], row)
    per, crows = M * plan.crows, plan.crows
    w.node.dispatch_begin(plan, W, packer)

    def fan_out(k, landed):
        w.phase(f"dispatch (fan-out of chunk {k})")
        w.node.dispatch_chunk(k, landed, plan, W, cached)

    stream(w.network, plan.num_chunks, lambda k: w.network.post(send[k * per:(k + 1) * per], [crows] * M, [crows] * M),
           "dispatch", after=fan_out)
    w.count_padded(plan)
    return w.node.dispatch_end(plan, W)


def dispatch_cached(w: Wiring, req: DispatchRequest, plan: Plan) -> DispatchResult:
    h = req.handle
    x, scales = req.x, req.x_scales
    packer, tensors = payload(x, scales, None, None, w.device)
    cols = packer.unpack(move(w, packer, tensors, h.send_head.to(w.device), plan, cached=True))
    return DispatchResult(cols["x"].to(x.device), cols["scales"].to(x.device) if scales is not None else None,
                          None, None, None, h)


def combine(w: Wiring, req: CombineRequest, plan: Plan) -> CombineResult:
    """Combine of a num_worst_tokens handle: the dispatch's steps backwards with the same fixed sizes.
    Each rank of a node gives every forwarder its rows for that forwarder's landed rows (zeros where
    it has none), the forwarder sums them in local-rank order, the partial goes back over the
    network to its slot, and the home rank adds its node partials in node order to 0 + the biases. Adding a zero row
    changes no float32 sum here (a sum of rows never becomes -0.0), so this equals the counted
    path's sums of only the rows that exist."""
    topo, dev = w.topology, w.device
    M = topo.num_nodes
    h = req.handle
    T, H = h.num_tokens, req.x.shape[1]
    K = req.topk_weights.shape[1] if req.topk_weights is not None else 0
    nch, crows, rows = plan.num_chunks, plan.crows, plan.num_recv
    per = M * crows
    packer = combine_packer(H, K)
    wts = rows_on(req.topk_weights, rows, dev) if K else None
    mine = packer.pack([req.x[:rows].to(dev)] + ([wts] if K else []))
    w.node.combine_begin(mine, plan, packer.row_bytes)
    back = torch.empty(nch * per + 1, packer.row_bytes, dtype=torch.uint8, device=dev)
    back[nch * per:] = 0   # the dump slot: pairs not sent read zeros
    partials = {}

    def before(k):
        partials[k] = w.node.combine_chunk(k, plan, packer, H, K)

    stream(w.network, nch, lambda k: w.network.post(partials.pop(k), [crows] * M, [crows] * M,
                                                    out=back[k * per:(k + 1) * per]), "combine", before=before)
    parts = packer.unpack(back)
    acc_y = bias_start(req.bias, T, H, dev)   # the biases first, as the counted path
    acc_w = torch.zeros(T, K, dtype=torch.float32, device=dev)
    for m in range(M):   # node partials in node order; pairs not sent read the zero dump slot
        slot = plan.slot[:, m]
        acc_y += parts["y"].index_select(0, slot).float()
        if K:
            acc_w += parts["w"].index_select(0, slot)
    w.count_padded(plan)
    return finish(req, acc_y, acc_w, K)


__all__ = ["dispatch", "move", "dispatch_cached", "combine"]
