"""One micro-batch through one staged module (``Chain``), its steps (``Step``), and the issue of two
step lists side by side (``interleave``): the mechanics under the schedules of
commlib.training.pipeline.schedule (StagedModule and the public schedules).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Optional, Sequence

import torch

from commlib.training import wgrad
from commlib.training.pipeline.stages import Carry
from commlib.training.pipeline.timeline import Timeline
from commlib.utils import env
from commlib.utils.event import EventOverlap


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
    """One step of a chain's forward or backward: one stage, issued by ``run()``."""
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

    Args:
      module: the StagedModule (its ``input_keys_and_tensors`` names where input gradients go).
      stages: the module's stages, in forward order.
      inputs: the module's inputs (tensors that receive the input gradients at the backward's end).
      carry: the first stage's carry (``module.make_carry(*inputs)``).
      tag: prefix of the step labels ("0." / "1." for the two micro-batches).
    """

    def __init__(self, module, stages: Sequence, inputs: tuple, carry: Carry,
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

    def _stage_steps(self, order, backward: bool, overlap: bool, timeline: Optional[Timeline]) -> list[Step]:
        """One Step per stage, in ``order``: the forward's or the backward's compute / comm of each."""
        compute, comm = ((self._backward_compute, self._backward_comm) if backward
                         else (self._forward_compute, self._forward_comm))
        steps = []
        for i in order:
            stage = self.stages[i]
            label = f"{self.tag}{'B' if backward else 'F'}.{stage.name}"
            if stage.kind == "compute":
                steps.append(Step("compute", label, lambda i=i: compute(i, timeline),
                                  light=getattr(stage, "light", False)))
            else:
                steps.append(Step("comm", label, lambda i=i: comm(i, overlap, timeline),
                                  blocks_host=stage.blocks_host(backward=backward), stream=stage.comm_stream()))
        return steps

    def forward_steps(self, overlap: bool, timeline: Optional[Timeline] = None) -> list[Step]:
        steps = self._stage_steps(range(len(self.stages)), False, overlap, timeline)
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
        steps = self._stage_steps(reversed(range(len(self.stages))), True, overlap, timeline)
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
        interleave(self.backward_steps(overlap=False), [])


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



def attach(chain: Chain, outs: tuple) -> tuple:
    """The chain's outputs ``outs`` tied to the chain by an autograd node (its backward runs the chain's)."""
    return _Attach.apply(chain, *outs)


class _Intercept:
    def __init__(self, chain: Chain) -> None:
        self.chain = chain

    def __enter__(self):
        self.chain.intercept = True
        return self.chain

    def __exit__(self, *exc):
        self.chain.intercept = False


def capture_output_grads(tensors: Sequence[torch.Tensor], grads: Optional[Sequence]) -> Optional[Chain]:
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


ISSUE_ORDERS = ("auto", "comm_first", "compute_first")


def resolve_issue_order(order: Optional[str]) -> str:
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


def interleave(a: list[Step], b: list[Step], lead: int = 0, order: str = "auto",
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
