"""commlib: expert-parallel dispatch/combine for Mixture-of-Experts, a drop-in for DeepEP's Buffer."""
from commlib.config import Config
from commlib.layout import topk_idx_t
from commlib.fp8 import per_token_cast_to_fp8, per_token_cast_back

from commlib.version import __version__  # noqa: F401
from commlib.buffer import Buffer
from commlib.elastic import ElasticBuffer, EPHandle
from commlib.utils.event import EventOverlap
from commlib.handle import DispatchHandle
from commlib.topology import Topology
from commlib import routing
from commlib.tuning import autotune as _autotune

Buffer.autotuner = _autotune.get_config

__all__ = ["Buffer", "ElasticBuffer", "EPHandle", "Config", "EventOverlap", "DispatchHandle", "Topology", "topk_idx_t",
           "per_token_cast_to_fp8", "per_token_cast_back", "routing"]
