"""Training on top of the Buffer: differentiable ``autograd`` ops, the same as ``torch.library``
custom ops for ``torch.compile`` (``ops``), the ``moe`` layer and model, the dual ``pipeline`` and
its weight-gradient deferral (``wgrad``)."""
