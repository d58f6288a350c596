"""Kept calls of the internode engine's kernel path: what a cached dispatch or a combine derives
before it moves a byte, made once and set per call instead of re-derived.

* Per shape (``Launches``, in ``Wiring.kept``): the launches, each made with every check of its
  launcher (kernels.*_spec, NodeFanout.*_spec) by the first call that needs it, shared by the
  calls of every handle; a call sets the argument slots that change (addresses, row counts, grid).
* Per handle (``KeptDispatch``, ``KeptCombine``, kept on the handle's plan: ``Plan.kept``): the
  call's geometry (its scratch's size, the chunk views' sizes and offsets, the network splits, the
  plan's addresses), so that a later call with the same arguments (the Buffer's fast path:
  ``InternodeBackend.plan_for`` / ``run_plan``) only allocates its outputs and scratch and issues
  the launches and the network chunks.

Every call runs through ``run``, the first one too: a call's full path is its kept call's
construction (with the checks of what it reads of the handle) and the same ``run``. A call whose
arguments differ in anything the construction read (shapes, dtypes, devices, the handle's tensors,
the Config, a bias) takes the full path again.

Legend: S send rows (network rows this rank sends), J landed rows, n rows received, T tokens, H
hidden, K top-k, P ranks per node, W bytes of a dispatch row, Wc of a combine row, Wd the
forwarder areas' row stride, k a network chunk.
"""
from __future__ import annotations

import torch

from commlib.backends.base import set_stream
from commlib.backends.internode import kernels as IK
from commlib.backends.internode.fanout import (COMBINE_ROWS_SYNC, COMBINE_SYNC, FORWARD_J,
                                               FORWARD_LANDED, FORWARD_SYNC, REDUCE_J, REDUCE_OUT, REDUCE_POS,
                                               REDUCE_SYNC, two_stream_syncs, chunk_sides, chunk_syncs)
from commlib.backends.internode.geometry import Plan
from commlib.backends.internode.network import stream
from commlib.backends.internode.rows import dispatch_packer, output_layout
from commlib.backends.internode.wiring import Wiring
from commlib.cuda import loader


class _Plain:
    """A kept launch where the driver's launch path is not there (CuPy's path, ``record_launches``,
    no libcuda): the same argument list (and ``grid``, as loader.Replay's), issued through
    ``loader.launch`` on the current stream."""

    __slots__ = ("family", "name", "grid", "block", "args", "shared_mem")

    def __init__(self, spec: tuple) -> None:
        self.family, self.name, self.grid, self.block, self.args, self.shared_mem = spec

    def current(self) -> bool:
        return True

    def issue(self, stream: int) -> None:
        loader.launch(self.family, self.name, self.grid, self.block, self.args, self.shared_mem)


def keep(spec):
    """A launch spec (kernels.*_spec, NodeFanout.*_spec) as a kept launch: ``args`` (its argument
    list, slots set per call), ``grid`` and ``issue(raw_stream)``; None for None (no rows)."""
    if spec is None:
        return None
    family, name, grid, block, args, shared = spec
    kept = loader.replay(family, name, grid, block, args, shared_mem=shared)
    return kept if kept is not None and kept.current() else _Plain(spec)


def raw_stream(device: torch.device) -> int:
    """The current stream of ``device`` as a driver handle (0 on the CPU, where launches are fakes)."""
    return torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0


class Launches:
    """The launches of one kind of kept call for one shape, shared by every handle's (module
    docstring); None until a call needs one."""

    __slots__ = ("pack", "land", "barrier", "forward", "rows", "reduce", "home")

    def __init__(self) -> None:
        self.pack = self.land = self.barrier = self.forward = self.rows = self.reduce = self.home = None

    def current(self) -> bool:
        """Still what a launch would run (kernel variant, launch path): else the full path remakes them."""
        for kept in (self.pack, self.land, self.barrier, self.forward, self.rows, self.reduce, self.home):
            if kept is not None:
                return kept.current()
        return True


def launches_for(w: Wiring, key: tuple) -> Launches:
    """The shared launches of ``key`` (the call's full path: new ones where the launch mode changed)."""
    L = w.kept.get(key)
    if L is None or not L.current():
        if len(w.kept) >= 64:
            w.kept.clear()
        L = w.kept[key] = Launches()
    return L


class _Kept:
    """What a cached dispatch and a combine keep per handle alike: the call it was made from
    (``fits``), its outputs' specs, its one scratch allocation uint8 [rows, width] and the sizes its
    chunk views are split into (the rows sent, chunk by chunk, then the rows that come back)."""

    op = ""

    def __init__(self, w: Wiring, plan: Plan, x: torch.Tensor, second, config) -> None:
        self.w, self.plan, self.config = w, plan, config
        self.shape, self.dtype, self.device = x.shape, x.dtype, x.device
        self.second_shape = None if second is None else second.shape
        self.in_area = w.node.in_area
        self._scratch = None

    def fits(self, x: torch.Tensor, second, config) -> bool:
        """Whether a call with ``x``, ``second`` (FP8 scales / combine weights) and ``config`` is the
        call this was made from (its handle checked by the subclass)."""
        if not (x.shape == self.shape and x.dtype == self.dtype and x.device == self.device and x.is_contiguous()
                and (config is self.config or config == self.config) and self.launches.current()):
            return False
        s = self.second_shape
        if s is None:
            return second is None
        return (second is not None and second.shape == s and second.dtype == torch.float32
                and second.device == self.device and second.is_contiguous())

    def alloc_outputs(self) -> tuple:
        """The outputs (first, second or None) on the current stream (a replay's): views of one
        allocation (``layout``: rows.output_layout), as the C++ replays carve theirs."""
        nbytes, (p1, p2) = self.layout
        block = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return (block.view(p1[0]).as_strided(p1[1], p1[2], p1[3]),
                None if p2 is None else block.view(p2[0]).as_strided(p2[1], p2[2], p2[3]))

    def alloc_first(self) -> tuple:
        """The full path's scratch (``scratch``; inside a CUDA graph capture, an allocation of the
        graph's, with the outputs) and its outputs on the output stream (Wiring.alloc), the Buffer's
        result ``blocks``. Returns (scratch, (first, second or None))."""
        w = self.w
        if w.cuda and torch._C._cuda_isCurrentStreamCapturing():
            block, first, second = w.alloc(((self.rows, self.width), torch.uint8), outputs=self.layout)
            return block, (first, second)
        first, second = w.alloc(outputs=self.layout)
        return self.scratch(), (first, second)

    def scratch(self) -> torch.Tensor:
        """The call's scratch uint8 [rows, width]: its rows in the engine's staging rows (Wiring.staging),
        taken at its first use outside a capture and kept (a later growth leaves this call its buffer)."""
        s = self._scratch
        if s is None:
            s = self._scratch = self.w.staging(self.rows, self.width)
        return s


class KeptDispatch(_Kept):
    """A cached dispatch on the kernels: pack by the plan's slots and the handle's send_head, the
    network chunks (with the forwarder: each landed chunk stored into the node's areas between two
    barriers, on two streams: fanout.py's DISPATCH_PACK_SYNC / two_stream_syncs / chunk_sides), land (no
    routing columns)."""

    op = "cached dispatch"

    def __init__(self, w: Wiring, plan: Plan, handle, x: torch.Tensor, scales, config) -> None:
        super().__init__(w, plan, x, scales, config)
        topo, dev = w.topology, w.device
        self.W = W = dispatch_packer(x, scales, 0, False).row_bytes
        S, J, nch = plan.send_starts[-1], plan.recv_starts[-1], plan.num_chunks
        self.rows, self.width, self.S = S + J, W + 4 * topo.ranks_per_node, S
        ss, rs = plan.send_starts, plan.recv_starts
        self.sizes = [ss[k + 1] - ss[k] for k in range(nch)] + [rs[k + 1] - rs[k] for k in range(nch)]
        n = plan.num_recv
        self.outputs = (((n, x.shape[1]), x.dtype), ((n, scales.shape[1]), torch.float32) if scales is not None else None)
        self.layout = output_layout(self.outputs)
        sh = handle.send_head
        self.send_head_of = sh   # what fits() compares the handle's with
        if not (sh.dtype == torch.int32 and tuple(sh.shape) == (x.shape[0], topo.num_ranks)):
            raise ValueError(f"[commlib rank {topo.rank}] cached dispatch: the handle's send_head must be int32 "
                             f"[{x.shape[0]}, {topo.num_ranks}], got {sh.dtype} {list(sh.shape)}")
        self.send_head = sh if sh.device == dev and sh.is_contiguous() else sh.to(dev).contiguous()   # kept alive
        self.slot_ptr, self.send_head_ptr = plan.slot.data_ptr(), self.send_head.data_ptr()
        self.pack_sync, self.sides = None, None
        if self.in_area:
            self.Wd = w.node.kept_begin(plan, W)   # room in the areas (collective where they grow)
            # the pack arrives at the barrier before the stores; per chunk (landed rows' byte offset, rows,
            # grid, the barrier's pieces its forward takes), each on its stream (chunk_sides)
            self.pack_sync, self.sides = w.node.pack_sync(), chunk_sides(nch)
            syncs = two_stream_syncs(nch)
            self.chunks = [((S + rs[k]) * self.width, rs[k + 1] - rs[k], w.node.grid(rs[k + 1] - rs[k]), syncs[k])
                           for k in range(nch)]
            self.land_n, self.land_stride, self.land_pos_off = n, self.Wd, -1
        else:
            self.land_n, self.land_stride, self.land_pos_off = J, self.width, W
        self.land_grid = IK.grid(self.land_n)
        self.launches = launches_for(w, ("cached dispatch", x.shape, x.dtype, self.second_shape, self.in_area))

    def fits(self, handle, x, scales, config) -> bool:
        return handle.send_head is self.send_head_of and super().fits(x, scales, config)

    def run(self, x: torch.Tensor, scales, outs: tuple, raw: int, block=None) -> None:
        """The call on ``x`` (and FP8 ``scales``) into ``outs``, launches on stream ``raw``."""
        w, plan, L, probe = self.w, self.plan, self.launches, self.w.probe
        if block is None:
            block = self.scratch()
        base, S, node = block.data_ptr(), self.S, w.node
        launches = 0
        if x.shape[0] or self.in_area:   # (with the forwarder the pack arrives at the barrier, even with no rows)
            if L.pack is None:
                topo = w.topology
                L.pack = keep(IK.pack_spec(None, block[:S], plan.slot, self.send_head, x, scales, None, None,
                                           me=topo.rank, M=topo.num_nodes, P=topo.ranks_per_node, Kc=w.max_chunks,
                                           ring=1, sync=self.pack_sync))
            a = L.pack.args
            a[IK.PACK_X], a[IK.PACK_SEND], a[IK.PACK_SLOT], a[IK.PACK_SEND_HEAD] = \
                x.data_ptr(), base, self.slot_ptr, self.send_head_ptr
            if scales is not None:
                a[IK.PACK_SCALES] = scales.data_ptr()
            L.pack.issue(raw)
            launches += 1
        if probe.recording:
            probe.mark("pack")
        views = block.split_with_sizes(self.sizes)
        nch, net = plan.num_chunks, w.network
        ss, rs = plan.send_splits, plan.recv_splits
        fan_out = None
        if self.in_area:   # the first forward on each stream waits for every rank's pack (every peer past its
            chunks, W, Wd = self.chunks, self.W, self.Wd   # reads of this rank's area), the last one takes the
                                                            # barrier after the stores
            def fan_out(k, landed):
                off, J, grid, sync = chunks[k]
                if J or sync:
                    if L.forward is None:
                        L.forward = keep(node.forward_spec(landed, W, Wd, sync))
                    f = L.forward
                    f.args[FORWARD_LANDED], f.args[FORWARD_J], f.args[FORWARD_SYNC], f.grid = base + off, J, sync, grid
                    r = net.chunk_raw   # (the chunk's stream where the chunks run on two)
                    f.issue(raw if r is None else r)
            launches += sum(1 for c in chunks if c[1] or c[3])
        stream(net, nch, lambda k: net.post(views[k], ss[k], rs[k], out=views[nch + k]), "dispatch", after=fan_out,
               sides=self.sides)
        if self.in_area and not nch:   # no forward took the barrier after the pack's arrival
            if L.barrier is None:
                L.barrier = keep(node.barrier_spec())
            L.barrier.issue(raw)
            launches += 1
        w.count_rows(plan)
        if probe.recording:
            probe.mark("network")
        if self.land_n:
            addr = node.area_address() if self.in_area else base + S * self.width
            if L.land is None:
                L.land = keep(IK.land_spec(addr, self.land_n, self.land_stride, self.land_pos_off, outs[0], outs[1]))
            a = L.land.args
            a[IK.LAND_ROWS], a[IK.LAND_N], a[IK.LAND_N_OUT], a[IK.LAND_X] = \
                addr, self.land_n, outs[0].shape[0], outs[0].data_ptr()
            if outs[1] is not None:
                a[IK.LAND_SCALES] = outs[1].data_ptr()
            L.land.grid = self.land_grid
            L.land.issue(raw)
            launches += 1
        if probe.recording:
            probe.op("launches", launches)
            probe.mark("land")


class KeptCombine(_Kept):
    """A combine on the kernels: this rank's rows gathered per landed row (one rank per node) or
    written into its area and summed per chunk by the forwarder, the partials back over the network
    chunk by chunk, the home sum (the biases, then node order)."""

    op = "combine"

    def __init__(self, w: Wiring, plan: Plan, handle, y: torch.Tensor, wts, config) -> None:
        super().__init__(w, plan, y, wts, config)
        self.H, self.K = H, K = y.shape[1], (wts.shape[1] if wts is not None else 0)
        self.Wc = Wc = 2 * H + 4 * K
        J, S, nch = plan.recv_starts[-1], plan.send_starts[-1], plan.num_chunks
        self.rows, self.width, self.J = J + S, Wc, J
        rs, ss = plan.recv_starts, plan.send_starts
        # the node partials this rank sends (chunk by chunk), then the partials that come back
        self.sizes = [rs[k + 1] - rs[k] for k in range(nch)] + [ss[k + 1] - ss[k] for k in range(nch)]
        self.T = T = handle.num_tokens
        self.outputs = (((T, H), torch.bfloat16), ((T, K), torch.float32) if K else None)
        self.layout = output_layout(self.outputs)
        if self.in_area:
            self.Wd = w.node.kept_begin(plan, Wc)   # (free: the dispatch reserved room for these rows)
            # per chunk (partials' byte offset, rows, grid, positions, the barrier's pieces its reduce takes:
            # the first waits for every rank's rows, which the rows kernel arrived after)
            syncs = chunk_syncs(nch, *COMBINE_SYNC)
            self.chunks = [(rs[k] * Wc, rs[k + 1] - rs[k], w.node.grid(rs[k + 1] - rs[k]), plan.landed_pos[k].data_ptr(),
                            syncs[k]) for k in range(nch)]
            self.rows_sync = w.node.sync_args(COMBINE_ROWS_SYNC)
            self.rows_ctas = IK.synced_ctas(w.node.gpu_share)   # (its CTAs wait at its start)
            self.rows_n, self.rows_pos = plan.num_recv, 0
        else:
            self.rows_n, self.rows_pos = J, plan.land_all.data_ptr()
            self.rows_sync, self.rows_ctas = None, IK.MAX_CTAS
        self.rows_grid, self.slot_ptr = IK.grid(self.rows_n, self.rows_ctas), plan.slot.data_ptr()
        self.launches = launches_for(w, ("combine", T, H, K, y.dtype, self.in_area))

    def fits(self, handle, y, wts, config) -> bool:
        return handle.num_tokens == self.T and super().fits(y, wts, config)

    def run(self, y: torch.Tensor, wts, outs: tuple, raw: int, block=None, biases=()) -> None:
        """The call on ``y`` (and ``wts``; ``biases``: the full path's) into ``outs``, launches on ``raw``."""
        w, plan, L, probe, node = self.w, self.plan, self.launches, self.w.probe, self.w.node
        if block is None:
            block = self.scratch()
        base, Wc = block.data_ptr(), self.Wc
        launches = 0
        rows = None
        if self.rows_n or self.in_area:   # (into the area: the barrier's pieces, even with no rows)
            out = node.area_address() if self.in_area else base
            if L.rows is None:
                L.rows = keep(IK.rows_spec(None if self.in_area else plan.land_all, self.rows_n, y, wts, out,
                                           self.Wd if self.in_area else Wc, self.rows_sync, self.rows_ctas))
            rows = L.rows
            a = rows.args
            a[IK.ROWS_POS], a[IK.ROWS_N], a[IK.ROWS_Y], a[IK.ROWS_OUT] = self.rows_pos, self.rows_n, y.data_ptr(), out
            if wts is not None:
                a[IK.ROWS_W] = wts.data_ptr()
            rows.grid = self.rows_grid
            launches += 1
        before = None
        if self.in_area:   # this rank's rows into its area between barriers (the rows kernel enters the first and
            rows.issue(raw)   # arrives at the second, the first reduce waits for it); the forwarder sums them per chunk
            chunks, H, K, Wd = self.chunks, self.H, self.K, self.Wd

            def before(k):
                off, J, grid, pos, sync = chunks[k]
                if J or sync:
                    if L.reduce is None:
                        L.reduce = keep(node.reduce_spec(plan.landed_pos[k], H, K, block[plan.recv_starts[k]:
                                                                                         plan.recv_starts[k + 1]], Wd,
                                                         sync))
                    r = L.reduce
                    r.args[REDUCE_POS], r.args[REDUCE_J], r.args[REDUCE_OUT], r.args[REDUCE_SYNC], r.grid = \
                        pos, J, base + off, sync, grid
                    r.issue(raw)
            launches += sum(1 for c in chunks if c[1] or c[4])
        elif rows is not None:
            rows.issue(raw)
        if probe.recording:
            probe.mark("rows")
        views = block.split_with_sizes(self.sizes)
        nch, net = plan.num_chunks, w.network
        ss, rs = plan.send_splits, plan.recv_splits
        stream(net, nch, lambda k: net.post(views[k], rs[k], ss[k], out=views[nch + k]), "combine", before=before)
        w.count_rows(plan)
        if probe.recording:
            probe.mark("network")
        if self.T:
            if biases:   # a biased combine (never kept, never replayed): its own launch, every check
                home = keep(IK.home_spec(block[self.J:], plan.slot, biases, outs[0], outs[1], H=self.H, K=self.K))
            else:
                if L.home is None:
                    L.home = keep(IK.home_spec(block[self.J:], plan.slot, [], outs[0], outs[1], H=self.H, K=self.K))
                home = L.home
                a = home.args
                a[IK.HOME_BACK], a[IK.HOME_SLOT], a[IK.HOME_Y] = base + self.J * Wc, self.slot_ptr, outs[0].data_ptr()
                if outs[1] is not None:
                    a[IK.HOME_W] = outs[1].data_ptr()
            home.issue(raw)
            launches += 1
        if probe.recording:
            probe.op("launches", launches)
            probe.mark("home")


def replay(kept: _Kept, x: torch.Tensor, second, comm, comm_raw: int, switch) -> tuple:
    """A kept call on new tensors (InternodeBackend.run_plan): its outputs on the current stream
    (``switch`` None: the caller's) or, with ``switch = (comm, caller)``, on the comm stream ``comm``;
    its scratch, launches and network chunks on ``comm`` (current while it runs: NCCL's calls are
    ordered on it). Returns (first output, second output or None)."""
    if comm is None:   # no CUDA (tests/internode_host.py): one stream
        outs = kept.alloc_outputs()
        kept.run(x, second, outs, comm_raw)
        return outs
    back = torch._C._cuda_getCurrentStream(kept.device.index)
    if switch is not None:
        set_stream(comm)
    outs = kept.alloc_outputs()
    if switch is None:
        set_stream(comm)
    try:
        kept.run(x, second, outs, comm_raw)
    finally:
        torch._C._cuda_setStream(*back)
    return outs


def first_dispatch(w: Wiring, plan: Plan, handle, x: torch.Tensor, scales, config) -> tuple:
    """A cached dispatch's full path: a new KeptDispatch (its checks), its outputs, its run.
    Returns (kept, (recv_x, recv_scales or None))."""
    kept = KeptDispatch(w, plan, handle, x, scales, config)
    block, outs = kept.alloc_first()
    kept.run(x, scales, outs, raw_stream(w.device), block)
    return kept, outs


def first_combine(w: Wiring, plan: Plan, handle, y: torch.Tensor, wts, biases: list, config) -> tuple:
    """A combine's full path: a new KeptCombine (its checks), its outputs, its run. Returns (kept,
    (combined_x, combined_w or None))."""
    kept = KeptCombine(w, plan, handle, y, wts, config)
    block, outs = kept.alloc_first()
    kept.run(y, wts, outs, raw_stream(w.device), block, biases=biases)
    return kept, outs


__all__ = ["keep", "raw_stream", "Launches", "launches_for", "KeptDispatch", "KeptCombine", "replay", "first_dispatch",
           "first_combine"]
