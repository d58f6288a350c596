"""MoEConfig: the shapes and choices of a MoE layer; COMM_DTYPE, the dtype rows cross the wire in."""
from __future__ import annotations

import dataclasses

import torch

COMM_DTYPE = torch.bfloat16


@dataclasses.dataclass
class MoEConfig:
    """The shapes and choices of a MoE layer (H hidden, E experts, K top-k, I expert intermediate)."""
    hidden: int
    num_experts: int
    topk: int
    expert_hidden: int                 # I: intermediate size of one routed expert
    num_groups: int = 1                # expert groups of the group-limited gate (one per node in V3)
    topk_groups: int = 1               # groups a token may use
    num_shared_experts: int = 0        # 0 or more shared experts (one dense MLP of that many * I)
    routed_scaling: float = 1.0        # V3 scales routed weights by 2.5
    expert_dtype: torch.dtype = torch.float32   # parameters (and compute) of experts
    expert_impl: str = "auto"          # "loop" | "grouped_mm" | "auto" (grouped_mm on CUDA bf16)
    fp8_dispatch: bool = False         # dispatch moves E4M3 + scales (hidden % 128 == 0); gradients bf16
    # pipeline stage of the shared experts (MoEBlock.stages): "attn" = right after routing, so the
    # dual pipeline runs them beside the other micro-batch's communication in the shorter attention
    # step (DeepSeek-V3 overlaps them with the dispatch); "experts" = with the routed experts
    shared_stage: str = "attn"

    def __post_init__(self) -> None:
        if self.num_experts % self.num_groups != 0:
            raise ValueError(f"MoEConfig: num_groups ({self.num_groups}) must divide num_experts ({self.num_experts})")
        if self.fp8_dispatch and self.hidden % 128 != 0:
            raise ValueError(f"MoEConfig: fp8_dispatch needs hidden % 128 == 0, got hidden {self.hidden}")
        if self.expert_impl not in ("auto", "loop", "grouped_mm"):
            raise ValueError(f"MoEConfig: expert_impl must be auto, loop or grouped_mm, got {self.expert_impl!r}")
        if self.shared_stage not in ("attn", "experts"):
            raise ValueError(f"MoEConfig: shared_stage must be attn or experts, got {self.shared_stage!r}")
