"""DeepEP v1 compatibility on the GPUs: ``import deep_ep`` on the nvlink backend against the reference
(tests/gpu/deep_ep_cases.py). Skipped without a GPU and CuPy."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))          # deep_ep_cases, nvlink_cases (spawned ranks inherit sys.path)
sys.path.insert(0, str(HERE.parent))   # tests/worlds.py

pytestmark = pytest.mark.gpu

from commlib.buffer import _cupy_available as _have_cupy

# One GPU is enough: ranks beyond the GPU count share a device (CUDA IPC inside it, a gloo group);
# such runs check correctness only, the ranks' kernels take turns on the GPU. The ranks keep NVLink
# multicast off themselves (commlib.utils.launch.SAFE_ENV).
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or not _have_cupy(), reason="needs a GPU and CuPy")


@needs_cuda
def test_deep_ep_on_nvlink():
    from worlds import run_world

    os.environ.setdefault("COMMLIB_TIMEOUT_S", "60")
    results = run_world(2, "deep_ep_cases", ["topology_facts", "intranode", "low_latency", "teardown"], use_gpu=True, timeout_s=300)
    failed = {k: v for k, v in results.items() if v}
    assert not failed, "\n\n".join(f"--- {k} ---\n{v}" for k, v in failed.items())
