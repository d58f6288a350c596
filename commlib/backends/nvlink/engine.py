"""NVLink engine: dispatch / combine inside one node, kernels writing straight into peer memory.

Legend: T tokens on this rank, H hidden, K top-k, E experts, L = E / R local experts, R ranks,
C channels, N rows received.

Peer memory: each rank cudaMallocs ONE buffer of ``num_nvl_bytes`` (CuPy's runtime, not torch's
allocator, so the IPC handle covers exactly this allocation), zeroes it, and exchanges its
cudaIpc handle with ``all_gather_object`` on the Buffer's group (NCCL or gloo: the group only
carries these few bytes, never data). Works between processes sharing a GPU too.

Buffer layout (every rank the same; csrc/common.cuh and commlib/cuda/loader.py hold the offsets):
  [0, CONTROL_BYTES)                      progress / head / done words, notify slots (csrc/notify.cu)
  [CONTROL, CONTROL + num_nvl_bytes)      staging: [source rank][channel] rings, shared by dispatch and
                                          combine (csrc/common.cuh Ring): num_nvl_bytes / R per source,
                                          that / C per channel, slots of the call's row
A ring has the config's num_max_nvl_chunked_recv_tokens slots; any token count streams through it
(Config.get_nvl_buffer_size_hint sizes num_nvl_bytes for that).

Calls never reset anything: kernels keep per-(kind, role, channel) sequence counters in device
memory, so eager calls and CUDA-graph replays interleave freely as long as every rank makes the
same calls in the same order (the DeepEP contract).

With COMMLIB_CE_BYTES the copy engines move the rows instead (copy_engine.py, a base class of
NVLinkBackend).
"""
from __future__ import annotations

import math
import time
import warnings
from typing import Optional

import torch

from commlib.utils import env
from commlib.utils.math import align_up, aligned_16
from commlib.cuda import callpath, loader as K
from commlib.config import CONTROL_BYTES
from commlib.handle import DispatchHandle
from commlib.layout import Layout, dispatch_layout, rows_before
from commlib.layout import send_head as layout_send_head
from commlib.utils.errors import is_device_failure
from commlib.validate import CommlibError
from commlib.backends.base import (Backend, CombineRequest, CombineResult, DispatchRequest, DispatchResult,
                                   alloc_outputs, set_stream as _set_stream)
from commlib.backends.nvlink.copy_engine import CopyEnginePath, StagingPool, ce_settings  # noqa: F401 - re-exported
from commlib.backends.nvlink.peer_memory import SLOT_ALIGN, PeerMemory

SMID_KINDS = {"notify": 0, "dispatch": 1, "combine": 2}
_MAX_LAYOUT_SHARED = 48 * 1024
# Count exchange (csrc/notify.cu): the mode word and the call signature every rank compares.
NOTIFY_MODE_REJECTED = 1   # this rank's Buffer refused its input: take part, with zero counts
NOTIFY_MODE_NO_HOST = 2    # num_worst_tokens: the host never reads the counts, so a mismatch traps
NOTIFY_SIG_FIELDS = ("hidden", "x dtype", "FP8 scales per token", "num_topk", "topk_weights",  # + 2 x ring rows
                     "num_experts", "num_channels")  # K.NOTIFY_SIG_WORDS words, notify.cu's order


class RankDisagreement(CommlibError, ValueError):
    """Ranks called the same op with different shapes / dtype / Config: raised on every rank before
    any data moved; the Buffer stays usable (every rank is still in step)."""


def _sig_value(field: str, v: int) -> str:
    if field == "x dtype":
        return {1: "fp8 (1 byte per element)", 2: "bf16 (2 bytes per element)"}.get(v, f"{v} bytes per element")
    if field == "topk_weights":
        return f"topk_weights {'given' if v & 1 else 'None'}, a ring of {v >> 1} rows per channel"
    if field == "num_channels":
        return f"{v} (Config.num_sms {2 * v})"
    return str(v)


def _config_key(config) -> Optional[tuple]:
    """What a Config sets for the NVLink kernels (None: the Buffer's default)."""
    if config is None:
        return None
    return (config.num_sms, config.num_max_nvl_chunked_send_tokens, config.num_max_nvl_chunked_recv_tokens)


class CachedPlan:
    """A cached dispatch's or a combine's launch, kept on its handle (``handle.extra["plans"]``): the
    replayed kernel, its outputs' shapes, and what the call was made with, which a later call must
    match to replay it."""

    __slots__ = ("owner", "shape", "dtype", "config_key", "channels", "replay", "outputs", "second_shape",
                 "out_slot", "local_rows", "remote_rows", "handle_tensors")

    def __init__(self, owner, x, config, channels, replay, outputs, out_slot, counts, second, handle_tensors):
        self.owner, self.shape, self.dtype, self.channels, self.replay = owner, x.shape, x.dtype, channels, replay
        # ((field, tensor), ...): the handle's tensors whose addresses the replayed arguments hold; a
        # handle copied with other tensors there (sharing ``extra``) must not replay this plan
        self.handle_tensors = handle_tensors
        self.config_key = _config_key(config)
        self.outputs = outputs          # ((shape, dtype), (shape, dtype) or None): the kernel's two outputs
        self.second_shape = tuple(second.shape) if second is not None else None
        self.out_slot = out_slot        # argument index of the first output's address (the second's is next)
        rank = owner.rank
        self.local_rows = int(counts[rank]) if counts else 0
        self.remote_rows = (sum(int(n) for n in counts) - self.local_rows) if counts else 0


class FullPlan:
    """A non-cached dispatch's two launches (count exchange, rows), kept per shape and Config: a
    later dispatch of that shape sets its tensors' addresses, its sequence word and its row count,
    and replays them. ``cpp``: their twin for the C++ call path (commlib.cuda.callpath), or None."""

    __slots__ = ("notify", "dispatch", "sig", "local_experts", "channels", "num_experts", "cpp")

    def __init__(self, notify, dispatch, sig, local_experts, channels, num_experts, twins: bool) -> None:
        self.notify, self.dispatch, self.sig = notify, dispatch, sig
        self.local_experts, self.channels, self.num_experts = local_experts, channels, num_experts
        self.cpp = (callpath.full_twin(notify, dispatch, sig, local_experts, channels, num_experts)
                    if twins and notify is not None and dispatch is not None else None)


# the handle tensors a cached dispatch's / a combine's kernel arguments point at (their launch order)
_DISPATCH_HANDLE_FIELDS = ("is_token_in_rank", "rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix")
_COMBINE_HANDLE_FIELDS = ("send_head", "rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix",
                          "sum_order")


# combine_kernel's arguments: x, w, send_head, the three prefix matrices, bias0, bias1, sum_order, out, out_w
_COMBINE_OUT_SLOT = 9


def _handle_tensors(handle: DispatchHandle, fields: tuple) -> tuple:
    return tuple((f, getattr(handle, f)) for f in fields)


class NVLinkBackend(CopyEnginePath, Backend):
    """Intranode GPU backend over CUDA IPC peer pointers (see module docstring)."""

    name = "nvlink"
    gpu_share = 1               # ranks of the group on this GPU (set in __init__ from the Buffer's context)
    _twins = False              # kept launches get C++ twins (commlib.cuda.callpath; set in __init__)
    _warned_residency = False

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
        self._dev_index = self.device.index   # what Tensor.get_device() returns for a tensor on it
        self.group = ctx.group
        self.timeout_ns = int(float(ctx.timeout_s) * 1e9)
        self.failed: Optional[str] = None
        self.last_wait_ns = 0  # ns the host last waited for counts (_wait_counts, _host_read)
        self._out = None       # the stream this call's outputs belong to (_alloc)
        self.replayed = 0      # calls served from a kept plan (layouts, cached dispatches, combines)
        self._blocks: list = []
        self._base: Optional[int] = None
        self._peer_ptrs: dict[int, int] = {}
        # control words first, then num_nvl_bytes of staging: one part per source rank, a ring per channel
        # inside it (csrc/common.cuh Ring), shared by dispatch and combine
        self.num_bytes = CONTROL_BYTES + int(ctx.num_nvl_bytes)
        self.part_bytes = int(ctx.num_nvl_bytes) // self.num_ranks // SLOT_ALIGN * SLOT_ALIGN
        self._ring_channels: Optional[int] = None  # channels of the last call (its rings' byte ranges)
        self._mem = PeerMemory(self.num_bytes, self.group, self.rank, self.num_ranks, self.device)
        self._base, self._peer_ptrs = self._mem.base, self._mem.peer_ptrs
        self.peer_bases = self._mem.peer_bases
        self.seq_counters = torch.zeros(K.NUM_SEQ_COUNTERS, dtype=torch.int64, device=self.device)
        self._layout_scratch: dict = {}  # per stream: [ticket, error word] int32
        self._layout_plans: dict = {}     # (stream, T, K, E) -> (loader.Replay of its launch, its partials)
        self._full_plans: dict = {}       # a non-cached dispatch's shape and Config -> FullPlan
        self.last_full_plan: Optional[FullPlan] = None  # the FullPlan the last dispatch ran or made (Buffer keeps it)
        self.init_host_words(K.notify_slot_words(self.num_ranks), pinned=True)
        # per kind and slot (one slot per launch, round robin over COMMLIB_DEBUG_SMID_SLOTS): %smid of up
        # to 256 CTAs, then (kernel variant COMM_TRACE=1) 3 u64 trace points per CTA
        self._smid_slots = env.debug_smid_slots()
        self._smids = torch.full((len(SMID_KINDS), self._smid_slots, K.TRACE_OFFSET_WORDS + 256 * K.TRACE_POINTS * 2),
                                 -1, dtype=torch.int32, device=self.device) if env.debug_smid() else None
        # per kind: launches since the reset, and the grid of the launch each slot holds
        self._smid_count = {kind: 0 for kind in SMID_KINDS}
        self._smid_grids = {kind: [0] * self._smid_slots for kind in SMID_KINDS}
        self.init_copy_engine()  # COMMLIB_CE_BYTES: the copy-engine data path (copy_engine.py)
        # ranks sharing this GPU (CUDA MPS): all their CTAs must be resident together; half-SM CTAs
        # when the SM budget (at least DeepEP's usual 24) would not fit one CTA per SM
        self.gpu_share = int(getattr(ctx, "gpu_share", 1) or 1)
        self.sm_count = torch.cuda.get_device_properties(self.device).multi_processor_count
        if self.gpu_share > 1:
            K.fit_shared_gpu(self.gpu_share, max(int(ctx.num_sms()), 24), self.sm_count)
        self._warned_residency = False
        K.compile_all()  # compile (or load) now, not inside the first call or a graph capture
        # kept launches get C++ twins where the C++ call path loads (built now, not inside a call)
        self._twins = callpath.load() is not None
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

    # ------------------------------------------------------------------ host words, outputs
    def init_host_words(self, count_words: int, pinned: bool) -> None:
        """The count exchange's host words: notify.cu writes a dispatch's counts straight into them
        (pinned memory, which kernels address directly) and then raises the flag to the call's
        sequence number, which the host polls: no copy, no stream sync."""
        self._host_counts = torch.zeros(count_words, dtype=torch.int32, device="cpu", pin_memory=pinned)
        self._host_flag = torch.zeros(1, dtype=torch.int64, device="cpu", pin_memory=pinned)
        self._counts_np, self._flag_np = self._host_counts.numpy(), self._host_flag.numpy()
        self._host_seq = 0

    def _wait_counts(self, seq: int, words: int) -> list:
        """The counts of the call whose notify launch carried ``seq``, once its flag is up. A device
        failure (a trapped notify: peer timeout, bad signature) surfaces through the stream's error
        within a poll period; COMMLIB_TIMEOUT_S plus a grace bounds the wait."""
        flag = self._flag_np
        t0 = time.perf_counter_ns()
        spins = 0
        while flag[0] != seq:
            spins += 1
            if spins & 0xFFF == 0:
                stream = self.ctx.comm_stream
                try:
                    done = stream is not None and stream.query()
                except Exception as e:  # noqa: BLE001 - RuntimeError / torch.AcceleratorError: sticky CUDA error
                    self.count_wait_failed(seq, e, False)
                if (done and flag[0] != seq) or time.perf_counter_ns() - t0 > self.timeout_ns + 5_000_000_000:
                    self.count_wait_failed(seq, None, done)
        self.last_wait_ns = time.perf_counter_ns() - t0
        return self._counts_np[:words].tolist()

    def count_wait_failed(self, seq: int, error: Optional[BaseException], done: bool) -> None:
        """Raise what a wait for the counts of call ``seq`` ends with (the C++ call path raises through
        this too): the comm stream's CUDA ``error``, or no flag although the notify kernel finished
        (``done``) or ran past COMMLIB_TIMEOUT_S."""
        if error is not None:
            raise self._device_failure("dispatch count exchange", error) from error
        self.failed = "dispatch count exchange: no counts"
        raise CommlibError(f"[commlib rank {self.rank}] dispatch count exchange: the notify kernel "
                           f"{'finished' if done else 'ran past COMMLIB_TIMEOUT_S'} without raising "
                           f"its host flag (call {seq}, flag {int(self._flag_np[0])})")

    def _alloc(self, specs: tuple) -> list:
        """A tensor per spec on the call's output stream (``self._out``; base.alloc_outputs), recorded
        in this call's blocks."""
        return alloc_outputs(self._out, self.ctx.comm_stream, specs, self.device, self._blocks)

    def _exchange_outputs(self, C: int, L: int, worst: int) -> list:
        """A non-cached dispatch's count-exchange outputs: channel, rank and receive-channel prefix
        matrices, and (num_worst_tokens only) the device counts: otherwise notify.cu writes the counts
        into the host words, and with num_worst_tokens the dispatch kernel reads their error word."""
        R, i32 = self.num_ranks, torch.int32
        return self._alloc((((R, C), i32), ((R, R), i32), ((R, C), i32),
                            ((K.HOST_COUNTS_EXPERT + L,), i32) if worst else None))

    def _row_outputs(self, N: int, T: int, topk, weights, send_head: bool) -> list:
        """A non-cached dispatch's per-row outputs: recv_src_idx [N], send_head [T, R] (where wanted),
        recv_topk_idx [N, K] and recv_topk_weights [N, K] (where there are top-k ids and weights)."""
        Kk = topk.shape[1] if topk is not None else 0
        return self._alloc((((N,), torch.int32), ((T, self.num_ranks), torch.int32) if send_head else None,
                            ((N, Kk), torch.int64) if topk is not None else None,
                            ((N, Kk), torch.float32) if topk is not None and weights is not None else None))

    def _next_seq(self) -> int:
        """The next call's host-flag value (1 .. 2^31 - 1, then 1 again)."""
        self._host_seq = self._host_seq % 0x7FFFFFFF + 1
        return self._host_seq

    def _host_read(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """The one device -> host copy of a call; a device-side timeout surfaces here. ``last_wait_ns``:
        how long the host was blocked in it (benchmarks.bench_host splits a call's time with it)."""
        t0 = time.perf_counter_ns()
        try:
            out = t.cpu()
            self.last_wait_ns = time.perf_counter_ns() - t0
            return out
        except RuntimeError as e:  # torch.AcceleratorError from a trapped kernel
            if not is_device_failure(e):
                raise
            raise self._device_failure(what, e) from e

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
        blocks = max(1, math.ceil(T / K.LAYOUT_THREADS))
        # outputs on the current stream (the caller's, or the comm stream of an overlapped call)
        self._out, self._blocks = None, []
        ntpr, ntpe, tir = self._alloc((((R,), torch.int32), ((num_experts,), torch.int32), ((T, R), torch.bool)))
        stream = torch._C._cuda_getCurrentRawStream(dev.index)
        key = (stream, T, Kk, num_experts)
        kept = self._layout_plans.get(key)
        if kept is not None and kept[0].current():  # the launch of an earlier layout like this one, replayed
            plan = kept[0]
            args = plan.args
            args[0], args[5], args[6], args[7] = topk.data_ptr(), ntpr.data_ptr(), ntpe.data_ptr(), tir.data_ptr()
            plan.issue(stream)
            self.replayed += 1
            return Layout(ntpr, None, ntpe, tir)
        scratch = self._layout_scratch.get(stream)
        if scratch is None:  # one ticket per stream: layouts on two streams must not share it
            scratch = torch.zeros(2, dtype=torch.int32, device=dev)
            self._layout_scratch[stream] = scratch
        # the blocks' partial counts, read back by the last block of the same launch (kept with a plan)
        partials = torch.empty(blocks * (R + num_experts), dtype=torch.int32, device=dev) if blocks > 1 else None
        args = (K.ptr(topk), K.i32(T), K.i32(Kk), K.i32(num_experts), K.i32(R),
                K.ptr(ntpr), K.ptr(ntpe), K.ptr(tir), K.ptr(partials), K.ptr(scratch))
        K.launch("layout", "layout_kernel", blocks, K.LAYOUT_THREADS, args, shared_mem=(R + num_experts) * 4)
        if dev.type == "cuda" and not torch.cuda.is_current_stream_capturing():
            plan = K.replay("layout", "layout_kernel", blocks, K.LAYOUT_THREADS, args,
                            shared_mem=(R + num_experts) * 4)
            if plan is not None:
                if len(self._layout_plans) >= 16:
                    self._layout_plans.clear()
                self._layout_plans[key] = (plan, partials, callpath.layout_plan(plan) if self._twins else None)
        return Layout(ntpr, None, ntpe, tir)

    # ------------------------------------------------------------------ geometry
    def _ring_bytes(self, num_channels: int) -> int:
        return self.part_bytes // num_channels // SLOT_ALIGN * SLOT_ALIGN

    def _check_residency(self, num_sms: int, what: str) -> None:
        """Warn once when the ranks sharing this GPU launch more CTAs than it holds at once: under CUDA
        MPS their kernels, which wait for each other on the device, then time out (time-slicing works)."""
        fit = self.sm_count * K.ctas_per_sm()
        if self.gpu_share * num_sms > fit:
            self._warned_residency = True
            warnings.warn(f"[commlib rank {self.rank}] {what}: {self.gpu_share} ranks share this GPU with "
                          f"{num_sms} CTAs each, more than its {fit} resident CTAs; under CUDA MPS the call "
                          f"times out (use num_sms <= {fit // self.gpu_share}, or time-slice the GPU)",
                          RuntimeWarning, stacklevel=4)

    def _ring(self, num_channels: int, slot_bytes: int, ring_tokens: int, what: str) -> tuple[int, int]:
        """(ring bytes per (source, channel), slots per ring = the config's ring) for a call; rows of any
        count stream through it. Buffer._check_capacity already refused rings that do not fit."""
        if num_channels > K.MAX_CHANNELS:
            raise ValueError(f"[commlib rank {self.rank}] {what}: {num_channels} channels, the nvlink backend "
                             f"supports at most {K.MAX_CHANNELS} (num_sms <= {2 * K.MAX_CHANNELS})")
        if self.gpu_share > 1 and not self._warned_residency:
            self._check_residency(2 * num_channels, what)
        ring_bytes = self._ring_bytes(num_channels)
        cap = min(int(ring_tokens), ring_bytes // slot_bytes)
        if cap < 1:
            raise ValueError(f"[commlib rank {self.rank}] {what}: a ring of {num_channels} channels gets "
                             f"{ring_bytes} bytes of the {self.num_bytes - CONTROL_BYTES}-byte staging, less than "
                             f"one {slot_bytes}-byte slot; build the Buffer with num_nvl_bytes >= "
                             f"Config.get_nvl_buffer_size_hint")
        return ring_bytes, cap

    def _drain_if_moved(self, num_channels: int) -> None:
        """A call with another channel count than the last one moves the rings' byte ranges: first wait
        until every peer's receivers are done with this rank's rows (csrc/notify.cu ring_drain_kernel).
        Every rank makes the same calls, so every rank drains at the same call. A call captured in a
        CUDA graph always drains (its replays may follow any call), and the call after a capture too."""
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if capturing or (self._ring_channels is not None and self._ring_channels != num_channels):
            K.launch("notify", "ring_drain_kernel", 1, 32,
                     (K.ptr(self.peer_bases), K.i32(self.rank), K.i32(self.num_ranks), K.ptr(self.seq_counters),
                      K.u64(self.timeout_ns)))
        self._ring_channels = -1 if capturing else num_channels

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
        self._blocks = []  # what _alloc makes for this call (DispatchResult.blocks)
        self.last_full_plan = None
        try:
            return self._dispatch(req)
        except RuntimeError as e:  # only CUDA failures that poison the context retire the backend
            if isinstance(e, CommlibError) or not is_device_failure(e):
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
        plan_key = None
        if not cached and not use_ce and req.prepacked is None and self._smids is None and dev.type == "cuda":
            # a dispatch shaped like an earlier one replays that one's two launches (FullPlan)
            plan_key = (T, H, x.dtype, S, Kk, weights is not None, E, _config_key(req.config), worst)
            plan = self._full_plans.get(plan_key)
            if (plan is not None and plan.notify.current() and plan.dispatch.current()
                    and self._ring_channels == C and not torch._C._cuda_isCurrentStreamCapturing()):
                self.last_full_plan = plan
                return self._dispatch_replayed(plan, req, x, scales, topk, weights, tir)
        prepacked = self.ce_take_prepacked(req, use_ce)
        off_scales = align_up(hidden_bytes)
        off_meta = off_scales + align_up(S * 4)
        slot_bytes = align_up(off_meta + 4 * (1 + 2 * Kk), SLOT_ALIGN)
        ring_bytes, cap = self._ring(C, slot_bytes, req.config.num_max_nvl_chunked_recv_tokens, "dispatch")

        host = None
        counts = None
        # outputs on the caller's stream (no record_stream), except on the copy-engine path, whose
        # helpers allocate on the comm stream: there the Buffer records every output as it finds it
        self._out = None if use_ce else self.ctx.out_stream
        if not cached:
            slot_words = K.notify_slot_words(R)
            if K.NOTIFY_WORD_EXPERT + L > slot_words:
                raise ValueError(f"[commlib rank {me}] nvlink dispatch: {L} experts per rank do not fit the count "
                                 f"exchange slot ({slot_words - K.NOTIFY_WORD_EXPERT} at most)")
            cpm, rpm, rcp, counts = self._exchange_outputs(C, L, worst)
            if worst:
                counts_ptr, flag_ptr, seq = counts.data_ptr(), 0, 0
            else:
                seq = self._next_seq()
                counts_ptr, flag_ptr = self._host_counts.data_ptr(), self._host_flag.data_ptr()
            layout = req.layout
            # what every rank must agree on (NOTIFY_SIG_FIELDS); notify.cu compares the ranks'
            # (the ring's rows ride in the topk_weights word: ranks with other ring sizes must not pair up)
            sig = [H, x.element_size(), S, Kk, int(weights is not None) + 2 * cap, E, C]
            notify_args = (K.ptr(tir), K.i32(T), K.ptr(layout.num_tokens_per_rank.contiguous()),
                           K.ptr(layout.num_tokens_per_expert.contiguous()), K.ptr(topk), K.i32(Kk), K.i32(E),
                           K.ptr(cpm), K.ptr(rpm), K.ptr(rcp), counts_ptr,
                           K.ptr(self.peer_bases), K.i32(me), K.i32(R), K.i32(C), K.i32(slot_words),
                           K.i32(NOTIFY_MODE_NO_HOST if worst else 0), K.i32(sig[0]), K.i32(sig[1]), K.i32(sig[2]),
                           K.i32(sig[4]),
                           K.ptr(self.seq_counters), self._smid_ptr("notify", 1), K.u64(self.timeout_ns),
                           flag_ptr, seq)
            K.launch("notify", "notify_kernel", 1, K.NOTIFY_THREADS, notify_args)
            if not worst:
                if use_ce and prepacked is None:  # the layout needs no host value: queue it before the wait
                    ce_layout = rows_before(tir)
                    ce_layout = (ce_layout, layout_send_head(tir, rpm, me, before=ce_layout))
                host = self._wait_counts(seq, K.HOST_COUNTS_EXPERT + L)
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

        recv_x, recv_scales = self._alloc((((N, H), x.dtype), ((N, S), torch.float32) if scales is not None else None))
        recv_src_idx = send_head = recv_topk_idx = recv_topk_w = None
        if not cached:   # CE: send_head comes from its layout
            recv_src_idx, send_head, recv_topk_idx, recv_topk_w = self._row_outputs(N, T, topk, weights, not use_ce)
        num_sms = req.config.num_sms
        ce_pos = None
        if use_ce:
            if cached:
                ce_pos, sent, got = h.extra["ce_pos"], h.extra["send_counts"], h.extra["recv_counts"]
            elif prepacked is not None:
                ce_pos, sent, got = prepacked.pos, host[4:4 + R], host[12:12 + R]
            else:
                (ce_pos, send_head), sent, got = ce_layout, host[4:4 + R], host[12:12 + R]
            self.ce_dispatch(x, scales, topk, weights, tir, ce_pos, sent, got, L, num_sms,
                             (recv_x, recv_scales, recv_topk_idx, recv_topk_w, recv_src_idx),
                             notified=not cached, prepacked=prepacked)
            if prepacked is not None and not cached:  # for the handle only (combine reads ce_pos): off the
                send_head = layout_send_head(tir, rpm, me, before=ce_pos)  # copies' critical path
        else:
            flags = 0 if cached else 1
            # rounds of at most a ring: the rows a head wait needs were published by an earlier round
            round_tokens = min(self._round(req.config.num_max_nvl_chunked_send_tokens, "dispatch"), cap)
            # the streaming sender publishes at 32-token blocks past round ends: safe with rings that
            # wrap only when a ring holds a round and two blocks more
            streaming_ok = math.ceil(T / C) <= cap or cap >= round_tokens + 64 if T else True
            # heads go back every head_batch rows: a lag of head_batch - 1 rows plus a round (or a round
            # and a 32-token block for the streaming sender) stays within a ring
            head_batch = max(1, min(32, cap - round_tokens + 1 - (32 if cap >= round_tokens + 64 else 0)))
            self._drain_if_moved(C)
            vkey = K.dispatch_variant_key(num_sms, streaming_ok)  # DISPATCH_STREAM_MAX_SMS: per call
            args = (K.ptr(x), K.ptr(scales), K.ptr(topk), K.ptr(weights), K.ptr(tir),
                      K.ptr(rpm), K.ptr(cpm), K.ptr(rcp),
                      K.ptr(recv_x), K.ptr(recv_scales), K.ptr(recv_src_idx), K.ptr(recv_topk_idx), K.ptr(recv_topk_w),
                      K.ptr(send_head),
                      K.i32(T), K.i32(hidden_bytes // 16), K.i32(S), K.i32(Kk), K.i32(L), K.i32(N),
                      K.ptr(self.peer_bases), K.i32(me), K.i32(R), K.i32(C),
                      K.u64(CONTROL_BYTES), K.u64(self.part_bytes), K.u64(ring_bytes), K.i32(cap), K.i32(slot_bytes),
                      K.i32(off_scales), K.i32(off_meta), K.i32(round_tokens), K.i32(flags), K.i32(head_batch),
                      # with num_worst_tokens the host never sees the counts: the kernel checks the error word
                      K.u64(counts.data_ptr() + 4 * K.HOST_COUNTS["bad_rank"]) if (counts is not None and worst) else K.u64(0),
                      K.ptr(self.seq_counters), self._smid_ptr("dispatch", num_sms), K.u64(self.timeout_ns))
            K.launch("dispatch", "dispatch_kernel", num_sms, K.threads("dispatch"), args, variant_key=vkey)
            if plan_key is not None and self._ring_channels == C:
                plan = FullPlan(K.replay("notify", "notify_kernel", 1, K.NOTIFY_THREADS, notify_args),
                                K.replay("dispatch", "dispatch_kernel", num_sms, K.threads("dispatch"), args, vkey),
                                sig, L, C, E, self._twins)
                if plan.notify is not None and plan.dispatch is not None:
                    if len(self._full_plans) >= 16:
                        self._full_plans.clear()
                    self._full_plans[plan_key] = plan
                    self.last_full_plan = plan
            if cached and self._smids is None and dev.type == "cuda":
                self._keep_plan(h, ("dispatch", x.dtype), CachedPlan(
                    self, x, req.config, C, K.replay("dispatch", "dispatch_kernel", num_sms, K.threads("dispatch"),
                                                     args, vkey),
                    (((N, H), x.dtype), ((N, S), torch.float32) if scales is not None else None), 8,
                    h.extra.get("send_counts"), scales, _handle_tensors(h, _DISPATCH_HANDLE_FIELDS)))

        if cached:
            handle = req.handle
            self._count(handle.extra.get("send_counts"))
            return DispatchResult(recv_x, recv_scales, None, None, None, handle,
                                  blocks=None if use_ce else tuple(self._blocks))
        return self._dispatch_result(req, host, ce_pos, (rpm, cpm, rcp, recv_src_idx, tir, send_head), T, H, E, C, N,
                                     worst, topk, (recv_x, recv_scales, recv_topk_idx, recv_topk_w), use_ce)

    def _dispatch_result(self, req, host, ce_pos, handle_tensors, T, H, E, C, N, worst, topk, outputs,
                         use_ce) -> DispatchResult:
        """A non-cached dispatch's result: its handle (made of ``handle_tensors``), the per-expert
        counts from the host words ``host`` (None with num_worst_tokens), the rows moved counted."""
        R, L = self.num_ranks, E // self.num_ranks
        rpm, cpm, rcp, recv_src_idx, tir, send_head = handle_tensors
        extra = {}
        per_expert: list = []
        if host is not None:
            sent = host[4:4 + R]
            extra = {"send_counts": sent, "recv_counts": host[12:12 + R]}
            if ce_pos is not None:
                extra["ce_pos"] = ce_pos
            self._count(sent)
            if topk is None:
                per_expert = [0] * L
            else:
                per_expert = host[K.HOST_COUNTS_EXPERT:K.HOST_COUNTS_EXPERT + L]
                al = req.expert_alignment
                if al != 1:
                    per_expert = [(c + al - 1) // al * al for c in per_expert]
        handle = DispatchHandle(
            rank_prefix_matrix=rpm, channel_prefix_matrix=cpm, recv_channel_prefix_matrix=rcp,
            recv_src_idx=recv_src_idx, is_token_in_rank=tir, send_head=send_head,
            topology=self.topology, num_tokens=T, hidden=H, num_experts=E, num_channels=C,
            num_recv_tokens=None if worst else N, num_worst_tokens=worst, backend=self.name, extra=extra)
        return DispatchResult(*outputs, per_expert, handle, blocks=None if use_ce else tuple(self._blocks))

    def _dispatch_replayed(self, plan: "FullPlan", req, x, scales, topk, weights, tir) -> DispatchResult:
        """A non-cached dispatch shaped like the one ``plan`` was made from (same sizes, dtypes and
        Config): the same steps as _dispatch, with its two launches replayed on new tensors."""
        dev = self.device
        T, H = x.shape
        E, worst, L, C = plan.num_experts, int(req.num_worst_tokens), plan.local_experts, plan.channels
        self._out = self.ctx.out_stream
        cpm, rpm, rcp, counts = self._exchange_outputs(C, L, worst)
        na = plan.notify.args
        layout = req.layout
        na[0], na[2], na[3] = tir.data_ptr(), layout.num_tokens_per_rank.data_ptr(), layout.num_tokens_per_expert.data_ptr()
        na[4] = topk.data_ptr() if topk is not None else 0
        na[7], na[8], na[9] = cpm.data_ptr(), rpm.data_ptr(), rcp.data_ptr()
        if worst:
            na[10] = counts.data_ptr()
        else:
            na[25] = seq = self._next_seq()
        stream = torch._C._cuda_getCurrentRawStream(dev.index)
        plan.notify.issue(stream)
        host = None
        if worst:
            N = worst
        else:
            host = self._wait_counts(seq, K.HOST_COUNTS_EXPERT + L)
            self._raise_bad_ids(host, plan.sig)
            N = host[0]
        S = scales.shape[1] if scales is not None else 0
        recv_x, recv_scales = self._alloc((((N, H), x.dtype), ((N, S), torch.float32) if scales is not None else None))
        recv_src_idx, send_head, recv_topk_idx, recv_topk_w = self._row_outputs(N, T, topk, weights, True)
        da = plan.dispatch.args
        da[0], da[1], da[2] = x.data_ptr(), K.ptr(scales), K.ptr(topk)
        da[3], da[4], da[5], da[6], da[7] = K.ptr(weights), tir.data_ptr(), rpm.data_ptr(), cpm.data_ptr(), rcp.data_ptr()
        da[8], da[9], da[10] = recv_x.data_ptr(), K.ptr(recv_scales), recv_src_idx.data_ptr()
        da[11], da[12], da[13] = K.ptr(recv_topk_idx), K.ptr(recv_topk_w), send_head.data_ptr()
        da[19] = N
        da[34] = counts.data_ptr() + 4 * K.HOST_COUNTS["bad_rank"] if worst else 0
        plan.dispatch.issue(stream)
        self.replayed += 1
        return self._dispatch_result(req, host, None, (rpm, cpm, rcp, recv_src_idx, tir, send_head), T, H, E, C, N,
                                     worst, topk, (recv_x, recv_scales, recv_topk_idx, recv_topk_w), False)

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

    def on_rejected(self, op: int, num_experts: int = 0) -> None:
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
                  K.ptr(self.seq_counters), self._smid_ptr("notify", 1), K.u64(self.timeout_ns), 0, 0))

    # ------------------------------------------------------------------ kept plans (cached dispatch, combine)
    def _keep_plan(self, handle: DispatchHandle, key: tuple, plan: "CachedPlan") -> None:
        """Keep what a handle's cached dispatch or combine launched, so the next identical call replays
        it (Buffer's fast path): no eligible plan without the driver's launch path, or while capturing."""
        if plan.replay is not None and self._ring_channels == plan.channels:
            handle.extra.setdefault("plans", {})[key] = plan
            if self._twins and plan.config_key is not None:
                twins = handle.extra.get("cpp_plans")
                if twins is None:
                    twins = handle.extra["cpp_plans"] = callpath.plan_set()
                twins.add(callpath.cached_plan(self, plan.replay, key[0], plan.dtype, plan.shape, plan.second_shape,
                                               plan.outputs, plan.config_key, plan.channels, plan.handle_tensors,
                                               plan.local_rows, plan.remote_rows))

    def plan_for(self, handle: DispatchHandle, key: tuple, x: torch.Tensor, config, second) -> Optional["CachedPlan"]:
        """The kept plan for a call with these arguments (``config``: the resolved Config; ``second``:
        FP8 scales or combine weights), or None when anything differs from the call it was made from: then the call takes the full
        path, which validates it as always."""
        plans = handle.extra.get("plans")
        plan = plans.get(key) if plans is not None else None
        if (plan is None or plan.owner is not self or self.failed or self._base is None
                or x.dtype != plan.dtype or x.shape != plan.shape or x.get_device() != self._dev_index
                or not x.is_contiguous() or x.data_ptr() & 15
                or plan.config_key != _config_key(config) or self._ring_channels != plan.channels
                or not plan.replay.current() or (self._dev_index >= 0 and torch._C._cuda_isCurrentStreamCapturing())):
            return None
        for field, t in plan.handle_tensors:
            if getattr(handle, field) is not t:
                return None
        if plan.second_shape is None:
            return plan if second is None else None
        if (second is None or second.dtype != torch.float32 or second.shape != plan.second_shape
                or second.get_device() != self._dev_index or not second.is_contiguous() or second.data_ptr() & 15):
            return None
        return plan

    def run_plan(self, plan: "CachedPlan", x: torch.Tensor, second, comm_raw: int, switch=None) -> tuple:
        """The call ``plan`` was made from, on new tensors: its outputs allocated on the current stream
        (or, with ``switch = (comm, compute)``, on the comm stream), the kernel replayed on the comm
        stream. Returns (first output, second output or None)."""
        (shape1, dtype1), spec2 = plan.outputs
        dev = self.device
        if switch is not None:
            _set_stream(switch[0])
        try:
            first = torch.empty(shape1, dtype=dtype1, device=dev)
            out2 = torch.empty(spec2[0], dtype=spec2[1], device=dev) if spec2 is not None else None
        finally:
            if switch is not None:
                _set_stream(switch[1])
        args = plan.replay.args
        args[0] = x.data_ptr()
        args[plan.out_slot] = first.data_ptr()
        if spec2 is not None:
            args[1] = second.data_ptr()
            args[plan.out_slot + 1] = out2.data_ptr()
        plan.replay.issue(comm_raw)
        self.replayed += 1
        counters = self.counters
        counters["local_rows"] += plan.local_rows
        counters["intranode_rows"] += plan.remote_rows
        return first, out2

    def _count(self, send_counts: Optional[list]) -> None:
        if not send_counts:
            return
        for r, n in enumerate(send_counts):
            key = "local_rows" if r == self.rank else "intranode_rows"
            self.counters[key] += int(n)

    # ------------------------------------------------------------------ combine
    def combine(self, req: CombineRequest) -> CombineResult:
        self._alive()
        self._blocks = []
        try:
            return self._combine(req)
        except RuntimeError as e:  # as in dispatch
            if isinstance(e, CommlibError) or not is_device_failure(e):
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
        ring_bytes, cap = self._ring(C, slot_bytes, req.config.num_max_nvl_chunked_recv_tokens, "combine")
        use_ce = self._ce is not None and "ce_pos" in h.extra
        self._out = None if use_ce else self.ctx.out_stream   # as in dispatch
        out, out_w = self._alloc((((T, H), torch.bfloat16), ((T, Kk), torch.float32) if w is not None else None))
        num_sms = req.config.num_sms
        if use_ce:
            pending = self.ce_combine(x, w, h, biases, req.sum_order, out, out_w, num_sms,
                                      later=req.finish_later and env.ce_defer_sum())
            self._count(h.extra.get("recv_counts"))
            return CombineResult(out, out_w, pending)
        self._drain_if_moved(C)
        args = (K.ptr(x), K.ptr(w), K.ptr(h.send_head),
                  K.ptr(h.rank_prefix_matrix), K.ptr(h.channel_prefix_matrix), K.ptr(h.recv_channel_prefix_matrix),
                  K.ptr(biases[0]), K.ptr(biases[1]), K.ptr(req.sum_order), K.ptr(out), K.ptr(out_w),
                  K.i32(T), K.i32(hidden_bytes // 16), K.i32(Kk),
                  K.ptr(self.peer_bases), K.i32(me), K.i32(R), K.i32(C),
                  K.u64(CONTROL_BYTES), K.u64(self.part_bytes), K.u64(ring_bytes), K.i32(cap), K.i32(slot_bytes),
                  K.i32(off_w), K.i32(min(self._round(req.config.num_max_nvl_chunked_send_tokens, "combine"), cap)),
                  K.i32(max(1, min(32, (cap + 1) // 2))),  # tail / head batch: 2 x batch <= cap + 1
                  K.ptr(self.seq_counters), self._smid_ptr("combine", num_sms), K.u64(self.timeout_ns))
        K.launch("combine", "combine_kernel", num_sms, K.threads("combine"), args)
        if not req.bias and self._smids is None and dev.type == "cuda":
            self._keep_plan(h, ("combine", Kk), CachedPlan(
                self, x, req.config, C, K.replay("combine", "combine_kernel", num_sms, K.threads("combine"), args),
                (((T, H), torch.bfloat16), ((T, Kk), torch.float32) if w is not None else None), _COMBINE_OUT_SLOT,
                h.extra.get("recv_counts"), w, _handle_tensors(h, _COMBINE_HANDLE_FIELDS)))
        self._count(h.extra.get("recv_counts"))
        return CombineResult(out, out_w, blocks=tuple(self._blocks))
