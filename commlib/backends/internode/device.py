"""The internode engine's per-token steps as kernels (kernels.py, csrc/internode.cu): a non-cached
dispatch, its cached dispatch and combine, on NCCL with one rank per node or the forwarder kernel.
The torch steps (counted.py) are their specification; the device tests hold both to the reference.

Dispatch: meta (the exchange row, scans: one launch), the one all-gather, the digest (one launch)
and its one host read, pack (send rows and the handle's matrices), the network chunks (and the
forwarder), land (the outputs' columns), recv_chan. Cached dispatch and combine read no counts.

Legend: T tokens here, H hidden, K top-k, R ranks, M nodes, P ranks per node, C channels, E
experts, Lx experts per rank, W bytes of a packed row, Wc bytes of a combine row.
"""
from __future__ import annotations

import torch

from commlib.backends.base import CombineRequest, CombineResult, DispatchRequest, DispatchResult
from commlib.backends.internode import kernels as IK
from commlib.backends.internode.exchange import N_SIG, row_len
from commlib.backends.internode.geometry import Plan, geometry
from commlib.backends.internode.network import stream
from commlib.backends.internode.rows import (area_row, dispatch_packer, here, int32_len, int32_views, rows_on,
                                             typed_views)
from commlib.backends.common import HOST, int32_columns
from commlib.backends.internode.wiring import Wiring
from commlib.handle import DispatchHandle
from commlib.utils.math import align_up


class HeadRow:
    """[0] + signature (int64) for the meta kernel, in pinned host memory it reads through the mapped
    address (no copy, no allocation per call). Kept between calls; rewritten only when a host read
    has shown the stream past its meta kernel (``released``), else a fresh one is made."""

    def __init__(self) -> None:
        self._head, self.busy = None, False

    def get(self, sig: list) -> torch.Tensor:
        n = 1 + len(sig)
        if self._head is None or self._head[0].numel() != n or self.busy:
            t = torch.zeros(n, dtype=torch.int64, device=HOST).pin_memory()
            self._head = (t, t.numpy())
        t, arr = self._head
        arr[1:] = sig
        self.busy = True
        return t

    def released(self) -> None:
        self.busy = False   # the stream is past every kernel before a host read: the head row was read


class Scratch:
    """A non-cached dispatch's scratch, kept between calls of one shape: the exchange row, the
    gathered rows, their digest and the scans (views of one allocation, made once per shape). Safe
    to reuse: every kernel and collective that touches them is issued in the call, on the Buffer's
    comm stream (NCCL's stream waits for it at the issue), and the host read of the digest has
    shown the stream past the previous call's readers of all but ``g``, which only the pack and
    recv_chan launches of that call read, in stream order before the next meta. Such a dispatch
    reads counts on the host, so it is never inside a CUDA graph capture."""

    def __init__(self) -> None:
        self._key, self.parts, self.digest_args = None, None, None

    def get(self, w: Wiring, T: int, n_row: int, n_dig: int, ring: int, Lx: int) -> tuple:
        """(row [n_row], g [R * n_row], g as [R, n_row], digest [n_dig], before [T, R], spos [T, M]) on
        the engine's device, and ``digest_args``: the digest launch's arguments for them."""
        key = (T, n_row, n_dig, ring, Lx)
        if key != self._key:
            topo = w.topology
            R, M, P = topo.num_ranks, topo.num_nodes, topo.ranks_per_node
            row, g, dig, before, spos = typed_views(w.device, (torch.int64, (n_row,)), (torch.int64, (R * n_row,)),
                                                    (torch.int64, (n_dig,)), (torch.int32, (T, R)),
                                                    (torch.int32, (T, M)))
            g2 = g.view(R, n_row)
            self.digest_args = IK.digest_args(g2, dig, n_sig=N_SIG, me=topo.rank, node=topo.node, loc=topo.local_rank,
                                              M=M, P=P, Kc=w.max_chunks, ring=ring, Lx=Lx)
            self.parts, self._key = (row, g, g2, dig, before, spos), key
        return self.parts


def fits(req: DispatchRequest) -> bool:
    """Whether a non-cached dispatch's rows are whole 4-byte words in every dtype of its handle's
    later calls (FP8 x: H bytes; BF16: 2 H): H % 4 == 0, and no num_worst_tokens (padded path)."""
    return not req.num_worst_tokens and req.x.shape[1] % 4 == 0


def dispatch(w: Wiring, head: HeadRow, scratch: Scratch, req: DispatchRequest, sig: list, ring: int,
             name: str) -> DispatchResult:
    topo, probe = w.topology, w.probe
    me, R, M, P = topo.rank, topo.num_ranks, topo.num_nodes, topo.ranks_per_node
    Kc, dev = w.max_chunks, w.device
    x = here(req.x, dev)
    scales = here(req.x_scales, dev) if req.x_scales is not None else None
    T, H = x.shape
    E = req.num_experts
    Lx = E // R
    K = req.topk_idx.shape[1] if req.topk_idx is not None else 0
    C = req.config.num_channels
    tir = here(req.layout.is_token_in_rank, dev)
    topk = here(req.topk_idx, dev) if K else None
    wts = here(req.topk_weights, dev) if K and req.topk_weights is not None else None
    experts_in = None if K else req.layout.num_tokens_per_expert.to(dev, torch.int32).contiguous()
    probe.mark("inputs")

    # ---- 1. metadata: one launch ----
    # the exchange row, the gathered rows, their digest and the scans: kept between calls (Scratch)
    row, g_flat, g, dig, before, spos = scratch.get(w, T, row_len(R, M, P, Kc, E), IK.digest_len(M, P, Kc, Lx),
                                                    ring, Lx)
    IK.meta(tir, topk, experts_in, head.get(sig), row, before, spos, M=M, P=P, E=E, Kc=Kc, ring=ring,
            max_nodes=w.max_nodes)
    probe.op("launches")
    probe.mark("meta")

    # ---- 2. one collective, one host read (of the gathered rows' digest) ----
    w.phase("dispatch (agreement + count exchange)")
    w.gather_into(row, g_flat)
    probe.mark("exchange")
    IK.launch_digest(scratch.digest_args)
    probe.op("launches")
    counts = w.read_counts(g, dig, sig, E)
    head.released()
    num_recv, expert_counts = counts["num_recv"], counts["experts"]
    probe.mark("read")
    plan = geometry("device", counts, ring, Kc)
    probe.mark("geometry")

    # ---- 3. pack: the send rows and the handle's matrices ----
    packer = dispatch_packer(x, scales, K, wts is not None)
    W = packer.row_bytes
    # one allocator call on the output stream (Wiring.alloc) for the send and landing rows, the handle's
    # (and the plan's) int32 tensors as views of one block, and the outputs
    n_land = 0 if w.node.in_area else plan.recv_starts[-1]
    ints = ((R, R), (R, C), (R, C), (T, R), (T, M), (num_recv,), (n_land,))
    rows, block, recv_x, recv_scales, recv_topk_idx, recv_topk_w = w.alloc(
        rows_spec(w, plan, W), (int32_len(*ints), torch.int32), ((num_recv, H), x.dtype),
        ((num_recv, scales.shape[1]), torch.float32) if scales is not None else None,
        ((num_recv, K), torch.int64) if K else None, ((num_recv, K), torch.float32) if wts is not None else None)
    send, recv = send_and_landing(plan, rows)
    rank_prefix, chan_prefix, recv_chan_prefix, send_head, slot, recv_src_idx, land_all = int32_views(
        dev, *ints, block=block)
    IK.pack(g, send, slot, send_head, x, scales, topk, wts, me=me, M=M, P=P, Kc=Kc, ring=ring, n_sig=N_SIG,
            tir=tir, before=before, spos=spos, rank_prefix=rank_prefix, chan_prefix=chan_prefix)
    probe.op("launches")
    plan.slot, plan.area_row = slot, area_row(packer, H, K)
    probe.mark("pack")

    # ---- 4. network chunks (and the forwarder), 5. land ----
    landed, addr, stride, pos_off, n_rows = move(w, send, recv, W, plan, packer, cached=False)
    probe.mark("network")
    if not w.node.in_area:   # combine gathers its rows by where each landed row went
        plan.land_all = land_all
    probe.mark("outputs")
    IK.land(addr, n_rows, stride, pos_off, recv_x, recv_scales, recv_src_idx, recv_topk_idx, recv_topk_w, K=K,
            expert_lo=me * Lx, num_local=Lx, pos_out=plan.land_all)
    del landed   # (its block is the call's: held until the Buffer has the result, see Wiring.alloc)
    IK.recv_chan(recv_src_idx, g, recv_chan_prefix, n_sig=N_SIG, me=me)
    probe.op("launches", 2)
    probe.mark("land")

    out = req.x.device
    if out != dev:   # inputs on another device than the engine's: the outputs and the handle go back there
        recv_x, recv_scales, recv_topk_idx, recv_topk_w, rank_prefix, chan_prefix, recv_chan_prefix, recv_src_idx, \
            tir, send_head = [None if t is None else t.to(out) for t in (
                recv_x, recv_scales, recv_topk_idx, recv_topk_w, rank_prefix, chan_prefix, recv_chan_prefix,
                recv_src_idx, tir, send_head)]
    handle = DispatchHandle(
        rank_prefix_matrix=rank_prefix, channel_prefix_matrix=chan_prefix,
        recv_channel_prefix_matrix=recv_chan_prefix, recv_src_idx=recv_src_idx,
        is_token_in_rank=tir, send_head=send_head,
        topology=topo, num_tokens=T, hidden=H, num_experts=E, num_channels=C,
        num_recv_tokens=num_recv, num_worst_tokens=0, backend=name,
        extra={"plan": plan, "num_recv": num_recv})
    a = req.expert_alignment
    per_expert_list = expert_counts if a == 1 else [align_up(c, a) for c in expert_counts]
    return DispatchResult(recv_x, recv_scales, recv_topk_idx, recv_topk_w, per_expert_list, handle,
                          blocks=w.take_blocks(keep=out == dev))


def rows_spec(w: Wiring, plan: Plan, W: int) -> tuple:
    """The allocation of a call's send rows [S, W + 4 P] and landing rows of every chunk [J, W + 4 P]."""
    return (plan.send_starts[-1] + plan.recv_starts[-1], W + 4 * w.topology.ranks_per_node), torch.uint8


def send_and_landing(plan: Plan, rows: torch.Tensor) -> tuple:
    """The send rows and the landing rows: views of ``rows`` (``rows_spec``)."""
    S = plan.send_starts[-1]
    return rows[:S], rows[S:]


def move(w: Wiring, send: torch.Tensor, recv, W: int, plan: Plan, packer, cached: bool) -> tuple:
    """The network chunks. One rank per node: every chunk lands in one buffer (rows carry their final
    row at byte W); with the forwarder, chunk k fans out while k + 1 is on the wire and the rows sit
    at their final rows of this rank's area. Returns (the landing buffer or None, address, row
    stride, position byte or -1, rows) of what ``IK.land`` reads."""
    P = w.topology.ranks_per_node
    nch, ss, rs = plan.num_chunks, plan.send_starts, plan.recv_starts
    w.count_rows(plan)
    post = lambda k: w.network.post(send[ss[k]:ss[k + 1]], plan.send_splits[k], plan.recv_splits[k],
                                    out=recv[rs[k]:rs[k + 1]])
    if not w.node.in_area:
        stream(w.network, nch, post, "dispatch")
        return recv, recv.data_ptr(), W + 4 * P, W, rs[-1]
    w.node.dispatch_begin(plan, W, packer)

    def fan_out(k, landed):
        w.phase(f"dispatch (fan-out of chunk {k})")
        w.node.dispatch_chunk(k, landed, plan, W, cached=True)   # positions kept below, for all chunks at once

    stream(w.network, nch, post, "dispatch", after=fan_out)
    w.node.finish_forward()
    if not cached:   # the landed rows' positions on every local rank: the forwarder's combine sources
        plan.landed_pos = list(int32_columns(recv, W, W + 4 * P).split([rs[k + 1] - rs[k] for k in range(nch)]))
    addr, stride = w.node.address()
    return recv, addr, stride, -1, plan.num_recv


def dispatch_cached(w: Wiring, req: DispatchRequest, plan: Plan) -> DispatchResult:
    """Cached dispatch on the kernels: pack by the plan's slots and the handle's send_head, the
    network chunks, land (no routing columns)."""
    topo, dev, h, probe = w.topology, w.device, req.handle, w.probe
    x = here(req.x, dev)
    scales = here(req.x_scales, dev) if req.x_scales is not None else None
    packer = dispatch_packer(x, scales, 0, False)
    W = packer.row_bytes
    n = plan.num_recv
    rows, recv_x, recv_scales = w.alloc(rows_spec(w, plan, W), ((n, x.shape[1]), x.dtype),
                                        ((n, scales.shape[1]), torch.float32) if scales is not None else None)
    send, recv = send_and_landing(plan, rows)
    IK.pack(None, send, plan.slot, here(h.send_head, dev), x, scales, None, None, me=topo.rank,
            M=topo.num_nodes, P=topo.ranks_per_node, Kc=w.max_chunks, ring=1)
    probe.op("launches")
    probe.mark("pack")
    landed, addr, stride, pos_off, n_rows = move(w, send, recv, W, plan, packer, cached=True)
    probe.mark("network")
    IK.land(addr, n_rows, stride, pos_off, recv_x, recv_scales)
    probe.op("launches")
    del landed
    probe.mark("land")
    out = req.x.device
    if out != dev:
        recv_x, recv_scales = recv_x.to(out), recv_scales.to(out) if scales is not None else None
    return DispatchResult(recv_x, recv_scales, None, None, None, h, blocks=w.take_blocks(keep=out == dev))


def combine(w: Wiring, req: CombineRequest, plan: Plan) -> CombineResult:
    """Combine on the kernels: this rank's rows gathered per landed row (one rank per node) or
    published into its area and summed by the forwarder per chunk, the partials back over the
    network chunk by chunk, the home sum (the biases, then node order) in one launch."""
    h, dev, node, probe = req.handle, w.device, w.node, w.probe
    n, T = plan.num_recv, h.num_tokens
    y = rows_on(req.x, n, dev)
    H = y.shape[1]
    wts = rows_on(req.topk_weights, n, dev) if req.topk_weights is not None else None
    K = wts.shape[1] if wts is not None else 0
    Wc = 2 * H + 4 * K
    nch, ss, rs = plan.num_chunks, plan.send_starts, plan.recv_starts
    # the node partials this rank sends and the partials that come back (views of one block) and the
    # outputs: one allocator call on the output stream
    both, out_y, out_w = w.alloc(((rs[-1] + ss[-1], Wc), torch.uint8), ((T, H), torch.bfloat16),
                                 ((T, K), torch.float32) if K else None)
    partial, back = both.split_with_sizes([rs[-1], ss[-1]])
    before = None
    if not node.in_area:
        IK.rows(plan.land_all, rs[-1], y, wts, partial.data_ptr(), Wc)
        probe.op("launches")
    else:   # this rank's rows written by a kernel straight into its area, summed per chunk by the forwarder
        node.combine_begin(lambda addr, stride: IK.rows(None, n, y, wts, addr, stride), plan, Wc)
        probe.op("launches")
        before = lambda k: node.combine_chunk(k, plan, None, H, K, out=partial[rs[k]:rs[k + 1]])
    probe.mark("rows")
    stream(w.network, nch, lambda k: w.network.post(partial[rs[k]:rs[k + 1]], plan.recv_splits[k], plan.send_splits[k],
                                                    out=back[ss[k]:ss[k + 1]]), "combine", before=before)
    w.count_rows(plan)
    probe.mark("network")
    IK.home(back, plan.slot, [here(b, dev) for b in req.bias] if req.bias else [], out_y, out_w, H=H, K=K)
    probe.op("launches")
    probe.mark("home")
    out = req.x.device
    if out != dev:
        out_y, out_w = out_y.to(out), out_w.to(out) if K else None
    return CombineResult(out_y, out_w, blocks=w.take_blocks(keep=out == dev))


__all__ = ["HeadRow", "Scratch", "fits", "dispatch", "rows_spec", "send_and_landing", "move", "dispatch_cached",
           "combine"]
