"""Low-latency (decode) mode on the NVLink engine: csrc/low_latency.cu over a CUDA IPC buffer.

Legend: T tokens here (T <= M = num_max_dispatch_tokens_per_rank), H hidden, K top-k, E experts,
R ranks, L = E / R local experts.

Same methods and results as commlib.backends.low_latency.reference.LowLatencyReference (the executable
specification), with static shapes and no host sync, so dispatch + combine can be captured in a
CUDA graph and replayed. Differences, all documented in the issue's terms:
  - rows of ``recv_x`` past ``recv_count`` are left as they are (DeepEP's behaviour; zeroing
    [L, R * M, H] costs more than the whole call at decode shapes). ``pad_zeros = True`` on the
    engine (``buffer._low_latency``) zeroes them, as the reference does. ``src_info`` padding is
    always -1.
  - expert ids outside [-1, E) are not checked on the host (that would be a sync): the dispatch
    kernel prints the first one it finds ('[commlib] rank r low_latency_dispatch: topk_idx[t, k] =
    ...') and traps, which the Buffer reports as CommlibError (and is poisoned, as after torch's
    device-side asserts). A token that reaches one expert through more than M of its (token, slot)
    pairs from one source (repeated ids) loses the pairs past M.
  - at most two calls of each kind may be in flight (return_recv_hook); the hooks must be called
    in call order. Both are checked on the host; on the device a third send waits for the first
    receive and times out with a '[commlib] rank ... timeout' line instead of corrupting it.
  - ``use_logfmt=True`` (combine_logfmt): the kernel sums each expert rank's partial and sends it as
    bf16, so LogFMT is applied around it: min(R, K) combine launches, launch j carrying every token's
    slots on its j-th expert rank (in rank order) only, so it returns that rank's bf16 partial; the
    partials go through the reference's codec (logfmt_roundtrip) and are summed in rank order in
    fp32, which is the reference's result bit for bit. It is min(R, K) exchanges, not a saving of
    bytes; the receive completes in the call (a hook is returned and does nothing).
  - wait-time stats ([R] int64): the nanoseconds of each launch that receives (CUDA events, read with
    a host sync, so not inside a CUDA graph capture) are added to every source's entry: the kernels
    do not time each source apart (DeepEP adds GPU clock cycles per source; the reference adds
    nanoseconds of its exchange to every source, as here).
  - shrink mode (``enable_shrink``): the kernels take the mask as a device int32 [R] (_device_mask):
    senders skip masked destinations, receivers treat a masked source as sending nothing and never
    wait on its words, combine leaves the experts of masked ranks out of the sum (the reference's
    results on the live ranks, bit for bit). A masked rank takes no part (as in the reference); if
    it calls anyway, with itself masked, its call moves nothing (zero rows, zero output) and only
    advances its own sequence numbers. A rank that stops calling is masked by the others after one
    timeout (COMMLIB_TIMEOUT_S), as in the reference: before each call (and in clean_low_latency_buffer
    with a rank masked) the unmasked ranks answer a roll call through the group's key-value store
    (RollCall: a host round trip per call); a CUDA graph replays without it, so a rank that stops
    during replays is a device timeout (CommlibError). Unmasking a rank needs a resync first: after
    ``low_latency_clean_mask_buffer`` every rank (the returning one too) calls
    ``clean_low_latency_buffer`` together with no call in flight (``barrier``), which puts every
    rank's sequence numbers and counters in step again; a call that unmasks a rank without it is
    refused (ValueError) on the ranks that made a call while it was masked. A mask change reaches the
    device on the next call that is not being captured: a CUDA graph replays with the device mask the
    last eager call left.

Memory: one IPC buffer per rank (commlib.backends.nvlink.peer_memory) of CONTROL_BYTES +
``num_rdma_bytes`` + SLACK bytes, separate from the NVLink engine's buffer:
  [0, CONTROL_BYTES)   count words, done words, arrival words (see csrc/low_latency.cu)
  then  dispatch half 0, dispatch half 1 (E * M slots each), combine half 0, combine half 1
        (flags, top-k records and R * M partial slots: commlib.backends.low_latency.reference.combine_half_bytes);
        the halves' sizes come from the size hint's, so a call of either dtype fits the same halves.
Two calls in flight with different (M, H, E) are not supported (their halves would overlap).
"""
from __future__ import annotations

import collections
import itertools
from typing import Optional

import torch
import torch.distributed as dist

from commlib.cuda import loader as K
from commlib.utils.math import align_up, aligned_16
from commlib.fp8 import BLOCK
from commlib.config import MAX_TOPK
from commlib.backends.low_latency.reference import (LowLatencyEngine, LowLatencyHandle, RollCall, check_combine_args,
                           check_dispatch_args, combine_half_bytes, logfmt_roundtrip)
from commlib.backends.nvlink.peer_memory import PeerMemory
from commlib.backends.base import alloc_outputs

THREADS = 512               # kLlThreads in csrc/low_latency.cu
CTAS_PER_SM = 2             # its __launch_bounds__: two CTAs fit an SM (64 registers a thread)
TRACE_BASE, TRACE_CTAS = 64, 256  # LL_TRACE_BASE, LL_TRACE_CTAS in csrc/low_latency.cu
MAX_EXPERTS = 2048          # LL_MAX_EXPERTS in csrc/low_latency.cu: words per half of the control arrays
CUM_BASE = TRACE_BASE + 2 * TRACE_CTAS * 8  # LL_CUM_BASE
MAX_PARTS = 4               # dispatch CTAs per token row the grid is sized for (the kernel uses up to LL_MAX_PARTS)
MAX_TOKENS = 1 << 24        # count words keep rows in 24 bits
OFF_COUNT = 0                               # u64 [2 halves][MAX_EXPERTS]: (local expert, source) counts
OFF_DISPATCH_DONE = OFF_COUNT + 2 * MAX_EXPERTS * 8     # u64 [MAX_RANKS]
OFF_COMBINE_DONE = OFF_DISPATCH_DONE + 8 * K.MAX_RANKS  # u64 [MAX_RANKS]
OFF_ARRIVAL = 36864                         # u64 [2 halves][MAX_EXPERTS]: rows landed per (local expert, source)
CONTROL_BYTES = OFF_ARRIVAL + 2 * MAX_EXPERTS * 8   # 69632, a multiple of 4 KB
SLACK = 4096                # the halves are 16-byte aligned: a few bytes past the size hint
SEND, RECV = 1, 2           # LL_SEND / LL_RECV phases
FP8_MODES = {"bf16": 0, "fp8": 1, "fp8_pow2": 2, "fp8_ue8m0": 3}
assert OFF_COMBINE_DONE + 8 * K.MAX_RANKS <= OFF_ARRIVAL and CONTROL_BYTES % 4096 == 0

_call_ids = itertools.count(1)


def geometry(M: int, H: int, E: int, use_fp8: bool, use_ue8m0: bool, num_ranks: int = 0) -> dict:
    """Byte offsets of one call's regions and slot layout (the same on every rank)."""
    row_d = 2 * H + H // BLOCK * 4 + 16          # rdma_size_hint's dispatch row
    half_d = align_up(E * M * row_d)
    R = num_ranks or E  # ranks (at most E; the worst case when unknown)
    # combine half (csrc/low_latency.cu, combine_slot_offset): flags [R][M], records [R][M][2K],
    # then slots [R][M] of 2H bytes; sized for the largest top-k
    half_c = align_up(combine_half_bytes(M, H, R, E))
    assert align_up(R * M * 8 * (2 * MAX_TOPK + 1)) + R * M * 2 * H <= half_c
    data_bytes = H if use_fp8 else 2 * H
    scale_bytes = (H // BLOCK if use_ue8m0 else H // BLOCK * 4) if use_fp8 else 0
    off_scales = align_up(data_bytes)
    slot_bytes = off_scales + align_up(scale_bytes)
    assert slot_bytes <= row_d, (slot_bytes, row_d)
    # dispatch half (csrc/low_latency.cu, dispatch_meta_offset): token rows [R][M], then meta [L][R][M] u64
    need_d = align_up(R * M * slot_bytes) + E * M * 8
    half_d = max(half_d, align_up(need_d))
    return {"off_dispatch": CONTROL_BYTES, "half_dispatch": half_d,
            "off_combine": CONTROL_BYTES + 2 * half_d, "half_combine": half_c,
            "end": CONTROL_BYTES + 2 * half_d + 2 * half_c,
            "slot_bytes": slot_bytes, "slot_off_scales": off_scales}


class NVLinkLowLatency(LowLatencyEngine):
    """Low-latency dispatch / combine kernels over CUDA IPC (see module docstring)."""

    def __init__(self, ctx, backend) -> None:
        super().__init__(ctx, backend)
        self.rank, self.num_ranks = ctx.rank, ctx.num_ranks
        self.device = ctx.device
        self.timeout_ns = int(float(ctx.timeout_s) * 1e9)
        self.pad_zeros = False
        # CTAs per launch: up to two per SM (the fused send + receive kernel needs every CTA resident;
        # with 144 local experts at the decode shape, 132 CTAs left 12 of them doing two experts)
        self.num_sms = CTAS_PER_SM * torch.cuda.get_device_properties(self.device).multi_processor_count
        # ranks sharing this GPU (CUDA MPS) run their kernels side by side: each gets a share of the
        # resident CTAs small enough for two of its launches in flight at once (a hooked dispatch's
        # receive beside the next send), or a rank whose CTAs find no room never starts and its peers
        # time out (8 ranks at one share each: DeepEP's test_low_latency timed out in its first combine)
        share = max(1, int(getattr(ctx, "gpu_share", 1) or 1))
        if share > 1:
            self.num_sms = max(1, self.num_sms // (2 * share))
        self.capacity = CONTROL_BYTES + int(ctx.num_rdma_bytes) + SLACK
        self.mem: Optional[PeerMemory] = PeerMemory(self.capacity, ctx.group, self.rank, self.num_ranks,
                                                    self.device)
        # [0, 4): completed (dispatch send, dispatch recv, combine send, combine recv) phases, << 32;
        # [TRACE_BASE, CUM_BASE): LL_TRACE variant timestamps; [CUM_BASE, ...): arrival totals per
        # (call & 3, local expert, source) (csrc/low_latency.cu, LL_CUM_BASE)
        self.state = torch.zeros(CUM_BASE + 4 * MAX_EXPERTS, dtype=torch.int64, device=self.device)
        self._pending = {"dispatch": collections.deque(), "combine": collections.deque()}
        # shrink mode (_device_mask): the kernels' mask, allocated here (not inside a graph capture)
        self._mask_dev = torch.zeros(self.num_ranks, dtype=torch.int32, device=self.device)
        self._mask_host = torch.zeros(self.num_ranks, dtype=torch.int32, device="cpu")
        self._masked_seen: set = set()
        self._roll: Optional[RollCall] = None   # shrink mode: ranks that stop calling get masked
        K.compile_all()
        self.mem.all_opened(ctx.group, self.rank, self.num_ranks)

    def destroy(self) -> None:
        if self.mem is None:
            return
        self.mem.close()
        self.mem = None

    def _alive(self) -> None:
        if self.mem is None:
            raise RuntimeError(f"[commlib rank {self.rank}] low-latency buffer used after destroy()")

    def _geometry(self, M: int, H: int, E: int, use_fp8: bool, use_ue8m0: bool) -> dict:
        g = geometry(M, H, E, use_fp8, use_ue8m0, self.num_ranks)
        if g["end"] > self.capacity:  # cannot happen when num_rdma_bytes >= the size hint
            raise ValueError(f"[commlib rank {self.rank}] low-latency buffer too small: {g['end']} bytes needed, "
                             f"{self.capacity} allocated")
        return g

    def _check_gpu_limits(self, H: int, Kk: int, E: int, M: int, use_fp8: bool) -> None:
        me = self.rank
        if not use_fp8 and H % 8:
            raise ValueError(f"[commlib rank {me}] nvlink low-latency dispatch: hidden ({H}) must be a multiple of 8")
        if Kk > MAX_TOPK:
            raise ValueError(f"[commlib rank {me}] nvlink low-latency mode: top-k ({Kk}) must be <= {MAX_TOPK}")
        if M >= MAX_TOKENS:
            raise ValueError(f"[commlib rank {me}] nvlink low-latency mode: num_max_dispatch_tokens_per_rank ({M}) "
                             f"must be < {MAX_TOKENS}")
        if E > MAX_EXPERTS:
            raise ValueError(f"[commlib rank {me}] nvlink low-latency mode: num_experts ({E}) must be <= {MAX_EXPERTS}")

    def _grid(self, *work: int) -> int:
        return max(1, min(int(self.num_sms), max(work)))

    def dispatch_grid(self, T: int, L: int) -> int:
        """CTAs of a dispatch launch: receivers share rows (any number), senders are CTA 0 (the counts)
        and up to MAX_PARTS CTAs per token."""
        return self._grid(L, 1 + MAX_PARTS * T)

    def combine_grid(self, M: int) -> int:
        """CTAs of a combine launch: send items (source, token); the receive takes up to two per token."""
        return self._grid(self.num_ranks * M)

    def _issue(self, kind: str, hook: bool) -> Optional[int]:
        """Host-side order of the calls in flight (the device pairs the k-th send with the k-th receive)."""
        pending = self._pending[kind]
        if not hook:
            if pending:
                raise ValueError(f"[commlib rank {self.rank}] low_latency_{kind}: call the receive hook of the "
                                 f"previous call first ({len(pending)} pending)")
            return None
        if len(pending) >= 2:
            raise ValueError(f"[commlib rank {self.rank}] low_latency_{kind}: two calls are already in flight; "
                             "call the oldest receive hook first (two buffer halves)")
        call = next(_call_ids)
        pending.append(call)
        return call

    def _make_hook(self, kind: str, call: int, receive, handle: Optional[LowLatencyHandle]):
        def hook() -> None:
            pending = self._pending[kind]
            if not pending or pending[0] != call:
                raise ValueError(f"[commlib rank {self.rank}] low_latency_{kind} receive hooks must be called once "
                                 "each, in call order")
            self._alive()
            pending.popleft()
            self.ctx.run(receive, [], None, False, False)
            if handle is not None:
                handle.extra["received"] = True
        return hook

    # ------------------------------------------------------------------ dispatch
    def enable_shrink(self) -> None:
        """Shrink mode: the kernels get the mask (_device_mask); before each call a roll call of the
        unmasked ranks (RollCall, collective to set up) masks one that stopped calling."""
        self._roll = RollCall(self.ctx.group, self.rank, self.num_ranks, self.ctx.buffer_id, self.ctx.timeout_s,
                              "nvlink-low-latency")

    def _shrink_mask(self, mask) -> Optional[torch.Tensor]:
        """The kernels' mask for this call (_device_mask), with the ranks that did not answer the roll
        call masked first (``mask`` updated in place, as DeepEP's kernels mark a rank that times out)."""
        dmask = self._device_mask(mask)
        if mask is not None and self._roll is not None and self._roll.round(mask):
            dmask = self._device_mask(mask)
        return dmask

    def _device_mask(self, mask) -> Optional[torch.Tensor]:
        """The kernels' mask (shrink mode; None otherwise: a null pointer, the unmasked path): a device
        int32 [R], 1 = no word goes to or is awaited from that rank. A masked caller masks every rank
        (its call moves nothing). Refuses a call that unmasks a rank this engine saw masked since the
        last resync (``barrier``): that rank's counters and this one's are out of step until then."""
        if mask is None:
            return None
        me = self.rank
        eff = mask.detach().to("cpu", torch.int32).ne(0).to(torch.int32)
        if int(eff[me]):
            eff.fill_(1)
        masked = set(eff.nonzero().flatten().tolist())
        back = self._masked_seen - masked
        if back:
            raise ValueError(f"[commlib rank {me}] shrink mode: rank(s) {sorted(back)} were masked in an earlier "
                             "nvlink low-latency call; call clean_low_latency_buffer on every rank (with no rank "
                             "masked) before calling with them unmasked")
        if not torch.equal(eff, self._mask_host):
            if any(self._pending.values()):  # their receive launches would read the new mask
                raise ValueError(f"[commlib rank {me}] shrink mode: the mask changed while receive hooks are "
                                 "pending; call them first")
            if torch.cuda.is_current_stream_capturing():
                raise ValueError(f"[commlib rank {me}] shrink mode: the mask changed since the last call; make "
                                 "one call outside the CUDA graph capture first (it copies the mask to the device)")
            self._mask_dev.copy_(eff)
            self._mask_host = eff
        self._masked_seen |= masked
        return self._mask_dev

    def barrier(self, mask) -> None:
        """clean_low_latency_buffer in shrink mode. With a rank masked: nothing (the kernels never wait
        for it). With none masked: the resync, collective over every rank of the group, with no call
        in flight: the ranks agree on the largest number of calls any of them made (a rank that took no
        part while masked made fewer), then each sets its four phase counters to that base + 2, its
        done words to the same (every receive up to there counts as done), and its arrival words and
        totals to zero, and a second all-gather keeps every rank from sending before all have. Words
        tagged with older calls (count, meta, record, flag words) stay stale: every later call number
        is above them."""
        self._alive()
        if mask is not None and bool(mask.ne(0).any()):
            if self._roll is not None:   # a rank that does not take part is masked (from the next call on)
                self._roll.round(mask)
            return
        me, R = self.rank, self.num_ranks
        if any(self._pending.values()):
            raise ValueError(f"[commlib rank {me}] clean_low_latency_buffer: call the pending receive hooks first")
        torch.cuda.synchronize(self.device)
        done = int((self.state[:4] >> 32).max())
        everyone: list = [None] * R
        dist.all_gather_object(everyone, (done, self._roll.seq if self._roll is not None else 0), group=self.ctx.group)
        base = max(d for d, _ in everyone) + 2
        if self._roll is not None:   # ranks masked for a while made fewer roll calls
            self._roll.align(max(r for _, r in everyone))
        self.state[:4] = base << 32
        self.state[CUM_BASE:] = 0
        words = torch.full((2 * K.MAX_RANKS,), base << 32, dtype=torch.int64, device=self.device)
        cp = K.cupy()
        with cp.cuda.Device(self.device.index):
            # dispatch then combine done words (adjacent), then the arrival words of both halves
            cp.cuda.runtime.memcpy(self.mem.base + OFF_DISPATCH_DONE, words.data_ptr(), words.numel() * 8, 4)
            cp.cuda.runtime.memset(self.mem.base + OFF_ARRIVAL, 0, 2 * MAX_EXPERTS * 8)
            cp.cuda.runtime.deviceSynchronize()
        torch.cuda.synchronize(self.device)
        dist.all_gather_object([None] * R, me, group=self.ctx.group)
        self._masked_seen = set()

    def _check_stats(self, wait_stats) -> None:
        if wait_stats is not None and torch.cuda.is_current_stream_capturing():
            raise ValueError(f"[commlib rank {self.rank}] wait-time stats on the nvlink low-latency engine are read "
                             "with a host sync (CUDA events): pass None while capturing a CUDA graph")

    def _timed(self, wait_stats, fn) -> None:
        """fn(); with ``wait_stats`` ([R] int64) the nanoseconds it took on the stream (CUDA events,
        one host sync) are added to every entry."""
        if wait_stats is None:
            fn()
            return
        stream = torch.cuda.current_stream(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        wait_stats.add_(round(start.elapsed_time(end) * 1e6))

    def dispatch(self, x, topk_idx, M: int, num_experts: int, use_fp8: bool, round_scale: bool,
                 use_ue8m0: bool, return_recv_hook: bool, mask: Optional[torch.Tensor] = None,
                 wait_stats: Optional[torch.Tensor] = None):
        self._alive()
        self._check_stats(wait_stats)
        b, R, me, dev = self.ctx, self.num_ranks, self.rank, self.device
        check_dispatch_args(b, x, topk_idx, M, num_experts, use_fp8, round_scale, use_ue8m0, check_ids=False)
        T, H = x.shape
        Kk = topk_idx.shape[1]
        E, L, RM = num_experts, num_experts // R, R * M
        self._check_gpu_limits(H, Kk, E, M, use_fp8)
        geo = self._geometry(M, H, E, use_fp8, use_ue8m0)
        mode = FP8_MODES["bf16" if not use_fp8 else "fp8_ue8m0" if use_ue8m0 else "fp8_pow2" if round_scale
                         else "fp8"]
        dmask = self._shrink_mask(mask)
        call = self._issue("dispatch", return_recv_hook)
        x = aligned_16(x)
        idx = topk_idx.contiguous()
        # the outputs on the caller's stream (base.alloc_outputs: freed blocks are reused in its order,
        # as DeepEP's; on the comm stream with a record_stream, a host running ahead of the GPU held
        # one [L, R * M, H] block per call in flight until the GPU caught up)
        made: list = []
        if use_fp8:
            sdt, sw = (torch.int32, H // (4 * BLOCK)) if use_ue8m0 else (torch.float32, H // BLOCK)
            recv_data, src_info, layout_range, recv_count = alloc_outputs(
                b.out_stream, b.comm_stream, (((L, RM, H), torch.float8_e4m3fn), ((L, RM), torch.int32),
                                              ((L, R), torch.int64), ((L,), torch.int32)), dev, made)
            # row-major scales the kernel writes, copied column-major on the caller's side: internal
            recv_scales = torch.empty((L, RM, sw), dtype=sdt, device=dev)
            recv_x = (recv_data, recv_scales)
        else:
            recv_data, src_info, layout_range, recv_count = alloc_outputs(
                b.out_stream, b.comm_stream, (((L, RM, H), torch.bfloat16), ((L, RM), torch.int32),
                                              ((L, R), torch.int64), ((L,), torch.int32)), dev, made)
            recv_x = recv_data
            recv_scales = None
        self.blocks = tuple(made)
        pos = torch.empty((T, Kk), dtype=torch.int32, device=dev)
        tail = (K.ptr(self.mem.peer_bases), K.i32(me), K.i32(R),
                K.u64(OFF_COUNT), K.u64(OFF_DISPATCH_DONE), K.u64(OFF_ARRIVAL), K.u64(geo["off_dispatch"]),
                K.u64(geo["half_dispatch"]),
                K.i32(MAX_EXPERTS), K.i32(geo["slot_bytes"]), K.i32(geo["slot_off_scales"]),
                K.ptr(self.state), K.u64(self.timeout_ns), K.ptr(dmask))
        head = (K.ptr(x), K.ptr(idx), K.ptr(pos), K.ptr(recv_data), K.ptr(recv_scales), K.ptr(src_info),
                K.ptr(layout_range), K.ptr(recv_count),
                K.i32(T), K.i32(H), K.i32(Kk), K.i32(E), K.i32(M), K.i32(mode), K.i32(int(self.pad_zeros)))
        grid = self.dispatch_grid(T, L)
        keep = (x, idx, dmask)  # a hook's launch passes the same pointers: keep them allocated until then

        def launch(phases: int) -> None:
            assert keep
            self._timed(wait_stats if phases & RECV else None,
                        lambda: K.launch("low_latency", "ll_dispatch_kernel", grid, THREADS,
                                         head + (K.i32(phases),) + tail))

        launch(SEND if return_recv_hook else SEND | RECV)
        handle = LowLatencyHandle(src_info, layout_range, M, H, E, buffer_id=b.buffer_id,
                                  extra={"pos": pos, "T": T, "K": Kk, "received": not return_recv_hook,
                                         "engine": "nvlink"})
        hook = self._make_hook("dispatch", call, lambda: launch(RECV), handle) if return_recv_hook else None
        return recv_x, recv_count, handle, hook

    # ------------------------------------------------------------------ combine
    def combine(self, x, topk_idx, topk_weights, handle: LowLatencyHandle, zero_copy: bool,
                return_recv_hook: bool, out: Optional[torch.Tensor], use_logfmt: bool = False,
                mask: Optional[torch.Tensor] = None, wait_stats: Optional[torch.Tensor] = None):
        self._alive()
        self._check_stats(wait_stats)
        b, R, me, dev = self.ctx, self.num_ranks, self.rank, self.device
        x = self.zero_copy_input(x, zero_copy)
        check_combine_args(b, self._combine_buffers, x, topk_idx, topk_weights, handle, zero_copy, out)
        if handle.extra.get("engine") != "nvlink":
            raise ValueError(f"[commlib rank {me}] handle was not made by the nvlink low-latency engine")
        M, H, E = handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts
        T, Kk = handle.extra["T"], handle.extra["K"]
        geo = self._geometry(M, H, E, False, False)
        if H % 8:
            raise ValueError(f"[commlib rank {me}] nvlink low-latency combine: hidden ({H}) must be a multiple of 8")
        dmask = self._shrink_mask(mask)
        call = self._issue("combine", return_recv_hook and not use_logfmt)
        x = aligned_16(x)
        idx = topk_idx.contiguous()
        w = topk_weights.contiguous()
        direct = out is not None and out.is_contiguous() and out.data_ptr() % 16 == 0 and not use_logfmt
        made = []
        result = out if direct else alloc_outputs(b.out_stream, b.comm_stream, (((T, H), torch.bfloat16),), dev,
                                                  made)[0]
        self.blocks = tuple(made)
        args_tail = (K.ptr(self.mem.peer_bases), K.i32(me), K.i32(R),
                     K.u64(OFF_COMBINE_DONE), K.u64(geo["off_combine"]), K.u64(geo["half_combine"]),
                     K.ptr(self.state), K.u64(self.timeout_ns), K.ptr(dmask))
        grid = self.combine_grid(M)

        def run_kernel(phases: int, slots: torch.Tensor, into: torch.Tensor) -> None:
            head = (K.ptr(x), K.ptr(slots), K.ptr(w), K.ptr(handle.extra["pos"]), K.ptr(handle.layout_range),
                    K.ptr(into), K.i32(T), K.i32(H), K.i32(Kk), K.i32(E), K.i32(M))
            self._timed(wait_stats if phases & RECV else None,
                        lambda: K.launch("low_latency", "ll_combine_kernel", grid, THREADS,
                                         head + (K.i32(phases),) + args_tail))

        if use_logfmt:
            if dmask is not None:  # slots on masked ranks leave the launches' split too (the reference's idx)
                owner = torch.div(idx.clamp(min=0), E // R, rounding_mode="floor").clamp(max=R - 1)
                idx = torch.where((idx >= 0) & (dmask[owner] != 0), torch.full_like(idx, -1), idx)
            self.combine_logfmt(run_kernel, idx, E // R, result)
            if out is not None:
                out.copy_(result)
            hook = (lambda: None) if return_recv_hook else None
            return (out if out is not None else result), hook

        keep = (x, idx, w, handle, dmask)  # the receive half (a hook) reads idx, w and the handle's pos

        def launch(phases: int) -> None:
            assert keep
            run_kernel(phases, idx, result)
            if phases & RECV and out is not None and not direct:
                out.copy_(result)

        launch(SEND if return_recv_hook else SEND | RECV)
        hook = self._make_hook("combine", call, lambda: launch(RECV), None) if return_recv_hook else None
        return (out if out is not None else result), hook

    def codec_device(self) -> torch.device:
        """Where the LogFMT codec runs: where the reference backend of this group runs it (its comm
        device: the CPU on a gloo group, this GPU otherwise), so the results are the reference's bit
        for bit (torch's log2 / exp2 may round differently on the CPU and the GPU)."""
        return torch.device("cpu") if dist.get_backend(self.ctx.group) == "gloo" else self.device

    def combine_logfmt(self, run_kernel, idx: torch.Tensor, L: int, result: torch.Tensor) -> None:
        """use_logfmt=True (module docstring): result = bf16(sum over t's expert ranks d, in rank order,
        of logfmt_roundtrip(P_d)), P_d the bf16 partial the kernel forms on rank d."""
        R, T = self.num_ranks, idx.shape[0]
        slot_lists = logfmt_launch_slots(idx, L, R)
        cdev = self.codec_device()
        acc = torch.zeros(T, result.shape[1], dtype=torch.float32, device=cdev)
        for slots, has in slot_lists:
            run_kernel(SEND | RECV, slots, result)
            part = logfmt_roundtrip(result.to(cdev))
            acc = torch.where(has.to(cdev).unsqueeze(1), acc + part, acc)
        result.copy_(acc.to(torch.bfloat16))


def logfmt_launch_slots(idx: torch.Tensor, L: int, R: int) -> list:
    """The launches of a LogFMT combine: min(R, K) pairs (slots_j [T, K] int64, has_j [T] bool): slots_j
    keeps each token's top-k slots on its j-th expert rank (ranks in ascending order) and -1 elsewhere;
    has_j tells the tokens with at least j + 1 expert ranks. Every rank makes the same launches."""
    T, Kk = idx.shape
    E = L * R
    valid = (idx >= 0) & (idx < E)
    dest = torch.where(valid, torch.div(idx, L, rounding_mode="floor"), torch.full_like(idx, R))
    on = torch.zeros(T, R + 1, dtype=torch.int32, device=idx.device)
    on.scatter_(1, dest, 1)
    on = on[:, :R]                                       # [T, R]: rank d holds one of t's slots
    nth = torch.cumsum(on, 1) - 1                        # d's place among t's ranks
    slot_nth = nth.gather(1, dest.clamp(max=R - 1))      # [T, K]: the place of each slot's rank
    count = on.sum(1)
    out = []
    for j in range(min(R, Kk)):
        out.append((torch.where(valid & (slot_nth == j), idx, torch.full_like(idx, -1)), count > j))
    return out


TRACE_POINTS = (("start", "send_ready", "rows_stored", "slots_scanned", "send_done", "arrivals_seen",
                 "recv_rows_done", "end"),
                ("start", "send_ready", "records_written", "record_seen", "partial_stored", "send_done",
                 "partials_seen", "end"))


def trace_summary(state: torch.Tensor, kernel: int, num_ctas: int, ctas: Optional[range] = None) -> dict:
    """Per trace point (kernel variant LL_TRACE=1): (min, median, max) microseconds after the earliest CTA start
    of the last launch of ``kernel`` (0 dispatch, 1 combine), over ``ctas`` (default: all of the
    launch's ``num_ctas``); points a launch did not reach are left out."""
    t = state[TRACE_BASE:CUM_BASE].view(2, TRACE_CTAS, 8)[kernel, :num_ctas].cpu().double()
    t0 = t[:, 0][t[:, 0] > 0].min()
    if ctas is not None:
        t = t[ctas.start:min(ctas.stop, num_ctas)]
    out = {}
    for i, name in enumerate(TRACE_POINTS[kernel]):
        col = t[:, i]
        col = col[col > 0]
        if col.numel():
            us = (col - t0) / 1e3
            out[name] = (round(float(us.min()), 2), round(float(us.median()), 2), round(float(us.max()), 2))
    return out
