"""``deep_ep.utils``: DeepEP v1's event helpers (commlib's) and its NVLink check."""
from __future__ import annotations

from commlib.utils.event import EventHandle, EventOverlap


def check_nvlink_connections(group) -> None:
    """DeepEP checks that PCIe GPUs of the group are NVLink-connected before building a Buffer.
    commlib checks what it needs itself (peer access when a GPU backend opens peer memory), so
    this accepts any group."""


__all__ = ["EventHandle", "EventOverlap", "check_nvlink_connections"]
