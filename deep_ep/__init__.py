"""``deep_ep`` compatibility package: DeepEP v1's Python API, served by commlib.

Clients written for DeepEP (``from deep_ep import Buffer, Config``, ``from deep_ep.utils import
EventHandle, EventOverlap``) run on commlib unchanged, and so do clients of DeepEP V2
(``deep_ep.ElasticBuffer``, ``deep_ep.utils.envs`` / ``event`` / ``math``). Importing it logs one INFO line on the
``deep_ep`` logger ("deep_ep -> commlib <version> (compatibility layer)"; COMMLIB_DEEP_EP_QUIET=1
silences it) and sets ``deep_ep.__implementation__ = "commlib"``, so a program can tell which one
it got. If a real DeepEP is also installed (its ``deep_ep_cpp`` extension or a ``deep_ep`` /
``deep-ep`` distribution), both claim the top-level name ``deep_ep``: this package warns
(RuntimeWarning) naming what it found, since whichever was installed last owns the files.
Install one of the two. See docs/deep_ep.md for what is covered and what differs.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import warnings

from commlib import Buffer, Config, EventOverlap, topk_idx_t
from commlib import ElasticBuffer, EPHandle
from commlib import __version__ as _commlib_version
from commlib.utils import env as _env
from commlib.utils.event import EventHandle
from deep_ep.utils.envs import get_logical_domain_size, get_physical_domain_size

__implementation__ = "commlib"
__version__ = _commlib_version

_log = logging.getLogger("deep_ep")


def find_real_deep_ep() -> list:
    """What of a real DeepEP installation is visible: ["deep_ep_cpp at <path>", "distribution deep-ep 1.2"]."""
    found = []
    try:
        spec = importlib.util.find_spec("deep_ep_cpp")
    except (ImportError, ValueError):
        spec = None
    if spec is not None:
        found.append(f"deep_ep_cpp at {spec.origin}")
    for name in ("deep_ep", "deep-ep"):
        try:
            d = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        label = f"distribution {d.metadata['Name']} {d.version}"
        if label not in found:
            found.append(label)
    return found


_real = find_real_deep_ep()
if _real:
    warnings.warn(
        "deep_ep resolved to commlib's DeepEP compatibility layer, but a real DeepEP is installed too ("
        + "; ".join(_real) + "): both provide the top-level package deep_ep, and the files of the one installed "
        "last win. Uninstall one of them (pip uninstall deep-ep, or use commlib.Buffer directly).",
        RuntimeWarning, stacklevel=2)
if not _env.deep_ep_quiet():
    _log.info("deep_ep -> commlib %s (compatibility layer)", __version__)

__all__ = ["Buffer", "ElasticBuffer", "EPHandle", "Config", "EventOverlap", "EventHandle", "topk_idx_t",
           "find_real_deep_ep", "get_logical_domain_size", "get_physical_domain_size"]
