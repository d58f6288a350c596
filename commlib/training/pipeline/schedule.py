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

The schedule (``interleave``) zips two step lists: whenever one list's next step is compute and
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

import dataclasses
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn

from commlib.training import wgrad
from commlib.training.pipeline.carveout import carveout_phases, resolve_sm_carveout
from commlib.training.pipeline.chain import (
    Chain, Step, attach, capture_output_grads, interleave, resolve_issue_order)
from commlib.training.pipeline.stages import Carry
from commlib.training.pipeline.timeline import Timeline
from commlib.utils import env


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
            outs = attach(chain, tuple(o.detach().requires_grad_(o.requires_grad) for o in outs))
        return outs[0] if len(outs) == 1 else outs

    def forward(self, *inputs):
        chain = self.start(*inputs)
        interleave(chain.forward_steps(overlap=False), [])
        return self.finish(chain)

    @classmethod
    def overlapped_forward_backward(cls, module0, inputs0, criterion0, labels0, module1, loss1, outputs1,
                                    output_grads1):
        """DualPipe's hook; see overlapped_forward_backward (this module)."""
        return overlapped_forward_backward(module0, inputs0, criterion0, labels0, module1, loss1, outputs1,
                                           output_grads1)


def _as_list(x) -> list:
    if x is None:
        return []
    return [x] if isinstance(x, torch.Tensor) else list(x)


def resolve_defer_weight_grads(value: Optional[bool]) -> bool:
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
    """Issue two step lists: overlapped (``interleave``, under the SM carveout, with the schedule's
    shared deferred weight gradients), or one after the other (the baseline). ``carveout_switch``:
    a dict that receives "set", the carveout's setter, for a step that changes it mid-schedule."""
    order = resolve_issue_order(issue_order)
    if overlap:
        chains = [c for c in chains if c is not None]
        shared = _share_deferred(chains)
        stages = [s for c in chains for s in c.stages]
        with carveout_phases(_chains_device(chains)) as set_carveout:
            set_carveout(resolve_sm_carveout(carveout, stages))
            if carveout_switch is not None:
                carveout_switch["set"] = set_carveout
            interleave(a, b, lead, order, after_comm_first)
            if shared:
                wgrad.run(shared)
        for c in chains:
            c.wgrad_next = None
    else:  # the baseline: one micro-batch after the other, every communication stream-ordered
        interleave(a, [])
        interleave(b, [])


def dual_forward(module: StagedModule, inputs0: Sequence, inputs1: Sequence, timeline: Optional[Timeline] = None,
                 overlap: bool = True, issue_order: Optional[str] = None, sm_carveout=None):
    """Forward of two micro-batches through ``module``, one's communication overlapping the
    other's compute.

    Args:
      module: the StagedModule both micro-batches run through.
      inputs0, inputs1: each micro-batch's inputs, as for ``module(*inputs)`` (for MoEModel: token
        ids [B, S] int64, or hidden states [B, S, H] in the model's dtype).
      timeline: records every step's span on its stream (None: nothing recorded).
      overlap: False runs micro-batch 0 then 1 with synchronous communication (the baseline).
      issue_order: which step of a (compute, comm) pair the host issues first: "auto" (default, or
        $COMMLIB_ISSUE_ORDER), "comm_first", "compute_first" (see ``interleave``).
      sm_carveout: SMs kept free of GEMMs while overlapping (``resolve_sm_carveout``: None =
        $COMMLIB_SM_CARVEOUT, default "auto" = the comm stages' SMs; "off" = none; an int).
    Returns:
      (outputs0, outputs1): what ``module(*inputs)`` returns for each (for MoEModel: [B, S, V]
      logits or [B, S, H] hidden states), attached for autograd like ``module(*inputs)``'s.
    """
    issue_order = resolve_issue_order(issue_order)
    c0, c1 = module.start(*inputs0, tag="0."), module.start(*inputs1, tag="1.")
    _run(c0.forward_steps(overlap, timeline), c1.forward_steps(overlap, timeline), overlap, lead=0,
         issue_order=issue_order, chains=(c0, c1), carveout=sm_carveout)
    return module.finish(c0), module.finish(c1)


def dual_backward(tensors0, grads0, tensors1, grads1, timeline: Optional[Timeline] = None,
                  overlap: bool = True, issue_order: Optional[str] = None, sm_carveout=None,
                  defer_weight_grads: Optional[bool] = None) -> None:
    """Backward of two micro-batches, one's communication overlapping the other's compute.

    Args:
      tensors0, grads0: micro-batch 0's loss (a scalar tensor) and None, or its outputs (a tensor
        or a sequence, e.g. [B, S, H]) and their gradients (same shapes and dtypes), as for
        torch.autograd.backward. Their graph must reach a staged module's outputs (``dual_forward``).
      tensors1, grads1: the same for micro-batch 1.
      timeline, issue_order, sm_carveout: as for ``dual_forward``.
      overlap: False runs micro-batch 0's backward then 1's, synchronous communication.
      defer_weight_grads: overlapped only; None = $COMMLIB_DEFER_WGRAD (default on). The weight
        gradients of a backward compute step run later (DualPipe's B / W split,
        commlib.training.wgrad): the expert GEMMs' after the chain's next backward compute step,
        the attention projections' after the next compute step of either micro-batch, so the step
        that feeds the next comm step is shorter. Gradients are unchanged (two summands per
        parameter commute).
    Returns:
      None; parameters and leaf inputs get their ``.grad`` (accumulated, as ``backward()`` does).
    """
    issue_order = resolve_issue_order(issue_order)
    t0, t1 = _as_list(tensors0), _as_list(tensors1)
    chain0 = capture_output_grads(t0, grads0 if grads0 is None else _as_list(grads0))
    chain1 = capture_output_grads(t1, grads1 if grads1 is None else _as_list(grads1))
    if chain0 is not None and not chain0.tag:
        chain0.tag = "0."
    if chain1 is not None and not chain1.tag:
        chain1.tag = "1."
    for chain in (chain0, chain1):
        if chain is not None:
            chain.defer_wgrad = overlap and resolve_defer_weight_grads(defer_weight_grads)
    s0 = chain0.backward_steps(overlap, timeline) if chain0 is not None else []
    s1 = chain1.backward_steps(overlap, timeline) if chain1 is not None else []
    _run(s0, s1, overlap, lead=0, issue_order=issue_order, chains=(chain0, chain1), carveout=sm_carveout)


# dual_forward_backward, joint schedule: micro-batch 0's first backward compute step after the turn
# keeps its weight gradients in place (beside two comm steps); a module switch for measurements.
TURN_KEEPS_WGRAD = True


def turn_on_comm_stream(steps: list[Step], turn: int, wrap: Optional[Callable] = None) -> None:
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

    ``schedule="split"`` (default): ``dual_forward``, the losses or given gradients, ``dual_backward``.
    ``schedule="joint"``: one interleaving, micro-batch 0's backward starting as soon as its forward
    ends, beside micro-batch 1's last forward steps. Its first comm step (combine', the cached
    dispatch of the output gradients) goes right after its last combine, before micro-batch 1's,
    and its expert backward then runs beside micro-batch 1's last combine and combine'. The split
    schedule instead leaves the compute stream idle for two comm steps in a row at the turn
    (micro-batch 1's last combine, then micro-batch 0's combine'); here it is one. In the backward
    micro-batch 1 then issues its steps first where both lists' next steps are comm steps. Where the
    comm stream is busy through the turn either way, the two take the same time (docs/pipeline.md).

    Args:
      module: the StagedModule both micro-batches run through.
      inputs0, inputs1: each micro-batch's inputs, as for ``module(*inputs)``.
      grads0, grads1: the outputs' gradients (same shapes and dtypes as the outputs, e.g. [B, S, H]),
        known before the forward ends; give both, or ``criterion``.
      criterion: ``criterion(*outputs) -> scalar loss`` where each backward starts: one callable, or
        a pair (micro-batch 0's and 1's, e.g. with their own labels).
      timeline, issue_order: as for ``dual_forward``.
      overlap: False runs ``dual_forward`` then ``dual_backward``, both sequential (the baseline,
        the same work).
      sm_carveout: as for ``dual_forward``, or a pair (forward, backward): the carveout changes when
        micro-batch 0's backward starts.
      defer_weight_grads: as for ``dual_backward``.
      schedule: "split" or "joint" (above).
    Returns:
      (loss0, loss1), scalar tensors, with ``criterion``; else (outputs0, outputs1) as
      ``module(*inputs)`` returns them. Detached: their backward ran, parameters have ``.grad``.
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
    defer = resolve_defer_weight_grads(defer_weight_grads)
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
        if capture_output_grads(tensors, grads) is not chain:
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
        turn_on_comm_stream(steps, len(fwd))
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

    The backward of loss1 (criterion, head) up to module1's outputs runs first, then module1's
    stages backward, paired with module0's stages forward, then module1's input gradients are
    passed on (leaves get ``.grad``).

    Args:
      module0: the StagedModule micro-batch 0's forward runs through.
      inputs0: its inputs, as for ``module0(*inputs0)`` (e.g. hidden states [B, S, H]).
      criterion0: ``criterion0(*outputs0, *labels0) -> loss0`` (last pipeline stage), or None.
      labels0: the extra arguments of criterion0 (e.g. target ids [B, S] int64), or None.
      module1: the StagedModule micro-batch 1's forward ran through.
      loss1: micro-batch 1's scalar loss (last pipeline stage), or None: then outputs1 and
        output_grads1 are module1's outputs and their gradients (same shapes and dtypes).
      timeline, overlap, issue_order, sm_carveout: as for ``dual_forward`` (overlap=False: the
        forward, then the backward, synchronous communication).
      defer_weight_grads: as for ``dual_backward``.
    Returns:
      (outputs0, loss0): module0's outputs as a list of tensors (attached for autograd), and
      criterion0's loss or None.
    """
    issue_order = resolve_issue_order(issue_order)
    if loss1 is not None:
        chain1 = capture_output_grads([loss1], None)
        loss1.detach_()
    elif outputs1:
        chain1 = capture_output_grads(list(outputs1), list(output_grads1))
    else:
        chain1 = None
    if not isinstance(module0, StagedModule):
        raise TypeError(f"overlapped_forward_backward: module0 must be a StagedModule, got {type(module0).__name__}")
    chain0 = module0.start(*inputs0, tag="0.")
    if chain1 is not None and not chain1.tag:
        chain1.tag = "1."
    if chain1 is not None:
        chain1.defer_wgrad = overlap and resolve_defer_weight_grads(defer_weight_grads)
    b_steps = chain1.backward_steps(overlap, timeline) if chain1 is not None else []
    # Backward leads: its first step (the last compute stage's backward, small) runs alone, so the
    # forward's first compute (attention) pairs with the backward's first comm (combine').
    _run(chain0.forward_steps(overlap, timeline), b_steps, overlap, lead=1, issue_order=issue_order,
         chains=(chain0, chain1), carveout=sm_carveout)
    outputs0 = module0.finish(chain0)
    outputs0 = [outputs0] if isinstance(outputs0, torch.Tensor) else list(outputs0)
    loss0 = criterion0(*outputs0, *(labels0 or [])) if criterion0 is not None else None
    return outputs0, loss0
