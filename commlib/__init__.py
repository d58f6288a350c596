"""commlib: expert-parallel dispatch/combine for Mixture-of-Experts, a drop-in for DeepEP's Buffer."""
from .config import Config
from .layout import topk_idx_t
from .fp8 import per_token_cast_to_fp8, per_token_cast_back

__version__ = "0.1.0"
from .buffer import Buffer
from .overlap import EventOverlap
from .handle import DispatchHandle
from .topology import Topology
from . import routing

__all__ = ["Buffer", "Config", "EventOverlap", "DispatchHandle", "Topology", "topk_idx_t",
           "per_token_cast_to_fp8", "per_token_cast_back", "routing"]
