"""Instrumentation of a backend's calls, off the hot path: the null ``Probe`` (the default in every
BackendContext) does nothing; benchmarks and experiments pass a ``RecordingProbe``.

A backend reports to ``ctx.probe``: ``mark(step)`` at the end of each step of a call, ``read(t)``
for its device -> host reads (the probe makes the copy, so it can time it), ``op(kind, n)`` for the
device operations it issues that torch's dispatcher does not see (kernel launches through CuPy,
a collective's stream wait), and ``call(name)`` around a whole call (a context manager: a recording probe counts
torch's device operations inside it). Its collectives go through the probe too: ``collective(fn, *args,
**kwargs)`` issues one (a torch.distributed function, async_op=True) and ``wait(work)`` waits for it, so a
recording probe with ``timing`` can time each (the engine's own host time is a call's less theirs) and
keep what it needs to issue the same collective again, bare.

Legend: a "device operation" is one of OP_KINDS: a launch (kernel or torch compute op), a copy,
an allocation, an event op (record / wait), a collective.
"""
from __future__ import annotations

import contextlib
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from commlib.utils.timing import thread_usage

OP_KINDS = ("launches", "copies", "allocations", "event_ops", "collectives")
_NULL_CONTEXT = contextlib.nullcontext()


class Probe:
    """The null probe: every report is free and ignored; ``read`` is a plain synchronous copy. A
    backend may skip its reports (``call``, ``mark``, ``op``, ``collective``, ``wait``) to a probe whose
    ``recording`` is False, so a probe that wants them sets it; ``read`` is always called."""

    recording = False

    def call(self, name: str):
        return _NULL_CONTEXT

    def mark(self, step: str) -> None:
        pass

    def read(self, t: torch.Tensor) -> torch.Tensor:
        return t.cpu()

    def op(self, kind: str, n: int = 1) -> None:
        pass

    def collective(self, fn, *args, **kwargs):
        return fn(*args, **kwargs)

    def wait(self, work) -> None:
        work.wait()


NULL_PROBE = Probe()

_FACTORIES = {"empty", "empty_strided", "zeros", "ones", "full", "arange", "scalar_tensor", "new_empty",
              "new_zeros", "new_full", "new_empty_strided", "empty_like", "zeros_like", "ones_like",
              "full_like", "lift_fresh", "lift_fresh_copy", "randperm"}
_COPIES = {"copy_", "_to_copy", "clone", "_local_scalar_dense", "index_copy_", "index_copy", "index_select",
           "_pin_memory", "contiguous", "cat", "stack"}
# aten ops that make no device work: views and metadata
_FREE = {"detach", "alias", "lift_fresh", "_unsafe_view", "sym_size", "sym_stride", "sym_numel", "dim",
         "is_pinned", "item", "set_", "resize_"}


def op_kind(func) -> str | None:
    """The OP_KINDS entry one aten op counts as, or None for a view / metadata op."""
    if func.namespace == "c10d":   # torch.distributed's collectives (the work's wait is not an op)
        return "collectives"
    name = func.overloadpacket.__name__
    if name in _FREE or getattr(func, "is_view", False):
        return None
    if name in _FACTORIES:
        return "allocations"
    if name in _COPIES:
        return "copies"
    return "launches"


class _Counter(TorchDispatchMode):
    def __init__(self, counts: dict) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = op_kind(func)
        if kind is not None:
            self.counts[kind] += 1
        return func(*args, **(kwargs or {}))


class Collective:
    """One collective a recording probe saw: ``fn(*args, **kwargs)`` (what issues it again, bare), the
    seconds its issue and its wait took, ``nbytes`` (its output tensor's bytes) and the CUDA stream
    it was issued on (None on CPU)."""

    __slots__ = ("fn", "args", "kwargs", "issue_s", "wait_s", "stream")

    def __init__(self, fn, args, kwargs, issue_s: float, stream) -> None:
        self.fn, self.args, self.kwargs, self.issue_s, self.wait_s, self.stream = fn, args, kwargs, issue_s, 0.0, stream

    @property
    def name(self) -> str:
        return getattr(self.fn, "__name__", str(self.fn))

    @property
    def nbytes(self) -> int:
        t = self.args[0] if self.args else None
        return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

    @property
    def seconds(self) -> float:
        return self.issue_s + self.wait_s


def _current_stream(args):
    t = args[0] if args else None
    if isinstance(t, torch.Tensor) and t.is_cuda:
        return torch.cuda.current_stream(t.device)
    return None


class RecordingProbe(Probe):
    """Records what a backend reports: ``marks`` [(step, perf_counter, read_s, thread_usage(),
    read_usage)] while ``tracing``, ``reads`` and ``read_s`` (the host reads and the seconds blocked
    in them), ``read_usage`` (the calling thread's (CPU s, voluntary, involuntary switches) inside
    them), and with ``count_ops`` the device operations per call: ``calls`` [(name, {kind: n})],
    torch's ops (seen by a dispatch mode) plus the backend's own reports. ``copy``: how a read
    brings a tensor to the host (default ``Tensor.cpu``; experiments try other waits). With ``timing``:
    ``collectives`` [Collective] in issue order, ``calls_s`` [(name, seconds)] of the outermost calls,
    and ``collective_s``, the seconds spent issuing and waiting for collectives so far."""

    recording = True

    def __init__(self, count_ops: bool = False, tracing: bool = False, copy=None, timing: bool = False) -> None:
        self.copy = copy or torch.Tensor.cpu
        self.count_ops = count_ops
        self.tracing = tracing
        self.timing = timing
        self.collectives: list = []
        self.collective_s = 0.0
        self.calls_s: list = []
        self._pending: dict = {}
        self._depth = 0
        self.marks: list = []
        self.reads = 0
        self.read_s = 0.0
        self.read_usage = (0.0, 0, 0)
        self.calls: list = []
        self._counts = None

    @contextlib.contextmanager
    def call(self, name: str):
        t0 = time.perf_counter()
        self._depth += 1
        try:
            if not self.count_ops or self._counts is not None:   # nested calls count in the outer one
                yield
                return
            self._counts = dict.fromkeys(OP_KINDS, 0)
            try:
                with _Counter(self._counts):
                    yield
            finally:
                self.calls.append((name, self._counts))
                self._counts = None
        finally:
            self._depth -= 1
            if self.timing and not self._depth:
                self.calls_s.append((name, time.perf_counter() - t0))

    def collective(self, fn, *args, **kwargs):
        if not self.timing:
            return fn(*args, **kwargs)
        t0 = time.perf_counter()
        work = fn(*args, **kwargs)
        seconds = time.perf_counter() - t0
        self.collective_s += seconds
        entry = Collective(fn, args, kwargs, seconds, _current_stream(args))
        self.collectives.append(entry)
        if work is not None:
            self._pending[id(work)] = entry
        return work

    def wait(self, work) -> None:
        if not self.timing:
            work.wait()
            return
        t0 = time.perf_counter()
        work.wait()
        seconds = time.perf_counter() - t0
        self.collective_s += seconds
        entry = self._pending.pop(id(work), None)
        if entry is not None:
            entry.wait_s += seconds

    def mark(self, step: str) -> None:
        if self.tracing:
            self.marks.append((step, time.perf_counter(), self.read_s, thread_usage(), self.read_usage))

    def read(self, t: torch.Tensor) -> torch.Tensor:
        self.reads += 1
        u0 = thread_usage()
        t0 = time.perf_counter()
        out = self.copy(t)   # counted by the dispatch mode
        self.read_s += time.perf_counter() - t0
        self.read_usage = tuple(a + b - c for a, b, c in zip(self.read_usage, thread_usage(), u0))
        return out

    def op(self, kind: str, n: int = 1) -> None:
        if self._counts is not None:
            self._counts[kind] += n

    def take_collectives(self) -> list:
        """The collectives recorded since the last take (every one waited for: call it between calls)."""
        out, self.collectives = self.collectives, []
        self._pending.clear()
        return out

    def last_ops(self) -> dict:
        """{kind: n} of the last counted call, plus "total"."""
        counts = dict(self.calls[-1][1])
        counts["total"] = sum(counts.values())
        return counts


__all__ = ["Probe", "NULL_PROBE", "RecordingProbe", "Collective", "OP_KINDS", "op_kind"]
