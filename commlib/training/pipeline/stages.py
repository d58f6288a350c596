"""The stages of a staged module: compute (any differentiable torch code) and communication
(dispatch, combine) with hand-written backwards, each passing a carry of named tensors on.

Legend: T tokens on this rank, H hidden, K top-k, N rows this rank received, L local experts.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from commlib.fp8 import per_token_cast_back, per_token_cast_to_fp8
from commlib.training import autograd as ops

Carry = dict   # key -> tensor (or handle): what one stage hands the next


@dataclasses.dataclass
class ComputeStage:
    """Differentiable torch code: fn(carry) -> new carry (keep keys it does not touch).

    ``light``: the stage's compute (forward and backward) is negligible beside a comm step (a residual
    add, a norm). The overlapped schedules issue a light step as soon as its turn comes instead of
    pairing it with a comm step of the other micro-batch, so that comm step can pair with real work.
    """
    name: str
    fn: Callable[[Carry], Carry]
    kind: str = "compute"
    light: bool = False


class CommStage:
    """Communication with a hand-written backward. Subclasses set consumes / produces.

    The schedule calls, in order (forward; backward likewise with grads):
      prepare_forward(inputs)  on the compute stream, at the end of the producing compute step,
                               before the event the communication waits for (casts, FP8 quantize)
      forward(inputs, previous_event, async_finish) -> (produced, saved, event)
                               communication only: no work on the compute stream
      finalize_forward(produced) on the compute stream, after waiting for the event (dequantize,
                               the rest of a combine taken with finish_later)
    and in the backward prepare_backward, backward, finalize_backward likewise.
    """
    kind = "comm"
    name = "comm"
    consumes: tuple = ()
    produces: tuple = ()

    def prepare_forward(self, inputs: dict) -> dict:
        return inputs

    def forward(self, inputs: dict, previous_event, async_finish: bool):
        raise NotImplementedError

    def finalize_forward(self, produced: dict) -> dict:
        return produced

    def prepare_backward(self, saved, grads: dict) -> dict:
        """grads: {produced key: grad or None} -> what backward takes."""
        return grads

    def finalize_backward(self, grads: dict) -> dict:
        """What backward returned -> the grads of consumed keys (on the compute stream, after the event)."""
        return grads

    def backward(self, saved, grads: dict, previous_event, async_finish: bool):
        """-> (grads of consumed keys: dict, event)."""
        raise NotImplementedError

    def comm_stream(self):
        return None

    def blocks_host(self, backward: bool) -> bool:
        """Whether the call waits on the host for the device (e.g. a receive count). The schedule
        issues such a step after its paired compute step, every other comm step before it."""
        return False

    def comm_sms(self) -> int:
        """SMs one call of this stage occupies (0: none or unknown); the overlapped schedules keep
        GEMMs off that many SMs (``sm_carveout``)."""
        return 0


def _prepack(buffer, x, **kw):
    """Buffer.prepack on the compute stream, right after the step that made x (the dispatch's row
    packing runs there on every SM instead of beside the other micro-batch's compute); None for a
    buffer without it (the replay stand-ins of the benchmarks, other backends)."""
    fn = getattr(buffer, "prepack", None)
    return fn(x, **kw) if fn is not None else None


def _buffer_call_sms(buffer, config) -> int:
    """SMs of a Buffer call made with ``config``: its num_sms, else the most the Buffer may choose
    itself (Buffer.num_sms or a tuned config's)."""
    if config is not None:
        return int(config.num_sms)
    tuned = [c.num_sms for c in getattr(buffer, "_tuned", {}).values() if c is not None]
    return int(max([getattr(type(buffer), "num_sms", 0) or 0] + tuned))


class DispatchStage(CommStage):
    """Dispatch as a stage: the carry's rows go to the ranks of their experts.

    Consumes: x_wire [T, H] bf16, topk_idx [T, K] int64 (global expert ids, -1 = none),
    topk_weights [T, K] float32.
    Produces: recv_x [N, H] bf16, recv_topk_idx [N, K] int64 (local expert ids, -1 = not here),
    recv_topk_weights [N, K] float32, counts (list of L ints: rows per local expert), handle (for
    the combine and the backward).

    Args:
      buffer: a commlib Buffer (or a stand-in with dispatch / combine / comm_stream).
      num_experts: E, the global expert count.
      name: the stage's name in step labels and timelines.
      config: the Buffer Config of every call (forward and backward); None: the Buffer's choice.
      fp8: x_wire is quantized to E4M3 + scales before the move and recv_x dequantized to bf16
        after; the backward moves bf16 gradients (straight-through, as
        commlib.training.autograd.dispatch(fp8=True)).
    """
    consumes = ("x_wire", "topk_idx", "topk_weights")
    produces = ("recv_x", "recv_topk_idx", "recv_topk_weights", "counts", "handle")

    def __init__(self, buffer, num_experts: int, name: str = "dispatch", config=None, fp8: bool = False) -> None:
        self.buffer, self.num_experts, self.name, self.config, self.fp8 = buffer, num_experts, name, config, fp8

    def comm_stream(self):
        return getattr(self.buffer, "comm_stream", None)

    def comm_sms(self) -> int:
        return _buffer_call_sms(self.buffer, self.config)

    def blocks_host(self, backward: bool) -> bool:
        # The forward is a non-cached dispatch: the host reads the receive count (count exchange),
        # so it waits until the comm stream has run everything queued before it plus the notify.
        # The backward is a combine of the gradients: no host wait.
        return not backward

    def prepare_forward(self, inputs):
        if self.fp8:
            inputs = dict(inputs, x_wire=per_token_cast_to_fp8(inputs["x_wire"]))
        return dict(inputs, prepacked=_prepack(self.buffer, inputs["x_wire"], topk_idx=inputs["topk_idx"],
                                               topk_weights=inputs["topk_weights"], num_experts=self.num_experts))

    def forward(self, inputs, previous_event, async_finish):
        out = ops.dispatch_forward(self.buffer, inputs["x_wire"], inputs["topk_idx"], inputs["topk_weights"],
                                   self.num_experts, config=self.config, previous_event=previous_event,
                                   async_finish=async_finish, prepacked=inputs.get("prepacked"))
        produced = {"recv_x": out.recv_x, "recv_topk_idx": out.recv_topk_idx,
                    "recv_topk_weights": out.recv_topk_weights, "counts": out.num_recv_tokens_per_expert_list,
                    "handle": out.handle}
        data = out.recv_x[0] if isinstance(out.recv_x, tuple) else out.recv_x
        saved = (out.handle, out.recv_topk_idx, data.shape, data.device)
        return produced, saved, out.event

    def finalize_backward(self, grads):
        if "x_wire" not in grads:
            return grads
        grad_x, grad_w = ops.finish(grads["x_wire"])
        return {k: v for k, v in (("x_wire", grad_x), ("topk_weights", grad_w)) if v is not None}

    def finalize_forward(self, produced):
        if isinstance(produced["recv_x"], tuple):
            produced = dict(produced, recv_x=per_token_cast_back(*produced["recv_x"], torch.bfloat16))
        return produced

    def prepare_backward(self, saved, grads):
        _, recv_topk_idx, shape, device = saved
        g_x = grads.get("recv_x")
        if g_x is None:
            g_x = torch.zeros(shape, dtype=torch.bfloat16, device=device)
        g_w = grads.get("recv_topk_weights")
        if g_w is None:
            g_w = torch.zeros(recv_topk_idx.shape, dtype=torch.float32, device=device)
        g_x, g_w = ops.prepare_dispatch_grads(g_x, g_w, recv_topk_idx)
        return {"recv_x": g_x, "recv_topk_weights": g_w}

    def backward(self, saved, grads, previous_event, async_finish):
        handle, recv_topk_idx = saved[0], saved[1]
        pending, _, event = ops.dispatch_backward(self.buffer, handle, grads["recv_x"], grads["recv_topk_weights"],
                                                  recv_topk_idx, config=self.config, prepared=True,
                                                  previous_event=previous_event, async_finish=async_finish,
                                                  finish_later=True)
        return {"x_wire": pending}, event  # finalize_backward: (grad of x_wire, grad of topk_weights)


class CombineStage(CommStage):
    """Combine as a stage: expert outputs go back to their tokens' ranks, weighted sums per token.

    Consumes: y [N, H] bf16 (the rows of a dispatch, each row's weighted expert output), handle
    (that dispatch's). Produces: combined [T, H] bf16 (summed in float32).

    Args:
      buffer: a commlib Buffer (or a stand-in with dispatch / combine / comm_stream).
      name: the stage's name in step labels and timelines.
      config: the Buffer Config of every call (forward and backward); None: the Buffer's choice.
    """
    consumes = ("y", "handle")
    produces = ("combined",)

    def __init__(self, buffer, name: str = "combine", config=None) -> None:
        self.buffer, self.name, self.config = buffer, name, config

    def comm_stream(self):
        return getattr(self.buffer, "comm_stream", None)

    def comm_sms(self) -> int:
        return _buffer_call_sms(self.buffer, self.config)

    def prepare_forward(self, inputs):
        return dict(inputs, y=inputs["y"].contiguous())

    def finalize_forward(self, produced):
        return dict(produced, combined=ops.finish(produced["combined"])[0])

    def forward(self, inputs, previous_event, async_finish):
        combined, _, event = ops.combine_forward(self.buffer, inputs["y"], inputs["handle"], config=self.config,
                                                 previous_event=previous_event, async_finish=async_finish,
                                                 finish_later=True)  # finalize_forward sums, where a backend can wait
        handle = inputs["handle"]
        return {"combined": combined}, (handle, (handle.num_tokens, inputs["y"].shape[1]), inputs["y"].device), event

    def prepare_backward(self, saved, grads):
        _, shape, device = saved
        g = grads.get("combined")
        if g is None:
            g = torch.zeros(shape, dtype=torch.bfloat16, device=device)
        g = g.to(torch.bfloat16).contiguous()
        return {"combined": g, "prepacked": _prepack(self.buffer, g, handle=saved[0])}

    def backward(self, saved, grads, previous_event, async_finish):
        grad_y, event = ops.combine_backward(self.buffer, saved[0], grads["combined"], config=self.config,
                                             previous_event=previous_event, async_finish=async_finish,
                                             prepacked=grads.get("prepacked"))
        return {"y": grad_y}, event

