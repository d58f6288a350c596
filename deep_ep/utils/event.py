"""``deep_ep.utils.event`` (V2's module path): commlib's EventHandle and EventOverlap."""
from commlib.utils.event import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]
