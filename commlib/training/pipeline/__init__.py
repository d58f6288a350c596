"""The dual pipeline: two micro-batches, one communicating while the other computes."""
from commlib.training.pipeline.schedule import (  # noqa: F401
    Chain, CombineStage, CommStage, ComputeStage, DispatchStage, StagedModule, Step, Timeline,
    dual_backward, dual_forward, dual_forward_backward, overlapped_forward_backward, resolve_sm_carveout,
    sm_carveout)

__all__ = ["Chain", "CombineStage", "CommStage", "ComputeStage", "DispatchStage", "StagedModule", "Step",
           "Timeline", "dual_backward", "dual_forward", "dual_forward_backward", "overlapped_forward_backward",
           "resolve_sm_carveout", "sm_carveout"]
