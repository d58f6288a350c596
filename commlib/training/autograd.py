"""Dispatch and combine as differentiable ops: the backward of dispatch is a combine, the backward
of combine is a cached dispatch (DeepSeek-V3's training recipe).

Legend: T tokens on this rank, H hidden, K top-k slots, N rows this rank received, E experts.

  dispatch(buffer, x_TH, topk_idx_TK, topk_weights_TK, num_experts) -> DispatchOutput
      forward  : Buffer.get_dispatch_layout + Buffer.dispatch
      backward : grad_x_TH, grad_topk_weights_TK = Buffer.combine(grad_recv_x_NH, handle,
                 topk_weights=grad_recv_topk_weights_NK masked to this rank's slots)
  combine(buffer, y_NH, handle) -> combined_x_TH
      forward  : Buffer.combine
      backward : grad_y_NH = Buffer.dispatch(grad_combined_x_TH, handle=handle)   (cached mode)

Why the backward pairs are exact: dispatch copies row t of rank s to every rank holding one of
its experts, so the gradient of x[t] is the sum of the gradients of those copies, which is what
combine computes (float32 accumulation, bf16 out). recv_topk_weights[n, k] is topk_weights[t, k]
on the rank owning expert k and the constant 0 elsewhere, so masking the incoming gradient to
this rank's slots and summing over ranks (combine's ``combined_topk_weights``) gives each slot
exactly the gradient from the rank that owns it. combine sums rows, so its gradient is the same
row copied back to every contributing rank: a cached dispatch. Gradients are bf16 on the wire,
as activations are (the same rounding DeepSeek-V3 uses); dispatch/combine accept bf16 only.

Routing weights: combine is an unweighted sum (DeepEP semantics), so the MoE layer applies
``recv_topk_weights`` to the expert outputs before combine; the gradient reaches ``topk_weights``
through dispatch's backward. combine's ``combined_topk_weights`` output is not differentiable
(a cached dispatch does not move weights back).

FP8: ``x`` may be a tuple ``(x_fp8 [T, H] e4m3, scales [T, H / 128] float32)``; such a dispatch
is differentiable in ``topk_weights`` only. ``fp8=True`` takes a bf16 ``x``, quantizes it, moves
FP8 and returns ``recv_x`` dequantized to bf16; the gradient is passed straight through the
quantization and moved back in bf16 (as V3 does).

torch.compile: the two ops here are ``torch.autograd.Function``s behind ``torch.compiler.disable``
(they take and return Python objects: the Buffer, a DispatchHandle, a Config, events), so a compiled
function calling them gets a graph break at each call. commlib.training.ops has the same ops, with
the same gradients, as ``torch.library`` custom ops that torch.compile traces through (the Buffer as
an id, the handle as tensors); commlib.training.moe's MoELayer uses those.

Asynchrony: the primitives (``dispatch_forward``, ``dispatch_backward``, ``combine_forward``,
``combine_backward``) take ``previous_event`` / ``async_finish`` / ``allocate_on_comm_stream``
like the Buffer and return the Buffer's event; the dual pipeline (commlib.training.pipeline.stages) calls them
directly to overlap communication with the other micro-batch's compute. The autograd ops run
them stream-ordered (``async_finish=False``): the comm stream waits for the current stream and
the current stream waits for the comm stream, with no host synchronisation beyond what a
non-cached dispatch needs for its receive count.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence, Union

import torch

from commlib.fp8 import per_token_cast_back, per_token_cast_to_fp8

XLike = Union[torch.Tensor, tuple]


class DispatchOutput(NamedTuple):
    """DeepEP's dispatch tuple order, with names."""
    recv_x: Any                                   # [N, H] bf16, or (fp8 [N, H], scales [N, H/128]) for FP8 input
    recv_topk_idx: Optional[torch.Tensor]         # [N, K] int64, local expert ids, -1 elsewhere
    recv_topk_weights: Optional[torch.Tensor]     # [N, K] float32, 0 elsewhere
    num_recv_tokens_per_expert_list: Optional[list]  # [local experts] ints
    handle: Any                                   # the routing handle combine reuses
    event: Any                                    # EventOverlap of the last communication call


# --------------------------------------------------------------------------------------------
# Primitives: one Buffer call each, with the Buffer's stream-ordering arguments.
# --------------------------------------------------------------------------------------------

def _check_bf16(name: str, t: torch.Tensor, buffer) -> None:
    if t.dtype != torch.bfloat16:
        rank = getattr(buffer, "rank", "?")
        raise TypeError(f"rank {rank}: {name} must be bfloat16 (what dispatch/combine move), got {t.dtype}")


def dispatch_forward(buffer, x: XLike, topk_idx: torch.Tensor, topk_weights: Optional[torch.Tensor],
                     num_experts: int, *, config=None, expert_alignment: int = 1, num_worst_tokens: int = 0,
                     previous_event=None, async_finish: bool = False,
                     allocate_on_comm_stream: bool = False, prepacked=None) -> DispatchOutput:
    """Layout + dispatch. x: [T, H] bf16 or (fp8, scales); topk_idx: [T, K] int64 global expert ids.
    prepacked: Buffer.prepack(x, topk_idx, topk_weights, num_experts)'s token (it holds the layout)."""
    # allocate_on_comm_stream is only legal with an explicit previous_event and async_finish.
    alloc = allocate_on_comm_stream and async_finish
    if prepacked is not None:  # the layout came with the packing (dispatch takes it from the token), on
        # the stream previous_event follows
        num_tokens_per_rank = num_tokens_per_rdma_rank = num_tokens_per_expert = is_token_in_rank = None
        dispatch_prev = previous_event if async_finish else None
    else:
        layout = buffer.get_dispatch_layout(topk_idx, num_experts, previous_event=previous_event,
                                            async_finish=async_finish,
                                            allocate_on_comm_stream=alloc and previous_event is not None)
        num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, layout_event = layout
        # With async_finish the layout's event orders dispatch after it on the comm stream; without,
        # the current stream already waited for the layout, so "wait for the current stream" is right.
        dispatch_prev = layout_event if async_finish else None
    out = buffer.dispatch(x, num_tokens_per_rank=num_tokens_per_rank,
                          num_tokens_per_rdma_rank=num_tokens_per_rdma_rank,
                          is_token_in_rank=is_token_in_rank, num_tokens_per_expert=num_tokens_per_expert,
                          topk_idx=topk_idx, topk_weights=topk_weights, expert_alignment=expert_alignment,
                          num_worst_tokens=num_worst_tokens, config=config, previous_event=dispatch_prev,
                          async_finish=async_finish,
                          allocate_on_comm_stream=alloc and dispatch_prev is not None, **_prepacked(prepacked))
    return DispatchOutput(*out)


def _prepacked(token) -> dict:
    """dispatch()'s prepacked argument, passed only when there is one (stand-in buffers lack it)."""
    return {} if token is None else {"prepacked": token}


def _later(finish_later: bool) -> dict:
    """combine()'s finish_later argument, passed only when set (stand-in buffers lack it)."""
    return {"finish_later": True} if finish_later else {}


def finish(value):
    """A combine result taken with finish_later: its outputs (PendingCombine.finish(), on the current
    stream); anything else is returned as it is."""
    return value.finish() if hasattr(value, "finish") else value


def prepare_dispatch_grads(grad_recv_x: torch.Tensor, grad_recv_topk_weights: Optional[torch.Tensor],
                           recv_topk_idx: Optional[torch.Tensor]):
    """The compute half of dispatch's backward: grad_recv_x -> bf16 contiguous, the weight gradient
    masked to this rank's slots (float32). Runs on the current stream; an overlapped schedule calls
    it before recording the event that dispatch_backward's communication waits for."""
    grad_recv_x = grad_recv_x.to(torch.bfloat16).contiguous()
    weights = None
    if grad_recv_topk_weights is not None:
        weights = grad_recv_topk_weights.float()
        if recv_topk_idx is not None:
            weights = torch.where(recv_topk_idx >= 0, weights, torch.zeros_like(weights))
        weights = weights.contiguous()
    return grad_recv_x, weights


def dispatch_backward(buffer, handle, grad_recv_x: torch.Tensor, grad_recv_topk_weights: Optional[torch.Tensor],
                      recv_topk_idx: Optional[torch.Tensor], *, config=None, previous_event=None,
                      async_finish: bool = False, allocate_on_comm_stream: bool = False, prepared: bool = False,
                      finish_later: bool = False):
    """Gradient of dispatch: a combine of the received rows' gradients.

    grad_recv_x: [N, H] (cast to bf16); grad_recv_topk_weights: [N, K] or None; recv_topk_idx: [N, K]
    (slots of other ranks are masked out of the weight gradient). ``prepared=True``: the two
    gradients already went through prepare_dispatch_grads (no compute is issued here).
    Returns (grad_x [T, H] bf16, grad_topk_weights [T, K] float32 or None, event); finish_later:
    (PendingCombine, None, event), see Buffer.combine.
    """
    if not prepared:
        grad_recv_x, grad_recv_topk_weights = prepare_dispatch_grads(grad_recv_x, grad_recv_topk_weights,
                                                                     recv_topk_idx)
    grad_x, grad_topk_weights, event = buffer.combine(
        grad_recv_x, handle, topk_weights=grad_recv_topk_weights, config=config, previous_event=previous_event,
        async_finish=async_finish, allocate_on_comm_stream=allocate_on_comm_stream, **_later(finish_later))
    if finish_later:
        return grad_x, None, event
    return grad_x, (grad_topk_weights if grad_recv_topk_weights is not None else None), event


def combine_forward(buffer, y: torch.Tensor, handle, *, topk_weights: Optional[torch.Tensor] = None,
                    bias=None, config=None, previous_event=None, async_finish: bool = False,
                    allocate_on_comm_stream: bool = False, finish_later: bool = False):
    """y: [N, H] bf16 rows as dispatch delivered them -> (combined_x [T, H] bf16, combined_topk_weights, event);
    finish_later: (PendingCombine, None, event), see Buffer.combine."""
    _check_bf16("combine x", y, buffer)
    return buffer.combine(y.contiguous(), handle, topk_weights=topk_weights, bias=bias, config=config,
                          previous_event=previous_event, async_finish=async_finish,
                          allocate_on_comm_stream=allocate_on_comm_stream, **_later(finish_later))


def combine_backward(buffer, handle, grad_combined_x: torch.Tensor, *, config=None, previous_event=None,
                     async_finish: bool = False, allocate_on_comm_stream: bool = False, prepacked=None):
    """Gradient of combine: a cached dispatch of grad_combined_x [T, H] -> (grad_y [N, H] bf16, event).
    prepacked: Buffer.prepack(grad_combined_x, handle=handle)'s token (grad_combined_x bf16 and contiguous)."""
    grad = grad_combined_x.to(torch.bfloat16).contiguous()
    out = buffer.dispatch(grad, handle=handle, config=config, previous_event=previous_event,
                          async_finish=async_finish, allocate_on_comm_stream=allocate_on_comm_stream,
                          **_prepacked(prepacked))
    return out[0], out[5]


# --------------------------------------------------------------------------------------------
# Autograd functions
# --------------------------------------------------------------------------------------------

class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, x_scales, topk_weights, buffer, topk_idx, num_experts, fp8, opts):
        if x_scales is not None:                     # FP8 given by the caller
            x_in: XLike = (x, x_scales)
        elif fp8:
            _check_bf16("dispatch x", x, buffer)
            x_in = per_token_cast_to_fp8(x)
        else:
            _check_bf16("dispatch x", x, buffer)
            x_in = x
        out = dispatch_forward(buffer, x_in, topk_idx, topk_weights, num_experts, **opts)
        recv_x, recv_scales = (out.recv_x if isinstance(out.recv_x, tuple) else (out.recv_x, None))
        if fp8 and x_scales is None:
            recv_x, recv_scales = per_token_cast_back(recv_x, recv_scales, torch.bfloat16), None
        ctx.buffer, ctx.handle, ctx.config = buffer, out.handle, opts.get("config")
        ctx.x_differentiable = x_scales is None
        ctx.num_recv, ctx.hidden, ctx.device = recv_x.shape[0], recv_x.shape[1], recv_x.device
        ctx.has_weights = topk_weights is not None
        if out.recv_topk_idx is not None:
            ctx.mark_non_differentiable(out.recv_topk_idx)
        if recv_scales is not None:
            ctx.mark_non_differentiable(recv_scales)
        ctx.save_for_backward(out.recv_topk_idx)
        return (recv_x, recv_scales, out.recv_topk_idx, out.recv_topk_weights,
                out.num_recv_tokens_per_expert_list, out.handle, out.event)

    @staticmethod
    def backward(ctx, grad_recv_x, _grad_scales, _grad_idx, grad_recv_topk_weights, *_rest):
        (recv_topk_idx,) = ctx.saved_tensors
        if grad_recv_x is None or not ctx.x_differentiable:
            grad_recv_x = torch.zeros(ctx.num_recv, ctx.hidden, dtype=torch.bfloat16, device=ctx.device)
        if not ctx.has_weights:
            grad_recv_topk_weights = None
        elif grad_recv_topk_weights is None:
            grad_recv_topk_weights = torch.zeros(recv_topk_idx.shape, dtype=torch.float32, device=ctx.device)
        grad_x, grad_w, _ = dispatch_backward(ctx.buffer, ctx.handle, grad_recv_x, grad_recv_topk_weights,
                                              recv_topk_idx, config=ctx.config)
        ctx.handle = None
        return (grad_x if ctx.x_differentiable else None, None, grad_w, None, None, None, None, None)


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, topk_weights, buffer, handle, config, *bias):
        bias_arg = None if not bias else (bias[0] if len(bias) == 1 else tuple(bias))
        combined_x, combined_topk_weights, _ = combine_forward(buffer, y, handle, topk_weights=topk_weights,
                                                                bias=bias_arg, config=config)
        ctx.buffer, ctx.handle, ctx.config = buffer, handle, config
        ctx.bias_dtypes = [b.dtype for b in bias]
        if combined_topk_weights is not None:
            ctx.mark_non_differentiable(combined_topk_weights)
        return combined_x, combined_topk_weights

    @staticmethod
    def backward(ctx, grad_combined_x, _grad_weights):
        grad_y, _ = combine_backward(ctx.buffer, ctx.handle, grad_combined_x, config=ctx.config)
        grad_bias = tuple(grad_combined_x.to(d) for d in ctx.bias_dtypes)
        ctx.handle = None
        return (grad_y, None, None, None, None) + grad_bias


@torch.compiler.disable
def dispatch(buffer, x: XLike, topk_idx: torch.Tensor, topk_weights: Optional[torch.Tensor], num_experts: int, *,
             fp8: bool = False, config=None, expert_alignment: int = 1, num_worst_tokens: int = 0) -> DispatchOutput:
    """Differentiable dispatch.

    x: [T, H] bf16 (or a (fp8, scales) tuple, or bf16 with ``fp8=True``); topk_idx: [T, K] int64;
    topk_weights: [T, K] float32 or None. Returns DispatchOutput; ``recv_x`` [N, H] and
    ``recv_topk_weights`` [N, K] carry gradients back to ``x`` and ``topk_weights``.
    """
    opts = dict(config=config, expert_alignment=expert_alignment, num_worst_tokens=num_worst_tokens)
    x_scales = None
    if isinstance(x, tuple):
        x, x_scales = x
    recv_x, recv_scales, recv_topk_idx, recv_topk_weights, counts, handle, event = _Dispatch.apply(
        x, x_scales, topk_weights, buffer, topk_idx, num_experts, fp8, opts)
    if recv_scales is not None:
        recv_x = (recv_x, recv_scales)
    return DispatchOutput(recv_x, recv_topk_idx, recv_topk_weights, counts, handle, event)


@torch.compiler.disable
def combine(buffer, y: torch.Tensor, handle, topk_weights: Optional[torch.Tensor] = None,
            bias: Union[None, torch.Tensor, Sequence[torch.Tensor]] = None, config=None
            ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Differentiable combine. y: [N, H] bf16 -> (combined_x [T, H] bf16, combined_topk_weights [T, K] or None).

    The gradient of ``combined_x`` flows to ``y`` (cached dispatch) and to ``bias``.
    """
    biases = () if bias is None else ((bias,) if isinstance(bias, torch.Tensor) else tuple(bias))
    return _Combine.apply(y, topk_weights, buffer, handle, config, *biases)
