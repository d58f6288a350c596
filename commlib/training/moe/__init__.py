"""A group-limited-gate MoE layer with expert parallelism, and a small model built from it.

Modules: ``config`` (MoEConfig), ``router`` (Router), ``experts`` (routed experts, SwiGLU, linear),
``rows`` (row gathers and slot sums), ``layer`` (MoELayer), ``model`` (RMSNorm, Attention, MoEBlock,
MoEModel: staged for the dual pipeline).
"""
from commlib.training.moe.config import COMM_DTYPE, MoEConfig
from commlib.training.moe.experts import Experts, SwiGLU, linear, routed_experts
from commlib.training.moe.layer import MoELayer
from commlib.training.moe.model import Attention, MoEBlock, MoEModel, RMSNorm
from commlib.training.moe.router import Router

__all__ = ["COMM_DTYPE", "Attention", "Experts", "MoEBlock", "MoEConfig", "MoELayer", "MoEModel", "RMSNorm",
           "Router", "SwiGLU", "linear", "routed_experts"]
