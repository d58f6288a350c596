"""CUDA kernels: ``csrc/`` (shipped as package data) and ``loader`` (NVRTC through CuPy, launch)."""
