"""``deep_ep.utils``: DeepEP's helper package, served by commlib.

v1 layout: ``from deep_ep.utils import EventHandle, EventOverlap`` and ``check_nvlink_connections``.
V2 layout: the submodules ``event`` (EventHandle, EventOverlap), ``envs`` (process-group set-up,
seeds, rank-0 printing, domain sizes, link bandwidths) and ``math`` (the FP8 casts and small
integer helpers its clients and tests use).

V2 also ships test-support modules in this package (``refs``, its reference dispatch / combine;
``gate``, its routing generator; ``testing``, its profiler timer). commlib does not: to run V2's
tests, scripts/deepep_tests.sh adds V2's own three files beside a copy of this package.
"""
from __future__ import annotations

from commlib.utils.event import EventHandle, EventOverlap


def check_nvlink_connections(group) -> None:
    """DeepEP checks that PCIe GPUs of the group are NVLink-connected before building a Buffer.
    commlib checks what it needs itself (peer access when a GPU backend opens peer memory), so
    this accepts any group."""


__all__ = ["EventHandle", "EventOverlap", "check_nvlink_connections"]
