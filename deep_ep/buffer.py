"""``deep_ep.buffer``: where DeepEP v1 defines Buffer (commlib's Buffer)."""
from commlib.buffer import Buffer
from commlib.config import Config
from commlib.utils.event import EventHandle, EventOverlap

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap"]
