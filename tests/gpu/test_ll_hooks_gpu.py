"""Low-latency receive hooks on the nvlink engine as DeepEP's: a hooked call launches the send kernel,
its hook the receive kernel; the profiler sees DeepEP-style names (``::dispatch`` / ``::combine``), two
kernels per hooked call. 2 ranks (they may share one GPU). Cases: tests/gpu/ll_hook_cases.py."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))          # ll_hook_cases (spawned ranks inherit sys.path)
sys.path.insert(0, str(HERE.parent))   # tests/worlds.py

from commlib.buffer import _cupy_available  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or not _cupy_available(),
                                                  reason="needs a GPU and CuPy")]


@pytest.mark.parametrize("case", ["launch_counts", "profiler_view"])
def test_ll_hooks(case):
    from worlds import run_world
    os.environ.setdefault("COMMLIB_TIMEOUT_S", "60")
    results = run_world(2, "ll_hook_cases", [case], use_gpu=True, timeout_s=300)
    assert results[case] is None, results[case]
