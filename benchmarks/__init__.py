"""User benchmarks (nccl-tests style tables + JSON), run as modules: python -m benchmarks.<name>."""
