"""commlib with a CUDA default device on the GPU engines (nvlink, low-latency nvlink, internode) and
the reference on GPU tensors: every output the same bytes as with the default device left alone.

2 ranks on one node (processes may share a GPU: correctness only), and 2 emulated nodes x 1 over
NCCL (each rank its own NCCL_HOSTID). Cases: tests/gpu/default_device_cases.py."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))          # default_device_cases (spawned ranks inherit sys.path)
sys.path.insert(0, str(HERE.parent))   # tests/worlds.py, tests/cases_default_device.py

from commlib.buffer import _cupy_available  # noqa: E402
from default_device_cases import CASES  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available() or not _cupy_available(),
                                                  reason="needs a GPU and CuPy")]

TWO_NODES = [name for name, (_, _, backend) in CASES.items() if backend == "internode"]
ONE_NODE = [name for name in CASES if name not in TWO_NODES]


def _check(results):
    failed = {k: v for k, v in results.items() if v is not None}
    assert not failed, "\n".join(f"--- {k} ---\n{v}" for k, v in failed.items())


def test_one_node_cuda_default():
    from worlds import run_world
    os.environ.setdefault("COMMLIB_TIMEOUT_S", "60")
    _check(run_world(2, "default_device_cases", ONE_NODE, use_gpu=True, timeout_s=300))


def test_two_nodes_cuda_default():
    from worlds import run_world
    os.environ.setdefault("COMMLIB_TIMEOUT_S", "120")
    _check(run_world(2, "default_device_cases", TWO_NODES, use_gpu=True, group_backend="nccl",
                     emulate_hosts=True, ranks_per_node=1, timeout_s=600))
