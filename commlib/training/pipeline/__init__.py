"""The dual pipeline: two micro-batches, one communicating while the other computes.

Modules: ``stages`` (compute / dispatch / combine stages), ``chain`` (one micro-batch's steps and
the interleaving of two step lists), ``timeline`` (step spans), ``carveout`` (SMs kept free of
GEMMs), ``schedule`` (StagedModule and the public schedules; how it all works).
"""
from commlib.training.pipeline.carveout import resolve_sm_carveout, sm_carveout
from commlib.training.pipeline.chain import ISSUE_ORDERS, Chain, Step, interleave, resolve_issue_order
from commlib.training.pipeline.schedule import (
    StagedModule, dual_backward, dual_forward, dual_forward_backward, overlapped_forward_backward,
    resolve_defer_weight_grads, turn_on_comm_stream)
from commlib.training.pipeline.stages import Carry, CombineStage, CommStage, ComputeStage, DispatchStage
from commlib.training.pipeline.timeline import Timeline

__all__ = ["ISSUE_ORDERS", "Carry", "Chain", "CombineStage", "CommStage", "ComputeStage", "DispatchStage",
           "StagedModule", "Step", "Timeline", "dual_backward", "dual_forward", "dual_forward_backward",
           "interleave", "overlapped_forward_backward", "resolve_defer_weight_grads", "resolve_issue_order",
           "resolve_sm_carveout", "sm_carveout", "turn_on_comm_stream"]
