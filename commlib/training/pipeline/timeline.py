"""Timeline: the span of every pipeline step on its stream, for benchmarks and plots."""
from __future__ import annotations

import time
from typing import Optional

import torch

from commlib.utils.event import EventOverlap


class Timeline:
    """Records (label, stream, start, end) of every step. CUDA: timing events on the stream the
    step runs on, read after a sync (``spans()``); CPU: wall-clock times (all sequential there)."""

    def __init__(self) -> None:
        self._raw: list = []

    def begin(self, label: str, stream_kind: str, cuda_stream=None, wait_event: Optional[EventOverlap] = None):
        if cuda_stream is None:
            return (label, stream_kind, time.perf_counter(), None)
        if stream_kind == "comm":
            # The comm stream waits where the Buffer will make it wait, so that "start" is when
            # the step can really begin, not when the host issued it.
            if wait_event is not None and wait_event.event is not None:
                cuda_stream.wait_event(wait_event.event)
            else:
                cuda_stream.wait_stream(torch.cuda.current_stream())
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(cuda_stream)
        return (label, stream_kind, ev, cuda_stream)

    def end(self, token) -> None:
        label, kind, start, cuda_stream = token
        if cuda_stream is None:
            self._raw.append((label, kind, start, time.perf_counter()))
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record(cuda_stream)  # after the step's kernels on that stream
        self._raw.append((label, kind, start, end))

    def spans(self) -> list[dict]:
        """[{label, stream, start_ms, end_ms}], times relative to the earliest start (syncs the device)."""
        if not self._raw:
            return []
        if isinstance(self._raw[0][2], torch.cuda.Event):
            torch.cuda.synchronize()
            t0 = self._raw[0][2]
            out = [{"label": l, "stream": k, "start_ms": t0.elapsed_time(s), "end_ms": t0.elapsed_time(e)}
                   for l, k, s, e in self._raw]
        else:
            t0 = self._raw[0][2]
            out = [{"label": l, "stream": k, "start_ms": (s - t0) * 1e3, "end_ms": (e - t0) * 1e3}
                   for l, k, s, e in self._raw]
        base = min(o["start_ms"] for o in out)
        for o in out:
            o["start_ms"] -= base
            o["end_ms"] -= base
        return out
