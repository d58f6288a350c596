"""``python -m commlib.bench``: the main job (``main``), its NCCL baseline (``baseline``), the oracle
every benchmark checks against (``oracle``, no code shared with the library), result bookkeeping and
files (``results``) and the GPU clock monitor (``clocks``)."""
