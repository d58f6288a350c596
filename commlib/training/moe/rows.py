"""Row gathers and per-row slot sums of the expert stage, with backwards that know their structure;
the slot sum runs as one kernel (csrc/moe_rows.cu) on CUDA bf16 rows.

Legend: N rows, H hidden, K slots (top-k) per row, M routed (row, slot) pairs in expert order.
"""
from __future__ import annotations

import importlib.util
from typing import Optional

import torch

from commlib.cuda import loader as K
from commlib.utils import env


class GatherRows(torch.autograd.Function):
    """out[m] = x[idx[m]], with a backward that knows the gather's structure. index_select's own
    backward fills an [N, H] tensor with zeros and scatter-adds into it (two passes, atomics on GPUs).

    * ``inv`` given: ``idx`` is a permutation of x's rows and ``inv`` its inverse. The backward is
      this op with the two swapped, one pass over the gradient, so it differentiates twice.
    * else ``pos_NK`` (the routed pairs' slot table, slot_positions): the backward is the slot sum
      (SlotSum: one kernel pass on CUDA bf16 rows, float32 sum, one rounding), or where that kernel
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
            g = GatherRows.apply(grad, other, idx, None)
        elif row_kernel_ok(grad, other.shape[1]):
            g = SlotSum.apply(grad, other, idx)
        else:
            g = grad.new_zeros(other.shape[0], grad.shape[1]).index_add_(0, idx, grad)
        return g, None, None, None


def slot_positions(order_M: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """[N, K] int32: pos[n, k] = m where the m-th routed pair (expert order, ``order_M[m] = n * K + k``)
    is slot k of row n; -1 where slot k of row n has no local expert."""
    pos = torch.full((N * K,), -1, dtype=torch.int32, device=order_M.device)
    pos[order_M] = torch.arange(order_M.numel(), dtype=torch.int32, device=order_M.device)
    return pos.view(N, K)


_cupy_ok: Optional[bool] = None


def row_kernel_ok(t: torch.Tensor, K: int) -> bool:
    """csrc/moe_rows.cu can sum ``t``'s rows: CUDA bf16, rows of whole 16-byte vectors, K <= 32 (one
    slot per lane), CuPy present, not switched off (COMMLIB_MOE_ROW_KERNEL=0), not traced by torch.compile."""
    global _cupy_ok
    if torch.compiler.is_compiling():   # a raw-pointer launch cannot be traced: torch's ops then
        return False
    if not (t.is_cuda and t.dtype == torch.bfloat16 and t.dim() == 2 and t.shape[1] % 8 == 0 and 1 <= K <= 32
            and env.moe_row_kernel()):
        return False
    if _cupy_ok is None:
        _cupy_ok = importlib.util.find_spec("cupy") is not None
    return _cupy_ok


def slot_sum_kernel(src_MH: torch.Tensor, pos_NK: torch.Tensor) -> torch.Tensor:
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


class SlotSum(torch.autograd.Function):
    """y[n] = sum over the slots k of row n that have a local expert of out[pos[n, k]] (the routed
    pairs' outputs, expert order), accumulated in float32 and rounded once to out's dtype. Backward:
    the gather of the gradient (exact). On CUDA bf16 rows one kernel pass (slot_sum_kernel); else
    float32 zeros + index_add_ + a cast, as before the kernel."""

    @staticmethod
    def forward(ctx, out_MH, pos_NK, rows_M):
        ctx.save_for_backward(pos_NK, rows_M)
        if row_kernel_ok(out_MH, pos_NK.shape[1]):
            return slot_sum_kernel(out_MH, pos_NK)
        acc_dtype = torch.promote_types(out_MH.dtype, torch.float32)
        # index_add runs in the tensor's dtype (float64 experts keep float64); in place on fresh zeros:
        # the out-of-place index_add would first copy the [N, H] float32 zeros. On CPU the order is fixed;
        # on GPUs index_add uses atomics (order varies)
        y = torch.zeros(pos_NK.shape[0], out_MH.shape[1], dtype=acc_dtype, device=out_MH.device)
        return y.index_add_(0, rows_M, out_MH.to(acc_dtype)).to(out_MH.dtype)

    @staticmethod
    def backward(ctx, g_NH):
        pos_NK, rows_M = ctx.saved_tensors
        return GatherRows.apply(g_NH, rows_M, None, pos_NK), None, None
