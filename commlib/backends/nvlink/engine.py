"""NVLink engine: dispatch / combine inside one node, kernels writing straight into peer memory.

Legend: T tokens on this rank, H hidden, K top-k, E experts, L = E / R local experts, R ranks,
C channels, N rows received.

Peer memory: each rank cudaMallocs ONE buffer of ``num_nvl_bytes`` (CuPy's runtime, not torch's
allocator, so the IPC handle covers exactly this allocation), zeroes it, and exchanges its
cudaIpc handle with ``all_gather_object`` on the Buffer's group (NCCL or gloo: the group only
carries these few bytes, never data). Works between processes sharing a GPU too.

Buffer layout (every rank the same; csrc/common.cuh and commlib/kernels.py hold the offsets):
  [0, CONTROL_BYTES)          progress / done words, notify slots (see csrc/notify.cu)
  [CONTROL, CONTROL + B)      dispatch staging: [source rank][channel][slot] (csrc/dispatch.cu)
  [CONTROL + B, CONTROL + 2B) combine staging: [source rank][channel][slot] (csrc/combine.cu)
with B = (num_nvl_bytes - CONTROL_BYTES) / 2. Slots per (source, channel) are whatever fits
(at least the config's num_max_nvl_chunked_recv_tokens when the buffer was sized with
Config.get_nvl_buffer_size_hint).

Calls never reset anything: kernels keep per-(kind, role, channel) sequence counters in device
memory, so eager calls and CUDA-graph replays interleave freely as long as every rank makes the
same calls in the same order (the DeepEP contract).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from commlib.utils import env
from commlib.utils.math import align_up, aligned_16
from commlib.cuda import loader as K
from commlib.config import CONTROL_BYTES
from commlib.handle import DispatchHandle
from commlib.layout import Layout, dispatch_layout, rows_before
from commlib.layout import send_head as layout_send_head
from commlib.validate import CommlibError
from commlib.backends.base import Backend, CombineRequest, CombineResult, DispatchRequest, DispatchResult, PendingCombine
from commlib.backends.nvlink.peer_memory import HostPeerMemory, PeerMemory

CE_FLAG_BYTES = 4096      # csrc/ce.cu: ready / free words before the copy-engine staging regions
CE_SYNC_BEGIN, CE_SYNC_PUSHED, CE_SYNC_DONE, CE_SYNC_PUSHED_NEXT = 0, 1, 2, 3  # csrc/ce.cu ce_sync_kernel modes
CE_MAX_PREPACKED = 4       # prepacks not yet dispatched (each holds a pack buffer of COMMLIB_CE_BYTES)
SLOT_ALIGN = 128          # staging slots never share a cache line (a line read early could be stale)
SMID_KINDS = {"notify": 0, "dispatch": 1, "combine": 2}
_MAX_LAYOUT_SHARED = 48 * 1024
# Count exchange (csrc/notify.cu): the mode word and the call signature every rank compares.
NOTIFY_MODE_REJECTED = 1   # this rank's Buffer refused its input: take part, with zero counts
NOTIFY_MODE_NO_HOST = 2    # num_worst_tokens: the host never reads the counts, so a mismatch traps
NOTIFY_SIG_FIELDS = ("hidden", "x dtype", "FP8 scales per token", "num_topk", "topk_weights",
                     "num_experts", "num_channels")  # K.NOTIFY_SIG_WORDS words, notify.cu's order


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
    sizes: list                    # block row sizes (_ce_sizes): the dispatch checks it moves the same blocks
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


def _ce_sizes(row: int, num_scales: int, num_topk: int, cached: bool, has_topk: bool, has_weights: bool) -> list:
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


class RankDisagreement(CommlibError, ValueError):
    """Ranks called the same op with different shapes / dtype / Config: raised on every rank before
    any data moved; the Buffer stays usable (every rank is still in step)."""


def _sig_value(field: str, v: int) -> str:
    if field == "x dtype":
        return {1: "fp8 (1 byte per element)", 2: "bf16 (2 bytes per element)"}.get(v, f"{v} bytes per element")
    if field == "topk_weights":
        return "given" if v else "None"
    if field == "num_channels":
        return f"{v} (Config.num_sms {2 * v})"
    return str(v)


class NVLinkBackend(Backend):
    """Intranode GPU backend over CUDA IPC peer pointers (see module docstring)."""

    name = "nvlink"
    _ce_host = False  # COMMLIB_CE_STAGING=host: the copy-engine staging is pinned host memory

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        topo = self.topology
        self.rank, self.num_ranks = topo.rank, topo.num_ranks
        if topo.num_nodes != 1:
            raise ValueError(f"[commlib rank {self.rank}] the nvlink backend serves one node, "
                             f"the topology has {topo.num_nodes}")
        if self.num_ranks > K.MAX_RANKS:
            raise ValueError(f"[commlib rank {self.rank}] the nvlink backend supports at most {K.MAX_RANKS} "
                             f"ranks per node, got {self.num_ranks}")
        self.device = ctx.device
        if self.device.type != "cuda":
            raise ValueError(f"[commlib rank {self.rank}] the nvlink backend needs a CUDA device")
        self.group = ctx.group
        self.timeout_ns = int(float(ctx.timeout_s) * 1e9)
        self.failed: Optional[str] = None
        self._base: Optional[int] = None
        self._peer_ptrs: dict[int, int] = {}
        self.num_bytes = max(int(ctx.num_nvl_bytes), CONTROL_BYTES)
        self.region_bytes = ((self.num_bytes - CONTROL_BYTES) // 2) // SLOT_ALIGN * SLOT_ALIGN
        self._mem = PeerMemory(self.num_bytes, self.group, self.rank, self.num_ranks, self.device)
        self._base, self._peer_ptrs = self._mem.base, self._mem.peer_ptrs
        self.peer_bases = self._mem.peer_bases
        self.seq_counters = torch.zeros(K.NUM_SEQ_COUNTERS, dtype=torch.int64, device=self.device)
        self._layout_scratch: dict = {}  # per stream: [ticket, error word] int32
        # per kind and slot (one slot per launch, round robin over COMMLIB_DEBUG_SMID_SLOTS): %smid of up
        # to 256 CTAs, then (kernel variant COMM_TRACE=1) 3 u64 trace points per CTA
        self._smid_slots = env.debug_smid_slots()
        self._smids = torch.full((len(SMID_KINDS), self._smid_slots, K.TRACE_OFFSET_WORDS + 256 * K.TRACE_POINTS * 2),
                                 -1, dtype=torch.int32, device=self.device) if env.debug_smid() else None
        # per kind: launches since the reset, and the grid of the launch each slot holds
        self._smid_count = {kind: 0 for kind in SMID_KINDS}
        self._smid_grids = {kind: [0] * self._smid_slots for kind in SMID_KINDS}
        self._probe_rows = None  # DISPATCH_PROBE_NO_REMOTE_COPY's shared recv_x (_probe_recv_x)
        self._ce: Optional[PeerMemory] = None  # the copy-engine path's staging (COMMLIB_CE_BYTES, csrc/ce.cu)
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
        K.compile_all()  # compile (or load) now, not inside the first call or a graph capture
        self._mem.all_opened(self.group, self.rank, self.num_ranks)

    # ------------------------------------------------------------------ lifecycle
    def destroy(self) -> None:
        """Close peer mappings and free this rank's buffer. Collective-free (safe from __del__)."""
        if self._base is None:
            return
        self._mem.close()
        if self._ce is not None:
            self._ce.close()
        self._peer_ptrs.clear()
        self._base = None

    def _alive(self) -> None:
        if self._base is None:
            raise CommlibError(f"[commlib rank {self.rank}] nvlink backend used after destroy()")
        if self.failed:
            raise CommlibError(f"[commlib rank {self.rank}] nvlink backend is unusable after an earlier failure: "
                               f"{self.failed}")

    def _host_read(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """The one device -> host copy of a call; a device-side timeout surfaces here."""
        try:
            return t.cpu()
        except Exception as e:  # noqa: BLE001 - RuntimeError / torch.AcceleratorError from a trapped kernel
            self.failed = f"{what}: {e}"
            raise CommlibError(f"[commlib rank {self.rank}] {what} failed on the device (a peer did not "
                               f"take part in time, or a kernel faulted; see the '[commlib] rank ... timeout' "
                               f"line above): {e}") from e

    # ------------------------------------------------------------------ debug
    def _smid_ptr(self, kind: str, grid: int):
        if self._smids is None:
            return K.u64(0)
        slot = self._smid_count[kind] % self._smid_slots
        self._smid_count[kind] += 1
        self._smid_grids[kind][slot] = grid
        return K.u64(self._smids[SMID_KINDS[kind], slot].data_ptr())

    def _need_smids(self, what: str) -> None:
        if self._smids is None:
            raise RuntimeError(f"{what} needs COMMLIB_DEBUG_SMID=1 when the Buffer is created")

    def _launch_words(self, kind: str, i: int) -> tuple[int, torch.Tensor]:
        """(grid, int32 words) of launch i of ``kind`` since the reset (it must still be in a slot)."""
        slot = i % self._smid_slots
        return self._smid_grids[kind][slot], self._smids[SMID_KINDS[kind], slot]

    def last_smids(self, kind: str = "dispatch") -> list[int]:
        """%smid of every CTA of the last ``kind`` launch (COMMLIB_DEBUG_SMID=1 only; syncs)."""
        self._need_smids("last_smids")
        if not self._smid_count[kind]:
            return []
        n, words = self._launch_words(kind, self._smid_count[kind] - 1)
        return words[:n].tolist()

    @staticmethod
    def _trace_points(n: int, words: torch.Tensor) -> list[tuple[int, int, int]]:
        pts = words[K.TRACE_OFFSET_WORDS:].view(torch.int64)[: n * K.TRACE_POINTS].view(n, K.TRACE_POINTS)
        return [tuple(p) for p in pts.tolist()]

    def last_trace(self, kind: str = "dispatch") -> list[tuple[int, int, int]]:
        """Per CTA of the last ``kind`` launch: (start, own role's work done, end) in ns of %globaltimer.

        Needs COMMLIB_DEBUG_SMID=1 when the Buffer is created and kernel variant COMM_TRACE=1; syncs.
        Even CTAs are senders, odd ones receivers. With SHARE_WORK the sender's time from its second
        point to its end is the receiver work it took over.
        """
        self._need_smids("last_trace")
        if not self._smid_count[kind]:
            return []
        return self._trace_points(*self._launch_words(kind, self._smid_count[kind] - 1))

    def reset_trace_history(self) -> None:
        """Start a new ``trace_history``: forget the launches recorded so far (no device work)."""
        for kind in self._smid_count:
            self._smid_count[kind] = 0

    def trace_history(self, kind: str = "dispatch") -> list[list[tuple[int, int, int]]]:
        """``last_trace`` of every ``kind`` launch since ``reset_trace_history``, oldest first, read once
        at the end (syncs): no sync between the launches. Raises if more launches ran than
        COMMLIB_DEBUG_SMID_SLOTS keeps (the oldest were overwritten)."""
        self._need_smids("trace_history")
        count = self._smid_count[kind]
        if count > self._smid_slots:
            raise RuntimeError(f"trace_history: {count} {kind} launches since the reset, but only "
                               f"COMMLIB_DEBUG_SMID_SLOTS={self._smid_slots} are kept")
        return [self._trace_points(*self._launch_words(kind, i)) for i in range(count)]

    def layout_error_count(self) -> int:
        """Top-k ids outside [-1, E) the layout kernel has seen so far (syncs)."""
        return int(sum(int(s[1].item()) for s in self._layout_scratch.values()))

    # ------------------------------------------------------------------ layout
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int) -> Layout:
        R = self.num_ranks
        T, Kk = topk_idx.shape
        if (R + num_experts) * 4 > _MAX_LAYOUT_SHARED:  # huge expert counts: the torch version
            return dispatch_layout(topk_idx, num_experts, self.topology)
        topk = topk_idx.contiguous()
        dev = self.device
        ntpr = torch.empty(R, dtype=torch.int32, device=dev)
        ntpe = torch.empty(num_experts, dtype=torch.int32, device=dev)
        tir = torch.empty((T, R), dtype=torch.bool, device=dev)
        blocks = max(1, math.ceil(T / K.LAYOUT_THREADS))
        partials = torch.empty(blocks * (R + num_experts), dtype=torch.int32, device=dev) if blocks > 1 else None
        stream = torch.cuda.current_stream(dev)
        scratch = self._layout_scratch.get(stream.cuda_stream)
        if scratch is None:  # one ticket per stream: layouts on two streams must not share it
            scratch = torch.zeros(2, dtype=torch.int32, device=dev)
            self._layout_scratch[stream.cuda_stream] = scratch
        K.launch("layout", "layout_kernel", blocks, K.LAYOUT_THREADS,
                 (K.ptr(topk), K.i32(T), K.i32(Kk), K.i32(num_experts), K.i32(R),
                  K.ptr(ntpr), K.ptr(ntpe), K.ptr(tir), K.ptr(partials), K.ptr(scratch)),
                 shared_mem=(R + num_experts) * 4)
        return Layout(ntpr, None, ntpe, tir)

    def _probe_recv_x(self, N: int, H: int, dtype) -> torch.Tensor:
        """DISPATCH_PROBE_NO_REMOTE_COPY (a timing probe, wrong results): the kernel never writes remote
        rows, so every call gets rows of one tensor zeroed once and shared by all calls. Finite values
        keep a model's routing sane, and no per-call fill kernel waits for SMs beside compute."""
        buf = self._probe_rows
        if buf is None or buf.dtype != dtype or buf.shape[1] != H or buf.shape[0] < N:
            buf = self._probe_rows = torch.zeros((max(N, 1), H), dtype=dtype, device=self.device)
        return buf[:N]

    # ------------------------------------------------------------------ geometry
    def _capacity(self, slot_bytes: int, num_channels: int) -> int:
        return self.region_bytes // (self.num_ranks * num_channels * slot_bytes)

    def staging_capacity(self, num_channels: int, slot_bytes: int) -> int:
        """Rows per (source, channel) a call may send: the kernels move a call whole (no ring yet), in
        half of the buffer less the control words, so a buffer sized by the ring hint holds about half
        a ring. Buffer._check_capacity refuses bigger calls on every rank before anything moves."""
        return self._capacity(slot_bytes, num_channels)

    def _check_channels(self, num_channels: int, num_tokens: int, slot_bytes: int, what: str) -> int:
        if num_channels > K.MAX_CHANNELS:
            raise ValueError(f"[commlib rank {self.rank}] {what}: {num_channels} channels, the nvlink backend "
                             f"supports at most {K.MAX_CHANNELS} (num_sms <= {2 * K.MAX_CHANNELS})")
        cap = self._capacity(slot_bytes, num_channels)
        per = math.ceil(num_tokens / num_channels) if num_tokens else 0
        if per > cap:
            raise ValueError(f"[commlib rank {self.rank}] {what}: {num_tokens} tokens need {per} slots per channel, "
                             f"the NVLink buffer ({self.num_bytes} bytes) holds {cap} slots of {slot_bytes} bytes "
                             f"per (rank, channel); build the Buffer with a larger num_nvl_bytes "
                             f"(Config.get_nvl_buffer_size_hint)")
        return cap

    @staticmethod
    def _round(send_chunk: int, family: str) -> int:
        """Tokens (rows) per published round: the config's send chunk, rounded to whole passes of
        the sender's copy warps (every warp but the publisher)."""
        warps = K.threads(family) // 32 - 1
        return align_up(max(1, int(send_chunk)), warps)

    # ------------------------------------------------------------------ dispatch
    def _device_failure(self, what: str, e: BaseException) -> CommlibError:
        """A CUDA error in a call (a kernel of this or an earlier call trapped: device timeout or
        signature mismatch, whose '[commlib] rank ...' line is on stdout): the context is gone, so
        the Buffer refuses every later call."""
        self.failed = f"{what}: {e}"
        return CommlibError(f"[commlib rank {self.rank}] {what} failed on the device (a peer did not take part "
                            f"in time, the ranks' calls differ, or a kernel faulted; see the '[commlib] rank ...' "
                            f"line printed by the device): {e}")

    def dispatch(self, req: DispatchRequest) -> DispatchResult:
        self._alive()
        try:
            return self._dispatch(req)
        except RuntimeError as e:  # CUDA errors (torch.AcceleratorError, cuLaunchKernel); not ValueError
            if isinstance(e, CommlibError):
                raise
            raise self._device_failure("dispatch", e) from e

    def _dispatch(self, req: DispatchRequest) -> DispatchResult:
        R, me, dev = self.num_ranks, self.rank, self.device
        x = aligned_16(req.x)
        T, H = x.shape
        hidden_bytes = H * x.element_size()
        if hidden_bytes % 16:
            raise ValueError(f"[commlib rank {me}] nvlink dispatch: x rows must be a multiple of 16 bytes, "
                             f"got hidden {H} x {x.element_size()} bytes")
        scales = req.x_scales.contiguous() if req.x_scales is not None else None
        S = scales.shape[1] if scales is not None else 0
        cached = req.handle is not None
        worst = int(req.num_worst_tokens)
        if cached:
            h = req.handle
            if h.backend != self.name:
                raise CommlibError(f"[commlib rank {me}] handle was made by backend {h.backend!r}, not {self.name!r}")
            C, E = h.num_channels, h.num_experts
            tir = h.is_token_in_rank
            rpm, cpm, rcp = h.rank_prefix_matrix, h.channel_prefix_matrix, h.recv_channel_prefix_matrix
            topk = weights = None
        else:
            C, E = req.config.num_channels, req.num_experts
            tir = req.layout.is_token_in_rank.contiguous()
            topk = req.topk_idx.contiguous() if req.topk_idx is not None else None
            weights = req.topk_weights.contiguous() if req.topk_weights is not None else None
        Kk = topk.shape[1] if topk is not None else 0
        L = E // R
        # the copy engines move the rows (csrc/ce.cu) where the host knows every count
        use_ce = self._ce is not None and not worst and (not cached or "ce_pos" in req.handle.extra)
        prepacked = self._ce_consume(req, use_ce)
        off_scales = align_up(hidden_bytes)
        off_meta = off_scales + align_up(S * 4)
        slot_bytes = align_up(off_meta + 4 * (1 + 2 * Kk), SLOT_ALIGN)
        cap = self._check_channels(C, T, slot_bytes, "dispatch")

        host = None
        counts = None
        if not cached:
            slot_words = K.notify_slot_words(R)
            if K.NOTIFY_WORD_EXPERT + L > slot_words:
                raise ValueError(f"[commlib rank {me}] nvlink dispatch: {L} experts per rank do not fit the count "
                                 f"exchange slot ({slot_words - K.NOTIFY_WORD_EXPERT} at most)")
            cpm = torch.empty((R, C), dtype=torch.int32, device=dev)
            rpm = torch.empty((R, R), dtype=torch.int32, device=dev)
            rcp = torch.empty((R, C), dtype=torch.int32, device=dev)
            counts = torch.empty(K.HOST_COUNTS_EXPERT + L, dtype=torch.int32, device=dev)
            layout = req.layout
            # what every rank must agree on (NOTIFY_SIG_FIELDS); notify.cu compares the ranks'
            sig = [H, x.element_size(), S, Kk, int(weights is not None), E, C]
            K.launch("notify", "notify_kernel", 1, K.NOTIFY_THREADS,
                     (K.ptr(tir), K.i32(T), K.ptr(layout.num_tokens_per_rank.contiguous()),
                      K.ptr(layout.num_tokens_per_expert.contiguous()), K.ptr(topk), K.i32(Kk), K.i32(E),
                      K.ptr(cpm), K.ptr(rpm), K.ptr(rcp), K.ptr(counts),
                      K.ptr(self.peer_bases), K.i32(me), K.i32(R), K.i32(C), K.i32(slot_words),
                      K.i32(NOTIFY_MODE_NO_HOST if worst else 0), K.i32(sig[0]), K.i32(sig[1]), K.i32(sig[2]),
                      K.i32(sig[4]),
                      K.ptr(self.seq_counters), self._smid_ptr("notify", 1), K.u64(self.timeout_ns)))
            if not worst:
                if use_ce and prepacked is None:  # the layout needs no host value: queue it before the wait
                    ce_layout = rows_before(tir)
                    ce_layout = (ce_layout, layout_send_head(tir, rpm, me, before=ce_layout))
                host = self._host_read(counts, "dispatch count exchange").tolist()
                self._raise_bad_ids(host, sig)
                N = host[0]
            else:
                N = worst
        else:
            if worst:
                N = worst
            elif h.num_recv_tokens is not None:
                N = int(h.num_recv_tokens)
            else:
                N = int(self._host_read(rpm[R - 1, me], "cached dispatch row count"))

        if K.variant_value("DISPATCH_PROBE_NO_REMOTE_COPY"):
            recv_x = self._probe_recv_x(N, H, x.dtype)
        else:
            recv_x = torch.empty((N, H), dtype=x.dtype, device=dev)
        recv_scales = torch.empty((N, S), dtype=torch.float32, device=dev) if scales is not None else None
        recv_src_idx = send_head = recv_topk_idx = recv_topk_w = None
        if not cached:
            recv_src_idx = torch.empty(N, dtype=torch.int32, device=dev)
            send_head = None if use_ce else torch.empty((T, R), dtype=torch.int32, device=dev)  # CE: from its layout
            if topk is not None:
                recv_topk_idx = torch.empty((N, Kk), dtype=torch.int64, device=dev)
                if weights is not None:
                    recv_topk_w = torch.empty((N, Kk), dtype=torch.float32, device=dev)
        num_sms = req.config.num_sms
        ce_pos = None
        if use_ce:
            if cached:
                ce_pos, sent, got = h.extra["ce_pos"], h.extra["send_counts"], h.extra["recv_counts"]
            elif prepacked is not None:
                ce_pos, sent, got = prepacked.pos, host[4:4 + R], host[12:12 + R]
            else:
                (ce_pos, send_head), sent, got = ce_layout, host[4:4 + R], host[12:12 + R]
            self._ce_dispatch(x, scales, topk, weights, tir, ce_pos, sent, got, L, num_sms,
                              (recv_x, recv_scales, recv_topk_idx, recv_topk_w, recv_src_idx),
                              notified=not cached, prepacked=prepacked)
            if prepacked is not None and not cached:  # for the handle only (combine reads ce_pos): off the
                send_head = layout_send_head(tir, rpm, me, before=ce_pos)  # copies' critical path
        else:
            flags = 0 if cached else 1
            K.launch("dispatch", "dispatch_kernel", num_sms, K.threads("dispatch"),
                     (K.ptr(x), K.ptr(scales), K.ptr(topk), K.ptr(weights), K.ptr(tir),
                      K.ptr(rpm), K.ptr(cpm), K.ptr(rcp),
                      K.ptr(recv_x), K.ptr(recv_scales), K.ptr(recv_src_idx), K.ptr(recv_topk_idx), K.ptr(recv_topk_w),
                      K.ptr(send_head),
                      K.i32(T), K.i32(hidden_bytes // 16), K.i32(S), K.i32(Kk), K.i32(L), K.i32(N),
                      K.ptr(self.peer_bases), K.i32(me), K.i32(R), K.i32(C),
                      K.u64(CONTROL_BYTES), K.i32(cap), K.i32(slot_bytes), K.i32(off_scales), K.i32(off_meta),
                      K.i32(self._round(req.config.num_max_nvl_chunked_send_tokens, "dispatch")), K.i32(flags),
                      # with num_worst_tokens the host never sees the counts: the kernel checks the error word
                      K.u64(counts.data_ptr() + 4 * K.HOST_COUNTS["bad_rank"]) if (counts is not None and worst) else K.u64(0),
                      K.ptr(self.seq_counters), self._smid_ptr("dispatch", num_sms), K.u64(self.timeout_ns)),
                     shared_mem=K.dynamic_smem("dispatch"),
                     variant_key=K.dispatch_variant_key(num_sms))  # DISPATCH_STREAM_MAX_SMS: per call

        if cached:
            handle = req.handle
            self._count(handle.extra.get("send_counts"))
            return DispatchResult(recv_x, recv_scales, None, None, None, handle)
        extra = {}
        per_expert: list = []
        if host is not None:
            sent = host[4:4 + R]
            extra = {"send_counts": sent, "recv_counts": host[12:12 + R]}
            if ce_pos is not None:
                extra["ce_pos"] = ce_pos
            self._count(sent)
            a = req.expert_alignment
            per_expert = [(c + a - 1) // a * a for c in host[K.HOST_COUNTS_EXPERT:K.HOST_COUNTS_EXPERT + L]]
            if topk is None:
                per_expert = [0] * L
        handle = DispatchHandle(
            rank_prefix_matrix=rpm, channel_prefix_matrix=cpm, recv_channel_prefix_matrix=rcp,
            recv_src_idx=recv_src_idx, is_token_in_rank=tir, send_head=send_head,
            topology=self.topology, num_tokens=T, hidden=H, num_experts=E, num_channels=C,
            num_recv_tokens=None if worst else N, num_worst_tokens=worst, backend=self.name, extra=extra)
        return DispatchResult(recv_x, recv_scales, recv_topk_idx, recv_topk_w, per_expert, handle)

    def _raise_bad_ids(self, host: list, sig: Optional[list] = None) -> None:
        """Raise what the count exchange found, on every rank alike: bad top-k ids (here or on a
        peer), a peer that rejected its input, or ranks whose call signatures differ."""
        hc = K.HOST_COUNTS
        bad_me, bad_rank, bad_value = host[hc["bad_me"]], host[hc["bad_rank"]], host[hc["bad_value"]]
        if bad_me and bad_me != K.NOTIFY_REJECTED:
            raise ValueError(f"[commlib rank {self.rank}] topk_idx holds expert ids outside [-1, num_experts) "
                             f"({bad_me} of them); nothing was sent")
        if bad_rank >= 0:
            what = ("rejected its dispatch input" if bad_value == K.NOTIFY_REJECTED else
                    f"has topk_idx with {bad_value} expert ids outside [-1, num_experts)")
            raise ValueError(f"[commlib rank {self.rank}] dispatch aborted: rank {bad_rank} {what} "
                             "(see the error on that rank); nothing was sent")
        other = host[hc["sig_rank"]]
        if sig is not None and other >= 0:
            me = self.rank
            theirs = host[hc["sig"]:hc["sig"] + K.NOTIFY_SIG_WORDS]
            diffs = [f"{f}: rank {other} has {_sig_value(f, t)}, rank {me} has {_sig_value(f, m)}"
                     for f, t, m in zip(NOTIFY_SIG_FIELDS, theirs, sig) if t != m]
            raise RankDisagreement(f"[commlib rank {me}] dispatch aborted: ranks disagree on the op: "
                                   + "; ".join(diffs or [f"signature of rank {other}"])
                                   + " (every rank must make the same sequence of calls with the same "
                                     "shapes/config); nothing was sent")

    def on_rejected(self, op: int) -> None:
        """The Buffer refused this rank's input (op 1 = dispatch, 2 = cached dispatch, 3 = combine).

        For a dispatch the peers are (or will be) in the count exchange: take part in it with the
        REJECTED word so they raise too (with num_worst_tokens they return all-padding outputs).
        Cached dispatch and combine have no exchange: the peers time out (COMMLIB_TIMEOUT_S) with a
        '[commlib] ... timeout' line naming this rank.
        """
        if op != 1 or self._base is None or self.failed:
            return
        R, dev = self.num_ranks, self.device
        rpm = torch.empty((R, R), dtype=torch.int32, device=dev)
        cpm = torch.empty((R, 1), dtype=torch.int32, device=dev)
        rcp = torch.empty((R, 1), dtype=torch.int32, device=dev)
        counts = torch.empty(K.HOST_COUNTS_EXPERT, dtype=torch.int32, device=dev)
        K.launch("notify", "notify_kernel", 1, K.NOTIFY_THREADS,
                 (K.u64(0), K.i32(0), K.u64(0), K.u64(0), K.u64(0), K.i32(0), K.i32(0),
                  K.ptr(cpm), K.ptr(rpm), K.ptr(rcp), K.ptr(counts),
                  K.ptr(self.peer_bases), K.i32(self.rank), K.i32(R), K.i32(1), K.i32(K.notify_slot_words(R)),
                  K.i32(NOTIFY_MODE_REJECTED), K.i32(0), K.i32(0), K.i32(0), K.i32(0),
                  K.ptr(self.seq_counters), self._smid_ptr("notify", 1), K.u64(self.timeout_ns)))

    def _count(self, send_counts: Optional[list]) -> None:
        if not send_counts:
            return
        for r, n in enumerate(send_counts):
            key = "local_rows" if r == self.rank else "intranode_rows"
            self.counters[key] += int(n)

    # ------------------------------------------------------------------ combine
    def combine(self, req: CombineRequest) -> CombineResult:
        self._alive()
        try:
            return self._combine(req)
        except RuntimeError as e:  # CUDA errors (see dispatch)
            if isinstance(e, CommlibError):
                raise
            raise self._device_failure("combine", e) from e

    def _combine(self, req: CombineRequest) -> CombineResult:
        h = req.handle
        R, me, dev = self.num_ranks, self.rank, self.device
        if h.backend != self.name:
            raise CommlibError(f"[commlib rank {me}] handle was made by backend {h.backend!r}, not {self.name!r}")
        x = aligned_16(req.x)
        N, H = x.shape
        hidden_bytes = H * x.element_size()
        if x.dtype != torch.bfloat16 or hidden_bytes % 16:
            raise ValueError(f"[commlib rank {me}] nvlink combine: x must be bf16 with hidden a multiple of 8, "
                             f"got {x.dtype} hidden {H}")
        T, C = h.num_tokens, h.num_channels
        w = req.topk_weights.contiguous() if req.topk_weights is not None else None
        Kk = w.shape[1] if w is not None else 0
        biases = [aligned_16(b) for b in req.bias] + [None, None]
        off_w = align_up(hidden_bytes)
        slot_bytes = align_up(off_w + 4 * Kk, SLOT_ALIGN)
        cap = self._check_channels(C, T, slot_bytes, "combine")
        out = torch.empty((T, H), dtype=torch.bfloat16, device=dev)
        out_w = torch.empty((T, Kk), dtype=torch.float32, device=dev) if w is not None else None
        num_sms = req.config.num_sms
        if self._ce is not None and "ce_pos" in h.extra:
            pending = self._ce_combine(x, w, h, biases, out, out_w, num_sms,
                                       later=req.finish_later and env.ce_defer_sum())
            self._count(h.extra.get("recv_counts"))
            return CombineResult(out, out_w, pending)
        K.launch("combine", "combine_kernel", num_sms, K.threads("combine"),
                 (K.ptr(x), K.ptr(w), K.ptr(h.send_head),
                  K.ptr(h.rank_prefix_matrix), K.ptr(h.channel_prefix_matrix), K.ptr(h.recv_channel_prefix_matrix),
                  K.ptr(biases[0]), K.ptr(biases[1]), K.ptr(out), K.ptr(out_w),
                  K.i32(T), K.i32(hidden_bytes // 16), K.i32(Kk),
                  K.ptr(self.peer_bases), K.i32(me), K.i32(R), K.i32(C),
                  K.u64(CONTROL_BYTES + self.region_bytes), K.i32(cap), K.i32(slot_bytes), K.i32(off_w),
                  K.i32(self._round(req.config.num_max_nvl_chunked_send_tokens, "combine")),
                  K.ptr(self.seq_counters), self._smid_ptr("combine", num_sms), K.u64(self.timeout_ns)),
                 shared_mem=K.dynamic_smem("combine"))
        self._count(h.extra.get("recv_counts"))
        return CombineResult(out, out_w)

    # ------------------------------------------------------------------ the copy-engine path
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
        stretch them (2 x H200, `balanced` 16384 tokens: F.dispatch 1.7 ms of packing alone on 4 CTAs,
        1.22-1.28 ms for the whole dispatch on 64-128; docs/pipeline.md)."""
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
        sizes = _ce_sizes(x.shape[1] * x.element_size(), scales.shape[1] if scales is not None else 0, Kk, cached,
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

    def _ce_consume(self, req: DispatchRequest, use_ce: bool) -> Optional[CePrepacked]:
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

    def _ce_dispatch(self, x, scales, topk, weights, tir, pos, sent: list, got: list, num_local: int,
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
        sizes = _ce_sizes(H * x.element_size(), scales.shape[1] if scales is not None else 0,
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

    def _ce_combine(self, x, w, h, biases, out, out_w, num_sms: int, later: bool = False):
        """Combine through the copy engines: push the rows of each source rank back into its region for
        this rank, then sum every token's rows in rank order (csrc/ce.cu ce_reduce_kernel). Host
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
                          K.ptr(biases[0]), K.ptr(biases[1]), K.ptr(out), K.ptr(out_w),
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
