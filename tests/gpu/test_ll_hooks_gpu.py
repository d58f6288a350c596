"""The nvlink low-latency engine as DeepEP's tests use it: a hooked call launches the send kernel, its
hook the receive kernel; the profiler sees DeepEP-style names (``::dispatch`` / ``::combine``), two
kernels per hooked call; in shrink mode a rank that stops calling gets masked. 2 (and 4) ranks, which
may share one GPU. Cases: tests/gpu/ll_hook_cases.py."""
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


@pytest.mark.parametrize("world_size", [2, 4])
def test_ll_shrink_stopped_rank(world_size, monkeypatch):
    """A rank that stops calling in shrink mode is masked by the others after one timeout (10 s here)."""
    from worlds import run_world
    monkeypatch.setenv("COMMLIB_TIMEOUT_S", "10")
    results = run_world(world_size, "ll_hook_cases", ["stopped_rank"], use_gpu=True, timeout_s=300)
    assert results["stopped_rank"] is None, results["stopped_rank"]
