"""A Mixture-of-Experts layer with expert parallelism through Buffer + commlib.training.autograd, its
single-process equivalent, and a transformer block split into pipeline stages.

Legend: T tokens on this rank, H hidden, I expert intermediate size, E experts, L local experts
(E / ranks), K top-k, N rows this rank received, M routed (row, slot) pairs, B batch, S sequence.

Numerics, stated once: activations cross the wire in bf16 (dispatch moves ``x_TH.to(bf16)``,
the expert partial sum of a row is cast to bf16 before combine, combine sums in float32 and
returns bf16). The single-process layer (``buffer=None``) reproduces exactly that rounding for a
world of ``num_ranks`` virtual ranks: every rank's experts run on the same rows, in the same order,
as they would behind a real dispatch, and the emulated dispatch/combine sum in float32 in rank
order. The forward is therefore bit-identical to expert parallelism with the same parameters;
the backward differs only where the replicated (non-expert) parameters' gradients are summed
across ranks by an all-reduce instead of inside one matmul.

Parameters: with ``full_init=True`` (default) every rank draws the full [E, ...] expert tensors
from the torch RNG and keeps its slice, so an expert-parallel model and a single-process model
built after the same ``torch.manual_seed`` hold identical parameters. ``full_init=False`` draws
only the local experts (big models; benchmarks).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from commlib.training import autograd as ops
from commlib.utils import env
from commlib.training import wgrad
from commlib.fp8 import per_token_cast_back, per_token_cast_to_fp8
from commlib.layout import local_expert_ids, token_in_rank
from commlib.cuda import loader as K
from commlib.training.pipeline.schedule import CombineStage, ComputeStage, DispatchStage, StagedModule
from commlib.routing import group_limited_topk

COMM_DTYPE = torch.bfloat16


@dataclasses.dataclass
class MoEConfig:
    hidden: int
    num_experts: int
    topk: int
    expert_hidden: int                 # I: intermediate size of one routed expert
    num_groups: int = 1                # expert groups of the group-limited gate (one per node in V3)
    topk_groups: int = 1               # groups a token may use
    num_shared_experts: int = 0        # 0 or more shared experts (one dense MLP of that many * I)
    routed_scaling: float = 1.0        # V3 scales routed weights by 2.5
    expert_dtype: torch.dtype = torch.float32   # parameters (and compute) of experts
    expert_impl: str = "auto"          # "loop" | "grouped_mm" | "auto" (grouped_mm on CUDA bf16)
    fp8_dispatch: bool = False         # dispatch moves E4M3 + scales (hidden % 128 == 0); gradients bf16
    # pipeline stage of the shared experts (MoEBlock.stages): "attn" = right after routing, so the
    # dual pipeline runs them beside the other micro-batch's communication in the shorter attention
    # step (DeepSeek-V3 overlaps them with the dispatch); "experts" = with the routed experts
    shared_stage: str = "attn"

    def __post_init__(self) -> None:
        if self.num_experts % self.num_groups != 0:
            raise ValueError(f"MoEConfig: num_groups ({self.num_groups}) must divide num_experts ({self.num_experts})")
        if self.fp8_dispatch and self.hidden % 128 != 0:
            raise ValueError(f"MoEConfig: fp8_dispatch needs hidden % 128 == 0, got hidden {self.hidden}")
        if self.expert_impl not in ("auto", "loop", "grouped_mm"):
            raise ValueError(f"MoEConfig: expert_impl must be auto, loop or grouped_mm, got {self.expert_impl!r}")
        if self.shared_stage not in ("attn", "experts"):
            raise ValueError(f"MoEConfig: shared_stage must be attn or experts, got {self.shared_stage!r}")


# ------------------------------------------------------------------------------------------------
# Experts
# ------------------------------------------------------------------------------------------------

def _use_grouped_mm(x_MA: torch.Tensor, impl: str) -> bool:
    return impl == "grouped_mm" or (impl == "auto" and x_MA.is_cuda and x_MA.dtype == torch.bfloat16
                                    and hasattr(torch, "_grouped_mm"))


def _group_offsets(counts: list[int], device: torch.device) -> torch.Tensor:
    """End row of every group, int32 on ``device``, without a host wait.

    The host -> device copy goes through pinned memory: a copy from pageable memory makes the
    driver synchronise with the stream first (CUDA's "API synchronization behavior"), which would
    stall the host until the GPU reaches this point, i.e. until the dispatch this expert stage
    waits for has finished. In the dual pipeline that delayed the next communication the host
    issues by a whole stage.
    """
    offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
    if device.type == "cuda":
        offs = offs.pin_memory()  # the caching host allocator keeps it alive until the copy is done
    return offs.to(device, non_blocking=True)


def _grouped_product(x_MA: torch.Tensor, w_LAB: torch.Tensor, counts: list[int], impl: str,
                     offs: Optional[torch.Tensor]) -> torch.Tensor:
    """Rows of x grouped by expert (counts[e] rows for expert e, in order) times w[e] -> [M, B]."""
    if _use_grouped_mm(x_MA, impl):
        return torch._grouped_mm(x_MA, w_LAB, offs=offs)
    outs = [x_e @ w_LAB[e] for e, x_e in enumerate(torch.split(x_MA, counts))]
    return torch.cat(outs) if outs else x_MA.new_zeros(0, w_LAB.shape[2])


def _grouped_weight_grad(x_MA: torch.Tensor, g_MB: torch.Tensor, counts: list[int], impl: str,
                         offs: Optional[torch.Tensor]) -> torch.Tensor:
    """d/dw of _grouped_product: [L, A, B], expert e = x_e^T g_e (zeros for an expert without rows)."""
    if _use_grouped_mm(x_MA, impl):
        g_LAB = torch._grouped_mm(x_MA.t(), g_MB, offs=offs)
        empty = [e for e, c in enumerate(counts) if c == 0]
        if empty:  # a group with no rows (K = 0): zeros by definition, whatever the kernel leaves there
            g_LAB[empty] = 0
        return g_LAB
    A, B = x_MA.shape[1], g_MB.shape[1]
    if not counts:
        return x_MA.new_zeros(0, A, B)
    return torch.stack([x_e.t() @ g_e if x_e.shape[0] else x_MA.new_zeros(A, B)
                        for x_e, g_e in zip(torch.split(x_MA, counts), torch.split(g_MB, counts))])


class _GroupedMatmul(torch.autograd.Function):
    """_grouped_product with a hand-written backward whose weight gradient can be deferred
    (commlib.training.wgrad: DualPipe's W, computed later by the schedule) when ``w`` is a leaf parameter;
    otherwise it is returned to autograd as usual. Same GEMMs as autograd's own backward of the
    product (the input gradient: g times w[e]^T per group; the weight gradient: x_e^T g_e)."""

    @staticmethod
    def forward(ctx, x_MA, w_LAB, counts, impl, offs):
        ctx.save_for_backward(x_MA, w_LAB)
        ctx.counts, ctx.impl, ctx.offs = counts, impl, offs
        ctx.param = w_LAB   # the input itself: a Parameter's .grad is where a deferred W accumulates
        return _grouped_product(x_MA, w_LAB, counts, impl, offs)

    @staticmethod
    def backward(ctx, g_MB):
        x_MA, w_LAB = ctx.saved_tensors
        counts, impl, offs = ctx.counts, ctx.impl, ctx.offs
        g_MB = g_MB.contiguous()
        g_x = g_w = None
        if ctx.needs_input_grad[0]:
            g_x = _grouped_product(g_MB, w_LAB.transpose(1, 2), counts, impl, offs)
        if ctx.needs_input_grad[1]:
            def weight_grad():
                return _grouped_weight_grad(x_MA, g_MB, counts, impl, offs)
            g_w = wgrad.grad_or_defer(ctx.param, weight_grad, wgrad.CHAIN)
        ctx.param = None
        return g_x, g_w, None, None, None


def _grouped_matmul(x_MA: torch.Tensor, w_LAB: torch.Tensor, counts: list[int], impl: str,
                    offs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rows of x grouped by expert (counts[e] rows for expert e, in order) times w[e] -> [M, B];
    differentiable, with a deferrable weight gradient (see _GroupedMatmul)."""
    if offs is None and _use_grouped_mm(x_MA, impl):
        offs = _group_offsets(counts, x_MA.device)
    if torch.is_grad_enabled() and (x_MA.requires_grad or w_LAB.requires_grad):
        return _GroupedMatmul.apply(x_MA, w_LAB, list(counts), impl, offs)
    return _grouped_product(x_MA, w_LAB, counts, impl, offs)


class _Linear(torch.autograd.Function):
    """y = x w^T (nn.Linear without bias) with a hand-written backward whose weight gradient can be
    deferred (commlib.training.wgrad, placement NEXT) when ``w`` is a leaf parameter. The same GEMMs as
    autograd's backward of F.linear: dx = g w, dw = g^T x over all rows (the same bits on CPU)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        ctx.param = w
        return F.linear(x, w)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        g_x = g_w = None
        if ctx.needs_input_grad[0]:
            g_x = g.matmul(w)
        if ctx.needs_input_grad[1]:
            def weight_grad():
                return g.reshape(-1, g.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))
            g_w = wgrad.grad_or_defer(ctx.param, weight_grad, wgrad.NEXT)
        ctx.param = None
        return g_x, g_w


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w) without bias, its weight gradient deferrable in the overlapped schedules."""
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return _Linear.apply(x, w)
    return F.linear(x, w)


class _GatherRows(torch.autograd.Function):
    """out[m] = x[idx[m]], with a backward that knows the gather's structure. index_select's own
    backward fills an [N, H] tensor with zeros and scatter-adds into it (two passes, atomics on GPUs).

    * ``inv`` given: ``idx`` is a permutation of x's rows and ``inv`` its inverse. The backward is
      this op with the two swapped, one pass over the gradient, so it differentiates twice.
    * else ``pos_NK`` (the routed pairs' slot table, _slot_positions): the backward is the slot sum
      (_SlotSum: one kernel pass on CUDA bf16 rows, float32 sum, one rounding), or where that kernel
      does not apply, what autograd does for index_select (zeros + index_add_ in the gradient's dtype).
    """

    @staticmethod
    def forward(ctx, x, idx, inv, pos_NK):
        ctx.permutation = inv is not None
        ctx.save_for_backward(idx, inv if ctx.permutation else pos_NK)
        return x.index_select(0, idx)

    @staticmethod
    def backward(ctx, grad):
        idx, other = ctx.saved_tensors
        if ctx.permutation:
            g = _GatherRows.apply(grad, other, idx, None)
        elif _row_kernel_ok(grad, other.shape[1]):
            g = _SlotSum.apply(grad, other, idx)
        else:
            g = grad.new_zeros(other.shape[0], grad.shape[1]).index_add_(0, idx, grad)
        return g, None, None, None


def _slot_positions(order_M: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """[N, K] int32: pos[n, k] = m where the m-th routed pair (expert order, ``order_M[m] = n * K + k``)
    is slot k of row n; -1 where slot k of row n has no local expert."""
    pos = torch.full((N * K,), -1, dtype=torch.int32, device=order_M.device)
    pos[order_M] = torch.arange(order_M.numel(), dtype=torch.int32, device=order_M.device)
    return pos.view(N, K)


_cupy_ok: Optional[bool] = None


def _row_kernel_ok(t: torch.Tensor, K: int) -> bool:
    """csrc/moe_rows.cu can sum ``t``'s rows: CUDA bf16, rows of whole 16-byte vectors, K <= 32 (one
    slot per lane), CuPy present, not switched off (COMMLIB_MOE_ROW_KERNEL=0)."""
    global _cupy_ok
    if not (t.is_cuda and t.dtype == torch.bfloat16 and t.dim() == 2 and t.shape[1] % 8 == 0 and 1 <= K <= 32
            and env.moe_row_kernel()):
        return False
    if _cupy_ok is None:
        import importlib.util
        _cupy_ok = importlib.util.find_spec("cupy") is not None
    return _cupy_ok


def _slot_sum_kernel(src_MH: torch.Tensor, pos_NK: torch.Tensor) -> torch.Tensor:
    """out[n] = bf16(sum over k of float32(src[pos[n, k]]), slot order) in one pass (csrc/moe_rows.cu)."""

    src, pos = src_MH.contiguous(), pos_NK.contiguous()
    N, slots = pos.shape
    out = torch.empty((N, src.shape[1]), dtype=src.dtype, device=src.device)
    if N:
        warps = 8
        with torch.cuda.device(src.device):
            K.launch("moe_rows", "slot_sum_bf16", (N + warps - 1) // warps, 32 * warps,
                     (K.ptr(src), K.ptr(pos), K.ptr(out), N, slots, src.shape[1] // 8))
    return out


class _SlotSum(torch.autograd.Function):
    """y[n] = sum over the slots k of row n that have a local expert of out[pos[n, k]] (the routed
    pairs' outputs, expert order), accumulated in float32 and rounded once to out's dtype. Backward:
    the gather of the gradient (exact). On CUDA bf16 rows one kernel pass (_slot_sum_kernel); else
    float32 zeros + index_add_ + a cast, as before the kernel."""

    @staticmethod
    def forward(ctx, out_MH, pos_NK, rows_M):
        ctx.save_for_backward(pos_NK, rows_M)
        if _row_kernel_ok(out_MH, pos_NK.shape[1]):
            return _slot_sum_kernel(out_MH, pos_NK)
        acc_dtype = torch.promote_types(out_MH.dtype, torch.float32)
        # index_add runs in the tensor's dtype (float64 experts keep float64); in place on fresh zeros:
        # the out-of-place index_add would first copy the [N, H] float32 zeros. On CPU the order is fixed;
        # on GPUs index_add uses atomics (order varies)
        y = torch.zeros(pos_NK.shape[0], out_MH.shape[1], dtype=acc_dtype, device=out_MH.device)
        return y.index_add_(0, rows_M, out_MH.to(acc_dtype)).to(out_MH.dtype)

    @staticmethod
    def backward(ctx, g_NH):
        pos_NK, rows_M = ctx.saved_tensors
        return _GatherRows.apply(g_NH, rows_M, None, pos_NK), None, None


def routed_experts(x_NH: torch.Tensor, topk_idx_NK: torch.Tensor, topk_weights_NK: torch.Tensor,
                   w_gate_up_LHI: torch.Tensor, w_down_LIH: torch.Tensor,
                   counts: Optional[list[int]] = None, impl: str = "auto",
                   rows_have_local_expert: bool = False) -> torch.Tensor:
    """y[n] = sum over slots k with topk_idx[n, k] >= 0 of topk_weights[n, k] * mlp_{topk_idx[n, k]}(x[n]).

    x_NH: rows (any float dtype, computed in the weights' dtype); topk_idx_NK: local expert ids
    (-1 = not here); w_gate_up_LHI: [L, H, 2I] (gate | up); w_down_LIH: [L, I, H]; counts: rows
    per local expert (dispatch's ``num_recv_tokens_per_expert_list`` with alignment 1), computed
    here (a host sync) when None. Returns [N, H] in the weights' dtype.
    Rows are permuted so each expert's rows are contiguous (stable: source order kept), then one
    grouped GEMM per projection, then scattered back and summed per row.

    rows_have_local_expert: the caller guarantees that every row has at least one slot here
    (topk_idx >= 0), as every row a dispatch delivers does (a token is sent only to the ranks
    that hold one of its experts). Then M == N, known on the host from ``counts`` (no sync),
    means exactly one slot per row: the (row, slot) pairs are a permutation of the rows, and the
    per-row sum a reordering, done without the float32 zeros, the index_add and its two casts,
    with one-pass backwards for both the gather and the scatter. When ``counts`` is None the
    sync that reads the counts also reads whether every row has exactly one slot, so the flag
    is not needed then. The result is the same either way: a one-term float32 sum is exact.
    """
    N, K = topk_idx_NK.shape
    L = w_gate_up_LHI.shape[0]
    flat_idx = topk_idx_NK.reshape(-1)
    if counts is None:
        valid_NK = topk_idx_NK >= 0
        per_expert = torch.bincount(flat_idx[valid_NK.reshape(-1)], minlength=L)
        # One host read for the counts and for "every row has exactly one slot here".
        host = torch.cat([per_expert, (valid_NK.sum(1) == 1).all().reshape(1).to(per_expert.dtype)]).tolist()
        counts, one_slot_per_row = host[:-1], bool(host[-1])
    else:
        one_slot_per_row = None
    if len(counts) != L:
        raise ValueError(f"routed_experts: counts has {len(counts)} entries for {L} local experts")
    M = sum(counts)
    if one_slot_per_row is None:
        if rows_have_local_expert and M < N:
            raise ValueError(f"routed_experts: rows_have_local_expert, but {N} rows have only {M} local slots")
        one_slot_per_row = rows_have_local_expert and M == N
    key = torch.where(flat_idx >= 0, flat_idx, torch.full_like(flat_idx, L))
    order_M = torch.argsort(key, stable=True)[:M]
    rows_M = torch.div(order_M, K, rounding_mode="floor")
    dtype = w_gate_up_LHI.dtype
    if one_slot_per_row:
        inv_N = torch.empty_like(rows_M).index_copy_(0, rows_M, torch.arange(N, device=rows_M.device))
        x_MH = _GatherRows.apply(x_NH, rows_M, inv_N, None).to(dtype)
    else:
        pos_NK = _slot_positions(order_M, N, K)
        x_MH = _GatherRows.apply(x_NH, rows_M, None, pos_NK).to(dtype)
    weights_M = topk_weights_NK.reshape(-1).index_select(0, order_M).to(dtype)
    offs = _group_offsets(counts, x_MH.device) if _use_grouped_mm(x_MH, impl) else None  # one copy, both GEMMs
    gate_up = _grouped_matmul(x_MH, w_gate_up_LHI, counts, impl, offs)
    gate, up = gate_up.chunk(2, dim=1)
    # The top-k weight scales the [M, I] activation rather than the [M, H] down-projection output:
    # the same value (the projection is linear), one [M, H] read + write less forward and backward
    # (I is the small side: 2048 vs 7168 in V3). Rounding: the weight is applied before the GEMM
    # (in the weights' dtype) instead of after it, so results differ in the last bits.
    act_MI = F.silu(gate) * up * weights_M.unsqueeze(1)
    out_MH = _grouped_matmul(act_MI, w_down_LIH, counts, impl, offs)
    if one_slot_per_row:
        return _GatherRows.apply(out_MH, inv_N, rows_M, None)
    # A row may meet several local experts: sum its slots in float32, round once (_SlotSum)
    return _SlotSum.apply(out_MH, pos_NK, rows_M)


class Experts(nn.Module):
    """Experts [first, first + num_local) of num_experts SwiGLU MLPs, weights stacked for grouped GEMMs."""

    def __init__(self, hidden: int, expert_hidden: int, num_experts: int, first: int, num_local: int,
                 dtype: torch.dtype = torch.float32, full_init: bool = True, device=None) -> None:
        super().__init__()
        n = num_experts if full_init else num_local
        std1, std2 = 1.0 / math.sqrt(hidden), 1.0 / math.sqrt(expert_hidden)
        w1 = torch.randn(n, hidden, 2 * expert_hidden, device=device) * std1
        w2 = torch.randn(n, expert_hidden, hidden, device=device) * std2
        if full_init:
            w1, w2 = w1[first:first + num_local], w2[first:first + num_local]
        self.w_gate_up = nn.Parameter(w1.to(dtype).contiguous())
        self.w_down = nn.Parameter(w2.to(dtype).contiguous())
        self.first, self.num_local = first, num_local

    def forward(self, x_NH, topk_idx_NK, topk_weights_NK, counts=None, impl="auto", lo=0, hi=None,
                rows_have_local_expert: bool = False):
        """Experts [lo, hi) of this module on local ids 0 .. hi - lo (see routed_experts)."""
        hi = self.num_local if hi is None else hi
        if (lo, hi) == (0, self.num_local):   # the parameters themselves: their weight gradients can be deferred
            w_gate_up, w_down = self.w_gate_up, self.w_down
        else:
            w_gate_up, w_down = self.w_gate_up[lo:hi], self.w_down[lo:hi]
        return routed_experts(x_NH, topk_idx_NK, topk_weights_NK, w_gate_up, w_down, counts, impl,
                              rows_have_local_expert=rows_have_local_expert)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, inner: int, device=None) -> None:
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * inner, bias=False, device=device)
        self.down = nn.Linear(inner, hidden, bias=False, device=device)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Router(nn.Module):
    """Sigmoid gate with group-limited top-k (DeepSeek-V3), float32."""

    def __init__(self, cfg: MoEConfig, device=None) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.randn(cfg.num_experts, cfg.hidden, device=device) / math.sqrt(cfg.hidden))

    def forward(self, x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores_TE = torch.sigmoid(F.linear(x_TH.float(), self.weight.float()))
        topk_idx_TK, topk_weights_TK = group_limited_topk(scores_TE, self.cfg.num_groups, self.cfg.topk_groups,
                                                          self.cfg.topk)
        if self.cfg.routed_scaling != 1.0:
            topk_weights_TK = topk_weights_TK * self.cfg.routed_scaling
        return topk_idx_TK, topk_weights_TK.contiguous()


# ------------------------------------------------------------------------------------------------
# Emulated communication for the single-process layer (same rounding as Buffer.dispatch/combine)
# ------------------------------------------------------------------------------------------------

class _EmulatedDispatch(torch.autograd.Function):
    """x_TH bf16 -> rows of every virtual rank; backward sums in float32 in rank order (= combine)."""

    @staticmethod
    def forward(ctx, x_TH, *rows_per_rank):
        ctx.num_tokens = x_TH.shape[0]
        ctx.save_for_backward(*rows_per_rank)
        return tuple(x_TH.index_select(0, rows) for rows in rows_per_rank)

    @staticmethod
    def backward(ctx, *grads):
        rows_per_rank = ctx.saved_tensors
        acc = None
        for rows, g in zip(rows_per_rank, grads):
            if g is None:
                continue
            if acc is None:
                acc = torch.zeros(ctx.num_tokens, g.shape[1], dtype=torch.float32, device=g.device)
            acc[rows] += g.float()
        return (None if acc is None else acc.to(COMM_DTYPE),) + (None,) * len(rows_per_rank)


class _FP8StraightThrough(torch.autograd.Function):
    """E4M3 round trip of x (what an FP8 dispatch delivers); the gradient passes unchanged."""

    @staticmethod
    def forward(ctx, x):
        return per_token_cast_back(*per_token_cast_to_fp8(x), x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _EmulatedCombine(torch.autograd.Function):
    """Rows of every virtual rank (bf16) -> float32 sum in rank order -> bf16; backward = copy back."""

    @staticmethod
    def forward(ctx, num_tokens, rows_per_rank, *ys):
        ctx.rows_per_rank = rows_per_rank
        acc = torch.zeros(num_tokens, ys[0].shape[1], dtype=torch.float32, device=ys[0].device)
        for rows, y in zip(rows_per_rank, ys):
            acc[rows] += y.float()
        return acc.to(COMM_DTYPE)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.to(COMM_DTYPE)
        return (None, None) + tuple(grad.index_select(0, rows) for rows in ctx.rows_per_rank)


# ------------------------------------------------------------------------------------------------
# The MoE layer
# ------------------------------------------------------------------------------------------------

class MoELayer(nn.Module):
    """Router + routed experts (+ shared experts), expert-parallel over ``buffer``'s ranks.

    buffer: a commlib Buffer (expert parallelism: this rank holds experts [rank * L, (rank+1) * L)),
    or None: all experts local, emulating ``num_ranks`` ranks' bf16 communication exactly.
    forward(x [T, H] float) -> [T, H] in x's dtype.
    """

    def __init__(self, cfg: MoEConfig, buffer=None, num_ranks: Optional[int] = None, full_init: bool = True,
                 device=None) -> None:
        super().__init__()
        self.cfg = cfg
        self.buffer = buffer
        self.rank = buffer.rank if buffer is not None else 0
        self.num_ranks = buffer.num_ranks if buffer is not None else (num_ranks or 1)
        if cfg.num_experts % self.num_ranks != 0:
            raise ValueError(f"MoELayer: num_experts ({cfg.num_experts}) must be divisible by the {self.num_ranks} ranks")
        self.num_local = cfg.num_experts // self.num_ranks if buffer is not None else cfg.num_experts
        first = self.rank * self.num_local if buffer is not None else 0
        self.router = Router(cfg, device=device)
        self.experts = Experts(cfg.hidden, cfg.expert_hidden, cfg.num_experts, first, self.num_local,
                               cfg.expert_dtype, full_init=full_init or buffer is None, device=device)
        self.shared = (SwiGLU(cfg.hidden, cfg.num_shared_experts * cfg.expert_hidden, device=device)
                       if cfg.num_shared_experts > 0 else None)

    # --- pieces, shared by forward() and the pipeline stages (commlib.training.pipeline.schedule) ---
    def route(self, x_TH: torch.Tensor):
        """-> (x_TH bf16 for the wire, topk_idx [T, K] int64, topk_weights [T, K] float32)."""
        topk_idx, topk_weights = self.router(x_TH)
        return x_TH.to(COMM_DTYPE).contiguous(), topk_idx, topk_weights

    def expert_compute(self, recv_x_NH, recv_topk_idx_NK, recv_topk_weights_NK, counts=None,
                       rows_have_local_expert: bool = False) -> torch.Tensor:
        """Received rows -> weighted expert output per row, bf16 [N, H] for combine.

        rows_have_local_expert=True: the rows come from a dispatch whose layout was computed from
        the routing (get_dispatch_layout, num_worst_tokens=0: no padding rows), so each has a local
        expert (see routed_experts); forward() and MoEBlock.stage_experts pass it.
        """
        y = self.experts(recv_x_NH, recv_topk_idx_NK, recv_topk_weights_NK, counts, self.cfg.expert_impl,
                         rows_have_local_expert=rows_have_local_expert)
        return y.to(COMM_DTYPE)

    def shared_compute(self, x_TH: torch.Tensor) -> Optional[torch.Tensor]:
        return self.shared(x_TH) if self.shared is not None else None

    @staticmethod
    def finish(combined_TH: torch.Tensor, shared_TH: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        if shared_TH is None:
            return combined_TH.to(dtype)
        shared_TH = shared_TH.to(dtype)
        if torch.promote_types(dtype, combined_TH.dtype) == dtype:
            # The add reads the bf16 rows and computes in ``dtype``: the cast is exact, so this is
            # combined.to(dtype) + shared bit for bit. On GPUs the add casts as it loads, saving the
            # cast's [T, H] pass (on CPU TensorIterator still makes the cast copy itself).
            return shared_TH + combined_TH
        return combined_TH.to(dtype) + shared_TH

    # --- whole layer ---
    def forward(self, x_TH: torch.Tensor) -> torch.Tensor:
        if self.buffer is None:
            R = self.num_ranks
            chunks = list(x_TH.chunk(R)) if x_TH.shape[0] % R == 0 else [x_TH]
            return torch.cat(self.forward_chunks(chunks))
        x_wire, topk_idx, topk_weights = self.route(x_TH)
        out = ops.dispatch(self.buffer, x_wire, topk_idx, topk_weights, self.cfg.num_experts,
                           fp8=self.cfg.fp8_dispatch)
        # ops.dispatch computes the layout from topk_idx and pads nothing: every row has a local expert.
        y_NH = self.expert_compute(out.recv_x, out.recv_topk_idx, out.recv_topk_weights,
                                   out.num_recv_tokens_per_expert_list, rows_have_local_expert=True)
        combined, _ = ops.combine(self.buffer, y_NH, out.handle)
        return self.finish(combined, self.shared_compute(x_TH), x_TH.dtype)

    def forward_chunks(self, xs: list) -> list:
        """Single-process layer on the tokens of every virtual rank (xs[r]: rank r's [T_r, H]).

        What is per-rank under expert parallelism (router, shared expert) runs per chunk, so its
        parameter gradients are sums of per-rank contributions as after an all-reduce; every
        virtual rank r's experts get the rows a real dispatch would give rank r, in the same order.
        """
        if self.buffer is not None:
            raise RuntimeError("MoELayer.forward_chunks is the single-process path (buffer=None)")
        routed = [self.route(x) for x in xs]
        x_wire = torch.cat([r[0] for r in routed])
        topk_idx = torch.cat([r[1] for r in routed])
        topk_weights = torch.cat([r[2] for r in routed])
        R, L = self.num_ranks, self.cfg.num_experts // self.num_ranks
        in_rank_TR = token_in_rank(topk_idx, self.cfg.num_experts, R)
        rows = [in_rank_TR[:, r].nonzero().flatten() for r in range(R)]
        if self.cfg.fp8_dispatch:
            x_wire = _FP8StraightThrough.apply(x_wire)
        recv_x = _EmulatedDispatch.apply(x_wire, *rows)
        ys = []
        for r in range(R):
            idx_r = local_expert_ids(topk_idx.index_select(0, rows[r]), r, L)
            w_r = topk_weights.index_select(0, rows[r])
            w_r = torch.where(idx_r >= 0, w_r, torch.zeros_like(w_r))
            # rows[r] are the tokens with an expert on rank r (token_in_rank), so every row has a local
            # slot here as behind a real dispatch; counts=None: routed_experts checks it exactly anyway.
            y = self.experts(recv_x[r], idx_r, w_r, None, self.cfg.expert_impl, lo=r * L, hi=(r + 1) * L)
            ys.append(y.to(COMM_DTYPE))
        combined = _EmulatedCombine.apply(x_wire.shape[0], rows, *ys).split([x.shape[0] for x in xs])
        return [self.finish(c, self.shared_compute(x), x.dtype) for c, x in zip(combined, xs)]


# ------------------------------------------------------------------------------------------------
# A transformer block (attention + MoE), with its pipeline stages
# ------------------------------------------------------------------------------------------------

_HAS_RMS_NORM = hasattr(F, "rms_norm")   # torch >= 2.4


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6, device=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden, device=device))
        self.eps = eps

    def forward(self, x):
        """x * rsqrt(mean(x^2) + eps) * weight over the last dimension.

        torch's rms_norm where it exists and x has the weight's dtype: on GPUs one fused kernel
        each way instead of pow, mean, rsqrt and two multiplies that each pass over x (on CPU it
        decomposes into about the same ops). With mixed dtypes it would return x's dtype where the
        formula promotes, and it has no fused kernel then, so the formula stays. float32: equal up
        to the order of the mean's sum. bf16: it computes in float32 and rounds once, where the
        formula rounds every intermediate to bf16 (closer to the exact value, not bit-equal).
        """
        if _HAS_RMS_NORM and x.dtype == self.weight.dtype:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Attention(nn.Module):
    """Causal multi-head self-attention (SDPA), x: [B, S, H]; heads of ``head_dim`` (default H / heads)."""

    def __init__(self, hidden: int, num_heads: int, device=None, dtype=None, head_dim: Optional[int] = None) -> None:
        super().__init__()
        if head_dim is None:
            if hidden % num_heads != 0:
                raise ValueError(f"Attention: num_heads ({num_heads}) must divide hidden ({hidden})")
            head_dim = hidden // num_heads
        self.num_heads, self.head_dim = num_heads, head_dim
        inner = num_heads * head_dim
        self.qkv = nn.Linear(hidden, 3 * inner, bias=False, device=device, dtype=dtype)
        self.out = nn.Linear(inner, hidden, bias=False, device=device, dtype=dtype)

    def forward(self, x_BSH):
        B, S, _ = x_BSH.shape
        # linear(): the projections' weight gradients can be deferred by the dual pipeline (wgrad)
        q, k, v = linear(x_BSH, self.qkv.weight).view(B, S, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return linear(o.transpose(1, 2).reshape(B, S, self.num_heads * self.head_dim), self.out.weight)


class MoEBlock(nn.Module):
    """h = h + attn(norm1(h)); h = h + moe(norm2(h)). h: [B, S, H].

    ``num_heads=0``: no attention (and no norm1): h = h + moe(norm2(h)), a MoE layer alone (the
    overlap benchmark uses it to bring compute down to the communication's size).

    Pipeline stages (commlib.training.pipeline.schedule), carry keys in brackets:
      attn     compute  [h] -> [h, x_wire, topk_idx, topk_weights, shared | x_norm]
      dispatch comm     [x_wire, topk_idx, topk_weights] -> [recv_x, recv_topk_idx, recv_topk_weights, counts, handle]
      experts  compute  [recv_*, counts, (x_norm)] -> [y, shared]
      combine  comm     [y, handle] -> [combined]
      finish   compute  [h, combined, shared] -> [h]   (merged into the next block's attn stage)

    The shared experts run in the attn stage (``MoEConfig.shared_stage="attn"``, the default; the
    carry holds their output instead of x_norm) or in the experts stage ("experts"). Results are
    the same bit for bit; only the pairing with the other micro-batch's communication changes:
    with two micro-batches each (compute, comm) pair costs its longer step, and the attention step
    is the shorter compute step beside a dispatch or combine in V3-like layers.
    """

    def __init__(self, cfg: MoEConfig, num_heads: int, buffer=None, num_ranks: Optional[int] = None,
                 full_init: bool = True, device=None, attn_dtype=None, head_dim: Optional[int] = None) -> None:
        super().__init__()
        if num_heads < 0:
            raise ValueError(f"MoEBlock: num_heads must be >= 0 (0 = no attention), got {num_heads}")
        self.norm1 = RMSNorm(cfg.hidden, device=device) if num_heads > 0 else None
        self.attn = (Attention(cfg.hidden, num_heads, device=device, dtype=attn_dtype, head_dim=head_dim)
                     if num_heads > 0 else None)
        self.norm2 = RMSNorm(cfg.hidden, device=device)
        self.moe = MoELayer(cfg, buffer=buffer, num_ranks=num_ranks, full_init=full_init, device=device)

    def forward(self, h_BSH: torch.Tensor) -> torch.Tensor:
        h_BSH, x = self._attention(h_BSH)
        return h_BSH + self.moe(x).view_as(h_BSH)

    def _attention(self, h_BSH):
        if self.attn is not None:
            a = self.attn(self.norm1(h_BSH).to(self.attn.qkv.weight.dtype)).to(h_BSH.dtype)
            h_BSH = h_BSH + a
        return h_BSH, self.norm2(h_BSH).flatten(0, 1)

    def forward_chunks(self, hs: list) -> list:
        """Single-process block on every virtual rank's sequences (see MoELayer.forward_chunks)."""
        pairs = [self._attention(h) for h in hs]
        moe_out = self.moe.forward_chunks([x for _, x in pairs])
        return [h + y.view_as(h) for (h, _), y in zip(pairs, moe_out)]

    # --- stages ---
    def stage_attn(self, carry: dict) -> dict:
        h, x_norm = self._attention(carry["h"])
        x_wire, topk_idx, topk_weights = self.moe.route(x_norm)
        out = {"h": h, "x_wire": x_wire, "topk_idx": topk_idx, "topk_weights": topk_weights}
        if self.moe.cfg.shared_stage == "attn":
            shared = self.moe.shared_compute(x_norm)
            if shared is not None:
                out["shared"] = shared
        else:
            out["x_norm"] = x_norm
        return out

    def stage_experts(self, carry: dict) -> dict:
        out = {k: v for k, v in carry.items()
               if k not in ("recv_x", "recv_topk_idx", "recv_topk_weights", "counts", "x_norm")}
        # The rows come from DispatchStage (layout from topk_idx, no padding): each has a local expert.
        out["y"] = self.moe.expert_compute(carry["recv_x"], carry["recv_topk_idx"], carry["recv_topk_weights"],
                                           carry["counts"], rows_have_local_expert=True)
        if "x_norm" in carry:  # shared_stage == "experts"
            shared = self.moe.shared_compute(carry["x_norm"])
            if shared is not None:
                out["shared"] = shared
        return out

    @staticmethod
    def stage_finish(carry: dict) -> dict:
        h = carry["h"]
        moe_out = MoELayer.finish(carry["combined"], carry.get("shared"), h.dtype).view_as(h)
        return {"h": h + moe_out}


# ------------------------------------------------------------------------------------------------
# A model: optional embedding, MoE blocks, optional head; staged for the dual pipeline
# ------------------------------------------------------------------------------------------------

class MoEModel(StagedModule):
    """[embedding] -> num_layers x MoEBlock -> [final norm + LM head].

    With ``vocab_size`` the input is token ids [B, S] int64 and the output logits [B, S, V] (a
    whole small LM); without, input and output are hidden states [B, S, H] (one DualPipe chunk).
    With a Buffer (expert parallelism) ``forward`` runs the staged chain (commlib.training.pipeline.schedule), so the
    dual-pipeline schedules can interleave two micro-batches; ``staged=False`` runs the blocks as
    plain modules through the autograd ops instead. Without a Buffer it is the single-process
    equivalent (same parameters under the same seed, same bf16 wire rounding).
    """

    def __init__(self, cfg: MoEConfig, num_layers: int, num_heads: int, buffer=None,
                 num_ranks: Optional[int] = None, vocab_size: Optional[int] = None, max_seq_len: int = 0,
                 full_init: bool = True, staged: bool = True, device=None, attn_dtype=None,
                 head_dim: Optional[int] = None) -> None:
        super().__init__()
        self.cfg, self.buffer, self.staged = cfg, buffer, staged
        # (dispatch Config, combine Config) every staged dispatch / combine passes per call (also to
        # its backward); None: the Buffer's own choice (Buffer.num_sms or a tuned config)
        self.comm_configs = (None, None)
        self.vocab_size = vocab_size
        if vocab_size is not None:
            self.embed = nn.Embedding(vocab_size, cfg.hidden, device=device)
            self.pos = nn.Parameter(torch.randn(max_seq_len, cfg.hidden, device=device) * 0.02)
        self.blocks = nn.ModuleList(MoEBlock(cfg, num_heads, buffer=buffer, num_ranks=num_ranks,
                                             full_init=full_init, device=device, attn_dtype=attn_dtype,
                                             head_dim=head_dim)
                                    for _ in range(num_layers))
        if vocab_size is not None:
            self.norm = RMSNorm(cfg.hidden, device=device)
            self.head = nn.Linear(cfg.hidden, vocab_size, bias=False, device=device)

    output_keys = ("out",)

    def make_carry(self, x):
        return {"x": x}

    def _prologue(self, x):
        if self.vocab_size is None:
            return x
        return self.embed(x) + self.pos[: x.shape[1]]

    def _epilogue(self, h):
        if self.vocab_size is None:
            return h
        return self.head(self.norm(h))

    def stages(self) -> list:
        out = []
        num_experts = self.cfg.num_experts
        for l, blk in enumerate(self.blocks):
            def attn(c, l=l, blk=blk):
                if l == 0:
                    c = {"h": self._prologue(c["x"])}
                else:
                    c = MoEBlock.stage_finish(c)
                return blk.stage_attn(c)
            out += [ComputeStage(f"attn{l}", attn),
                    DispatchStage(self.buffer, num_experts, name=f"dispatch{l}", config=self.comm_configs[0],
                                  fp8=self.cfg.fp8_dispatch),
                    ComputeStage(f"experts{l}", blk.stage_experts),
                    CombineStage(self.buffer, name=f"combine{l}", config=self.comm_configs[1])]
        # without a head the last stage is a residual add: light (never paired with a comm step)
        out.append(ComputeStage("finish", lambda c: {"out": self._epilogue(MoEBlock.stage_finish(c)["h"])},
                                light=self.vocab_size is None))
        return out

    def forward(self, x):
        if self.buffer is not None and self.staged:
            return StagedModule.forward(self, x)
        R = self.blocks[0].moe.num_ranks if len(self.blocks) else 1
        if self.buffer is None and R > 1 and x.shape[0] % R == 0:
            # Single process standing in for R ranks: rank r's sequences are the r-th chunk of the
            # batch; per-rank work runs per chunk (see MoELayer.forward_chunks).
            hs = [self._prologue(c) for c in x.chunk(R)]
            for blk in self.blocks:
                hs = blk.forward_chunks(hs)
            return torch.cat([self._epilogue(h) for h in hs])
        h = self._prologue(x)
        for blk in self.blocks:
            h = blk(h)
        return self._epilogue(h)
