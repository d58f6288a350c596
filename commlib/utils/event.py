"""EventOverlap: the event a communication call leaves behind, so compute can overlap with it.

Usage (as with DeepEP):
    recv_x, ..., handle, event = buffer.dispatch(x, ..., async_finish=True)
    ...independent compute on the current stream...
    event.current_stream_wait()          # or: with event: ...
On CPU there is no stream and the event is None: waiting is a no-op (calls are synchronous).

EventHandle is DeepEP's C++ event type written in Python: a CUDA event recorded on the current
stream when it is built (nothing on a machine without CUDA), so ``EventOverlap(EventHandle())``
marks "now" on the current stream, as Megatron and DeepEP's own tests write it.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch


class EventHandle:
    """A CUDA event recorded on the current stream at construction (``event`` is None without CUDA)."""

    def __init__(self) -> None:
        self.event: Optional["torch.cuda.Event"] = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream())

    def current_stream_wait(self) -> None:
        """Make the current stream wait for the point this handle marks."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __repr__(self) -> str:
        return f"EventHandle(event={'set' if self.event is not None else None})"


def cuda_event(event) -> Optional["torch.cuda.Event"]:
    """The torch.cuda.Event inside ``event`` (a torch.cuda.Event, an EventHandle or None)."""
    if isinstance(event, EventHandle):
        return event.event
    return event


class EventOverlap:
    def __init__(self, event: Union["torch.cuda.Event", EventHandle, None] = None,
                 extra_tensors: Optional[Sequence[torch.Tensor]] = None) -> None:
        self.event = cuda_event(event)
        # Keeps tensors alive until the event is waited on (they are used by the comm stream).
        self.extra_tensors = tuple(extra_tensors) if extra_tensors else None

    def current_stream_wait(self) -> None:
        """Make the current stream wait for the communication this event marks."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.current_stream_wait()

    def __repr__(self) -> str:
        return f"EventOverlap(event={'set' if self.event is not None else None})"
