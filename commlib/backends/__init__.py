"""Transports behind the Buffer: one factory, one contract (``base``).

``make_backend(name, ctx)`` builds the dispatch / combine engine; ``make_low_latency(name, ctx,
backend)`` the decode engine beside it. Both take a ``BackendContext``, never the Buffer.
"""
from __future__ import annotations

from commlib.backends.base import Backend, BackendContext
from commlib.backends.internode.engine import InternodeBackend
from commlib.backends.low_latency.nvlink import NVLinkLowLatency
from commlib.backends.low_latency.reference import LowLatencyReference
from commlib.backends.nvlink.engine import NVLinkBackend
from commlib.backends.reference import ReferenceBackend

BACKENDS = {"reference": ReferenceBackend, "nvlink": NVLinkBackend, "internode": InternodeBackend}
LOW_LATENCY = {"reference": LowLatencyReference, "nvlink": NVLinkLowLatency}


def make_backend(name: str, ctx: BackendContext) -> Backend:
    """The engine called ``name`` (reference, nvlink, internode) for the Buffer described by ``ctx``."""
    try:
        cls = BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; known: {sorted(BACKENDS)}") from None
    return cls(ctx)


def make_low_latency(name: str, ctx: BackendContext, backend: Backend):
    """The low-latency (decode) engine beside ``backend``; NotImplementedError where none exists."""
    cls = LOW_LATENCY.get(name)
    if cls is None:
        raise NotImplementedError(
            f"Buffer: low_latency_mode=True has no {name} kernels yet; pass backend='nvlink' "
            "(one node) or backend='reference' (torch.distributed collectives, same semantics)")
    return cls(ctx, backend)


__all__ = ["Backend", "BackendContext", "make_backend", "make_low_latency", "BACKENDS", "LOW_LATENCY"]
