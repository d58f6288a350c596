"""Deferred weight gradients: a backward pass split into its input-gradient part (needed by the next
step of the chain) and its weight-gradient part (needed only by the optimizer), DualPipe's B / W
split. While ``deferring(queue)`` is active, ops that support it (commlib.moe's grouped expert
GEMMs) put ``(parameter, compute)`` into ``queue`` instead of returning the parameter's gradient
to autograd; ``run(queue)`` later computes each and accumulates it into ``parameter.grad`` the way
autograd's AccumulateGrad does (set when None, else add in place).

Only leaf parameters are deferred (a view's gradient must flow back through autograd), and only
while a queue is active on this thread; otherwise ``defer`` returns False and the op returns the
gradient itself. commlib.pipeline uses this in its overlapped schedules (``defer_weight_grads``).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Optional

import torch

_local = threading.local()


@contextlib.contextmanager
def deferring(queue: Optional[list]):
    """Within the block, deferrable weight gradients go to ``queue`` (None: nothing is deferred)."""
    previous = getattr(_local, "queue", None)
    _local.queue = queue
    try:
        yield queue
    finally:
        _local.queue = previous


def defer(param: torch.Tensor, compute: Callable[[], torch.Tensor]) -> bool:
    """Queue ``compute`` (-> the gradient of ``param``) if a queue is active and ``param`` is a leaf
    that requires grad; True if queued (the caller then returns None for it to autograd)."""
    queue = getattr(_local, "queue", None)
    if queue is None or not param.is_leaf or not param.requires_grad:
        return False
    queue.append((param, compute))
    return True


def run(queue: list) -> int:
    """Compute every queued weight gradient in order, accumulate it, empty the queue; returns how
    many ran. Accumulation as AccumulateGrad: ``grad = g`` when None, else ``grad += g``."""
    n = len(queue)
    with torch.no_grad():
        for param, compute in queue:
            g = compute()
            if param.grad is None:
                param.grad = g.detach()
            else:
                param.grad.add_(g)
    queue.clear()
    return n
