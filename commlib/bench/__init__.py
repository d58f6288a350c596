"""``python -m commlib.bench``: the main job (``main``), its NCCL baseline (``baseline``) and the GPU
clock monitor (``clocks``)."""
