"""Deprecated: ``EventOverlap`` is ``commlib.utils.event.EventOverlap``, the dual pipeline is
``commlib.training.pipeline`` (this alias stays for one release)."""
import warnings

from commlib.training.pipeline import (  # noqa: F401
    StagedModule, dual_backward, dual_forward, dual_forward_backward, overlapped_forward_backward)
from commlib.utils.event import EventOverlap  # noqa: F401

warnings.warn("commlib.overlap is deprecated; import commlib.utils.event / commlib.training.pipeline",
              DeprecationWarning, stacklevel=2)
