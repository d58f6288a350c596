"""The dual pipeline: two micro-batches through a MoE model, one communicating while the other
computes (DeepSeek-V3's two-micro-batch overlap), forward, backward, both in one call
(``dual_forward_backward``), and forward-with-backward (DualPipe's ``overlapped_forward_backward``
hook).

How it works
------------
A ``StagedModule`` describes its forward as a chain of stages that alternate between compute
(attention, router, experts, ... any differentiable torch code) and communication (dispatch,
combine). The chain passes a *carry*, a dict of named tensors (and handles), from stage to stage.

Running a chain records, per compute stage, its inputs as fresh autograd leaves and its outputs,
so its backward can run on its own: ``torch.autograd.backward(outputs, grads)`` then read the
leaves' ``.grad``. Communication stages have hand-written backwards (dispatch -> combine of the
gradients, combine -> cached dispatch; commlib.training.autograd). A chain is thus a list of forward steps
and, later, a list of backward steps, each step one stage, and two such lists can be interleaved.

The schedule (``_interleave``) zips two step lists: whenever one list's next step is compute and
the other's is communication, both are issued together. Compute kernels go to the current
(compute) stream; communication goes to the Buffer's comm stream, ordered *only* through events:
a comm step passes ``previous_event`` = the event recorded right after the stage that produced its
input, with ``async_finish=True``; the next compute stage of that micro-batch calls
``event.current_stream_wait()`` before it starts. When both lists' next steps are of the same kind,
one runs alone; after that the lists stay out of phase, so in steady state every comm step is
paired with a compute step.

Issue-order rule (which of a pair the host issues first): the host issues in program order, and a
compute step costs it a long time (an autograd backward launches dozens of kernels; the model's
stages are partly host-bound), so a comm step issued after its partner reaches the comm stream
late, and the comm stream idles although its input was ready long before. Hence: **the comm step
first**, since its inputs were produced by the micro-batch's previous step and it only enqueues
work on the comm stream. The one exception is a step that waits on the host: a non-cached
dispatch reads its receive count (count exchange), so the host blocks until the comm stream has
run everything queued before it; that step goes **second**, so the compute stream has the other
micro-batch's work queued while the host waits (``CommStage.blocks_host``). Combine, the cached
dispatch of combine's backward (receive count from the handle) and the combine of dispatch's
backward never wait. ``issue_order="comm_first"`` / ``"compute_first"`` force one order (for
measurements). The order changes neither the pairs nor the sequence of comm steps, so every rank
runs the same collectives in the same order. Backward runs stage by stage: each compute stage's
backward is its own ``torch.autograd.backward(stage outputs, explicit grads)``, so comm steps of
the other micro-batch are issued between those pieces.

  forward+backward (``overlapped_forward_backward``, F = micro-batch 0 forward, B = micro-batch 1
  backward), per MoE block, in host issue order (comm steps marked *)::

      B.finish | *B.combine' F.attn | B.experts' *F.dispatch | *B.dispatch' F.experts | *F.combine B.attn

      compute stream: B.finish | F.attn       | B.experts    | F.experts     | B.attn
      comm stream:             | B.combine'   | F.dispatch   | B.dispatch'   | F.combine
      (' = backward: combine' is a cached dispatch of grads, dispatch' a combine of grads)

  two forwards (``dual_forward``) or two backwards (``dual_backward``)::

      compute stream: 0.attn | 1.attn     | 0.experts  | 1.experts  | 0.finish ...
      comm stream:           | 0.dispatch | 1.dispatch | 0.combine  | 1.combine

While an overlapped schedule runs, torch's GEMMs keep off the comm SMs (``sm_carveout``; default
"auto" = the comm stages' SMs), and the backward defers weight gradients (``defer_weight_grads``,
commlib.training.wgrad: DualPipe's B / W split): the expert GEMMs' to after the chain's next backward compute
step, the attention projections' to after the next compute step of either micro-batch, so the step
that feeds the next all-to-all is shorter. The sequential baseline does neither.

On CPU events are None and every call is synchronous: the same steps run in the same order with
the same results (every rank runs the same schedule, so collectives match across ranks).

Autograd integration
--------------------
``StagedModule.__call__`` runs the chain on its own and returns outputs attached to the chain by
an autograd node: an ordinary ``loss.backward()`` reaching them runs the chain's backward stage by
stage (sequentially) and then passes the input gradients on, so a staged module also works in any
plain training loop or non-overlapped pipeline step. The overlapped schedules instead let that
node capture the output gradients, run the chain's backward steps interleaved with the other
micro-batch, and pass the input gradients on at the end. A staged module's inputs must be leaves,
or tensors used nowhere else in the graph (their gradient is pushed by a separate backward call).

Gradients accumulate into ``.grad`` per stage; with both micro-batches starting from zero grads
the result equals the sequential order bit for bit (two summands commute exactly).
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Callable, Iterable, Optional, Sequence

import torch
import torch.nn as nn

from commlib.training import autograd as ops
from commlib.utils import env
from commlib.training import wgrad
from commlib.fp8 import per_token_cast_back, per_token_cast_to_fp8
from commlib.utils.event import EventOverlap

Carry = dict


# ------------------------------------------------------------------------------------------------
# Stages
# ------------------------------------------------------------------------------------------------

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
    """[x_wire, topk_idx, topk_weights] -> [recv_x, recv_topk_idx, recv_topk_weights, counts, handle].

    fp8=True: x_wire (bf16) is quantized before the move and recv_x dequantized to bf16 after;
    the backward moves bf16 gradients (straight-through, as commlib.training.autograd.dispatch(fp8=True)).
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
    """[y, handle] -> [combined]."""
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


# ------------------------------------------------------------------------------------------------
# Timeline (optional): spans of every step on its stream, for benchmarks and plots
# ------------------------------------------------------------------------------------------------

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


# ------------------------------------------------------------------------------------------------
# Chains: one micro-batch through one staged module
# ------------------------------------------------------------------------------------------------

def _is_float_tensor(v) -> bool:
    return isinstance(v, torch.Tensor) and v.is_floating_point()


def _capture(device: torch.device) -> Optional[EventOverlap]:
    """An event at the current point of the current stream (None on CPU)."""
    if device.type != "cuda":
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(device))
    return EventOverlap(ev)


@dataclasses.dataclass
class Step:
    kind: str            # "compute" | "comm" | "none" (bookkeeping, never paired)
    label: str
    run: Callable[[], None]
    blocks_host: bool = False   # comm steps: the call waits on the host (non-cached dispatch)
    light: bool = False         # compute steps: never paired (ComputeStage.light)
    stream: object = None       # comm steps: the stream their work goes to (None: unknown / CPU)

    @property
    def unpaired(self) -> bool:
        return self.kind == "none" or self.light


class Chain:
    """One micro-batch in one StagedModule: forward records, then the backward.

    Event bookkeeping: ``ready`` is the event right after the last compute step (what the next
    comm step passes as previous_event); ``pending`` is the event of the last comm step (what the
    next compute step waits for). ``prepared`` holds the next comm step's inputs, prepared at the
    end of the compute step that produced them; ``to_finalize`` the last comm step's outputs,
    finalized at the start of the compute step that consumes them.
    """

    def __init__(self, module: "StagedModule", stages: Sequence, inputs: tuple, carry: Carry,
                 tag: str = "") -> None:
        self.module, self.stages, self.tag = module, list(stages), tag
        self.inputs = inputs                  # the module's real inputs (gradients pushed here at the end)
        self.carry = carry
        self.grad_enabled = torch.is_grad_enabled()
        self.records: list = [None] * len(self.stages)
        self.device = next((v.device for v in carry.values() if isinstance(v, torch.Tensor)),
                           torch.device("cpu"))
        self.ready: Optional[EventOverlap] = None
        self.pending: Optional[EventOverlap] = None
        self.prepared: Optional[tuple] = None         # (stage index, prepared inputs or grads)
        self.to_finalize: Optional[tuple] = None      # (stage, produced) awaiting finalize
        self.grads: dict = {}
        self.intercept = False
        self.output_grads: Optional[tuple] = None
        self.output_keys: tuple = ()
        self.done_backward = False
        # Deferred weight gradients (commlib.training.wgrad), set by the overlapped schedules. CHAIN entries
        # of one backward compute step run right after the chain's next backward compute step (the
        # last ones at the end of its backward); NEXT entries go to ``wgrad_next``, a list shared by
        # the schedule's two chains, run after the next compute step of either (the rest at the end
        # of the schedule).
        self.defer_wgrad = False
        self.keep_wgrad_steps = 0   # this many (non-light) backward compute steps first run in place
        self.wgrad_pending: list = []
        self.wgrad_next: Optional[list] = None

    def _settle(self, backward: bool) -> None:
        """Wait for the last comm step and finalize its outputs (on the compute stream)."""
        if self.pending is not None:
            self.pending.current_stream_wait()
            self.pending = None
        if self.to_finalize is not None:
            stage, produced = self.to_finalize
            self.to_finalize = None
            if backward:
                self.grads.update(stage.finalize_backward(produced))
            else:
                self.carry.update(stage.finalize_forward(produced))

    def _comm_inputs(self, i: int, overlap: bool, backward: bool):
        """The prepared inputs of comm step i and the event it waits for."""
        stage = self.stages[i]
        if self.prepared is not None and self.prepared[0] == i:
            prepared = self.prepared[1]
            self.prepared = None
            return prepared, (self.ready if overlap else None)
        # Not prepared by a compute step (a chain starting with comm, or two comm stages in a row):
        # settle, prepare here and wait for the current stream.
        self._settle(backward)
        prepared = (stage.prepare_backward(self.records[i], {k: self.grads.get(k) for k in stage.produces})
                    if backward else stage.prepare_forward({k: self.carry[k] for k in stage.consumes}))
        return prepared, (_capture(self.device) if overlap else None)

    # --- forward ---
    def _forward_compute(self, i: int, timeline: Optional[Timeline]) -> None:
        stage = self.stages[i]
        self._settle(backward=False)
        tok = timeline.begin(f"{self.tag}F.{stage.name}", "compute", _cur_stream(self.device)) if timeline else None
        if self.grad_enabled:
            leaves = {k: (v.detach().requires_grad_(True) if _is_float_tensor(v) else v)
                      for k, v in self.carry.items()}
            with torch.enable_grad():
                out = stage.fn(dict(leaves))
            self.records[i] = (leaves, out)
        else:
            out = stage.fn(dict(self.carry))
        self.carry = out
        nxt = self.stages[i + 1] if i + 1 < len(self.stages) else None
        if nxt is not None and nxt.kind == "comm":
            missing = [k for k in nxt.consumes if k not in out]
            if missing:
                raise KeyError(f"pipeline stage {nxt.name!r} needs carry keys {missing}; "
                               f"stage {stage.name!r} left {sorted(out)}")
            self.prepared = (i + 1, nxt.prepare_forward({k: out[k] for k in nxt.consumes}))
        self.ready = _capture(self.device)
        if not getattr(stage, "light", False):  # a light step is not "the next compute step" of a queue
            self._run_deferred(None)
        if timeline:
            timeline.end(tok)

    def _run_deferred(self, produced: Optional[list]) -> None:
        """After a compute step, behind the event the next comm step waits for (``ready``): the
        weight gradients deferred to this point, then queue what this step deferred (``produced``;
        None for a forward step)."""
        if self.wgrad_next:
            wgrad.run(self.wgrad_next)
        if produced is None:
            return
        chain_items, next_items = wgrad.split(produced)
        wgrad.run(self.wgrad_pending)
        if self.wgrad_next is None:
            chain_items += next_items
        else:
            self.wgrad_next.extend(next_items)
        self.wgrad_pending = chain_items

    def _forward_comm(self, i: int, overlap: bool, timeline: Optional[Timeline]) -> None:
        stage = self.stages[i]
        inputs, prev = self._comm_inputs(i, overlap, backward=False)
        tok = timeline.begin(f"{self.tag}F.{stage.name}", "comm", stage.comm_stream(), prev) if timeline else None
        produced, saved, event = stage.forward(inputs, prev, overlap)
        if timeline:
            timeline.end(tok)
        self.carry = {k: v for k, v in self.carry.items() if k not in stage.consumes}
        self.records[i] = saved if self.grad_enabled else None
        self.to_finalize = (stage, produced)
        if overlap:
            self.pending, self.ready = event, event

    def forward_steps(self, overlap: bool, timeline: Optional[Timeline] = None) -> list[Step]:
        steps = []
        for i, stage in enumerate(self.stages):
            label = f"{self.tag}F.{stage.name}"
            if stage.kind == "compute":
                steps.append(Step("compute", label, lambda i=i: self._forward_compute(i, timeline),
                                  light=getattr(stage, "light", False)))
            else:
                steps.append(Step("comm", label, lambda i=i: self._forward_comm(i, overlap, timeline),
                                  blocks_host=stage.blocks_host(backward=False), stream=stage.comm_stream()))
        steps.append(Step("none", f"{self.tag}F.end", lambda: self._settle(backward=False)))
        return steps

    # --- backward ---
    def _backward_compute(self, i: int, timeline: Optional[Timeline]) -> None:
        stage = self.stages[i]
        self._settle(backward=True)
        leaves, out = self.records[i]
        tok = timeline.begin(f"{self.tag}B.{stage.name}", "compute", _cur_stream(self.device)) if timeline else None
        tensors, grads = [], []
        for k, t in out.items():
            g = self.grads.get(k)
            if g is not None and isinstance(t, torch.Tensor) and t.requires_grad:
                tensors.append(t)
                grads.append(g.to(t.dtype) if g.dtype != t.dtype else g)
        light = getattr(stage, "light", False)
        keep = light or self.keep_wgrad_steps > 0
        if keep and not light:
            self.keep_wgrad_steps -= 1
        deferred: Optional[list] = [] if self.defer_wgrad and not keep else None
        if tensors:
            with wgrad.deferring(deferred):
                torch.autograd.backward(tensors, grads)
        self.grads = {k: v.grad for k, v in leaves.items() if _is_float_tensor(v) and v.grad is not None}
        self.records[i] = None
        prv = self.stages[i - 1] if i > 0 else None
        if prv is not None and prv.kind == "comm":
            self.prepared = (i - 1, prv.prepare_backward(self.records[i - 1],
                                                         {k: self.grads.get(k) for k in prv.produces}))
        self.ready = _capture(self.device)
        if self.defer_wgrad and not light:
            self._run_deferred(deferred)
        if timeline:
            timeline.end(tok)

    def _backward_comm(self, i: int, overlap: bool, timeline: Optional[Timeline]) -> None:
        stage = self.stages[i]
        grads_out, prev = self._comm_inputs(i, overlap, backward=True)
        tok = timeline.begin(f"{self.tag}B.{stage.name}", "comm", stage.comm_stream(), prev) if timeline else None
        grads_in, event = stage.backward(self.records[i], grads_out, prev, overlap)
        if timeline:
            timeline.end(tok)
        self.grads = {k: g for k, g in self.grads.items() if k not in stage.produces}
        self.to_finalize = (stage, {k: g for k, g in grads_in.items() if g is not None})
        self.records[i] = None
        if overlap and event is not None:
            self.pending, self.ready = event, event

    def begin_backward(self) -> None:
        """Start the backward from the captured output gradients (the first backward step's inputs)."""
        if self.output_grads is None:
            raise RuntimeError("pipeline: backward of a micro-batch whose output gradients were not captured")
        if self.done_backward:
            raise RuntimeError("pipeline: the backward of this micro-batch already ran")
        self.grads = {k: g for k, g in zip(self.output_keys, self.output_grads) if g is not None}
        self.ready = _capture(self.device)

    def backward_steps(self, overlap: bool, timeline: Optional[Timeline] = None, begin: bool = True) -> list[Step]:
        """The backward steps. ``begin=False``: the caller runs begin_backward() before the first of
        them (a schedule that builds the list before the forward has run)."""
        if begin:
            self.begin_backward()
        steps = []
        for i in reversed(range(len(self.stages))):
            stage = self.stages[i]
            label = f"{self.tag}B.{stage.name}"
            if stage.kind == "compute":
                steps.append(Step("compute", label, lambda i=i: self._backward_compute(i, timeline),
                                  light=getattr(stage, "light", False)))
            else:
                steps.append(Step("comm", label, lambda i=i: self._backward_comm(i, overlap, timeline),
                                  blocks_host=stage.blocks_host(backward=True), stream=stage.comm_stream()))
        steps.append(Step("none", f"{self.tag}B.end", self._backward_end))
        return steps

    def _backward_end(self) -> None:
        """Run the weight gradients still deferred; pass the first stage's input gradients on to
        the module's real inputs."""
        self._settle(backward=True)
        wgrad.run(self.wgrad_pending)
        self.done_backward = True
        tensors, grads = [], []
        for k, t in self.module.input_keys_and_tensors(self.inputs):
            g = self.grads.get(k)
            if g is not None and isinstance(t, torch.Tensor) and t.requires_grad:
                tensors.append(t)
                grads.append(g.to(t.dtype) if g.dtype != t.dtype else g)
        self.grads, self.records, self.output_grads = {}, [], None
        if tensors:
            torch.autograd.backward(tensors, grads)

    def run_backward_now(self, grads: Sequence[Optional[torch.Tensor]]) -> None:
        """Sequential backward (when a plain ``.backward()`` reaches the chain's outputs)."""
        self.output_grads = tuple(grads)
        _interleave(self.backward_steps(overlap=False), [])


def _cur_stream(device: torch.device):
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


class _Attach(torch.autograd.Function):
    """Ties a chain's outputs to the chain: its backward runs (or, intercepting, captures) the chain's."""

    @staticmethod
    def forward(ctx, chain, *outs):
        ctx.commlib_chain = chain
        return tuple(o.detach() for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        chain = ctx.commlib_chain
        ctx.commlib_chain = None
        if chain is not None:
            if chain.intercept:
                chain.output_grads = grads
            else:
                chain.run_backward_now(grads)
        return (None,) * (1 + len(grads))


def _find_chains(tensors: Iterable) -> list:
    """Chains whose attached outputs these tensors' graphs reach (stopping at each chain)."""
    found, seen = [], set()
    stack = [t.grad_fn for t in tensors if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        chain = getattr(node, "commlib_chain", None)
        if chain is not None:
            found.append(chain)
            continue
        stack.extend(fn for fn, _ in node.next_functions if fn is not None)
    return found


class _Intercept:
    def __init__(self, chain: Chain) -> None:
        self.chain = chain

    def __enter__(self):
        self.chain.intercept = True
        return self.chain

    def __exit__(self, *exc):
        self.chain.intercept = False


def _capture_output_grads(tensors: Sequence[torch.Tensor], grads: Optional[Sequence]) -> Optional[Chain]:
    """Run the backward of ``tensors`` up to the one chain it reaches, capturing that chain's
    output gradients (the chain's own backward is not run). Returns the chain, or None when the
    graph reaches no chain or several (the backward then simply ran to completion)."""
    chains = _find_chains(tensors)
    if len(chains) != 1:
        torch.autograd.backward(list(tensors), grads)
        return None
    chain = chains[0]
    with _Intercept(chain):
        torch.autograd.backward(list(tensors), grads)
    if chain.output_grads is None:  # the graph did not need the chain after all
        return None
    return chain


# ------------------------------------------------------------------------------------------------
# The schedule
# ------------------------------------------------------------------------------------------------

ISSUE_ORDERS = ("auto", "comm_first", "compute_first")


def _issue_order(order: Optional[str]) -> str:
    """The issue order of paired steps: the argument, else $COMMLIB_ISSUE_ORDER, else "auto"."""
    if order is None:
        order = env.issue_order()
    if order not in ISSUE_ORDERS:
        raise ValueError(f"pipeline: issue order must be one of {ISSUE_ORDERS}, got {order!r}")
    return order


def _comm_first(comm: Step, order: str) -> bool:
    if order == "auto":
        return not comm.blocks_host
    return order == "comm_first"


def _interleave(a: list[Step], b: list[Step], lead: int = 0, order: str = "auto",
                after_comm_first: bool = False) -> None:
    """Issue two step lists, pairing a compute step of one with a comm step of the other.

    Issue order of a pair (``order``):
      "auto"          the comm step first, so the comm stream gets its work before the host spends
                      its time issuing the (many) kernels of the compute step, unless the comm step
                      waits on the host (a non-cached dispatch reading its receive count): that one
                      goes second, so the compute stream has the other micro-batch's work queued
                      while the host waits.
      "comm_first"    always the comm step first; "compute_first" always the compute step first
                      (the schedule before the issue-order rule; kept for measurements).
    Bookkeeping steps and light compute steps (``Step.unpaired``) are issued as soon as their turn
    comes. When both next steps are of the same kind, one list issues its step alone; the lists then
    stay out of phase. Which one: the list ``lead`` (0 = a, 1 = b); with ``after_comm_first``, the
    list whose last paired step was a comm step, if only one of them, since its step's input is the
    sooner ready (a comm step waits for the comm stream, its other neighbour for a compute step).
    The order never changes which steps are paired, nor the order of the comm steps among
    themselves, so every rank still runs the same collectives in the same order whatever it chooses.
    """
    i = j = 0
    last = [None, None]  # kind of each list's last paired-kind step
    while i < len(a) or j < len(b):
        sa = a[i] if i < len(a) else None
        sb = b[j] if j < len(b) else None
        if sa is not None and sa.unpaired:
            sa.run(); i += 1
            continue
        if sb is not None and sb.unpaired:
            sb.run(); j += 1
            continue
        if sa is not None and sb is not None and sa.kind != sb.kind:
            comp, comm = (sa, sb) if sa.kind == "compute" else (sb, sa)
            if _comm_first(comm, order):
                comm.run()
                comp.run()
            else:
                comp.run()
                comm.run()
            last = [sa.kind, sb.kind]
            i += 1
            j += 1
            continue
        first = lead
        if sa is None:
            first = 1
        elif sb is None:
            first = 0
        elif after_comm_first and (last[0] == "comm") != (last[1] == "comm"):
            first = 0 if last[0] == "comm" else 1
        if first == 0:
            sa.run(); last[0] = sa.kind; i += 1
        else:
            sb.run(); last[1] = sb.kind; j += 1


# ------------------------------------------------------------------------------------------------
# StagedModule and the public schedules
# ------------------------------------------------------------------------------------------------

class StagedModule(nn.Module):
    """An nn.Module whose forward is a chain of compute / comm stages.

    Subclasses implement:
      stages() -> list of ComputeStage / CommStage (alternating is best, not required)
      make_carry(*inputs) -> the first stage's carry
      output_keys -> tuple of carry keys returned (in order) by forward
    and may override input_keys_and_tensors(inputs) -> [(carry key, input tensor)] naming which
    carry key's gradient belongs to which input (default: make_carry's keys, by identity).
    """

    output_keys: tuple = ("h",)

    def stages(self) -> list:
        raise NotImplementedError

    def make_carry(self, *inputs) -> Carry:
        raise NotImplementedError

    def input_keys_and_tensors(self, inputs: tuple) -> list:
        carry = self.make_carry(*inputs)
        ids = {id(t): t for t in inputs if isinstance(t, torch.Tensor)}
        return [(k, v) for k, v in carry.items() if isinstance(v, torch.Tensor) and id(v) in ids]

    def start(self, *inputs, tag: str = "") -> Chain:
        return Chain(self, self.stages(), inputs, self.make_carry(*inputs), tag)

    def finish(self, chain: Chain):
        """The chain's outputs, attached for autograd (a tensor, or a tuple if several)."""
        outs = tuple(chain.carry[k] for k in self.output_keys)
        chain.carry = {}
        if chain.grad_enabled and any(isinstance(o, torch.Tensor) and o.requires_grad for o in outs):
            chain.output_keys = self.output_keys
            # Detached inputs: the outer backward must not reach the last stage's graph, which
            # the chain's own backward runs (a second traversal would find it freed).
            outs = _Attach.apply(chain, *(o.detach().requires_grad_(o.requires_grad) for o in outs))
        return outs[0] if len(outs) == 1 else outs

    def forward(self, *inputs):
        chain = self.start(*inputs)
        _interleave(chain.forward_steps(overlap=False), [])
        return self.finish(chain)

    @classmethod
    def overlapped_forward_backward(cls, module0, inputs0, criterion0, labels0, module1, loss1, outputs1,
                                    output_grads1):
        """DualPipe's hook; see commlib.training.pipeline.schedule.overlapped_forward_backward."""
        return overlapped_forward_backward(module0, inputs0, criterion0, labels0, module1, loss1, outputs1,
                                           output_grads1)


def _as_list(x) -> list:
    if x is None:
        return []
    return [x] if isinstance(x, torch.Tensor) else list(x)


def resolve_sm_carveout(value, stages: Iterable = ()) -> int:
    """SMs the overlapped schedules keep GEMMs off: ``value`` (None: $COMMLIB_SM_CARVEOUT, default
    "auto"); "auto" = the most SMs any comm stage among ``stages`` occupies per call (its Config's
    num_sms, else the Buffer's), "off" or 0 = none, an int = that many."""
    if value is None:
        value = env.sm_carveout()
    if isinstance(value, str):
        v = value.strip().lower()
        if v == "auto":
            return max((s.comm_sms() for s in stages if isinstance(s, CommStage)), default=0)
        if v in ("off", "none", "0"):
            return 0
        try:
            value = int(v)
        except ValueError:
            raise ValueError(f"pipeline: sm_carveout must be 'auto', 'off' or an SM count, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"pipeline: sm_carveout must be 'auto', 'off' or an SM count >= 0, got {value!r}")
    return value


@contextlib.contextmanager
def _carveout_phases(device: Optional[torch.device] = None):
    """Yields set(num_sms): from now on torch's GEMMs keep off ``num_sms`` SMs (<= 0: the value
    before); returns the count set. The value before is restored on exit. A no-op on CPU or where
    torch lacks the setting (set returns 0)."""
    setter = getattr(torch._C, "_set_sm_carveout_experimental", None)
    getter = getattr(torch._C, "_get_sm_carveout_experimental", None)
    if device is None or device.type != "cuda" or setter is None or getter is None:
        yield lambda num_sms: 0
        return
    total = torch.cuda.get_device_properties(device).multi_processor_count
    previous = getter()

    def set_(num_sms: int) -> int:
        if num_sms <= 0:
            setter(previous)
            return 0
        n = min(int(num_sms), total - 1)
        setter(n)
        return n

    try:
        yield set_
    finally:
        setter(previous)


@contextlib.contextmanager
def sm_carveout(num_sms: int, device: Optional[torch.device] = None):
    """While active, the GEMMs torch launches (cuBLAS, the CUTLASS grouped GEMM behind
    ``torch._grouped_mm``) size their grids for all SMs but ``num_sms`` (torch's experimental SM
    carveout, process-wide; the previous value is restored on exit). DeepSeek-V3's point: persistent
    GEMM kernels hold every SM until they finish, so a communication kernel queued beside one waits
    for SMs, and a GEMM sized for every SM runs a second wave on the SMs the comm kernels hold; with
    the carveout, the ``num_sms`` SMs stay free of GEMM CTAs. The default cuBLAS path honours it
    (torch 2.11, one H200), so the BLAS library is left alone: preferring cuBLASLt made a 16384 x
    7168 x 1536 matmul 482-509 us instead of 444-446. Alone, a GEMM may lose to wave quantization
    (benchmarks/bench_gemm_carveout.py: -4..+7% at 4 SMs, up to +48% at 12). A no-op for
    num_sms <= 0, on CPU, or where torch lacks the setting."""
    if num_sms <= 0:
        yield 0
        return
    with _carveout_phases(device) as set_:
        yield set_(num_sms)


def _defer_weight_grads(value: Optional[bool]) -> bool:
    """The argument, else $COMMLIB_DEFER_WGRAD (default on)."""
    return env.defer_wgrad() if value is None else bool(value)


def _chains_device(chains: Sequence) -> Optional[torch.device]:
    return next((c.device for c in chains if c is not None), None)


def _share_deferred(chains: Sequence) -> Optional[list]:
    """One NEXT list for the chains of an overlapped schedule where any chain defers (else None)."""
    chains = [c for c in chains if c is not None]
    if not any(c.defer_wgrad for c in chains):
        return None
    shared: list = []
    for c in chains:
        c.wgrad_next = shared
    return shared


def _run(a: list[Step], b: list[Step], overlap: bool, lead: int, issue_order: Optional[str] = None,
         chains: Sequence = (), carveout=None, after_comm_first: bool = False,
         carveout_switch: Optional[dict] = None) -> None:
    """Issue two step lists: overlapped (``_interleave``, under the SM carveout, with the schedule's
    shared deferred weight gradients), or one after the other (the baseline). ``carveout_switch``:
    a dict that receives "set", the carveout's setter, for a step that changes it mid-schedule."""
    order = _issue_order(issue_order)
    if overlap:
        chains = [c for c in chains if c is not None]
        shared = _share_deferred(chains)
        stages = [s for c in chains for s in c.stages]
        with _carveout_phases(_chains_device(chains)) as set_carveout:
            set_carveout(resolve_sm_carveout(carveout, stages))
            if carveout_switch is not None:
                carveout_switch["set"] = set_carveout
            _interleave(a, b, lead, order, after_comm_first)
            if shared:
                wgrad.run(shared)
        for c in chains:
            c.wgrad_next = None
    else:  # the baseline: one micro-batch after the other, every communication stream-ordered
        _interleave(a, [])
        _interleave(b, [])


def dual_forward(module: StagedModule, inputs0: Sequence, inputs1: Sequence, timeline: Optional[Timeline] = None,
                 overlap: bool = True, issue_order: Optional[str] = None, sm_carveout=None):
    """Forward of two micro-batches through ``module``, one's communication overlapping the
    other's compute. Returns (outputs0, outputs1), each attached for autograd like module(*inputs).
    ``overlap=False`` runs micro-batch 0 then 1 with synchronous communication (the baseline).
    ``issue_order``: see ``_interleave`` (default "auto", or $COMMLIB_ISSUE_ORDER).
    ``sm_carveout``: SMs kept free of GEMMs while overlapping (``resolve_sm_carveout``: default
    "auto" = the comm stages' SMs, or $COMMLIB_SM_CARVEOUT; "off" = none)."""
    issue_order = _issue_order(issue_order)
    c0, c1 = module.start(*inputs0, tag="0."), module.start(*inputs1, tag="1.")
    _run(c0.forward_steps(overlap, timeline), c1.forward_steps(overlap, timeline), overlap, lead=0,
         issue_order=issue_order, chains=(c0, c1), carveout=sm_carveout)
    return module.finish(c0), module.finish(c1)


def dual_backward(tensors0, grads0, tensors1, grads1, timeline: Optional[Timeline] = None,
                  overlap: bool = True, issue_order: Optional[str] = None, sm_carveout=None,
                  defer_weight_grads: Optional[bool] = None) -> None:
    """Backward of two micro-batches (each: a loss with grads None, or outputs with their
    gradients, as for torch.autograd.backward), one's communication overlapping the other's
    compute. ``overlap=False``: micro-batch 0 then 1, synchronous communication.
    ``issue_order`` / ``sm_carveout``: as for ``dual_forward``.
    ``defer_weight_grads`` (overlapped only; default $COMMLIB_DEFER_WGRAD, on): the weight gradients
    of a backward compute step run later (DualPipe's B / W split, commlib.training.wgrad): the expert GEMMs'
    after the chain's next backward compute step, the attention projections' after the next compute
    step of either micro-batch, so the step that feeds the next comm step is shorter.
    Measured on 2 x H200 (docs/pipeline.md): up to ~10% off the dual time where expert GEMMs are
    long, neutral elsewhere; gradients are unchanged (two summands per parameter commute)."""
    issue_order = _issue_order(issue_order)
    t0, t1 = _as_list(tensors0), _as_list(tensors1)
    chain0 = _capture_output_grads(t0, grads0 if grads0 is None else _as_list(grads0))
    chain1 = _capture_output_grads(t1, grads1 if grads1 is None else _as_list(grads1))
    if chain0 is not None and not chain0.tag:
        chain0.tag = "0."
    if chain1 is not None and not chain1.tag:
        chain1.tag = "1."
    for chain in (chain0, chain1):
        if chain is not None:
            chain.defer_wgrad = overlap and _defer_weight_grads(defer_weight_grads)
    s0 = chain0.backward_steps(overlap, timeline) if chain0 is not None else []
    s1 = chain1.backward_steps(overlap, timeline) if chain1 is not None else []
    _run(s0, s1, overlap, lead=0, issue_order=issue_order, chains=(chain0, chain1), carveout=sm_carveout)


TURN_KEEPS_WGRAD = True  # dual_forward_backward: see there (a module switch for measurements)


def _turn_on_comm_stream(steps: list[Step], turn: int, wrap: Optional[Callable] = None) -> None:
    """Where only light and bookkeeping steps lie between a chain's last forward comm step and its
    first backward comm step (a residual add, the loss and its backward, the gradients' packing),
    issue them on that comm stream: on the compute stream they would queue behind the other
    micro-batch's expert backward, and hold this chain's combine' back until it ends. ``turn``: the
    index of the step between the chain's forward and backward steps; ``wrap(stream, run)``: the
    moved step's run (default: ``run`` under ``torch.cuda.stream(stream)``)."""
    comm = [i for i, st in enumerate(steps) if st.kind == "comm"]
    before = [i for i in comm if i < turn]
    after = [i for i in comm if i > turn]
    if not before or not after:
        return
    p, q = before[-1], after[0]
    if not all(steps[i].unpaired for i in range(p + 1, q)):
        return
    stream = steps[p].stream
    if stream is None:
        return
    wrap = wrap or _on_stream
    for i in range(p + 1, q):
        steps[i] = dataclasses.replace(steps[i], run=wrap(stream, steps[i].run))


def _on_stream(stream, fn: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        with torch.cuda.stream(stream):
            fn()
    return run


def _detached(out):
    return tuple(o.detach() for o in out) if isinstance(out, tuple) else out.detach()


def dual_forward_backward(module: StagedModule, inputs0: Sequence, inputs1: Sequence,
                          grads0: Optional[Sequence] = None, grads1: Optional[Sequence] = None,
                          criterion=None, timeline: Optional[Timeline] = None,
                          overlap: bool = True, issue_order: Optional[str] = None, sm_carveout=None,
                          defer_weight_grads: Optional[bool] = None, schedule: str = "split"):
    """Forward and backward of two micro-batches through ``module``, overlapped (two forwards then two
    backwards, e.g. a data-parallel step split in two).

    Where to start each backward: ``criterion(*outputs) -> scalar loss`` (one callable, or a pair:
    micro-batch 0's and 1's, e.g. with their own labels), or ``grads0`` / ``grads1``, the outputs'
    gradients (as for torch.autograd.backward), known before the forward ends.

    ``schedule="split"`` (default): ``dual_forward``, the losses or given gradients, ``dual_backward``.
    ``schedule="joint"``: one interleaving, micro-batch 0's backward starting as soon as its forward
    ends, beside micro-batch 1's last forward steps. Its first comm step (combine', the cached dispatch of the
    output gradients) goes right after its last combine, before micro-batch 1's, and its expert
    backward then runs beside micro-batch 1's last combine and combine'. The split schedule instead
    leaves the compute stream idle for two comm steps in a row at the turn (micro-batch 1's last
    combine, then micro-batch 0's combine'); here it is one. In the backward micro-batch 1 then
    issues its steps first where both lists' next steps are comm steps. Measured on 2 x H200
    (docs/pipeline.md) the two take the same time: the comm stream is busy through the turn either
    way, and the turn's memory-bound steps (residual add, packing) get only the carved-out SMs
    beside the expert backward.

    ``sm_carveout``: as for ``dual_forward``, or a pair (forward, backward): the carveout changes when
    micro-batch 0's backward starts. ``issue_order`` / ``defer_weight_grads``: as for
    ``dual_backward``. ``overlap=False``: ``dual_forward`` then ``dual_backward``, both sequential
    (the baseline, the same work).
    Returns (loss0, loss1) with ``criterion``, else (outputs0, outputs1); detached (their backward ran).
    """
    if criterion is None and (grads0 is None or grads1 is None):
        raise ValueError("dual_forward_backward: give criterion, or both grads0 and grads1")
    if criterion is not None and (grads0 is not None or grads1 is not None):
        raise ValueError("dual_forward_backward: give criterion or grads0 / grads1, not both")
    if isinstance(sm_carveout, tuple) and len(sm_carveout) != 2:
        raise ValueError(f"dual_forward_backward: sm_carveout must be a value or a (forward, backward) pair, "
                         f"got {sm_carveout!r}")
    if schedule not in ("split", "joint"):
        raise ValueError(f"dual_forward_backward: schedule must be 'split' or 'joint', got {schedule!r}")
    if not torch.is_grad_enabled():
        raise RuntimeError("dual_forward_backward: autograd is disabled (torch.no_grad); use dual_forward")
    fwd_cv, bwd_cv = sm_carveout if isinstance(sm_carveout, tuple) else (sm_carveout, sm_carveout)
    given = (grads0, grads1)
    criteria = tuple(criterion) if isinstance(criterion, (tuple, list)) else (criterion, criterion)
    if len(criteria) != 2:
        raise ValueError(f"dual_forward_backward: criterion must be a callable or a pair, got {len(criteria)}")
    if not overlap or schedule == "split":
        outs = dual_forward(module, inputs0, inputs1, timeline, overlap=overlap, issue_order=issue_order,
                            sm_carveout=fwd_cv)
        back = dict(timeline=timeline, overlap=overlap, issue_order=issue_order, sm_carveout=bwd_cv,
                    defer_weight_grads=defer_weight_grads)
        if criterion is not None:
            losses = [crit(*_as_list(o)) for crit, o in zip(criteria, outs)]
            dual_backward(losses[0], None, losses[1], None, **back)
            return tuple(loss.detach() for loss in losses)
        dual_backward(outs[0], grads0, outs[1], grads1, **back)
        return tuple(_detached(o) for o in outs)
    chains = [module.start(*inputs0, tag="0."), module.start(*inputs1, tag="1.")]
    defer = _defer_weight_grads(defer_weight_grads)
    for c in chains:
        c.defer_wgrad = defer
    # Where the chains end with a comm step (or a light stage after it), micro-batch 0's first
    # backward compute step (the expert backward after the turn) pairs with micro-batch 1's last two
    # comm steps (combine, combine'): deferring its weight gradients would only leave the compute
    # stream idle there.
    last = chains[0].stages[-1] if chains[0].stages else None
    ends_in_comm = last is not None and (last.kind == "comm" or getattr(last, "light", False))
    chains[0].keep_wgrad_steps = int(TURN_KEEPS_WGRAD and ends_in_comm)
    stages = [s for c in chains for s in c.stages]
    switch: dict = {}
    results: list = [None, None]

    def turn(k: int) -> None:
        """Micro-batch k's forward has been issued: its output gradients, then its backward begins."""
        chain = chains[k]
        out = module.finish(chain)
        if criterion is not None:
            loss = criteria[k](*_as_list(out))
            tensors, grads, results[k] = [loss], None, loss.detach()
        else:
            tensors, grads, results[k] = _as_list(out), _as_list(given[k]), _detached(out)
        if _capture_output_grads(tensors, grads) is not chain:
            what = "loss" if criterion is not None else "outputs"
            raise RuntimeError(f"dual_forward_backward: micro-batch {k}'s {what} do not reach its forward "
                               "(outputs without grad, or a loss that does not use them)")
        if k == 0 and bwd_cv != fwd_cv:
            switch["set"](resolve_sm_carveout(bwd_cv, stages))
        chain.begin_backward()

    lists = []
    for k, c in enumerate(chains):
        fwd = c.forward_steps(True, timeline)
        steps = fwd + [Step("none", f"{c.tag}turn", lambda k=k: turn(k))] + c.backward_steps(True, timeline, begin=False)
        _turn_on_comm_stream(steps, len(fwd))
        lists.append(steps)
    _run(lists[0], lists[1], True, lead=0, issue_order=issue_order, chains=chains, carveout=fwd_cv,
         after_comm_first=True, carveout_switch=switch)
    return results[0], results[1]


def overlapped_forward_backward(module0: StagedModule, inputs0: Sequence, criterion0: Optional[Callable],
                                labels0: Optional[Sequence], module1: StagedModule, loss1: Optional[torch.Tensor],
                                outputs1: Optional[Sequence], output_grads1: Optional[Sequence],
                                timeline: Optional[Timeline] = None, overlap: bool = True,
                                issue_order: Optional[str] = None, sm_carveout=None,
                                defer_weight_grads: Optional[bool] = None):
    """Forward of micro-batch 0 through module0 interleaved with the backward of micro-batch 1
    through module1 (DualPipe's ``overlapped_forward_backward`` contract).

    loss1: micro-batch 1's loss (last pipeline stage), or None and then outputs1 / output_grads1
    are module1's outputs and their gradients. The backward of the loss (criterion, head) up to
    module1's outputs runs first, then module1's stages backward, paired with module0's stages
    forward, then module1's input gradients are passed on (leaves get ``.grad``).
    Returns (outputs0 as a list, loss0 = criterion0(*outputs0, *labels0) or None).
    ``overlap=False``: the forward, then the backward, synchronous communication (the baseline).
    ``issue_order`` / ``sm_carveout``: as for ``dual_forward``; ``defer_weight_grads``: as for
    ``dual_backward``.
    """
    issue_order = _issue_order(issue_order)
    if loss1 is not None:
        chain1 = _capture_output_grads([loss1], None)
        loss1.detach_()
    elif outputs1:
        chain1 = _capture_output_grads(list(outputs1), list(output_grads1))
    else:
        chain1 = None
    if not isinstance(module0, StagedModule):
        raise TypeError(f"overlapped_forward_backward: module0 must be a StagedModule, got {type(module0).__name__}")
    chain0 = module0.start(*inputs0, tag="0.")
    if chain1 is not None and not chain1.tag:
        chain1.tag = "1."
    if chain1 is not None:
        chain1.defer_wgrad = overlap and _defer_weight_grads(defer_weight_grads)
    b_steps = chain1.backward_steps(overlap, timeline) if chain1 is not None else []
    # Backward leads: its first step (the last compute stage's backward, small) runs alone, so the
    # forward's first compute (attention) pairs with the backward's first comm (combine').
    _run(chain0.forward_steps(overlap, timeline), b_steps, overlap, lead=1, issue_order=issue_order,
         chains=(chain0, chain1), carveout=sm_carveout)
    outputs0 = module0.finish(chain0)
    outputs0 = [outputs0] if isinstance(outputs0, torch.Tensor) else list(outputs0)
    loss0 = criterion0(*outputs0, *(labels0 or [])) if criterion0 is not None else None
    return outputs0, loss0
