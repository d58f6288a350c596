"""The NVLink engine's copy-engine data path (COMMLIB_CE_BYTES, csrc/ce.cu): rows move with
cudaMemcpyAsync between per-rank staging regions instead of SM kernels writing peer memory.

A dispatch packs every peer's rows into its region of a pack buffer (ce_pack_kernel; this rank's own
rows straight into the outputs), pushes each region into the peer's staging with the copy engines,
and copies what the peers pushed here into the outputs; a combine pushes rows back and sums them
(ce_reduce_kernel). ce_sync_kernel orders the pushes between ranks. Buffer.prepack packs a coming
dispatch ahead, on the caller's stream. COMMLIB_CE_STAGING=host stages through pinned host memory.

Legend: T tokens on this rank, H hidden, K top-k, R ranks, N rows received.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from commlib.utils import env
from commlib.utils.math import align_up, aligned_16
from commlib.cuda import loader as K
from commlib.handle import DispatchHandle
from commlib.layout import Layout, rows_before
from commlib.validate import CommlibError
from commlib.backends.base import DispatchRequest, PendingCombine
from commlib.backends.nvlink.peer_memory import SLOT_ALIGN, HostPeerMemory, PeerMemory

CE_FLAG_BYTES = 4096      # csrc/ce.cu: ready / free words before the copy-engine staging regions
CE_SYNC_BEGIN, CE_SYNC_PUSHED, CE_SYNC_DONE, CE_SYNC_PUSHED_NEXT = 0, 1, 2, 3  # csrc/ce.cu ce_sync_kernel modes
CE_MAX_PREPACKED = 4       # prepacks not yet dispatched (each holds a pack buffer of COMMLIB_CE_BYTES)


@dataclasses.dataclass
class CePrepacked:
    """Rows of a coming copy-engine dispatch, packed on the caller's stream (NvlinkBackend.prepack):
    pack buffer ``slot`` holds every destination's blocks, this rank's own rows in region ``rank``.
    Consumed by exactly one dispatch of the same x (and handle, for a cached one)."""
    slot: int
    x: torch.Tensor
    handle: Optional[DispatchHandle]
    layout: Optional[Layout]       # non-cached: the layout computed with the pack (dispatch's layout args)
    pos: torch.Tensor              # [T, R] rows_before(is_token_in_rank): row of token t among those for r
    sizes: list                    # block row sizes (ce_sizes): the dispatch checks it moves the same blocks
    consumed: bool = False


class StagingPool:
    """Device buffers of ``nbytes`` each for the copy-engine path (packs, combine landings). A buffer
    is taken by a call, or by a prepack / deferred sum that a later call or finish() completes
    (``pending``); ``events[i]`` is recorded after its last reader, and whoever writes it next waits
    for it. Buffers are allocated as needed: one or two in flight in practice."""

    def __init__(self, nbytes: int, device) -> None:
        self.nbytes, self.device = nbytes, device
        self.bufs: list = []
        self.events: list = []
        self.pending: list = []

    def take_after(self, stream) -> int:
        """take(), with ``stream`` waiting for the buffer's last reader: for a writer on another
        stream than the one that read it."""
        i = self.take()
        if self.events[i] is not None:
            stream.wait_event(self.events[i])
        return i

    def take(self) -> int:
        """Index of a buffer nothing pending holds (a new one when all are)."""
        for i, pending in enumerate(self.pending):
            if not pending:
                return i
        self.bufs.append(torch.empty(self.nbytes, dtype=torch.uint8, device=self.device))
        self.events.append(None)
        self.pending.append(False)
        return len(self.bufs) - 1

    def ptr(self, i: int) -> int:
        return self.bufs[i].data_ptr()


def ce_sizes(row: int, num_scales: int, num_topk: int, cached: bool, has_topk: bool, has_weights: bool) -> list:
    """Bytes per row of a copy-engine dispatch's five blocks (x, FP8 scales, top-k ids, weights, source
    index; 0 = absent), as the outputs the call returns: a cached dispatch moves x (and scales) only."""
    return [row, 4 * num_scales, 8 * num_topk if (has_topk and not cached) else 0,
            4 * num_topk if (has_topk and has_weights and not cached) else 0, 0 if cached else 4]


def ce_settings(rank: int) -> tuple[int, bool]:
    """(COMMLIB_CE_BYTES, staging in host memory?), both read and checked: a host staging asked for
    without staging bytes is refused rather than silently left to the SM kernels."""
    ce_bytes, host = env.ce_bytes(), env.ce_staging() == "host"
    if host and not ce_bytes:
        raise ValueError(f"[commlib rank {rank}] COMMLIB_CE_STAGING=host needs COMMLIB_CE_BYTES > 0 (the staging "
                         "size per rank); without it the SM kernels move the rows")
    return ce_bytes, host


class CopyEnginePath:
    """The copy-engine half of NVLinkBackend (a base class of it): its staging, pack and landing
    buffers, and the dispatch / combine / prepack that use them. Reads the backend's rank,
    num_ranks, device, group, timeout_ns and get_dispatch_layout."""

    _ce: Optional[PeerMemory] = None  # the staging (COMMLIB_CE_BYTES), None: the SM kernels move the rows
    _ce_host = False  # COMMLIB_CE_STAGING=host: the copy-engine staging is pinned host memory

    def init_copy_engine(self) -> None:
        """Collective (with the backend's constructor): map the staging when COMMLIB_CE_BYTES is set."""
        self._ce = None
        ce_bytes, ce_host = ce_settings(self.rank)
        if ce_bytes:
            self.ce_region_bytes = (ce_bytes - CE_FLAG_BYTES) // self.num_ranks // SLOT_ALIGN * SLOT_ALIGN
            if self.ce_region_bytes <= 0:
                raise ValueError(f"[commlib rank {self.rank}] COMMLIB_CE_BYTES={ce_bytes} leaves no staging region "
                                 f"per rank (at least {CE_FLAG_BYTES + SLOT_ALIGN * self.num_ranks} bytes)")
            # staging "host": pinned host memory shared by the processes, rows cross PCIe out and back in
            self._ce_host = ce_host
            staging = HostPeerMemory if self._ce_host else PeerMemory
            self._ce = staging(ce_bytes, self.group, self.rank, self.num_ranks, self.device)
            # pack buffers: a dispatch's rows for every peer r are packed into region r of one before the
            # copy engines push them. A buffer is taken by a prepack (caller's stream) or by a call, and
            # free again after the call's copies out of it (its event): two prepacked dispatches can be
            # in flight at once (the dual pipeline's two micro-batches), each with its own.
            self._ce_packs = StagingPool(self.num_ranks * self.ce_region_bytes, self.device)
            self._ce_packs.take()
            # host staging: combine's rows from peer r land in region r of one of these before the sum
            # (a deferred sum, combine(finish_later=True), keeps its buffer until finish())
            self._ce_lands = StagingPool(self.num_ranks * self.ce_region_bytes, self.device)
            self._ce_counter = torch.zeros(1, dtype=torch.int64, device=self.device)
            self._ce_half_sms = torch.cuda.get_device_properties(self.device).multi_processor_count // 2

    def _ce_blocks(self, row_sizes: list, sent: list, got: list, what: str) -> list:
        """Blocks of one call's staging region: block b holds ``cap`` rows of ``row_sizes[b]`` bytes
        (0: absent) at a 16-byte aligned offset; both ends of a push derive the same layout. Raises
        when the rows this rank pushes to a peer (``sent``) or receives from one (``got``) exceed ``cap``."""
        per_row = sum(row_sizes)
        offsets, cap = self._ce_offsets(row_sizes)
        most = max((n for counts in (sent, got) for r, n in enumerate(counts) if r != self.rank), default=0)
        if most > cap:
            raise CommlibError(f"[commlib rank {self.rank}] nvlink {what} (copy engines): {most} rows of {per_row} "
                               f"bytes do not fit a {self.ce_region_bytes}-byte staging region ({cap} rows); "
                               f"raise COMMLIB_CE_BYTES (now {self._ce.num_bytes}: {self.num_ranks} regions + "
                               f"{CE_FLAG_BYTES} flag bytes)")
        return offsets

    def _ce_grid(self, num_sms: int, every_sm: bool = False) -> int:
        """CTAs of the packing / summing kernels (one per SM: 1024 / 512 threads at 64 / 120 registers):
        COMMLIB_CE_SMS, else the call's num_sms but at least half the GPU's SMs. No SM touches NVLink on
        this path; the packing and the sum are short local passes bound by bytes in flight, so few CTAs
        stretch them (docs/notes/2026-11-30_pipeline_log.md)."""
        grid = 2 * self._ce_half_sms if every_sm else max(1, env.ce_sms() or max(num_sms, self._ce_half_sms))
        cluster = K.variant_value("COMM_CLUSTER")  # the kernels launch as clusters of this many CTAs
        return -(-grid // cluster) * cluster

    def _ce_sync(self, mode: int) -> None:
        K.launch("ce", "ce_sync_kernel", 1, 32, (K.i32(mode), K.ptr(self._ce.peer_bases), K.i32(self.rank),
                                                  K.i32(self.num_ranks), K.ptr(self._ce_counter),
                                                  K.u64(self.timeout_ns)))

    def _ce_copies(self, copies: list) -> None:
        """cudaMemcpyAsync (copy engines) of (dst, src, bytes) on torch's current stream."""
        rt = K.cupy().cuda.runtime
        stream = torch.cuda.current_stream(self.device).cuda_stream
        kind = rt.memcpyDefault if self._ce_host else rt.memcpyDeviceToDevice  # host staging: D2H / H2D
        for dst, src, nbytes in copies:
            if nbytes:
                rt.memcpyAsync(dst, src, nbytes, kind, stream)

    def _ce_region(self, base: int, src: int) -> int:
        return base + CE_FLAG_BYTES + src * self.ce_region_bytes

    def _ce_stream(self):
        return torch.cuda.current_stream(self.device)

    def _ce_event(self):
        """An event recorded now on the current stream."""
        event = torch.cuda.Event()
        event.record(self._ce_stream())
        return event

    def _ce_pack_rows(self, slot: int, x, scales, topk, weights, tir, pos, sizes: list, offs: list, own: list,
                      num_local: int, grid: int) -> None:
        """ce_pack_kernel on the current stream: every peer r's rows into region r of pack buffer
        ``slot``, this rank's own rows to ``own`` (one pointer per block, 0 = absent)."""
        T, H = x.shape
        K.launch("ce", "ce_pack_kernel", grid, 1024,
                 (K.ptr(x), K.ptr(scales), K.ptr(topk), K.ptr(weights), K.ptr(tir), K.ptr(pos),
                  K.u64(self._ce_packs.ptr(slot)), K.u64(self.ce_region_bytes), *(K.u64(o) for o in offs[1:]),
                  *(K.u64(o) for o in own), K.i32(sum(1 << b for b in range(5) if sizes[b])),
                  K.i32(T), K.i32(H * x.element_size() // 16), K.i32(scales.shape[1] if scales is not None else 0),
                  K.i32(topk.shape[1] if topk is not None else 0), K.i32(num_local), K.i32(self.rank),
                  K.i32(self.num_ranks)))

    def prepack(self, x: torch.Tensor, scales: Optional[torch.Tensor], topk: Optional[torch.Tensor],
                weights: Optional[torch.Tensor], num_experts: int, handle: Optional[DispatchHandle]):
        """Pack the rows of a coming copy-engine dispatch of ``x`` on the current stream, with every SM
        (Buffer.prepack). Non-cached (``handle`` None): the layout too. Returns a CePrepacked for that
        dispatch, or None where the call would not take the copy engines, COMMLIB_CE_PREPACK=0, or a
        staging region holds fewer rows than x has (the call then packs itself and checks the counts)."""
        if self._ce is None or not env.ce_prepack():
            return None
        cached = handle is not None
        if cached and "ce_pos" not in handle.extra:
            return None
        given, x, T, R, me = x, aligned_16(x), x.shape[0], self.num_ranks, self.rank
        Kk = topk.shape[1] if topk is not None else 0
        sizes = ce_sizes(x.shape[1] * x.element_size(), scales.shape[1] if scales is not None else 0, Kk, cached,
                          topk is not None, weights is not None)
        offs, cap = self._ce_offsets(sizes)
        if T > cap:  # own rows and each peer's are at most T: within the region, no count needed
            return None
        scales = scales.contiguous() if scales is not None else None
        if cached:
            layout, tir, pos = None, handle.is_token_in_rank, handle.extra["ce_pos"]
        else:
            topk = topk.contiguous()
            weights = weights.contiguous() if weights is not None else None
            layout = self.get_dispatch_layout(topk, num_experts)
            tir = layout.is_token_in_rank
            pos = rows_before(tir)
        packs = self._ce_packs
        if sum(packs.pending) >= CE_MAX_PREPACKED:  # each holds a pack buffer until its dispatch
            raise ValueError(f"[commlib rank {me}] {CE_MAX_PREPACKED} prepacked dispatches are outstanding: "
                             "dispatch them (each prepack() is for exactly one dispatch) before packing more")
        slot = packs.take_after(self._ce_stream())  # after the last call's copies out of this buffer
        packs.pending[slot] = True
        base = packs.ptr(slot) + me * self.ce_region_bytes
        if T:
            self._ce_pack_rows(slot, x, scales, topk, weights, tir, pos, sizes, offs,
                               [base + offs[b] if sizes[b] else 0 for b in range(5)],
                               num_experts // R if not cached else 0, self._ce_grid(0, every_sm=True))
        return CePrepacked(slot, given, handle, layout, pos, sizes)

    def ce_take_prepacked(self, req: DispatchRequest, use_ce: bool) -> Optional[CePrepacked]:
        """The request's prepacked rows (Buffer._check_prepacked checked them against the request),
        marked used; None when there are none."""
        p = req.prepacked
        if p is None:
            return None
        if not isinstance(p, CePrepacked) or not use_ce:
            raise CommlibError(f"[commlib rank {self.rank}] prepacked rows reached a dispatch without the copy engines")
        p.consumed = True
        self._ce_packs.pending[p.slot] = False
        stream = self._ce_stream()  # made on the caller's stream, read on this one
        lay = p.layout
        for t in (p.pos, *((lay.num_tokens_per_rank, lay.num_tokens_per_expert, lay.is_token_in_rank) if lay else ())):
            if isinstance(t, torch.Tensor):
                t.record_stream(stream)
        return p

    def _ce_offsets(self, sizes: list) -> tuple[list, int]:
        """(offset of each block in a staging region, rows a region holds) for block row sizes ``sizes``."""
        cap = (self.ce_region_bytes - 16 * len(sizes)) // sum(sizes)
        offsets, at = [], 0
        for size in sizes:
            offsets.append(at)
            at += align_up(cap * size)
        return offsets, cap

    def ce_dispatch(self, x, scales, topk, weights, tir, pos, sent: list, got: list, num_local: int,
                     num_sms: int, outs: tuple, notified: bool = False,
                     prepacked: Optional[CePrepacked] = None) -> None:
        """Dispatch through the copy engines: pack every peer's rows (and this rank's own straight into
        the outputs), push each peer's blocks into its region for this rank, then copy the blocks the
        peers pushed here into the outputs. ``sent[r]`` / ``got[s]``: rows to r / from s. ``notified``:
        the call ran the count exchange (no BEGIN wait needed, csrc/ce.cu). ``prepacked``: the rows are
        in its pack buffer already (own rows in region ``rank``, copied out here)."""
        R, me = self.num_ranks, self.rank
        T, H = x.shape
        recv_x, recv_scales, recv_topk, recv_w, recv_src = outs
        sizes = ce_sizes(H * x.element_size(), scales.shape[1] if scales is not None else 0,
                          topk.shape[1] if topk is not None else 0, recv_src is None, recv_topk is not None,
                          recv_w is not None)
        offs = self._ce_blocks(sizes, sent, got, "dispatch")
        outs_rows = [recv_x, recv_scales, recv_topk, recv_w, recv_src]
        first = [sum(got[:s]) for s in range(R)]  # recv rows are grouped by source rank

        def own(b: int) -> int:  # this rank's own rows go straight to its outputs
            t = outs_rows[b]
            return 0 if t is None or not sizes[b] else t.data_ptr() + first[me] * sizes[b]

        if prepacked is not None:
            if prepacked.sizes != sizes:
                raise CommlibError(f"[commlib rank {me}] prepacked rows have blocks {prepacked.sizes}, this "
                                   f"dispatch {sizes}")
            slot = prepacked.slot
        else:
            slot = self._ce_packs.take()
            if T:
                self._ce_pack_rows(slot, x, scales, topk, weights, tir, pos, sizes, offs,
                                   [own(b) for b in range(5)], num_local, self._ce_grid(num_sms))
        pack = self._ce_packs.ptr(slot)
        if not notified:
            self._ce_sync(CE_SYNC_BEGIN)  # packing needs no peer; pushing needs each peer's region free
        peers = self._ce.peer_ptrs
        self._ce_copies([(self._ce_region(peers[r], me) + offs[b], pack + r * self.ce_region_bytes + offs[b],
                          sent[r] * sizes[b])
                         for r in range(R) if r != me for b in range(5) if sizes[b]])
        self._ce_sync(CE_SYNC_PUSHED_NEXT if notified else CE_SYNC_PUSHED)
        self._ce_copies([(outs_rows[b].data_ptr() + first[s] * sizes[b], self._ce_region(self._ce.base, s) + offs[b],
                          got[s] * sizes[b])
                         for s in range(R) if s != me for b in range(5) if sizes[b]])
        if prepacked is not None:  # own rows: one copy per block out of region `rank` of the pack buffer
            self._ce_copies([(own(b), pack + me * self.ce_region_bytes + offs[b], got[me] * sizes[b])
                             for b in range(5) if own(b)])
        self._ce_sync(CE_SYNC_DONE)
        self._ce_packs.events[slot] = self._ce_event()  # a prepack reusing the buffer waits for it

    def ce_combine(self, x, w, h, biases, sum_order, out, out_w, num_sms: int, later: bool = False):
        """Combine through the copy engines: push the rows of each source rank back into its region for
        this rank, then sum every token's biases and rows, the rows in rank order or ``sum_order``'s
        (csrc/ce.cu ce_reduce_kernel). Host
        staging: the rows land in a device buffer first, and with ``later`` the sum is left to the
        returned PendingCombine (run on the consumer's stream, every SM); else returns None."""
        R, me = self.num_ranks, self.rank
        N, H = x.shape
        row = H * 2
        Kk = w.shape[1] if w is not None else 0
        sent, got = h.extra["send_counts"], h.extra["recv_counts"]
        sizes = [row, 4 * Kk]
        offs = self._ce_blocks(sizes, sent, got, "combine")
        first = [sum(got[:s]) for s in range(R)]
        peers = self._ce.peer_ptrs
        self._ce_sync(CE_SYNC_BEGIN)
        self._ce_copies([(self._ce_region(peers[s], me) + offs[b], src.data_ptr() + first[s] * sizes[b],
                          got[s] * sizes[b])
                         for s in range(R) if s != me for b, src in enumerate((x, w)) if sizes[b]])
        self._ce_sync(CE_SYNC_PUSHED)
        staging, slot, lands = self._ce.base, None, self._ce_lands
        if self._ce_host:  # the sum reads device memory: bring each source's blocks in first
            slot = lands.take_after(self._ce_stream())  # after the last sum out of this buffer
            land = lands.ptr(slot)
            self._ce_copies([(land + s * self.ce_region_bytes + offs[b], self._ce_region(staging, s) + offs[b],
                              sent[s] * sizes[b])
                             for s in range(R) if s != me for b in range(2) if sizes[b]])
            staging = land - CE_FLAG_BYTES  # ce_reduce_kernel finds region s at staging + CE_FLAG_BYTES + s * bytes
            self._ce_sync(CE_SYNC_DONE)  # the regions here are read: the peers may push into them again
        T = h.num_tokens

        def reduce(grid: int) -> None:
            if T:
                K.launch("ce", "ce_reduce_kernel", grid, 512,
                         (K.ptr(x), K.ptr(w), K.u64(staging), K.u64(self.ce_region_bytes), K.u64(offs[1]),
                          K.ptr(h.is_token_in_rank), K.ptr(h.extra["ce_pos"]), K.i32(first[me]),
                          K.ptr(biases[0]), K.ptr(biases[1]), K.ptr(sum_order), K.ptr(out), K.ptr(out_w),
                          K.i32(T), K.i32(row // 16), K.i32(Kk), K.i32(me), K.i32(R)))

        if slot is None:
            reduce(self._ce_grid(num_sms))
            self._ce_sync(CE_SYNC_DONE)
            return None
        if not later:
            reduce(self._ce_grid(num_sms))
            lands.events[slot] = self._ce_event()
            return None
        lands.pending[slot] = True

        def finish():
            reduce(self._ce_grid(0, every_sm=True))
            stream = self._ce_stream()
            for t in (out, out_w):  # made on the comm stream, written and used on this one
                if t is not None:
                    t.record_stream(stream)
            lands.events[slot] = self._ce_event()
            lands.pending[slot] = False
            return out, out_w

        return PendingCombine(finish)
