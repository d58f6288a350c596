"""Dispatch and combine as ``torch.library`` custom ops with autograd, so ``torch.compile`` traces a
MoE block through them without a graph break (``fullgraph=True``), on every backend.

Legend: T tokens on this rank, H hidden, K top-k slots, N rows this rank received, E experts,
L local experts (E / R), R ranks, C channels of the dispatch, M = num_max_dispatch_tokens_per_rank.

  dispatch(buffer, x_TH, topk_idx_TK, topk_weights_TK, E)  -> Dispatched(recv_x_NH, ..., handle)
      backward: (grad_x_TH, grad_topk_weights_TK) = combine of the row gradients (the weight
                gradient masked to this rank's slots), as commlib.training.autograd
  dispatch_cached(buffer, x_TH, handle) -> recv_x_NH        backward: combine
  combine(buffer, y_NH, handle[, topk_weights_NK]) -> (combined_x_TH, combined_topk_weights_TK)
      backward: grad_y_NH = dispatch_cached(grad_combined_x_TH)
  low_latency_dispatch / low_latency_combine: the decode path (bf16 or FP8 rows; fixed shapes, no
      autograd, no hooks), for ``torch.compile(mode="reduce-overhead")`` (CUDA graphs)

What crosses an op's boundary is tensors and ints only:
* the Buffer is an int, ``buffer.buffer_id``, looked up in a registry of live Buffers (weak
  references; ``register_buffer``, done by MoELayer and by the wrappers here when not traced: a
  traced call cannot register, so register before compiling code that calls the ops directly);
* the handle is a list of tensors (``Handle``): the DispatchHandle's six tensors and a one-byte
  ``token`` tensor allocated per dispatch. The handle's other state (ints, topology, the backend's
  private plan) stays in a registry keyed by the token's address while the token is alive; the
  ops rebuild the DispatchHandle from the tensors they are given plus that state. The token is a
  device tensor (no host read to find it), so graphs of the decode path stay capturable.

Shapes the fake (meta) kernels give, with no host sync: ``num_worst_tokens > 0``: N is that
number; cached dispatch and combine: from the handle's tensors; a non-cached dispatch without
``num_worst_tokens``: N (and C) are unbacked symbolic sizes (``ctx.new_dynamic_size``), known only
after the count exchange. The per-expert counts are a CPU int64 tensor then (host values, the
list DeepEP returns); a traced ``.tolist()`` of it needs
``torch._dynamo.config.capture_scalar_outputs = True`` (``compile_config`` sets it and its
companions for a block).

The ops run stream-ordered and synchronously (``async_finish=False``); configs are the Buffer's
own choice (a ``commlib.Config`` is a Python object). FP8: ``fp8=True`` quantizes bf16 ``x``,
moves E4M3 + scales and returns ``recv_x`` dequantized to bf16; the gradient passes straight
through, in bf16 (as commlib.training.autograd).
"""
from __future__ import annotations

import contextlib
import dataclasses
import weakref
from typing import NamedTuple, Optional

import torch

from commlib.fp8 import per_token_cast_back, per_token_cast_to_fp8
from commlib.handle import DispatchHandle
from commlib.training.autograd import combine_backward, combine_forward, dispatch_forward, prepare_dispatch_grads

# ----------------------------------------------------------------------------------------------
# Registries: live Buffers by id, and the non-tensor state of live handles by token address
# ----------------------------------------------------------------------------------------------

_BUFFERS: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()
_HANDLES: dict = {}   # token address -> (weakref to the token, handle, dtypes/devices of its tensors)

HANDLE_FIELDS = ("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix", "recv_src_idx",
                 "is_token_in_rank", "send_head")
# dtypes the fake kernels give the handle's tensors (commlib/handle.py); a backend's other dtypes
# are cast to these at the boundary and back inside the ops
_HANDLE_DTYPES = (torch.int32, torch.int32, torch.int32, torch.int32, torch.bool, torch.int32)
_LL_FIELDS = ("src_info", "layout_range")
_LL_DTYPES = (torch.int32, torch.int64)


class Handle(NamedTuple):
    """A dispatch handle as tensors (what crosses the ops' boundary).

    token [1] uint8 (its address keys the handle's other state); rank_prefix_matrix [R, R] int32;
    channel_prefix_matrix, recv_channel_prefix_matrix [R, C] int32; recv_src_idx [N] int32;
    is_token_in_rank [T, R] bool; send_head [T, R] int32 (commlib/handle.py says what each holds)."""
    token: torch.Tensor
    rank_prefix_matrix: torch.Tensor
    channel_prefix_matrix: torch.Tensor
    recv_channel_prefix_matrix: torch.Tensor
    recv_src_idx: torch.Tensor
    is_token_in_rank: torch.Tensor
    send_head: torch.Tensor


class Dispatched(NamedTuple):
    recv_x: torch.Tensor                      # [N, H] bf16
    recv_topk_idx: torch.Tensor               # [N, K] int64 local expert ids, -1 elsewhere
    recv_topk_weights: torch.Tensor           # [N, K] float32, 0 elsewhere
    num_recv_tokens_per_expert: torch.Tensor  # [L] int64: CPU (host counts), or on the device with num_worst_tokens
    handle: Handle


class LowLatencyHandle(NamedTuple):
    """A low-latency handle as tensors: token [1] uint8, src_info [L, R * M] int32, layout_range [L, R] int64."""
    token: torch.Tensor
    src_info: torch.Tensor
    layout_range: torch.Tensor


def register_buffer(buffer) -> int:
    """Make ``buffer`` reachable from the ops by its id (weakly held). Returns ``buffer.buffer_id``."""
    _BUFFERS[buffer.buffer_id] = buffer
    return buffer.buffer_id


def live_handles() -> int:
    """How many handles' state the registry holds (their token tensors are alive)."""
    return len(_HANDLES)


def _buffer(buffer_id: int):
    buffer = _BUFFERS.get(buffer_id)
    if buffer is None:
        raise RuntimeError(f"commlib.training.ops: no live Buffer with id {buffer_id}: call "
                           "commlib.training.ops.register_buffer(buffer) before tracing or running the ops")
    return buffer


def _forget(address: int, ref) -> None:
    entry = _HANDLES.get(address)
    if entry is not None and entry[0] is ref:
        del _HANDLES[address]


def _keep(handle, fields, dtypes, device) -> list:
    """handle -> [token, its tensors in ``fields`` order cast to ``dtypes`` on ``device``]; its state kept
    under the token's address until the token is freed."""
    token = torch.empty(1, dtype=torch.uint8, device=device)
    address = token.data_ptr()
    ref = weakref.ref(token, lambda r, a=address: _forget(a, r))
    tensors = [getattr(handle, f) for f in fields]
    _HANDLES[address] = (ref, handle, [(t.dtype, t.device) for t in tensors])
    return [token] + [t.to(device=device, dtype=d) for t, d in zip(tensors, dtypes)]


def _restore(buffer, tensors, fields, what: str):
    """The handle a [token, tensors...] list stands for, its tensor fields the ones given."""
    token = tensors[0]
    entry = _HANDLES.get(token.data_ptr())
    if entry is None or entry[0]() is None:
        raise RuntimeError(f"[commlib rank {buffer.rank}] {what}: the handle's token is unknown: pass the handle "
                           "tensors that commlib.training.ops' dispatch returned, while they are alive")
    _, handle, kinds = entry
    if len(tensors) != len(fields) + 1:
        raise ValueError(f"[commlib rank {buffer.rank}] {what}: a handle has {len(fields) + 1} tensors, got {len(tensors)}")
    values = {f: t.to(device=dev, dtype=dt) for f, t, (dt, dev) in zip(fields, tensors[1:], kinds)}
    return dataclasses.replace(handle, **values)


def _fresh(outputs: list, inputs: list) -> list:
    """A custom op's outputs may not alias its inputs or one another: clone those that do."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor) and t.numel()}
    out = []
    for t in outputs:
        if t.numel():
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:
                t = t.clone()
                ptr = t.untyped_storage().data_ptr()
            seen.add(ptr)
        out.append(t)
    return out


def _check_bf16(name: str, t: torch.Tensor, buffer) -> None:
    if t.dtype != torch.bfloat16:
        raise TypeError(f"[commlib rank {buffer.rank}] {name} must be bfloat16 (what dispatch/combine move), "
                        f"got {t.dtype}")


# ----------------------------------------------------------------------------------------------
# dispatch (non-cached; num_worst_tokens)
# ----------------------------------------------------------------------------------------------

@torch.library.custom_op("commlib::dispatch", mutates_args=())
def _dispatch_op(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, buffer_id: int,
                 num_experts: int, num_worst_tokens: int, expert_alignment: int, fp8: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    buffer = _buffer(buffer_id)
    x_in = per_token_cast_to_fp8(x) if fp8 else x
    out = dispatch_forward(buffer, x_in, topk_idx, topk_weights, num_experts, expert_alignment=expert_alignment,
                           num_worst_tokens=num_worst_tokens)
    recv_x = per_token_cast_back(*out.recv_x, torch.bfloat16) if fp8 else out.recv_x
    L = num_experts // buffer.num_ranks
    if num_worst_tokens:   # no host counts (no sync): counted on the device from the received ids
        ids = out.recv_topk_idx.flatten()
        counts = torch.zeros(L + 1, dtype=torch.int64, device=ids.device)
        counts = counts.index_add_(0, torch.where(ids >= 0, ids, L), torch.ones_like(ids))[:L]
    else:
        counts = torch.tensor(out.num_recv_tokens_per_expert_list, dtype=torch.int64, device="cpu")
    handle = _keep(out.handle, HANDLE_FIELDS, _HANDLE_DTYPES, x.device)
    res = _fresh([recv_x, out.recv_topk_idx, out.recv_topk_weights, counts] + handle, [x, topk_idx, topk_weights])
    return res[0], res[1], res[2], res[3], res[4:]


def _fake_handle(x: torch.Tensor, R: int, N, T) -> list:
    C = torch.library.get_ctx().new_dynamic_size()
    i32 = dict(dtype=torch.int32, device=x.device)
    return [x.new_empty(1, dtype=torch.uint8), x.new_empty(R, R, **i32), x.new_empty(R, C, **i32),
            x.new_empty(R, C, **i32), x.new_empty(N, **i32), x.new_empty(T, R, dtype=torch.bool),
            x.new_empty(T, R, **i32)]


@_dispatch_op.register_fake
def _(x, topk_idx, topk_weights, buffer_id, num_experts, num_worst_tokens, expert_alignment, fp8):
    R = _buffer(buffer_id).num_ranks
    T, H = x.shape
    K = topk_idx.shape[1]
    N = num_worst_tokens or torch.library.get_ctx().new_dynamic_size()
    counts_device = x.device if num_worst_tokens else torch.device("cpu")
    return (x.new_empty(N, H, dtype=torch.bfloat16), x.new_empty(N, K, dtype=torch.int64),
            x.new_empty(N, K, dtype=torch.float32),
            torch.empty(num_experts // R, dtype=torch.int64, device=counts_device),
            _fake_handle(x, R, N, T))


def _dispatch_setup(ctx, inputs, output):
    ctx.buffer_id = inputs[3]
    ctx.hidden = inputs[0].shape[1]
    recv_topk_idx, handle = output[1], output[4]
    ctx.save_for_backward(recv_topk_idx, *handle)


def _dispatch_backward(ctx, grad_recv_x, _grad_idx, grad_recv_topk_weights, _grad_counts, _grad_handle):
    recv_topk_idx, *handle = ctx.saved_tensors
    N = recv_topk_idx.shape[0]
    if grad_recv_x is None:
        grad_recv_x = recv_topk_idx.new_zeros(N, ctx.hidden, dtype=torch.bfloat16)
    if grad_recv_topk_weights is None:
        grad_recv_topk_weights = torch.zeros_like(recv_topk_idx, dtype=torch.float32)
    # the weight gradient masked to this rank's slots, then both summed home by a combine
    grad_recv_x, grad_recv_topk_weights = prepare_dispatch_grads(grad_recv_x, grad_recv_topk_weights, recv_topk_idx)
    grad_x, grad_w = torch.ops.commlib.combine(grad_recv_x, grad_recv_topk_weights, handle, ctx.buffer_id)
    return grad_x, None, grad_w, None, None, None, None, None


_dispatch_op.register_autograd(_dispatch_backward, setup_context=_dispatch_setup)


# ----------------------------------------------------------------------------------------------
# cached dispatch
# ----------------------------------------------------------------------------------------------

@torch.library.custom_op("commlib::dispatch_cached", mutates_args=())
def _dispatch_cached_op(x: torch.Tensor, handle: list[torch.Tensor], buffer_id: int) -> torch.Tensor:
    buffer = _buffer(buffer_id)
    h = _restore(buffer, handle, HANDLE_FIELDS, "cached dispatch")
    recv_x, _ = combine_backward(buffer, h, x)
    return _fresh([recv_x], [x, *handle])[0]


@_dispatch_cached_op.register_fake
def _(x, handle, buffer_id):
    return x.new_empty(handle[4].shape[0], x.shape[1], dtype=torch.bfloat16)


def _cached_setup(ctx, inputs, output):
    ctx.buffer_id = inputs[2]
    ctx.save_for_backward(*inputs[1])


def _cached_backward(ctx, grad_recv_x):
    handle = list(ctx.saved_tensors)
    grad_x, _ = torch.ops.commlib.combine(grad_recv_x.to(torch.bfloat16).contiguous(), None, handle, ctx.buffer_id)
    return grad_x, [None] * len(handle), None


_dispatch_cached_op.register_autograd(_cached_backward, setup_context=_cached_setup)


# ----------------------------------------------------------------------------------------------
# combine
# ----------------------------------------------------------------------------------------------

@torch.library.custom_op("commlib::combine", mutates_args=())
def _combine_op(y: torch.Tensor, topk_weights: Optional[torch.Tensor], handle: list[torch.Tensor],
                buffer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    buffer = _buffer(buffer_id)
    h = _restore(buffer, handle, HANDLE_FIELDS, "combine")
    combined_x, combined_w, _ = combine_forward(buffer, y, h, topk_weights=topk_weights)
    if combined_w is None:
        combined_w = combined_x.new_empty(combined_x.shape[0], 0, dtype=torch.float32)
    res = _fresh([combined_x, combined_w], [y, topk_weights, *handle])
    return res[0], res[1]


@_combine_op.register_fake
def _(y, topk_weights, handle, buffer_id):
    T = handle[5].shape[0]
    K = topk_weights.shape[1] if topk_weights is not None else 0
    return y.new_empty(T, y.shape[1], dtype=torch.bfloat16), y.new_empty(T, K, dtype=torch.float32)


def _combine_setup(ctx, inputs, output):
    ctx.buffer_id = inputs[3]
    ctx.save_for_backward(*inputs[2])


def _combine_backward(ctx, grad_combined_x, _grad_weights):
    handle = list(ctx.saved_tensors)
    grad_y = torch.ops.commlib.dispatch_cached(grad_combined_x.to(torch.bfloat16).contiguous(), handle,
                                               ctx.buffer_id)
    return grad_y, None, [None] * len(handle), None


_combine_op.register_autograd(_combine_backward, setup_context=_combine_setup)


# ----------------------------------------------------------------------------------------------
# low-latency (decode) dispatch and combine: fixed shapes, no host sync, no autograd
# ----------------------------------------------------------------------------------------------

@torch.library.custom_op("commlib::low_latency_dispatch", mutates_args=())
def _ll_dispatch_op(x: torch.Tensor, topk_idx: torch.Tensor, buffer_id: int, num_max_dispatch_tokens_per_rank: int,
                    num_experts: int, use_fp8: bool, round_scale: bool, use_ue8m0: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    buffer = _buffer(buffer_id)
    recv_x, recv_count, handle, _, _ = buffer.low_latency_dispatch(
        x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8=use_fp8, round_scale=round_scale,
        use_ue8m0=use_ue8m0)
    data, scales = recv_x if use_fp8 else (recv_x, recv_x.new_empty(*recv_x.shape[:2], 0, dtype=torch.float32))
    kept = _keep(handle, _LL_FIELDS, _LL_DTYPES, x.device)
    res = _fresh([data, scales, recv_count.to(torch.int32)] + kept, [x, topk_idx])
    return res[0], res[1], res[2], res[3:]


def _ll_scales(x: torch.Tensor, L: int, RM: int, use_fp8: bool, use_ue8m0: bool) -> torch.Tensor:
    """The scales' fake: [L, R * M, S], column-major in its last two dims as the Buffer returns them."""
    if not use_fp8:
        return x.new_empty(L, RM, 0, dtype=torch.float32)
    S = x.shape[1] // (512 if use_ue8m0 else 128)
    return x.new_empty(L, S, RM, dtype=torch.int32 if use_ue8m0 else torch.float32).transpose(1, 2)


@_ll_dispatch_op.register_fake
def _(x, topk_idx, buffer_id, num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale, use_ue8m0):
    R = _buffer(buffer_id).num_ranks
    L, RM = num_experts // R, R * num_max_dispatch_tokens_per_rank
    dtype = torch.float8_e4m3fn if use_fp8 else torch.bfloat16
    return (x.new_empty(L, RM, x.shape[1], dtype=dtype), _ll_scales(x, L, RM, use_fp8, use_ue8m0),
            x.new_empty(L, dtype=torch.int32),
            [x.new_empty(1, dtype=torch.uint8), x.new_empty(L, RM, dtype=torch.int32),
             x.new_empty(L, R, dtype=torch.int64)])


@torch.library.custom_op("commlib::low_latency_combine", mutates_args=())
def _ll_combine_op(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: list[torch.Tensor],
                   buffer_id: int) -> torch.Tensor:
    buffer = _buffer(buffer_id)
    h = _restore(buffer, handle, _LL_FIELDS, "low-latency combine")
    combined, _, _ = buffer.low_latency_combine(x, topk_idx, topk_weights, h)
    return _fresh([combined], [x, topk_idx, topk_weights, *handle])[0]


@_ll_combine_op.register_fake
def _(x, topk_idx, topk_weights, handle, buffer_id):
    return x.new_empty(topk_idx.shape[0], x.shape[2], dtype=torch.bfloat16)


# ----------------------------------------------------------------------------------------------
# The Python API
# ----------------------------------------------------------------------------------------------

def dispatch(buffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, *,
             fp8: bool = False, num_worst_tokens: int = 0, expert_alignment: int = 1) -> Dispatched:
    """Differentiable dispatch as a custom op (traceable by torch.compile).

    Args:
        buffer: a registered commlib Buffer (``register_buffer``; done here when not tracing).
        x: [T, H] bf16; topk_idx: [T, K] int64 global expert ids (-1 empty); topk_weights: [T, K] float32.
        num_experts: E; fp8: move E4M3 + scales (H % 128 == 0), return bf16 rows;
        num_worst_tokens: > 0 pads the outputs to that many rows (no host sync); expert_alignment:
            per-expert counts rounded up to a multiple of it.
    Returns:
        Dispatched(recv_x [N, H] bf16, recv_topk_idx [N, K] int64, recv_topk_weights [N, K] float32,
        num_recv_tokens_per_expert [L] int64, handle); gradients flow from recv_x and
        recv_topk_weights to x and topk_weights.
    """
    _check_bf16("dispatch x", x, buffer)
    if not torch.compiler.is_compiling():
        register_buffer(buffer)
    recv_x, recv_topk_idx, recv_topk_weights, counts, handle = torch.ops.commlib.dispatch(
        x, topk_idx, topk_weights, buffer.buffer_id, num_experts, num_worst_tokens, expert_alignment, fp8)
    return Dispatched(recv_x, recv_topk_idx, recv_topk_weights, counts, Handle(*handle))


def dispatch_cached(buffer, x: torch.Tensor, handle: Handle) -> torch.Tensor:
    """Differentiable cached dispatch: x [T, H] bf16 along ``handle``'s routing -> recv_x [N, H] bf16
    (N from the handle: no host sync); backward: a combine."""
    _check_bf16("dispatch x", x, buffer)
    if not torch.compiler.is_compiling():
        register_buffer(buffer)
    return torch.ops.commlib.dispatch_cached(x, list(handle), buffer.buffer_id)


def combine(buffer, y: torch.Tensor, handle: Handle, topk_weights: Optional[torch.Tensor] = None):
    """Differentiable combine: y [N, H] bf16 -> (combined_x [T, H] bf16, combined_topk_weights [T, K]
    float32 or None). The gradient of combined_x flows to y (a cached dispatch); topk_weights
    [N, K] float32 are summed the same way, not differentiated."""
    _check_bf16("combine x", y, buffer)
    if not torch.compiler.is_compiling():
        register_buffer(buffer)
    combined_x, combined_w = torch.ops.commlib.combine(y.contiguous(), topk_weights, list(handle), buffer.buffer_id)
    return combined_x, (combined_w if topk_weights is not None else None)


def dispatch_handle(buffer, handle: Handle) -> DispatchHandle:
    """The DispatchHandle a ``Handle`` stands for, to pass to the Buffer's own methods (eager code)."""
    return _restore(buffer, list(handle), HANDLE_FIELDS, "dispatch_handle")


def low_latency_dispatch(buffer, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                         num_experts: int, *, use_fp8: bool = False, round_scale: bool = False,
                         use_ue8m0: bool = False):
    """Decode dispatch as a custom op (Buffer.low_latency_dispatch without hooks or stats).

    Args: x [T, H] bf16 (T <= M = num_max_dispatch_tokens_per_rank), topk_idx [T, K] int64; use_fp8,
        round_scale, use_ue8m0: as the Buffer's.
    Returns: (recv_x, recv_count [L] int32, LowLatencyHandle); recv_x [L, R * M, H] bf16, or with
        use_fp8 (E4M3 [L, R * M, H], scales [L, R * M, S] column-major in the last two dims: float32
        S = H / 128, or int32 S = H / 512 with use_ue8m0). Fixed shapes, no host read: CUDA-graph
        capturable where the Buffer's low-latency path is.
    """
    if not torch.compiler.is_compiling():
        register_buffer(buffer)
    data, scales, recv_count, handle = torch.ops.commlib.low_latency_dispatch(
        x, topk_idx, buffer.buffer_id, num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale, use_ue8m0)
    return (data, scales) if use_fp8 else data, recv_count, LowLatencyHandle(*handle)


def low_latency_combine(buffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                        handle: LowLatencyHandle) -> torch.Tensor:
    """Decode combine as a custom op: x [L, R * M, H] bf16 expert outputs -> [T, H] bf16, the top-k
    weighted sum (topk_idx [T, K] int64, topk_weights [T, K] float32 as given to the dispatch)."""
    if not torch.compiler.is_compiling():
        register_buffer(buffer)
    return torch.ops.commlib.low_latency_combine(x, topk_idx, topk_weights, list(handle), buffer.buffer_id)


@contextlib.contextmanager
def compile_config():
    """The dynamo settings a compiled MoE block needs: ``capture_scalar_outputs`` (the per-expert counts'
    ``.tolist()`` becomes unbacked sizes, not a graph break). Use around the first (tracing) call."""
    with torch._dynamo.config.patch(capture_scalar_outputs=True, capture_dynamic_output_shape_ops=True):
        yield
