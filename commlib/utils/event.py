"""EventOverlap: the event a communication call leaves behind, so compute can overlap with it.

Usage (as with DeepEP):
    recv_x, ..., handle, event = buffer.dispatch(x, ..., async_finish=True)
    ...independent compute on the current stream...
    event.current_stream_wait()          # or: with event: ...
On CPU there is no stream and the event is None: waiting is a no-op (calls are synchronous).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch


class EventOverlap:
    def __init__(self, event: Optional["torch.cuda.Event"] = None,
                 extra_tensors: Optional[Sequence[torch.Tensor]] = None) -> None:
        self.event = event
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

