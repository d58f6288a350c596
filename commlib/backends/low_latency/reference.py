"""Low-latency mode (decode): DeepEP v1's low_latency_dispatch / low_latency_combine, reference semantics.

Legend: T tokens here (T <= M = num_max_dispatch_tokens_per_rank), H hidden, K top-k, E experts,
R ranks, L = E / R local experts.

dispatch: every (token, top-k slot) with expert e >= 0 is one row for expert e (a token reaches
  an expert once per slot, not once per rank). Output ``recv_x`` is [L, R * M, H]: expert e's rows
  packed from row 0, grouped by source rank in rank order, token order within a source;
  ``recv_count[e]`` of them are valid, the rest are zero. FP8 (``use_fp8``): the sender casts
  each 128-channel block with scale = amax / 448 (``round_scale``: rounded up to a power of two;
  ``use_ue8m0``: the power-of-two scales' exponents packed four per int32, [L, R * M, H / 512]),
  so ``recv_x`` is (E4M3 [L, R * M, H], scales [L, R * M, H / 128] float32 or packed int32).
combine: a weighted sum grouped by the rank that holds the experts (each multiply and add rounded
  once, IEEE): for every rank d, P_d = 0.f; P_d += topk_weights[t, k] * float(row of (t, k)) over
  t's slots k in top-k order whose expert lives on d (fp32), rounded to bf16; then acc = 0.f;
  acc += float(P_d) over the ranks d in order; combined[t] = bf16(acc). So an expert rank sends one
  bf16 partial per token (the BF16 combine: DeepEP's internode combine forwards bf16 partial sums
  the same way) instead of one row per slot; the GPU engines match this bit for bit. With every slot
  on one rank it is the plain top-k-order sum; otherwise each partial adds one bf16 rounding.
Shapes are static (no host-visible counts), which is what makes the GPU path graph-capturable.
With ``return_recv_hook=True`` the call does the send half (the exchange) and returns a hook that
does the receive half (the rows into the outputs, which hold zeros until then), as DeepEP's call
issues its send kernel and the hook its receive kernel; without it the call does both.
"""
from __future__ import annotations

import dataclasses
import datetime
import itertools
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from commlib.config import MAX_TOPK
from commlib.fp8 import BLOCK, FP8_MAX
from commlib.validate import check_tensor

_MIN_AMAX = 1e-4


@dataclasses.dataclass
class LowLatencyHandle:
    src_info: torch.Tensor        # [L, R * M] int32: token index on the source rank of each row (-1 padding)
    layout_range: torch.Tensor    # [L, R] int64: (first row << 32) | rows, per (local expert, source rank)
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
    buffer_id: int = 0
    extra: dict = dataclasses.field(default_factory=dict)

    def __getitem__(self, index):  # DeepEP reads the handle as a tuple
        return (self.src_info, self.layout_range, self.num_max_dispatch_tokens_per_rank, self.hidden,
                self.num_experts)[index]


def combine_half_bytes(M: int, hidden: int, num_ranks: int, num_experts: int) -> int:
    """Bytes of one combine half: E * M bf16 rows, or at least R * M bf16 partials + flags and top-k records."""
    partials = num_ranks * M * (2 * hidden + 8 * (2 * MAX_TOPK + 1)) + 16
    return max(num_experts * M * 2 * hidden, partials)


def rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int, num_experts: int) -> int:
    """Bytes of buffer the low-latency path needs (two alternating halves each of dispatch and combine)."""
    for name, v in (("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank), ("hidden", hidden),
                    ("num_ranks", num_ranks), ("num_experts", num_experts)):
        if v <= 0:
            raise ValueError(f"get_low_latency_rdma_size_hint: {name} must be positive, got {v}")
    M = num_max_dispatch_tokens_per_rank
    slots = num_experts * M                                           # rows a rank may receive
    dispatch_row = hidden * 2 + hidden // BLOCK * 4 + 16              # bf16 or fp8 + scales + meta
    return 2 * (slots * dispatch_row + combine_half_bytes(M, hidden, num_ranks, num_experts))


def cast_fp8(x: torch.Tensor, round_scale: bool, use_ue8m0: bool):
    """[n, H] -> (E4M3 [n, H], scales [n, H/128] float32, or exponents packed [n, H/512] int32)."""
    n, H = x.shape
    blocks = x.float().view(n, H // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=2).clamp(min=_MIN_AMAX)
    # a true division on every device: torch's CUDA `tensor / python scalar` multiplies by the
    # rounded reciprocal instead, which moves some scales by one ulp (the GPU kernel divides too)
    scale = amax / torch.full_like(amax, FP8_MAX)
    if round_scale:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (blocks / scale.unsqueeze(2)).to(torch.float8_e4m3fn).view(n, H)
    if not use_ue8m0:
        return q, scale.contiguous()
    exps = (torch.log2(scale).round().to(torch.int32) + 127).to(torch.uint8)    # UE8M0: the biased exponent
    return q, exps.view(n, H // (4 * BLOCK), 4).contiguous().view(torch.int32).view(n, H // (4 * BLOCK))


def unpack_ue8m0(packed: torch.Tensor) -> torch.Tensor:
    """[..., H/512] int32 -> [..., H/128] float32 power-of-two scales."""
    # an explicit contiguous_format clone: .contiguous() keeps a column-major [.., n, 1] view (size-1
    # dims count as contiguous), whose last stride a dtype view refuses
    exps = packed.clone(memory_format=torch.contiguous_format).view(torch.uint8).to(torch.int32) - 127
    return torch.exp2(exps.float())


def check_dispatch_args(b, x, topk_idx, M: int, num_experts: int, use_fp8: bool, round_scale: bool,
                        use_ue8m0: bool, check_ids: bool = True) -> None:
    """Reject bad low_latency_dispatch input (every engine). ``check_ids`` reads topk_idx on the
    host; GPU engines skip it (no host sync: their kernels ignore ids outside [0, num_experts))."""
    rank, R = b.rank, b.num_ranks
    check_tensor("x", x, rank, dtype=torch.bfloat16, dim=2, device=b.device)
    check_tensor("topk_idx", topk_idx, rank, dtype=torch.int64, dim=2, device=b.device)
    T, H = x.shape
    if topk_idx.shape[0] != T:
        raise ValueError(f"[commlib rank {rank}] topk_idx has {topk_idx.shape[0]} rows but x has {T} tokens")
    if T > M:
        raise ValueError(f"[commlib rank {rank}] x has {T} tokens, more than num_max_dispatch_tokens_per_rank={M}")
    if num_experts <= 0 or num_experts % R:
        raise ValueError(f"[commlib rank {rank}] num_experts ({num_experts}) must be divisible by the number "
                         f"of ranks ({R})")
    if use_fp8 and H % BLOCK:
        raise ValueError(f"[commlib rank {rank}] FP8 low-latency dispatch: hidden ({H}) must be a multiple of {BLOCK}")
    if use_ue8m0 and (not use_fp8 or not round_scale or H % (4 * BLOCK)):
        raise ValueError(f"[commlib rank {rank}] use_ue8m0 needs use_fp8, round_scale and hidden % 512 == 0")
    if check_ids and topk_idx.numel() and (int(topk_idx.min()) < -1 or int(topk_idx.max()) >= num_experts):
        raise ValueError(f"[commlib rank {rank}] topk_idx holds expert ids outside [-1, {num_experts})")
    need = rdma_size_hint(M, H, R, num_experts)
    if b.num_rdma_bytes < need:
        raise ValueError(f"[commlib rank {rank}] num_rdma_bytes={b.num_rdma_bytes} is too small: build the "
                         f"Buffer with num_rdma_bytes >= Buffer.get_low_latency_rdma_size_hint({M}, {H}, {R}, "
                         f"{num_experts}) = {need}")


def check_combine_args(b, combine_buffers, x, topk_idx, topk_weights, handle: LowLatencyHandle, zero_copy: bool,
                       out) -> None:
    """Reject bad low_latency_combine input (every engine)."""
    rank, R = b.rank, b.num_ranks
    if not isinstance(handle, LowLatencyHandle):
        raise TypeError(f"[commlib rank {rank}] handle must come from low_latency_dispatch, got {type(handle).__name__}")
    if handle.buffer_id != b.buffer_id:
        raise ValueError(f"[commlib rank {rank}] handle was made by another Buffer")
    if not handle.extra.get("received"):
        raise ValueError(f"[commlib rank {rank}] call the dispatch's receive hook before low_latency_combine")
    L = handle.num_experts // R
    M, H = handle.num_max_dispatch_tokens_per_rank, handle.hidden
    check_tensor("x", x, rank, dtype=torch.bfloat16, dim=3, device=b.device)
    if tuple(x.shape) != (L, R * M, H):
        raise ValueError(f"[commlib rank {rank}] x must have shape [{L}, {R * M}, {H}], got {list(x.shape)}")
    T, K = handle.extra["T"], handle.extra["K"]
    check_tensor("topk_idx", topk_idx, rank, dtype=torch.int64, dim=2, device=b.device)
    check_tensor("topk_weights", topk_weights, rank, dtype=torch.float32, dim=2, device=b.device)
    if tuple(topk_idx.shape) != (T, K) or tuple(topk_weights.shape) != (T, K):
        raise ValueError(f"[commlib rank {rank}] topk_idx / topk_weights must be [{T}, {K}] as in the dispatch")
    if out is not None:
        check_tensor("out", out, rank, dtype=torch.bfloat16, dim=2, device=b.device)
        if tuple(out.shape) != (T, H):
            raise ValueError(f"[commlib rank {rank}] out must have shape [{T}, {H}], got {list(out.shape)}")


def logfmt_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """bf16 [n, H] -> float32 [n, H]: the values after crossing as LogFMT-10 (``use_logfmt=True`` combine).

    Per 128-channel block: if every |value| is below 1 and the block is not constant in magnitude,
    each value travels as a sign and a 9-bit code on a log2 scale from log_amin to log_amax (511
    levels, log_amin clipped to log_amax - 32; code 0 is zero), rounded to the nearer level in the
    linear domain; otherwise the block travels as bf16, unchanged. 10 bits per value instead of 16.
    """
    n, H = x.shape
    if H % BLOCK:
        raise ValueError(f"LogFMT combine: hidden ({H}) must be a multiple of {BLOCK}")
    v = x.float().view(n, H // BLOCK, BLOCK)
    a = v.abs()
    amax = a.amax(dim=2, keepdim=True)
    amin = a.amin(dim=2, keepdim=True)
    log_amax = torch.log2(amax)
    log_amin = torch.maximum(torch.log2(amin), log_amax - 32)
    cast = (log_amax < 0) & (log_amin < log_amax)
    levels = 511
    step = torch.where(cast, (log_amax - log_amin) / (levels - 1), torch.ones_like(log_amax))
    # level j (0-based) holds 2^(log_amin + j * step); a value rounds up past the levels' linear midpoint
    mid = torch.log2((1 + torch.exp2(step)) / 2)
    pos = (torch.log2(a) - log_amin) / step
    j = torch.floor(pos)
    j = torch.where((pos - j) * step >= mid, j + 1, j)
    code = torch.clamp(j + 1, min=0, max=levels)       # 0 = zero
    code = torch.where(a > 0, code, torch.zeros_like(code))
    dec = torch.where(code > 0, torch.exp2(log_amin + (code - 1) * step), torch.zeros_like(a))
    dec = torch.where(v < 0, -dec, dec)
    return torch.where(cast, dec, v).view(n, H)


def rank_grouped_sum(vals: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, L: int,
                     R: int, logfmt: bool = False) -> torch.Tensor:
    """combine's sum (module docstring): vals [T, K, H] float32 rows per slot -> bf16 [T, H].

    Per rank d, P_d = 0; P_d = P_d + w * v over the slots on d in top-k order (fp32), rounded to
    bf16 (``logfmt``: then through LogFMT-10, logfmt_roundtrip); then acc = 0; acc = acc + P_d over the ranks in order (every op rounded once). A rank with
    no slot adds nothing (P_d = +0 would leave acc unchanged anyway: acc is never -0).
    """
    T, K, H = vals.shape
    valid = topk_idx >= 0
    dest = torch.where(valid, topk_idx // L, torch.full_like(topk_idx, -1))
    acc = torch.zeros(T, H, dtype=torch.float32, device=vals.device)
    for d in range(R):
        part = torch.zeros(T, H, dtype=torch.float32, device=vals.device)
        on_d = dest == d
        for k in range(K):  # multiply then add (two roundings)
            part = torch.where(on_d[:, k:k + 1], part + topk_weights[:, k:k + 1] * vals[:, k], part)
        part = logfmt_roundtrip(part.to(torch.bfloat16)) if logfmt else part.to(torch.bfloat16).float()
        acc = torch.where(on_d.any(1, keepdim=True), acc + part, acc)
    return acc.to(torch.bfloat16)


class RollCall:
    """Shrink mode's check that the unmasked ranks are still calling, through the process group's
    key-value store (no collective, so a rank that stopped cannot block it): in each round every
    unmasked rank posts a key and waits, at most ``timeout_s``, for the keys of the other unmasked
    ranks; a rank whose key does not come is masked (``mask[r] = 1``), as DeepEP's kernels mask a
    rank that times out. Collective at creation (the ranks agree on a name). The ranks that take part
    in a round must number their rounds alike (``seq``; ``align`` after a resync)."""

    def __init__(self, group, rank: int, num_ranks: int, buffer_id: int, timeout_s: float, what: str) -> None:
        ids = [None] * num_ranks
        dist.all_gather_object(ids, buffer_id, group=group)
        self._ns = f"commlib/rollcall/{what}/{ids[0]}"
        self._store = dist.distributed_c10d._get_default_store()
        self.rank, self.num_ranks, self.timeout_s = rank, num_ranks, float(timeout_s)
        self.seq = 0

    def _key(self, seq: int, r: int) -> str:
        return f"{self._ns}/{seq}/{r}"

    def round(self, mask: torch.Tensor) -> list:
        """One round ([R] int32 host ``mask``, updated in place): returns the ranks it masked. A rank
        that has itself masked takes no part (it moves nothing anyway)."""
        me = self.rank
        if int(mask[me]):
            return []
        self.seq += 1
        live = [r for r in range(self.num_ranks) if r != me and not int(mask[r])]
        self._store.set(self._key(self.seq, me), b"1")
        if self.seq > 2:   # every live peer has passed round seq - 2 (it posted seq - 1 before this wait)
            self._store.delete_key(self._key(self.seq - 2, me))
        keys = [self._key(self.seq, r) for r in live]
        try:
            if keys:
                self._store.wait(keys, datetime.timedelta(seconds=self.timeout_s))
            return []
        except Exception:  # noqa: BLE001 - the store's timeout: the peers whose keys are missing stopped
            gone = [r for r, k in zip(live, keys) if not self._store.check([k])]
            for r in gone:
                mask[r] = 1
            return gone

    def align(self, seq: int) -> None:
        """Number the next round ``seq + 1`` (every rank the same, after a resync)."""
        self.seq = int(seq)


class LowLatencyEngine:
    """What every low-latency engine shares: the Buffer, and the two alternating combine inputs."""

    # the last call's output allocations made on the Buffer's out_stream (base.alloc_outputs), or
    # None: the Buffer then records every output tensor for the caller's stream
    blocks: Optional[tuple] = None

    def __init__(self, ctx, backend) -> None:
        self.ctx = ctx
        self.backend = backend
        self._combine_buffers: list = [None, None]
        self._next = 0

    def next_combine_buffer(self, handle: LowLatencyHandle) -> torch.Tensor:
        """The [L, R * M, H] bf16 buffer a zero-copy combine reads (two alternate, as in DeepEP)."""
        b = self.ctx
        L = handle.num_experts // b.num_ranks
        shape = (L, b.num_ranks * handle.num_max_dispatch_tokens_per_rank, handle.hidden)
        i = self._next
        self._next ^= 1
        buf = self._combine_buffers[i]
        if buf is None or tuple(buf.shape) != shape:
            buf = self._combine_buffers[i] = torch.zeros(shape, dtype=torch.bfloat16, device=b.device)
        self._staged = buf
        return buf

    def zero_copy_input(self, x: torch.Tensor, zero_copy: bool) -> torch.Tensor:
        """What a combine reads: with ``zero_copy`` (as DeepEP) the buffer the last
        get_next_low_latency_combine_buffer call handed out, whatever ``x`` is; otherwise ``x``."""
        if not zero_copy:
            return x
        staged = getattr(self, "_staged", None)
        if staged is None:
            raise ValueError(f"[commlib rank {self.ctx.rank}] zero_copy=True: write the expert outputs into "
                             "get_next_low_latency_combine_buffer(handle) first (none was handed out since the "
                             "last zero-copy combine)")
        self._staged = None
        return staged

    def destroy(self) -> None:
        """Release what the engine holds beyond the backend (nothing here)."""


class LowLatencyReference(LowLatencyEngine):
    """The reference transport for low-latency mode (torch.distributed all_to_all of byte rows).

    ``backend`` is the ReferenceBackend: its collectives carry timeouts.
    """

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x, topk_idx, M: int, num_experts: int, use_fp8: bool, round_scale: bool,
                 use_ue8m0: bool, return_recv_hook: bool, mask: Optional[torch.Tensor] = None,
                 wait_stats: Optional[torch.Tensor] = None):
        """``mask`` ([R] int32, shrink mode): masked ranks get no rows and send none; a rank that does
        not answer within the timeout is masked here. ``wait_stats`` ([R] int64): nanoseconds this
        rank waited for each source's rows are added."""
        b, rank, R = self.ctx, self.ctx.rank, self.ctx.num_ranks
        check_dispatch_args(b, x, topk_idx, M, num_experts, use_fp8, round_scale, use_ue8m0)
        T, H = x.shape
        L = num_experts // R
        dev = self.backend.comm_device
        idx = topk_idx.to(dev)
        tok, slot = torch.nonzero(idx >= 0, as_tuple=True)            # (token, k) pairs, token-major
        experts = idx[tok, slot]
        dest = experts // L
        order = torch.argsort(dest * (T + 1) * 64 + tok * 64 + slot, stable=True)   # by destination rank
        if mask is not None:
            order = order[mask.to(dev)[dest[order]] == 0]
        tok, experts, dest = tok[order], experts[order], dest[order]
        rows = x.to(dev)[tok]
        cols = []
        if use_fp8:
            q, s = cast_fp8(rows, round_scale, use_ue8m0) if rows.shape[0] else (
                torch.empty(0, H, dtype=torch.float8_e4m3fn, device=dev),
                torch.empty(0, H // (4 * BLOCK) if use_ue8m0 else H // BLOCK,
                            dtype=torch.int32 if use_ue8m0 else torch.float32, device=dev))
            sw = s.shape[1] * 4
            cols += [q.view(torch.uint8), s.contiguous().view(torch.uint8).view(-1, sw)]
        else:
            cols += [rows.contiguous().view(torch.uint8).view(-1, 2 * H)]
        meta = torch.stack([tok.to(torch.int32), (experts % L).to(torch.int32)], dim=1)
        cols.append(meta.view(torch.uint8).view(-1, 8))
        payload = torch.cat(cols, dim=1)
        send_counts = torch.bincount(dest, minlength=R).tolist()
        self.backend.calls += 1
        waits = [0] * R
        if mask is None:
            counts = self.backend._agree(self.backend.signature(4, H, num_experts, use_fp8, topk_idx.shape[1],
                                                                False, b.default_config("dispatch", R)),
                                         send_counts + [0])
            recv_counts = counts[:, rank].tolist()
            self.backend._phase = "low_latency_dispatch (data exchange)"
            t0 = time.perf_counter_ns()
            recv = self.backend._a2a_rows(payload, send_counts, recv_counts)
            waits = [time.perf_counter_ns() - t0] * R
        else:
            self.backend._phase = "low_latency_dispatch (shrink-mode exchange)"
            recv, recv_counts = self._store_a2a(payload, send_counts, None, mask, waits)
        if wait_stats is not None:
            wait_stats += torch.tensor(waits, dtype=torch.int64, device=wait_stats.device)
        # what the receive fills in (DeepEP's outputs: static shapes, valid once the receive ran)
        out_dev, RM = x.device, R * M
        if use_fp8:
            S = H // (4 * BLOCK) if use_ue8m0 else H // BLOCK
            recv_x = (torch.zeros(L, RM, H, dtype=torch.float8_e4m3fn, device=out_dev),
                      torch.zeros(L, RM, S, dtype=torch.int32 if use_ue8m0 else torch.float32, device=out_dev))
        else:
            recv_x = torch.zeros(L, RM, H, dtype=torch.bfloat16, device=out_dev)
        recv_count = torch.zeros(L, dtype=torch.int32, device=out_dev)
        handle = LowLatencyHandle(torch.full((L, RM), -1, dtype=torch.int32, device=out_dev),
                                  torch.zeros(L, R, dtype=torch.int64, device=out_dev), M, H, num_experts,
                                  buffer_id=b.buffer_id,
                                  extra={"send_counts": send_counts, "recv_counts": recv_counts, "order": order.cpu(),
                                         "tok": tok.cpu(), "slot": slot[order].cpu(), "T": T,
                                         "K": topk_idx.shape[1], "received": False})
        sent = (recv, recv_counts, L, M, H, use_fp8, use_ue8m0)
        if not return_recv_hook:
            self._dispatch_receive(sent, recv_x, recv_count, handle)
            return recv_x, recv_count, handle, None
        return recv_x, recv_count, handle, self._hook(lambda: self._dispatch_receive(sent, recv_x, recv_count, handle))

    def _dispatch_receive(self, sent: tuple, recv_x, recv_count: torch.Tensor, handle: LowLatencyHandle) -> None:
        """The receive half of a dispatch (the hook's, with return_recv_hook): the rows exchanged by the
        call, grouped per local expert, into the call's outputs."""
        recv, recv_counts, L, M, H, use_fp8, use_ue8m0 = sent
        R, dev = self.ctx.num_ranks, self.backend.comm_device
        meta_r = recv[:, -8:].contiguous().view(torch.int32).view(-1, 2)
        src_rank = torch.repeat_interleave(torch.arange(R, device=dev), torch.tensor(recv_counts, device=dev))
        local = meta_r[:, 1].to(torch.int64)
        # rows per (local expert): sources in rank order, tokens in order (stable sort keeps arrival order)
        pos = torch.argsort(local * (R + 1) + src_rank, stable=True)
        recv, local, src_rank, src_tok = recv[pos], local[pos], src_rank[pos], meta_r[pos, 0]
        counts = torch.bincount(local, minlength=L).to(torch.int32)
        first = torch.cumsum(counts.to(torch.int64), 0) - counts.to(torch.int64)
        row_in_expert = torch.arange(local.numel(), device=dev) - first[local]
        width = H if use_fp8 else 2 * H
        out_x = torch.zeros(L, R * M, width, dtype=torch.uint8, device=dev)
        out_x[local, row_in_expert] = recv[:, :width]
        src_info = torch.full((L, R * M), -1, dtype=torch.int32, device=dev)
        src_info[local, row_in_expert] = src_tok
        per = torch.zeros(L, R, dtype=torch.int64, device=dev)
        per.index_put_((local, src_rank), torch.ones_like(local), accumulate=True)
        start = torch.cumsum(per, 1) - per
        if use_fp8:
            sw = (H // (4 * BLOCK)) * 4 if use_ue8m0 else (H // BLOCK) * 4
            s_bytes = torch.zeros(L, R * M, sw, dtype=torch.uint8, device=dev)
            s_bytes[local, row_in_expert] = recv[:, width:width + sw]
            recv_x[0].copy_(out_x.view(torch.float8_e4m3fn))
            recv_x[1].copy_(s_bytes.view(torch.int32 if use_ue8m0 else torch.float32))
        else:
            recv_x.copy_(out_x.view(torch.bfloat16))
        recv_count.copy_(counts)
        handle.src_info.copy_(src_info)
        handle.layout_range.copy_((start << 32) | per)
        handle.extra.update(pos=pos.cpu(), local=local.cpu(), row=row_in_expert.cpu(), received=True)

    # ------------------------------------------------------------------ shrink mode
    def enable_shrink(self) -> None:
        """Shrink mode: rows travel through the process group's key-value store, one message per
        (call, source, destination) under a name every rank agrees on now (collective). A gloo
        point-to-point message cannot be waited for with a timeout without closing every connection
        of its group; a store key can, so a rank that stopped calling costs the others one timeout."""
        ids = [None] * self.ctx.num_ranks
        dist.all_gather_object(ids, self.ctx.buffer_id, group=self.backend.group)
        self._ns = f"commlib/shrink/{ids[0]}"
        self._store = dist.distributed_c10d._get_default_store()
        self._seq = 0

    def _store_a2a(self, rows: torch.Tensor, send_counts: list, recv_counts: Optional[list], mask: torch.Tensor,
                 waits: list):
        """All-to-all of byte rows [n, width] among the unmasked ranks only (shrink mode), so a rank
        that stopped calling cannot block the others: a peer whose rows do not arrive within the
        timeout is masked (``mask[r] = 1``) and sends nothing more. ``recv_counts`` None: taken from
        the messages; given: a masked peer's rows are zeros. Returns (rows received, grouped by source
        rank; recv_counts)."""
        R, me = self.ctx.num_ranks, self.ctx.rank
        self._seq += 1
        key = f"{self._ns}/{self._seq}/{{}}-{{}}".format
        rows = rows.to("cpu").contiguous()
        width = rows.shape[1]
        live = [r for r in range(R) if r != me and not int(mask[r])]
        s_start = [0] + list(itertools.accumulate(send_counts))
        for r in live:
            self._store.set(key(me, r), rows[s_start[r]:s_start[r + 1]].numpy().tobytes())
        got = {me: rows[s_start[me]:s_start[me + 1]]}
        for r in live:
            t0 = time.perf_counter_ns()
            try:
                self._store.wait([key(r, me)], datetime.timedelta(seconds=self.ctx.timeout_s))
                raw = self._store.get(key(r, me))
                self._store.delete_key(key(r, me))
                got[r] = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(-1, width) if raw else rows[:0]
            except Exception:  # noqa: BLE001 - the store's timeout: shrink mode masks the peer
                mask[r] = 1
            waits[r] += time.perf_counter_ns() - t0
        if recv_counts is None:
            recv_counts = [int(got[r].shape[0]) if r in got else 0 for r in range(R)]
        parts = []
        for r in range(R):
            part = got.get(r)
            if part is None or part.shape[0] != recv_counts[r]:
                part = torch.zeros(recv_counts[r], width, dtype=rows.dtype, device="cpu")
            parts.append(part)
        return torch.cat(parts).to(self.backend.comm_device), list(recv_counts)

    def barrier(self, mask: torch.Tensor) -> None:
        """Shrink mode's barrier (clean_low_latency_buffer): every unmasked rank hears from every other;
        one that does not answer within the timeout is masked."""
        self.backend.calls += 1
        self.backend._phase = "clean_low_latency_buffer (shrink-mode barrier)"
        self._store_a2a(torch.zeros(0, 1, dtype=torch.uint8, device="cpu"), [0] * self.ctx.num_ranks, None, mask,
                      [0] * self.ctx.num_ranks)

    def _hook(self, receive: Callable[[], None]) -> Callable[[], None]:
        """A receive hook: runs ``receive`` (the call's receive half) once."""
        done = []

        def hook() -> None:
            if done:
                raise ValueError(f"[commlib rank {self.ctx.rank}] a low-latency receive hook may be called once")
            done.append(True)
            receive()
        return hook

    # ------------------------------------------------------------------ combine
    def combine(self, x, topk_idx, topk_weights, handle: LowLatencyHandle, zero_copy: bool,
                return_recv_hook: bool, out: Optional[torch.Tensor], use_logfmt: bool = False,
                mask: Optional[torch.Tensor] = None, wait_stats: Optional[torch.Tensor] = None):
        """``use_logfmt``: each bf16 partial crosses as LogFMT-10 (logfmt_roundtrip). ``mask`` / ``wait_stats``
        as in dispatch: slots whose expert lives on a masked rank are left out of the sum."""
        b, R = self.ctx, self.ctx.num_ranks
        x = self.zero_copy_input(x, zero_copy)
        check_combine_args(b, self._combine_buffers, x, topk_idx, topk_weights, handle, zero_copy, out)
        H = handle.hidden
        T, K = handle.extra["T"], handle.extra["K"]
        ex = handle.extra
        dev = self.backend.comm_device
        rows = x.to(dev)[ex["local"].to(dev), ex["row"].to(dev)]                   # sorted order
        arrival = torch.empty_like(rows)
        arrival[ex["pos"].to(dev)] = rows
        self.backend.calls += 1
        rows_out = arrival.contiguous().view(torch.uint8).view(-1, 2 * H)
        waits = [0] * R
        if mask is None:
            self.backend._agree(self.backend.signature(5, H, handle.num_experts, False, K, True,
                                                       b.default_config("combine", R)), [0] * (R + 1))
            self.backend._phase = "low_latency_combine (data exchange)"
            t0 = time.perf_counter_ns()
            back = self.backend._a2a_rows(rows_out, ex["recv_counts"], ex["send_counts"]).view(torch.bfloat16)
            waits = [time.perf_counter_ns() - t0] * R
        else:
            self.backend._phase = "low_latency_combine (shrink-mode exchange)"
            back, _ = self._store_a2a(rows_out, ex["recv_counts"], ex["send_counts"], mask, waits)
            back = back.view(torch.bfloat16)
        if wait_stats is not None:
            wait_stats += torch.tensor(waits, dtype=torch.int64, device=wait_stats.device)
        idx = topk_idx.to(dev)
        if mask is not None:  # experts on masked ranks are left out, as empty slots
            owner = torch.where(idx >= 0, idx // (handle.num_experts // R), torch.zeros_like(idx))
            idx = torch.where((idx >= 0) & (mask.to(dev)[owner] != 0), torch.full_like(idx, -1), idx)
        result = out if out is not None else torch.zeros(T, H, dtype=torch.bfloat16, device=x.device)
        sent = (back, idx, topk_weights.to(dev), handle, use_logfmt)
        if not return_recv_hook:
            self._combine_receive(sent, result)
            return result, None
        return result, self._hook(lambda: self._combine_receive(sent, result))

    def _combine_receive(self, sent: tuple, result: torch.Tensor) -> None:
        """The receive half of a combine (the hook's, with return_recv_hook): the rows sent back by the
        call, summed per token (rank_grouped_sum) into ``result`` [T, H] bf16."""
        back, idx, weights, handle, use_logfmt = sent
        R, dev, ex = self.ctx.num_ranks, self.backend.comm_device, handle.extra
        # back[i] is the row of pair i in the send order: (tok[i], slot[i])
        vals = torch.zeros(ex["T"], ex["K"], handle.hidden, dtype=torch.float32, device=dev)
        vals[ex["tok"].to(dev), ex["slot"].to(dev)] = back.float()
        result.copy_(rank_grouped_sum(vals, idx, weights, handle.num_experts // R, R, logfmt=use_logfmt))
