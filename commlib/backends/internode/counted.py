"""The internode engine's torch steps: a dispatch whose counts the host reads once, its cached
dispatch, and combine. The specification of the device kernels (device.py), and the path on CPU
ranks and wherever the kernels do not fit.

Dispatch: the exchange row (exchange.exchange_row), one all-gather, one host read of its digest;
the send rows packed once per (token, destination node) in chunk-major order with their final rows
on every rank there; per chunk the network step, then the node step lands them at their final row
(so no sort). Combine mirrors it: per chunk the node step sums the rows of the node, the partial
crosses back, and the home rank adds the node partials in node order to 0 + the biases (DeepEP
v1's internode combine adds its biases at home, before the node partials).

Legend: T tokens here, H hidden, K top-k, R ranks, M nodes, P ranks per node, me = (node, loc),
E experts, Lx experts per rank, W bytes of a packed row, S send rows.
"""
from __future__ import annotations

import torch

from commlib import layout as L
from commlib.backends.base import CombineRequest, CombineResult, DispatchRequest, DispatchResult
from commlib.backends.common import bias_start, sum_rows
from commlib.backends.internode.exchange import N_SIG, exchange_digest, exchange_row
from commlib.backends.internode.geometry import Plan, geometry, send_order
from commlib.backends.internode.network import stream
from commlib.backends.internode.rows import area_row, combine_packer, payload, rows_on, with_positions
from commlib.backends.internode.wiring import Wiring
from commlib.handle import DispatchHandle
from commlib.utils.math import align_up


def exchange(w: Wiring, req: DispatchRequest, sig: list, ring: int, error: int = 0) -> tuple:
    """Build this rank's exchange row (torch steps) and all-gather it. Returns (g [R, row_len],
    is_tir [T, R], in_node [T, M], spos [T, M], chunk [T, M], topk on the device or None)."""
    topo, dev = w.topology, w.device
    E = req.num_experts
    K = req.topk_idx.shape[1] if req.topk_idx is not None else 0
    is_tir = req.layout.is_token_in_rank.to(dev)
    topk = req.topk_idx.to(dev) if K else None
    experts_in = None if K else req.layout.num_tokens_per_expert
    row, in_node, spos, chunk = exchange_row(w.h2d([error] + sig), is_tir, topk, experts_in, M=topo.num_nodes,
                                             P=topo.ranks_per_node, E=E, Kc=w.max_chunks, ring=ring,
                                             max_nodes=w.max_nodes)
    w.phase("dispatch (agreement + count exchange)")
    return w.gather(row), is_tir, in_node, spos, chunk, topk


def digest(w: Wiring, g: torch.Tensor, E: int, ring: int) -> torch.Tensor:
    topo = w.topology
    return exchange_digest(g, n_sig=N_SIG, me=topo.rank, node=topo.node, loc=topo.local_rank, M=topo.num_nodes,
                           P=topo.ranks_per_node, Kc=w.max_chunks, ring=ring, Lx=E // topo.num_ranks)


def dispatch(w: Wiring, req: DispatchRequest, sig: list, ring: int, name: str) -> DispatchResult:
    """A non-cached dispatch without num_worst_tokens on the torch steps."""
    topo = w.topology
    me, R = topo.rank, topo.num_ranks
    x, scales = req.x, req.x_scales
    T, H = x.shape
    out_device = x.device
    E = req.num_experts
    Lx = E // R
    K = req.topk_idx.shape[1] if req.topk_idx is not None else 0
    has_w = req.topk_weights is not None
    g, is_tir, in_node, spos, chunk, topk = exchange(w, req, sig, ring)
    tokens_of = g[:, -1]                                                         # [R] T of every rank
    counts = w.read_counts(g, digest(w, g, E, ring), sig, E)
    num_recv, expert_counts = counts["num_recv"], counts["experts"]

    # the handle's matrices (device, from the gathered counts: no host -> device copy)
    C = req.config.num_channels
    rank_prefix = torch.cumsum(g[:, N_SIG:N_SIG + R], dim=0).to(torch.int32)
    chan_prefix = L.channel_prefix_matrix(is_tir, C)
    send_head = L.send_head(is_tir, rank_prefix, me)                             # [T, R] final rows

    plan = geometry("counted", counts, ring, w.max_chunks)
    send_order(plan, in_node, chunk)
    packer, tensors = payload(x, scales, topk, req.topk_weights, w.device)
    plan.area_row = area_row(packer, H, K)
    cols = packer.unpack(move(w, packer, tensors, send_head, plan, cached=False))

    recv_x = cols["x"].to(out_device)
    recv_scales = cols["scales"].to(out_device) if scales is not None else None
    recv_src_idx = cols["src_idx"].to(out_device)
    # each source's channel prefixes towards this rank, from the rows that landed (no collective)
    recv_chan_prefix = L.recv_channel_prefix(cols["src_idx"], rank_prefix[:, me], tokens_of, C)
    recv_topk_idx, recv_topk_w = expert_columns(cols, me, Lx, K, has_w, out_device)
    per_expert_list = [align_up(int(c), req.expert_alignment) for c in expert_counts]
    handle = DispatchHandle(
        rank_prefix_matrix=rank_prefix.to(out_device), channel_prefix_matrix=chan_prefix.to(out_device),
        recv_channel_prefix_matrix=recv_chan_prefix.to(out_device), recv_src_idx=recv_src_idx,
        is_token_in_rank=is_tir.to(out_device), send_head=send_head.to(out_device),
        topology=topo, num_tokens=T, hidden=H, num_experts=E, num_channels=C,
        num_recv_tokens=num_recv, num_worst_tokens=0, backend=name,
        extra={"plan": plan, "num_recv": num_recv})
    return DispatchResult(recv_x, recv_scales, recv_topk_idx, recv_topk_w, per_expert_list, handle)


def expert_columns(cols: dict, me: int, num_local: int, K: int, has_w: bool, out_device) -> tuple:
    """recv_topk_idx (local expert ids, -1 elsewhere) and recv_topk_weights (0 elsewhere) from the
    landed rows' columns, on ``out_device``; (None, None) without top-k."""
    if not K:
        return None, None
    local_idx = L.local_expert_ids(cols["topk_idx"], me, num_local)
    if not has_w:
        return local_idx.to(out_device), None
    wts = torch.where(local_idx >= 0, cols["topk_w"], torch.zeros_like(cols["topk_w"]))
    return local_idx.to(out_device), wts.to(out_device)


def move(w: Wiring, packer, tensors: list, send_head: torch.Tensor, plan: Plan, cached: bool) -> torch.Tensor:
    """The data steps of a dispatch: pack, network chunks, node step, land at the final rows.
    Returns [num_recv, packer.row_bytes] uint8: every row is written once (by its forwarder)."""
    topo = w.topology
    M, P = topo.num_nodes, topo.ranks_per_node
    T = send_head.shape[0]
    tok, nod = plan.send_tok, plan.send_node
    W = packer.row_bytes
    if tok.numel():   # each send row carries its final row on every rank of its destination node
        base = packer.pack([t.index_select(0, tok) if t.shape[0] == T else t for t in tensors])
        send = with_positions(base, send_head.view(T, M, P)[tok, nod])
    else:
        send = torch.empty(0, W + 4 * P, dtype=torch.uint8, device=w.device)
    w.count_rows(plan)
    starts = plan.send_starts
    w.node.dispatch_begin(plan, W, packer)
    stream(w.network, plan.num_chunks,
           lambda k: w.network.post(send[starts[k]:starts[k + 1]], plan.send_splits[k], plan.recv_splits[k]),
           "dispatch", after=lambda k, landed: _fan_out(w, k, landed, plan, W, cached))
    return w.node.dispatch_end(plan, W)


def _fan_out(w: Wiring, k: int, landed, plan: Plan, W: int, cached: bool) -> None:
    w.phase(f"dispatch (fan-out of chunk {k})")
    w.node.dispatch_chunk(k, landed, plan, W, cached)


def dispatch_cached(w: Wiring, req: DispatchRequest, plan: Plan) -> DispatchResult:
    """A cached dispatch of a counted handle on the torch steps (no routing columns)."""
    h = req.handle
    x, scales = req.x, req.x_scales
    packer, tensors = payload(x, scales, None, None, w.device)
    recv = move(w, packer, tensors, h.send_head.to(w.device), plan, cached=True)
    cols = packer.unpack(recv)
    return DispatchResult(cols["x"].to(x.device), cols["scales"].to(x.device) if scales is not None else None,
                          None, None, None, h)


def combine(w: Wiring, req: CombineRequest, plan: Plan) -> CombineResult:
    """Combine of a counted handle on the torch steps: per chunk the node partial (node step), the
    network step back, then at home 0 + the biases + the node partials in node order."""
    h, dev = req.handle, w.device
    T, H = h.num_tokens, req.x.shape[1]
    n = plan.num_recv
    K = req.topk_weights.shape[1] if req.topk_weights is not None else 0
    wts = rows_on(req.topk_weights, n, dev) if K else None
    packer = combine_packer(H, K)
    rows = packer.pack([req.x[:n].to(dev)] + ([wts] if K else []))          # [n, Wc] at the final rows
    back = torch.empty(sum(plan.home_lens), packer.row_bytes, dtype=torch.uint8, device=dev)
    ss = plan.send_starts
    partials = {}
    w.node.combine_begin(rows, plan, packer.row_bytes)

    def before(k):
        partials[k] = w.node.combine_chunk(k, plan, packer, H, K)

    stream(w.network, plan.num_chunks,
           lambda k: w.network.post(partials.pop(k), plan.recv_splits[k], plan.send_splits[k],
                                    out=back[ss[k]:ss[k + 1]]), "combine", before=before)
    w.count_rows(plan)
    tok = plan.send_tok.index_select(0, plan.home)   # home: node partials in node order
    acc_y, acc_w = sum_rows(packer.unpack(back.index_select(0, plan.home)), tok.split(plan.home_lens), T, H, K,
                            bias_start(req.bias, T, H, dev))
    return finish(req, acc_y, acc_w, K)


def finish(req: CombineRequest, acc_y: torch.Tensor, acc_w, K: int) -> CombineResult:
    """The home sum (biases included) in bf16 (weights float32) on the caller's device."""
    out_device = req.x.device
    return CombineResult(acc_y.to(torch.bfloat16).to(out_device), acc_w.to(out_device) if K else None)


__all__ = ["exchange", "digest", "dispatch", "expert_columns", "move", "dispatch_cached", "combine", "finish"]
