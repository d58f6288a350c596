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

Two routes. The kernels (``fits``: the node step is the forwarder kernel, a row of x whole 4-byte
words): the pack kernel writes every (token, node) row at its slot, the forwarder stores the landed
rows at their final rows of the node's areas, and the land kernel copies them straight into the
outputs, allocated on the caller's stream (``Wiring.alloc``); rows past the received count are
then set to the padding. The host does not know the received count, so N rows would be reserved in
the areas: where they exceed what the areas hold (``ForwarderNode.window``), the forwarder lands
them a window of final rows at a time, re-reading the landed rows per window (fanout.py, Windows). Combine: the rows kernel writes this rank's rows into its area, the
forwarder sums them per chunk, the home kernel adds the node partials. Nothing of the size of the
outputs is made beside them. The torch steps (CPU ranks, the node group's all-to-all, one rank per
node): the same rows through ``Packer`` and the node step's own landing buffer.

Legend: T tokens here, H hidden, K top-k, R ranks, M nodes, P ranks per node, W bytes of a packed
row, per = M x rows per chunk (the rows of one chunk), N = num_worst_tokens (rows out).
"""
from __future__ import annotations

import torch

from commlib import layout as L
from commlib.backends.base import CombineRequest, CombineResult, DispatchRequest, DispatchResult
from commlib.backends.common import bias_start
from commlib.backends.internode import kernels as IK
from commlib.backends.internode.counted import exchange, expert_columns, finish
from commlib.backends.internode.exchange import N_SIG
from commlib.backends.internode.geometry import Plan, padded_plan
from commlib.backends.internode.network import stream
from commlib.backends.internode.rows import area_row, combine_packer, dispatch_packer, here, payload, rows_on
from commlib.backends.internode.wiring import Wiring
from commlib.handle import DispatchHandle


def fits(w: Wiring, req: DispatchRequest) -> bool:
    """Whether a num_worst_tokens dispatch (and its handle's calls) runs on the kernels: rows land in
    the forwarder's areas, and a row of x is whole 4-byte words (H % 4 == 0, as ``device.fits``)."""
    return w.node.in_area and req.x.shape[1] % 4 == 0


def dispatch(w: Wiring, req: DispatchRequest, sig: list, ring: int, name: str, kernels: bool = False) -> DispatchResult:
    """A dispatch with ``num_worst_tokens`` rows out: one collective for the counts, no host read.
    ``kernels``: the kernel route (``fits``; the engine also asks for CuPy and COMMLIB_INTERNODE_KERNELS)."""
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
    if kernels:
        return _dispatch_kernels(w, req, plan, topk, is_tir, rank_prefix, chan_prefix, send_head, g, name)
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
    if plan.kernels:
        return _cached_kernels(w, req, plan)
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
    if plan.kernels:
        return _combine_kernels(w, req, plan)
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


# ---------------------------------------------------------------------------- the kernel route
def _dispatch_kernels(w: Wiring, req: DispatchRequest, plan: Plan, topk, is_tir: torch.Tensor,
                      rank_prefix: torch.Tensor, chan_prefix: torch.Tensor, send_head: torch.Tensor,
                      g: torch.Tensor, name: str) -> DispatchResult:
    """The rest of a num_worst_tokens dispatch on the kernels (module docstring): the outputs and the
    handle's tensors are allocated once, on the call's output stream, and written in place."""
    topo, dev = w.topology, w.device
    me, R = topo.rank, topo.num_ranks
    x = here(req.x, dev)
    scales = here(req.x_scales, dev) if req.x_scales is not None else None
    T, H = x.shape
    E, N, C = req.num_experts, plan.num_recv, req.config.num_channels
    K = topk.shape[1] if topk is not None else 0
    wts = here(req.topk_weights, dev) if K and req.topk_weights is not None else None
    topk = here(topk, dev) if K else None
    Lx = E // R
    i32 = torch.int32
    plan.kernels = True
    plan.slot = torch.where(plan.slot < plan.slots, plan.slot, -1).to(i32)   # -1: the pair is not sent
    packer = dispatch_packer(x, scales, K, wts is not None)
    plan.area_row = area_row(packer, H, K)
    rows, recv_x, recv_scales, recv_topk_idx, recv_topk_w, recv_src_idx, rp, cp, rcp, sh = w.alloc(
        _rows_spec(w, plan, packer), ((N, H), x.dtype),
        ((N, scales.shape[1]), torch.float32) if scales is not None else None,
        ((N, K), torch.int64) if K else None, ((N, K), torch.float32) if wts is not None else None,
        ((N,), i32), ((R, R), i32), ((R, C), i32), ((R, C), i32), ((T, R), i32))
    sh.copy_(send_head)
    outs = (recv_x, recv_scales, recv_src_idx, recv_topk_idx, recv_topk_w)
    _move_kernels(w, plan, packer, rows, x, scales, topk, wts, sh, cached=False,
                  land=lambda addr, stride, lo, hi: IK.land(addr, hi - lo, stride, -1, *_window(outs, lo, hi, N), K=K,
                                                            expert_lo=me * Lx, num_local=Lx))
    _pad(plan, (recv_x, 0), (recv_scales, 0), (recv_src_idx, -1), (recv_topk_idx, -1), (recv_topk_w, 0))
    rp.copy_(rank_prefix)
    cp.copy_(chan_prefix)
    rcp.copy_(L.recv_channel_prefix(recv_src_idx, rank_prefix[:, me], g[:, -1], C))
    out = req.x.device
    moved = out != dev
    if moved:   # inputs on another device than the engine's: the outputs and the handle go back there
        recv_x, recv_scales, recv_topk_idx, recv_topk_w, recv_src_idx, rp, cp, rcp, sh, is_tir = [
            None if t is None else t.to(out) for t in (recv_x, recv_scales, recv_topk_idx, recv_topk_w,
                                                       recv_src_idx, rp, cp, rcp, sh, is_tir)]
    handle = DispatchHandle(
        rank_prefix_matrix=rp, channel_prefix_matrix=cp, recv_channel_prefix_matrix=rcp, recv_src_idx=recv_src_idx,
        is_token_in_rank=is_tir, send_head=sh, topology=topo, num_tokens=T, hidden=H, num_experts=E,
        num_channels=C, num_recv_tokens=None, num_worst_tokens=N, backend=name,
        extra={"plan": plan, "num_recv": N})
    return DispatchResult(recv_x, recv_scales, recv_topk_idx, recv_topk_w, [], handle,
                          blocks=w.take_blocks(keep=not moved))


def _rows_spec(w: Wiring, plan: Plan, packer) -> tuple:
    """The allocation of a call's send rows and landing rows, every slot of each: [2 slots, W + 4 P]."""
    return (2 * plan.slots, packer.row_bytes + 4 * w.topology.ranks_per_node), torch.uint8


def _window(outs: tuple, lo: int, hi: int, N: int) -> list:
    """The outputs' rows [lo, hi) (None stays None; the whole tensors for one window of N rows)."""
    if lo == 0 and hi == N:
        return list(outs)
    return [None if t is None else t[lo:hi] for t in outs]


def _move_kernels(w: Wiring, plan: Plan, packer, rows: torch.Tensor, x, scales, topk, wts, send_head: torch.Tensor,
                  cached: bool, land) -> None:
    """Pack every (token, node) row at its slot of the send rows, run the network chunks into the
    landing rows (both ``rows``: ``_rows_spec``) with the forwarder, window by window (one where the
    areas hold all N rows): the rows of window [lo, hi) end at their final rows - lo from area row
    ``at``, then ``land(address there, row stride, lo, hi)`` copies them into the outputs' rows."""
    topo = w.topology
    M, P = topo.num_nodes, topo.ranks_per_node
    W, crows, N = packer.row_bytes, plan.crows, plan.num_recv
    per = M * crows
    send, landing = rows.split(plan.slots)
    send[:, W:] = 0xFF   # slots no pair fills: no position on any local rank (the forwarder skips them)
    IK.pack(None, send, plan.slot, send_head, x, scales, topk, wts, me=topo.rank, M=M, P=P, Kc=w.max_chunks, ring=1)
    node = w.node
    win = node.windows_begin(plan, W)
    first = win if win < N else None   # window [0, win) as the chunks land (None: every row, one window)

    def fan_out(k, landed):
        w.phase(f"dispatch (fan-out of chunk {k})")
        node.dispatch_chunk(k, landed, plan, W, cached, hi=first)

    stream(w.network, plan.num_chunks,
           lambda k: w.network.post(send[k * per:(k + 1) * per], [crows] * M, [crows] * M,
                                    out=landing[k * per:(k + 1) * per]),
           "dispatch", after=fan_out)
    node.finish_forward()
    w.count_padded(plan)
    addr, stride = node.address()
    land(addr, stride, 0, min(win, N))
    for i, lo in enumerate(range(win, N, win), 1):   # the areas' two halves in turn (fanout.py, Windows)
        hi, at = min(lo + win, N), (i % 2) * win
        w.phase(f"dispatch (window {i} of the forwarder)")
        node.dispatch_window(landing, W, lo, hi, at)
        land(addr + at * stride, stride, lo, hi)


def _pad(plan: Plan, *outs) -> None:
    """Rows at or past the received count (known on the device only) set to the padding:
    (tensor [N, ...] or None, value) pairs, in place. Float tensors are set through their bytes."""
    N = plan.num_recv
    pad = None
    for t, value in outs:
        if t is None or not N:
            continue
        if pad is None:
            pad = torch.arange(N, device=t.device) >= plan.num_recv_dev
        rows = t.view(torch.uint8) if t.is_floating_point() else t
        rows.masked_fill_(pad.view(-1, *([1] * (rows.dim() - 1))), value)


def _cached_kernels(w: Wiring, req: DispatchRequest, plan: Plan) -> DispatchResult:
    """Cached dispatch of a padded handle on the kernels: x (and scales) only."""
    h, dev = req.handle, w.device
    x = here(req.x, dev)
    scales = here(req.x_scales, dev) if req.x_scales is not None else None
    N = plan.num_recv
    packer = dispatch_packer(x, scales, 0, False)
    rows, recv_x, recv_scales = w.alloc(_rows_spec(w, plan, packer), ((N, x.shape[1]), x.dtype),
                                        ((N, scales.shape[1]), torch.float32) if scales is not None else None)
    outs = (recv_x, recv_scales)
    _move_kernels(w, plan, packer, rows, x, scales, None, None, here(h.send_head, dev), cached=True,
                  land=lambda addr, stride, lo, hi: IK.land(addr, hi - lo, stride, -1, *_window(outs, lo, hi, N)))
    _pad(plan, (recv_x, 0), (recv_scales, 0))
    out = req.x.device
    if out != dev:
        recv_x, recv_scales = recv_x.to(out), recv_scales.to(out) if scales is not None else None
    return DispatchResult(recv_x, recv_scales, None, None, None, h, blocks=w.take_blocks(keep=out == dev))


def _combine_kernels(w: Wiring, req: CombineRequest, plan: Plan) -> CombineResult:
    """Combine of a padded handle on the kernels: this rank's N rows into its area (rows kernel), the
    forwarder's node partials per chunk, back over the network to their slots, the home sum (the
    biases, then the node partials in node order) in one launch into the outputs."""
    h, dev, node = req.handle, w.device, w.node
    M = w.topology.num_nodes
    N, T = plan.num_recv, h.num_tokens
    y = rows_on(req.x, N, dev)
    H = y.shape[1]
    wts = rows_on(req.topk_weights, N, dev) if req.topk_weights is not None else None
    K = wts.shape[1] if wts is not None else 0
    crows = plan.crows
    per = M * crows
    node.combine_begin(lambda addr, stride, sync: IK.rows(None, N, y, wts, addr, stride, sync,
                                                          IK.synced_ctas(node.gpu_share)), plan, 2 * H + 4 * K)
    # the node partials this rank sends and the partials that come back (views of one block), the outputs
    both, out_y, out_w = w.alloc(((2 * plan.slots, 2 * H + 4 * K), torch.uint8), ((T, H), torch.bfloat16),
                                 ((T, K), torch.float32) if K else None)
    partial, back = both.split(plan.slots)
    stream(w.network, plan.num_chunks,
           lambda k: w.network.post(partial[k * per:(k + 1) * per], [crows] * M, [crows] * M,
                                    out=back[k * per:(k + 1) * per]),
           "combine", before=lambda k: node.combine_chunk(k, plan, None, H, K, out=partial[k * per:(k + 1) * per]))
    w.count_padded(plan)
    IK.home(back, plan.slot, [here(b, dev) for b in req.bias] if req.bias else [], out_y, out_w, H=H, K=K)
    out = req.x.device
    if out != dev:
        out_y, out_w = out_y.to(out), out_w.to(out) if K else None
    return CombineResult(out_y, out_w, blocks=w.take_blocks(keep=out == dev))


__all__ = ["fits", "dispatch", "move", "dispatch_cached", "combine"]
