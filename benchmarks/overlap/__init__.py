"""The pieces of ``python -m benchmarks.bench_overlap``: options, the model and its calibration, the
compute-dense reference (replay), the dual-vs-sequential check, the figures, profiling and the report."""
