"""Low-latency mode on the nvlink backend: bit for bit against the reference, in spawned GPU worlds.

2 ranks (one per GPU, NCCL group, reference on the GPU) and 4 ranks on 2 GPUs (two processes per
GPU, gloo group, reference on the CPU). Cases: tests/gpu/low_latency_cases.py. Skipped without
2 GPUs and CuPy; the NVRTC compile check runs wherever CuPy's NVRTC does.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))          # low_latency_cases, nvlink_cases (spawned ranks inherit sys.path)
sys.path.insert(0, str(HERE.parent))   # tests/worlds.py

pytestmark = pytest.mark.gpu


from commlib.buffer import _cupy_available as _have_cupy  # noqa: E402


# One GPU is enough: ranks beyond the GPU count share a device (CUDA IPC inside it, a gloo group);
# such runs check correctness only, the ranks' kernels take turns on the GPU. The ranks keep NVLink
# multicast off themselves (commlib.utils.launch.SAFE_ENV).
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or not _have_cupy(), reason="needs a GPU and CuPy")

CASES_2 = ["bf16", "fp8", "hooks_and_zero_copy", "two_in_flight", "cuda_graph", "decode_shape", "many_experts",
           "logfmt", "wait_stats", "masked_ranks", "host_ahead_memory", "teardown"]
CASES_4 = ["bf16", "fp8", "hooks_and_zero_copy", "two_in_flight", "cuda_graph", "logfmt", "wait_stats",
           "masked_ranks", "teardown"]


def test_nvrtc_compiles_low_latency():
    """The kernel family compiles with NVRTC (no GPU needed) when CuPy's NVRTC is present."""
    try:
        from cupy.cuda import nvrtc
        nvrtc.getVersion()
    except Exception:  # noqa: BLE001
        pytest.skip("no NVRTC")
    import nvrtc_compile

    for plain in (False, True):
        size, _ = nvrtc_compile.compile_family("low_latency", plain)
        assert size > 0


@needs_cuda
@pytest.mark.parametrize("world_size", [2, 4])
def test_low_latency_matches_reference(world_size):
    from worlds import run_world

    os.environ.setdefault("COMMLIB_TIMEOUT_S", "60")
    names = CASES_2 if world_size == 2 else CASES_4
    only = os.environ.get("COMMLIB_TEST_CASES")
    if only:
        names = [n for n in names if n in only.split(",") or n == "teardown"]
    results = run_world(world_size, "low_latency_cases", names, use_gpu=True, timeout_s=240)
    failed = {k: v for k, v in results.items() if v}
    assert not failed, "\n\n".join(f"--- {k} ---\n{v}" for k, v in failed.items())
