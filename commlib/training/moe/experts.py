"""The routed experts: grouped GEMMs over rows sorted by expert (``routed_experts``, ``Experts``),
the shared expert (``SwiGLU``), and ``linear``; their weight gradients can be deferred by the dual
pipeline (commlib.training.wgrad).

Legend: N rows this rank received, H hidden, I expert intermediate size, L local experts, K top-k,
M routed (row, slot) pairs; A, B a grouped product's inner and outer sizes.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from commlib.training import wgrad
from commlib.training.moe.rows import GatherRows, SlotSum, slot_positions


def use_grouped_mm(x_MA: torch.Tensor, impl: str) -> bool:
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
    offs = torch.tensor(counts, dtype=torch.int64, device="cpu").cumsum(0).to(torch.int32)
    if device.type == "cuda" and not torch.compiler.is_compiling():   # traced: pinning is not
        offs = offs.pin_memory()  # the caching host allocator keeps it alive until the copy is done
    return offs.to(device, non_blocking=True)


def _grouped_product(x_MA: torch.Tensor, w_LAB: torch.Tensor, counts: list[int], impl: str,
                     offs: Optional[torch.Tensor]) -> torch.Tensor:
    """Rows of x grouped by expert (counts[e] rows for expert e, in order) times w[e] -> [M, B]."""
    if use_grouped_mm(x_MA, impl):
        return torch._grouped_mm(x_MA, w_LAB, offs=offs)
    outs = [x_e @ w_LAB[e] for e, x_e in enumerate(torch.split(x_MA, counts))]
    return torch.cat(outs) if outs else x_MA.new_zeros(0, w_LAB.shape[2])


def _grouped_weight_grad(x_MA: torch.Tensor, g_MB: torch.Tensor, counts: list[int], impl: str,
                         offs: Optional[torch.Tensor]) -> torch.Tensor:
    """d/dw of _grouped_product: [L, A, B], expert e = x_e^T g_e (zeros for an expert without rows)."""
    if use_grouped_mm(x_MA, impl):
        g_LAB = torch._grouped_mm(x_MA.t(), g_MB, offs=offs)
        if torch.compiler.is_compiling():   # traced, the counts are unbacked: zero the empty groups on the device
            rows_L = torch.diff(offs, prepend=offs.new_zeros(1))
            return torch.where((rows_L == 0).view(-1, 1, 1), torch.zeros_like(g_LAB), g_LAB)
        empty = [e for e, c in enumerate(counts) if c == 0]
        if empty:  # a group with no rows (K = 0): zeros by definition, whatever the kernel leaves there
            g_LAB[empty] = 0
        return g_LAB
    A, B = x_MA.shape[1], g_MB.shape[1]
    if not counts:
        return x_MA.new_zeros(0, A, B)
    # an expert without rows: the product over an empty inner dimension is zeros (no branch on the
    # count, which a traced run does not know)
    return torch.stack([x_e.t() @ g_e for x_e, g_e in zip(torch.split(x_MA, counts), torch.split(g_MB, counts))])


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
    if offs is None and use_grouped_mm(x_MA, impl):
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
    """F.linear(x, w) without bias, its weight gradient deferrable in the overlapped schedules.

    Args: x [..., A] and w [B, A], the same float dtype. Returns: [..., B] in that dtype.
    """
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        return _Linear.apply(x, w)
    return F.linear(x, w)


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
    if one_slot_per_row is None and torch.compiler.is_compiling():
        # Traced, M and N are unbacked sizes a branch cannot read: the general path (the same values,
        # see above), with the facts the slicing below needs checked at run time instead.
        torch._check(M <= N * K)
        if rows_have_local_expert:
            torch._check(M >= N)
        one_slot_per_row = False
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
        x_MH = GatherRows.apply(x_NH, rows_M, inv_N, None).to(dtype)
    else:
        pos_NK = slot_positions(order_M, N, K)
        x_MH = GatherRows.apply(x_NH, rows_M, None, pos_NK).to(dtype)
    weights_M = topk_weights_NK.reshape(-1).index_select(0, order_M).to(dtype)
    offs = _group_offsets(counts, x_MH.device) if use_grouped_mm(x_MH, impl) else None  # one copy, both GEMMs
    gate_up = _grouped_matmul(x_MH, w_gate_up_LHI, counts, impl, offs)
    gate, up = gate_up.chunk(2, dim=1)
    # The top-k weight scales the [M, I] activation rather than the [M, H] down-projection output:
    # the same value (the projection is linear), one [M, H] read + write less forward and backward
    # (I is the small side: 2048 vs 7168 in V3). Rounding: the weight is applied before the GEMM
    # (in the weights' dtype) instead of after it, so results differ in the last bits.
    act_MI = F.silu(gate) * up * weights_M.unsqueeze(1)
    out_MH = _grouped_matmul(act_MI, w_down_LIH, counts, impl, offs)
    if one_slot_per_row:
        return GatherRows.apply(out_MH, inv_N, rows_M, None)
    # A row may meet several local experts: sum its slots in float32, round once (SlotSum)
    return SlotSum.apply(out_MH, pos_NK, rows_M)


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
        """Experts [lo, hi) of this module on local ids 0 .. hi - lo.

        Args: x_NH [N, H] rows; topk_idx_NK [N, K] int64 local ids (-1 = not here); topk_weights_NK
        [N, K] float; counts, impl, rows_have_local_expert: see ``routed_experts``.
        Returns: [N, H] in the weights' dtype.
        """
        hi = self.num_local if hi is None else hi
        if (lo, hi) == (0, self.num_local):   # the parameters themselves: their weight gradients can be deferred
            w_gate_up, w_down = self.w_gate_up, self.w_down
        else:
            w_gate_up, w_down = self.w_gate_up[lo:hi], self.w_down[lo:hi]
        return routed_experts(x_NH, topk_idx_NK, topk_weights_NK, w_gate_up, w_down, counts, impl,
                              rows_have_local_expert=rows_have_local_expert)


class SwiGLU(nn.Module):
    """The shared expert: down(silu(gate(x)) * up(x)), x [T, H] -> [T, H] (float32 parameters)."""

    def __init__(self, hidden: int, inner: int, device=None) -> None:
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * inner, bias=False, device=device)
        self.down = nn.Linear(inner, hidden, bias=False, device=device)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)
