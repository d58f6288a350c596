"""The NVLink engine: dispatch / combine kernels over CUDA-IPC peer memory on one node."""
