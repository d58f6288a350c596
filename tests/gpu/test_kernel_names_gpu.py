"""The names a profiler shows for commlib's kernels on the device: the normal and the low-latency
dispatch / combine kernels carry ``::dispatch`` / ``::combine`` as DeepEP's do, one line each in the
profile table (cases: tests/gpu/kernel_names_cases.py). 2 ranks; on one GPU they share it (under
MPS in scripts/gpu_check.sh). tests/test_kernels_compile.py checks the same names in the cubins on CPU.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))          # kernel_names_cases and the modules it imports
sys.path.insert(0, str(HERE.parent))   # tests/worlds.py

from commlib.buffer import _cupy_available as _have_cupy  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or not _have_cupy(), reason="needs a GPU and CuPy")]


def test_profiler_names_of_dispatch_and_combine():
    from worlds import run_world

    results = run_world(2, "kernel_names_cases", ["normal_names", "low_latency_names", "teardown"],
                        use_gpu=True, timeout_s=240)
    failed = {k: v for k, v in results.items() if v}
    assert not failed, "\n\n".join(f"--- {k} ---\n{v}" for k, v in failed.items())
