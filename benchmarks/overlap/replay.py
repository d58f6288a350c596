"""ReplayComm: a Buffer stand-in that replays recorded transfers, for the compute-dense reference."""
from __future__ import annotations

import collections
import math

import torch

from commlib.backends.base import PendingCombine
from commlib.utils.event import EventOverlap

_ROW_DTYPES = (torch.bfloat16, torch.float16) + tuple(
    getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
_Rows = collections.namedtuple("_Rows", "shape dtype device")  # a recorded row tensor, kept as its shape


class ReplayComm:
    """A Buffer stand-in for the compute-dense reference (``compute_dense_ms``).

    In ``record`` mode every call (get_dispatch_layout, dispatch, combine) goes to the real Buffer,
    and the stand-in keeps what the compute needs of its outputs: index and weight tensors, counts,
    handles; the rows (bf16 / fp16 / fp8 tensors) only as shape and dtype. In ``replay`` mode each
    call returns the next recorded outputs (``rewind()`` before each run) with the rows made anew on
    the comm stream, and moves nothing. A schedule replayed this way runs the same kernels on the
    compute stream with nothing to wait for: the time the compute alone takes when it runs densely,
    at whatever clock the power cap then allows. The rows are copies of random normal values (one
    source tensor per dtype), not zeros: a GEMM on zeros toggles fewer bits and draws
    less power, so under the cap it may run at a higher clock than on activations (docs/training.md)."""

    def __init__(self, buffer) -> None:
        self._buffer = buffer
        self._log: list = []
        self._pos = 0
        self.mode = "record"
        self._sources: dict = {}  # (shape, dtype, device) -> random rows the replayed rows copy

    def __getattr__(self, name):  # everything else (comm_stream, rank, num_sms, ...) is the real Buffer's
        return getattr(self._buffer, name)

    def rewind(self) -> None:
        self._pos = 0

    def record(self) -> None:
        """Forget the recorded calls; the next calls pass through and are recorded anew."""
        self._log, self._pos, self.mode = [], 0, "record"
        self._sources = {}

    @staticmethod
    def _template(obj):
        if isinstance(obj, torch.Tensor) and obj.dtype in _ROW_DTYPES:
            return _Rows(tuple(obj.shape), obj.dtype, obj.device)
        if isinstance(obj, tuple):
            return tuple(ReplayComm._template(o) for o in obj)
        return obj

    def _source(self, tmpl: _Rows) -> torch.Tensor:
        """Random normal values of the template's shape: a view of one flat tensor per dtype and
        device (grown to the largest rows asked for)."""
        numel = math.prod(tmpl.shape)
        key = (tmpl.dtype, tmpl.device)
        src = self._sources.get(key)
        if src is None or src.numel() < numel:
            g = torch.Generator(device=tmpl.device).manual_seed(numel)
            src = torch.randn(numel, generator=g, device=tmpl.device, dtype=torch.float32).to(tmpl.dtype)
            self._sources[key] = src
        return src[:numel].view(tmpl.shape)

    def _build(self, tmpl, made: list):
        if isinstance(tmpl, _Rows):
            t = self._source(tmpl).clone()
            made.append(t)
            return t
        if isinstance(tmpl, tuple):
            return tuple(self._build(o, made) for o in tmpl)
        return tmpl

    def _call(self, kind: str, event_index: int, real, previous_event, async_finish: bool):
        if self.mode == "record":
            out = real()
            tmpl = list(out)
            tmpl[event_index] = None
            self._log.append((kind, tuple(self._template(o) for o in tmpl)))
            return out
        if self._pos >= len(self._log) or self._log[self._pos][0] != kind:
            raise RuntimeError(f"ReplayComm: call {self._pos} is a {kind}, the recorded run "
                               f"{'had no more calls' if self._pos >= len(self._log) else 'made a ' + self._log[self._pos][0]}")
        tmpl = self._log[self._pos][1]
        self._pos += 1
        comm = getattr(self._buffer, "comm_stream", None)
        made: list = []
        if comm is None:  # CPU: no streams
            out = list(self._build(tmpl, made))
            out[event_index] = EventOverlap(None)
            return tuple(out)
        cur = torch.cuda.current_stream()
        if previous_event is not None and previous_event.event is not None:
            comm.wait_event(previous_event.event)
        else:
            comm.wait_stream(cur)
        with torch.cuda.stream(comm):
            out = list(self._build(tmpl, made))
            event = torch.cuda.Event()
            event.record(comm)
        for t in made:
            t.record_stream(cur)
        if not async_finish:
            cur.wait_event(event)
        out[event_index] = EventOverlap(event)
        return tuple(out)

    def prepack(self, *args, **kw):
        """None: the recorded and the replayed runs make the same calls (layout, dispatch), and the
        replay leaves out the packing (transfer work on the compute stream)."""
        return None

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False, **kw):
        return self._call("layout", 4, lambda: self._buffer.get_dispatch_layout(
            topk_idx, num_experts, previous_event=previous_event, async_finish=async_finish, **kw),
            previous_event, async_finish)

    def dispatch(self, x, *args, previous_event=None, async_finish=False, **kw):
        return self._call("dispatch", 5, lambda: self._buffer.dispatch(
            x, *args, previous_event=previous_event, async_finish=async_finish, **kw), previous_event, async_finish)

    def combine(self, x, handle, *args, previous_event=None, async_finish=False, finish_later=False, **kw):
        """finish_later: the recorded run sums on the comm stream; both hand a finished PendingCombine."""
        out = self._call("combine", 2, lambda: self._buffer.combine(
            x, handle, *args, previous_event=previous_event, async_finish=async_finish, **kw),
            previous_event, async_finish)
        if finish_later:
            return PendingCombine(result=(out[0], out[1])), None, out[2]
        return out
