"""Deferred weight gradients: a backward pass split into its input-gradient part (needed by the next
step of the chain) and its weight-gradient part (needed only by the optimizer), DualPipe's B / W
split. While ``deferring(queue)`` is active, ops that support it (commlib.training.moe.experts' grouped expert
GEMMs) put ``(parameter, compute)`` into ``queue`` instead of returning the parameter's gradient
to autograd; ``run(queue)`` later computes each and accumulates it into ``parameter.grad`` the way
autograd's AccumulateGrad does (set when None, else add in place).

Only leaf parameters are deferred (a view's gradient must flow back through autograd), and only
while a queue is active; otherwise ``defer`` returns False and the op returns the gradient itself.
The active queue is process-wide, not per thread: autograd runs the backward of CUDA ops on its own
per-device threads, while the caller's thread waits in ``torch.autograd.backward`` (a thread-local
queue was invisible there: nothing was deferred on the GPU). So one thread at a time may defer.
commlib.training.pipeline uses this in its overlapped schedules (``defer_weight_grads``).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch

_queue: Optional[list] = None   # the active queue (process-wide, see above)


@contextlib.contextmanager
def deferring(queue: Optional[list]):
    """Within the block, deferrable weight gradients go to ``queue`` (None: nothing is deferred)."""
    global _queue
    previous, _queue = _queue, queue
    try:
        yield queue
    finally:
        _queue = previous


CHAIN, NEXT = "chain", "next"   # where a schedule runs a deferred gradient (commlib.training.pipeline)


def defer(param: torch.Tensor, compute: Callable[[], torch.Tensor], where: str = CHAIN) -> bool:
    """Queue ``compute`` (-> the gradient of ``param``) if a queue is active and ``param`` is a leaf
    that requires grad; True if queued (the caller then returns None for it to autograd).
    ``where`` is a hint for the schedule: CHAIN = after the chain's next backward compute step (the
    expert GEMMs: the step after the expert backward is the light attention side), NEXT = after the
    next compute step of either micro-batch (the attention projections: the next step is the other
    micro-batch's forward attention, the light side of its pair)."""
    queue = _queue
    if queue is None or not param.is_leaf or not param.requires_grad:
        return False
    queue.append((param, compute, where))
    return True


def grad_or_defer(param: torch.Tensor, compute: Callable[[], torch.Tensor], where: str = CHAIN):
    """For a backward returning ``param``'s gradient: None once ``compute`` is queued (``defer``),
    else ``compute()`` now."""
    return None if defer(param, compute, where) else compute()


def split(queue: list) -> tuple:
    """(CHAIN entries, NEXT entries) of a queue, each in order."""
    return [e for e in queue if e[2] != NEXT], [e for e in queue if e[2] == NEXT]


def run(queue: list) -> int:
    """Compute every queued weight gradient in order, accumulate it, empty the queue; returns how
    many ran. Accumulation as AccumulateGrad: ``grad = g`` when None, else ``grad += g``."""
    n = len(queue)
    with torch.no_grad():
        for param, compute, _ in queue:
            g = compute()
            if param.grad is None:
                param.grad = g.detach()
            else:
                param.grad.add_(g)
    queue.clear()
    return n
