"""The internode engine's per-token steps as kernels (kernels.py, csrc/internode.cu): a non-cached
dispatch, its cached dispatch and combine, on NCCL with one rank per node or the forwarder kernel.
The torch steps (counted.py) are their specification; the device tests hold both to the reference.

Dispatch: meta (the exchange row, scans: one launch), the one all-gather, the digest (one launch)
and its one host read, pack (send rows and the handle's matrices), the network chunks (and the
forwarder), land (the outputs' columns), recv_chan. Cached dispatch and combine read no counts;
they run as kept calls (kept.py), which the Buffer replays for later calls of the same handle.

Legend: T tokens here, H hidden, K top-k, R ranks, M nodes, P ranks per node, C channels, E
experts, Lx experts per rank, W bytes of a packed row, Wc bytes of a combine row.
"""
from __future__ import annotations

import ctypes

import torch

from commlib.backends.base import CombineRequest, CombineResult, DispatchRequest, DispatchResult
from commlib.backends.internode import kernels as IK
from commlib.backends.internode.exchange import N_SIG, row_len
from commlib.backends.internode.fanout import chunk_sides
from commlib.backends.internode.geometry import Plan, geometry
from commlib.backends.internode.kept import first_combine, first_dispatch, keep
from commlib.backends.internode.network import stream
from commlib.backends.internode.rows import (area_row, dispatch_packer, here, int32_len, int32_views, output_layout,
                                             rows_on, typed_views)
from commlib.backends.common import HOST
from commlib.backends.internode.wiring import Wiring
from commlib.handle import DispatchHandle
from commlib.utils.errors import CommlibError
from commlib.utils.math import align_up


class HeadRow:
    """[0] + signature (int64) for the meta kernel, in pinned host memory it reads through the mapped
    address (no copy, no allocation per call). Kept between calls; rewritten only when a host read
    has shown the stream past its meta kernel (``released``), else a fresh one is made. Written
    through a ctypes array over the tensor's memory (ctypes' code is the launches' own: on a host
    whose caches the last call's rows flushed, numpy's assignment costs several times more)."""

    def __init__(self) -> None:
        self._head, self.busy = None, False

    def get(self, sig: list) -> torch.Tensor:
        n = 1 + len(sig)
        if self._head is None or len(self._head[1]) != n or self.busy:
            t = torch.zeros(n, dtype=torch.int64, device=HOST).pin_memory()
            self._head = (t, (ctypes.c_int64 * n).from_address(t.data_ptr()))   # the tensor keeps the memory
        t, arr = self._head
        arr[1:] = sig
        self.busy = True
        return t

    def released(self) -> None:
        self.busy = False   # the stream is past every kernel before a host read: the head row was read


class Fresh:
    """A non-cached dispatch's scratch and launches for one shape of its inputs, kept between calls
    (``Scratch``). The scratch: the exchange row, the gathered rows, their digest and the scans
    (views of one allocation). Safe to reuse: every kernel and collective that touches them is
    issued in the call, on the Buffer's comm stream (NCCL's stream waits for it at the issue), and
    the host read of the digest has shown the stream past the previous call's readers of all but
    ``g``, which only the pack and recv_chan launches of that call read, in stream order before the
    next meta. Such a dispatch reads counts on the host, so it is never inside a CUDA graph capture.
    The launches (meta, digest, pack, land, recv_chan; kept.keep): made with every check of their
    launchers by the first dispatch of the shape (land: the first that lands rows); every dispatch
    sets the argument slots that change (its tensors' addresses, its row counts)."""

    def __init__(self, w: Wiring, T: int, E: int, ring: int, C: int) -> None:
        topo = w.topology
        R, M, P, Kc = topo.num_ranks, topo.num_nodes, topo.ranks_per_node, w.max_chunks
        Lx = E // R
        n_row = row_len(R, M, P, Kc, E)
        self.row, self.g_flat, self.dig, self.before, self.spos = typed_views(
            w.device, (torch.int64, (n_row,)), (torch.int64, (R * n_row,)), (torch.int64, (IK.digest_len(M, P, Kc, Lx),)),
            (torch.int32, (T, R)), (torch.int32, (T, M)))
        self.g = self.g_flat.view(R, n_row)
        self.digest = keep(IK.digest_spec(self.g, self.dig, n_sig=N_SIG, me=topo.rank, node=topo.node,
                                          loc=topo.local_rank, M=M, P=P, Kc=Kc, ring=ring, Lx=Lx))
        self.meta = self.pack = self.land = self.recv_chan = self.packer = None
        self.node_launches = None   # the forwarder's barrier and forward, kept for the C++ path (twins.full_twin)
        self.area_row = 0
        # the handle's int32 tensors, views of one allocation (int32_views): these shapes, then the
        # received rows' source indices [N] and (one rank per node) the landed rows' output rows
        self.shapes = ((R, R), (R, C), (R, C), (T, R), (T, M))
        ends = [0]
        for a, b in self.shapes:
            ends.append(ends[-1] + 4 * a * b)
        self.ends = ends   # byte offsets: rank_prefix, chan_prefix, recv_chan_prefix, send_head, slot, recv_src_idx
        self.me, self.Lx = topo.rank, Lx


class Scratch:
    """A non-cached dispatch's kept state (``Fresh``) per shape of its inputs, for the last few shapes."""

    MAX_SHAPES = 16

    def __init__(self) -> None:
        self.shapes: dict = {}
        self.last: Fresh | None = None   # the last dispatch's (full_twin)

    def get(self, w: Wiring, key: tuple, T: int, E: int, ring: int, C: int) -> Fresh:
        f = self.shapes.get(key)
        if f is None:
            if len(self.shapes) >= self.MAX_SHAPES:
                self.shapes.clear()
            f = self.shapes[key] = Fresh(w, T, E, ring, C)
        self.last = f
        return f


def fits(req: DispatchRequest) -> bool:
    """Whether a non-cached dispatch's rows are whole 4-byte words in every dtype of its handle's
    later calls (FP8 x: H bytes; BF16: 2 H): H % 4 == 0, and no num_worst_tokens (padded path)."""
    return not req.num_worst_tokens and req.x.shape[1] % 4 == 0


def dispatch(w: Wiring, head: HeadRow, scratch: Scratch, req: DispatchRequest, sig: list, ring: int,
             name: str) -> DispatchResult:
    probe, dev, Kc = w.probe, w.device, w.max_chunks
    rec = probe.recording
    x = here(req.x, dev)
    scales = here(req.x_scales, dev) if req.x_scales is not None else None
    T, H = x.shape
    E = req.num_experts
    K = req.topk_idx.shape[1] if req.topk_idx is not None else 0
    C = req.config.num_channels
    tir = here(req.layout.is_token_in_rank, dev)
    topk = here(req.topk_idx, dev) if K else None
    wts = here(req.topk_weights, dev) if K and req.topk_weights is not None else None
    experts_in = None if K else req.layout.num_tokens_per_expert.to(dev, torch.int32).contiguous()
    if rec:
        probe.mark("inputs")
    # the shape: everything the kept launches' checks read (the rest is the engine's, fixed)
    f = scratch.get(w, (T, H, E, K, C, ring, x.dtype, -1 if scales is None else scales.shape[1], scales is None or
                        scales.dtype, tir.dtype, topk is None or topk.dtype, wts is None or wts.dtype), T, E, ring, C)
    raw = torch._C._cuda_getCurrentRawStream(w.dev_index) if w.cuda else 0   # (kept.raw_stream, no device reads)

    # ---- 1. metadata: one launch ----
    h = head.get(sig)
    if f.meta is None:
        topo = w.topology
        f.meta = keep(IK.meta_spec(tir, topk, experts_in, h, f.row, f.before, f.spos, M=topo.num_nodes,
                                   P=topo.ranks_per_node, E=E, Kc=Kc, ring=ring, max_nodes=w.max_nodes))
    a = f.meta.args
    a[IK.META_TIR], a[IK.META_HEAD] = tir.data_ptr(), h.data_ptr()
    a[IK.META_TOPK] = 0 if topk is None else topk.data_ptr()
    a[IK.META_EXPERTS] = 0 if experts_in is None else experts_in.data_ptr()
    f.meta.issue(raw)
    if rec:
        probe.op("launches")
        probe.mark("meta")

    # ---- 2. one collective, one host read (of the gathered rows' digest) ----
    w.gather_into(f.row, f.g_flat)
    if rec:
        probe.mark("exchange")
    f.digest.issue(raw)
    counts = w.read_counts(f.g, f.dig, sig, E)
    head.released()
    num_recv, expert_counts = counts["num_recv"], counts["experts"]
    if rec:
        probe.op("launches")
        probe.mark("read")
    plan = geometry("device", counts, ring, Kc)
    if rec:
        probe.mark("geometry")

    # ---- 3. pack: the send rows and the handle's matrices ----
    if f.packer is None:
        f.packer = dispatch_packer(x, scales, K, wts is not None)
        f.area_row = area_row(f.packer, H, K)
    packer = f.packer
    W = packer.row_bytes
    # on the output stream (Wiring.alloc): the send and landing rows, the handle's (and the plan's) int32
    # tensors as views of one block, and the outputs as views of one more (as the C++ path carves them)
    in_area = w.node.in_area
    # (after the source rows: one rank per node, each landed row's output row; with the forwarder, each
    # landed row's positions on every local rank, which the forward kernel stores there for combine)
    J, P = plan.recv_starts[-1], w.topology.ranks_per_node
    ints = (*f.shapes, (num_recv,), (J, P) if in_area else (J,))
    rows, block, recv_x, recv_scales, recv_topk_idx, recv_topk_w = w.alloc(
        rows_spec(w, plan, W), (int32_len(*ints), torch.int32), outputs=output_layout((
            ((num_recv, H), x.dtype), ((num_recv, scales.shape[1]), torch.float32) if scales is not None else None,
            ((num_recv, K), torch.int64) if K else None, ((num_recv, K), torch.float32) if wts is not None else None)))
    send, recv = send_and_landing(plan, rows)
    rank_prefix, chan_prefix, recv_chan_prefix, send_head, slot, recv_src_idx, tail = int32_views(
        dev, *ints, block=block)
    if f.pack is None:   # (with the forwarder it arrives at the node barrier before the forwards' stores)
        topo = w.topology
        f.pack = keep(IK.pack_spec(f.g, send, slot, send_head, x, scales, topk, wts, me=f.me, M=topo.num_nodes,
                                   P=topo.ranks_per_node, Kc=Kc, ring=ring, n_sig=N_SIG, tir=tir, before=f.before,
                                   spos=f.spos, rank_prefix=rank_prefix, chan_prefix=chan_prefix,
                                   sync=w.node.pack_sync() if in_area else None))
    b, ends = rank_prefix.data_ptr(), f.ends
    a = f.pack.args
    a[IK.PACK_TIR], a[IK.PACK_X], a[IK.PACK_SEND] = tir.data_ptr(), x.data_ptr(), send.data_ptr()
    a[IK.PACK_RANK_PREFIX], a[IK.PACK_CHAN_PREFIX], a[IK.PACK_SEND_HEAD], a[IK.PACK_SLOT] = \
        b, b + ends[1], b + ends[3], b + ends[4]
    a[IK.PACK_SCALES] = 0 if scales is None else scales.data_ptr()
    a[IK.PACK_TOPK] = 0 if topk is None else topk.data_ptr()
    a[IK.PACK_W] = 0 if wts is None else wts.data_ptr()
    f.pack.issue(raw)
    plan.slot, plan.area_row = slot, f.area_row
    if rec:
        probe.op("launches")
        probe.mark("pack")

    # ---- 4. network chunks (and the forwarder), 5. land ----
    landed, addr, stride, pos_off, n_rows = move(w, send, recv, W, plan, packer, tail if in_area else None)
    if rec:
        probe.mark("network")
    if not in_area:   # combine gathers its rows by where each landed row went
        plan.land_all = tail
    if rec:
        probe.mark("outputs")
    if f.land is None and n_rows:
        f.land = keep(IK.land_spec(addr, n_rows, stride, pos_off, recv_x, recv_scales, recv_src_idx, recv_topk_idx,
                                   recv_topk_w, K=K, expert_lo=f.me * f.Lx, num_local=f.Lx, pos_out=plan.land_all))
    launches = 1
    if n_rows:
        land = f.land
        a = land.args
        a[IK.LAND_ROWS], a[IK.LAND_N], a[IK.LAND_N_OUT], a[IK.LAND_X] = addr, n_rows, num_recv, recv_x.data_ptr()
        a[IK.LAND_SRC] = b + ends[5]
        a[IK.LAND_SCALES] = 0 if recv_scales is None else recv_scales.data_ptr()
        a[IK.LAND_TOPK] = 0 if recv_topk_idx is None else recv_topk_idx.data_ptr()
        a[IK.LAND_W] = 0 if recv_topk_w is None else recv_topk_w.data_ptr()
        a[IK.LAND_POS] = 0 if in_area else b + ends[5] + 4 * num_recv
        land.grid = IK.grid(n_rows)
        land.issue(raw)
        launches += 1
    del landed   # (its block is the call's: held until the Buffer has the result, see Wiring.alloc)
    if f.recv_chan is None:
        f.recv_chan = keep(IK.recv_chan_spec(recv_src_idx, f.g, recv_chan_prefix, n_sig=N_SIG, me=f.me))
    a = f.recv_chan.args
    a[IK.RECV_CHAN_SRC], a[IK.RECV_CHAN_OUT] = b + ends[5], b + ends[2]
    f.recv_chan.issue(raw)
    if rec:
        probe.op("launches", launches)
        probe.mark("land")

    out = req.x.device
    if out != dev:   # inputs on another device than the engine's: the outputs and the handle go back there
        recv_x, recv_scales, recv_topk_idx, recv_topk_w, rank_prefix, chan_prefix, recv_chan_prefix, recv_src_idx, \
            tir, send_head = [None if t is None else t.to(out) for t in (
                recv_x, recv_scales, recv_topk_idx, recv_topk_w, rank_prefix, chan_prefix, recv_chan_prefix,
                recv_src_idx, tir, send_head)]
    handle = make_handle(w, plan, name, T, H, E, C, tir, rank_prefix, chan_prefix, recv_chan_prefix, send_head,
                         recv_src_idx)
    return DispatchResult(recv_x, recv_scales, recv_topk_idx, recv_topk_w,
                          per_expert(expert_counts, req.expert_alignment), handle,
                          blocks=w.take_blocks(keep=out == dev))


def make_handle(w: Wiring, plan: Plan, name: str, T: int, H: int, E: int, C: int, tir, rank_prefix, chan_prefix,
                recv_chan_prefix, send_head, recv_src_idx) -> DispatchHandle:
    """A non-cached dispatch's handle (its plan in ``extra``)."""
    return DispatchHandle(
        rank_prefix_matrix=rank_prefix, channel_prefix_matrix=chan_prefix,
        recv_channel_prefix_matrix=recv_chan_prefix, recv_src_idx=recv_src_idx,
        is_token_in_rank=tir, send_head=send_head,
        topology=w.topology, num_tokens=T, hidden=H, num_experts=E, num_channels=C,
        num_recv_tokens=plan.num_recv, num_worst_tokens=0, backend=name,
        extra={"plan": plan, "num_recv": plan.num_recv})


def per_expert(counts: list, alignment: int) -> list:
    """num_recv_tokens_per_expert_list: this rank's experts' rows, each rounded up to ``alignment``."""
    return counts if alignment == 1 else [align_up(c, alignment) for c in counts]


def full_failed(g: torch.Tensor, E: int, backend, sig: list) -> None:
    """The C++ call path's non-cached dispatch read a digest that flags an error: raise as
    Wiring.read_counts does (the digest's read counted, then the whole rows read and checked)."""
    w = backend.wiring
    w.reads[0] += 1
    w.exchange_failed(g, sig, E=E)


def read_timed_out(backend, seconds: float) -> None:
    """The C++ non-cached dispatch's digest read did not complete: this Buffer is done (raises)."""
    msg = (f"[commlib rank {backend.topology.rank}] dispatch: the count exchange did not complete within "
           f"{seconds:.1f} s (a peer that is not in this dispatch, or a stalled device); this Buffer is unusable")
    backend.failed = msg
    raise CommlibError(msg)


def rows_spec(w: Wiring, plan: Plan, W: int) -> tuple:
    """The allocation of a call's send rows [S, W + 4 P] and landing rows of every chunk [J, W + 4 P]."""
    return (plan.send_starts[-1] + plan.recv_starts[-1], W + 4 * w.topology.ranks_per_node), torch.uint8


def send_and_landing(plan: Plan, rows: torch.Tensor) -> tuple:
    """The send rows and the landing rows: views of ``rows`` (``rows_spec``)."""
    S = plan.send_starts[-1]
    return rows[:S], rows[S:]


def move(w: Wiring, send: torch.Tensor, recv, W: int, plan: Plan, packer, positions=None) -> tuple:
    """The network chunks. One rank per node: every chunk lands in one buffer (rows carry their final
    row at byte W); with the forwarder, chunk k fans out while k + 1 is on the wire (the chunks on two
    streams, network.stream ``sides``; the pack arrived at the barrier before the stores) and the rows
    sit at their final rows of this rank's area, and the forward kernel stores each landed row's
    positions into ``positions`` (int32 [J, P]: the plan's landed_pos, combine's sources). Returns
    (the landing buffer or None, address, row stride, position byte or -1, rows) of what ``IK.land``
    reads."""
    P = w.topology.ranks_per_node
    nch, ss, rs = plan.num_chunks, plan.send_starts, plan.recv_starts
    w.count_rows(plan)
    if nch == 1:   # one chunk: the whole send and landing rows (no view per call)
        post = lambda k: w.network.post(send, plan.send_splits[0], plan.recv_splits[0], out=recv)
    else:
        post = lambda k: w.network.post(send[ss[k]:ss[k + 1]], plan.send_splits[k], plan.recv_splits[k],
                                        out=recv[rs[k]:rs[k + 1]])
    if not w.node.in_area:
        stream(w.network, nch, post, "dispatch")
        return recv, recv.data_ptr(), W + 4 * P, W, rs[-1]
    w.node.dispatch_begin(plan, W, packer, arrived=True)

    # the landed rows' positions on every local rank (the forwarder's combine sources), per chunk
    plan.landed_pos = [positions] if nch == 1 else list(positions.split([rs[k + 1] - rs[k] for k in range(nch)]))

    def fan_out(k, landed):
        w.phase(f"dispatch (fan-out of chunk {k})")
        w.node.dispatch_chunk(k, landed, plan, W, cached=True, pos_out=plan.landed_pos[k])

    stream(w.network, nch, post, "dispatch", after=fan_out, sides=chunk_sides(nch))
    w.node.finish_forward()
    addr, stride = w.node.address()
    return recv, addr, stride, -1, plan.num_recv


def dispatch_cached(w: Wiring, req: DispatchRequest, plan: Plan) -> DispatchResult:
    """Cached dispatch on the kernels (kept.KeptDispatch: pack by the plan's slots and the handle's
    send_head, the network chunks, land), kept on the plan for the Buffer's replays of this call."""
    dev, h = w.device, req.handle
    x = here(req.x, dev)
    scales = here(req.x_scales, dev) if req.x_scales is not None else None
    kept, (recv_x, recv_scales) = first_dispatch(w, plan, h, x, scales, req.config)
    out = req.x.device
    if out != dev:
        recv_x, recv_scales = recv_x.to(out), recv_scales.to(out) if scales is not None else None
    else:
        plan.kept[("dispatch", x.dtype)] = kept
    return DispatchResult(recv_x, recv_scales, None, None, None, h, blocks=w.take_blocks(keep=out == dev))


def combine(w: Wiring, req: CombineRequest, plan: Plan) -> CombineResult:
    """Combine on the kernels (kept.KeptCombine: this rank's rows gathered per landed row, or
    published into its area and summed by the forwarder per chunk, the partials back over the
    network chunk by chunk, the home sum: the biases, then node order), kept on the plan for the
    Buffer's replays where it has no bias."""
    dev, n = w.device, plan.num_recv
    y = rows_on(req.x, n, dev)
    wts = rows_on(req.topk_weights, n, dev) if req.topk_weights is not None else None
    biases = [here(b, dev) for b in req.bias] if req.bias else []
    kept, (out_y, out_w) = first_combine(w, plan, req.handle, y, wts, biases, req.config)
    out = req.x.device
    if out != dev:
        out_y, out_w = out_y.to(out), out_w.to(out) if wts is not None else None
    elif not biases:   # a kept call holds no bias (the Buffer replays only combines without one)
        plan.kept[("combine", wts.shape[1] if wts is not None else 0)] = kept
    return CombineResult(out_y, out_w, blocks=w.take_blocks(keep=out == dev))


__all__ = ["HeadRow", "Fresh", "Scratch", "fits", "dispatch", "make_handle", "per_expert", "full_failed",
           "read_timed_out", "rows_spec", "send_and_landing", "move", "dispatch_cached", "combine"]
