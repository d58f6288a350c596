"""The internode engine (engine.InternodeBackend), bottom to top: exchange, geometry, rows, kernels,
fanout (engine-free) · network, node (the two seams) · wiring · counted, padded, device (the data
paths) · engine. tests/test_layers.py holds that order."""
from commlib.backends.internode.engine import InternodeBackend

__all__ = ["InternodeBackend"]
