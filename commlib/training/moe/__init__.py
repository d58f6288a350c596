"""A group-limited-gate MoE layer with expert parallelism, and a small model built from it."""
from commlib.training.moe.layer import (  # noqa: F401
    COMM_DTYPE, Attention, Experts, MoEBlock, MoEConfig, MoELayer, MoEModel, RMSNorm, Router, SwiGLU, linear,
    routed_experts)

__all__ = ["COMM_DTYPE", "Attention", "Experts", "MoEBlock", "MoEConfig", "MoELayer", "MoEModel", "RMSNorm",
           "Router", "SwiGLU", "linear", "routed_experts"]
