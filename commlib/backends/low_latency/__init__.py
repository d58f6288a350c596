"""Low-latency (decode) dispatch / combine: ``reference`` (collectives) and ``nvlink`` (kernels)."""
