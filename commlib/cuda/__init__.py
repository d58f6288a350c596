"""CUDA kernels: ``loader`` compiles the top-level ``csrc/`` (in a wheel: ``commlib/_csrc``) with NVRTC
through CuPy and launches them."""
