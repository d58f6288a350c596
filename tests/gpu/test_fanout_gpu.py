"""The internode engine's IPC fan-out (commlib.backends.internode.fanout.NodeFanout, csrc/fanout.cu) on the device.

2 and 4 processes sharing the GPUs there are (CUDA IPC between them, a gloo group for the handle
exchange), every process one local rank of a single node; forward, reduce and CUDA-graph replays are
checked bit for bit against torch oracles (cases: tests/gpu/fanout_cases.py). Such runs check
correctness only: processes sharing a GPU take turns on it. Skipped without a GPU and CuPy.

    python -m pytest tests/gpu/test_fanout_gpu.py -q
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))          # fanout_cases (spawned ranks inherit sys.path)
sys.path.insert(0, str(HERE.parent))   # tests/worlds.py

from commlib.buffer import _cupy_available as _have_cupy

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or not _have_cupy(), reason="needs a GPU and CuPy")]

CASES = ["forward", "forward_windows", "reduce", "dispatch_then_combine", "sync_pieces", "graph_forward",
         "graph_combine", "refusals"]


@pytest.mark.parametrize("world_size", [2, 4])
def test_fanout_matches_oracle(world_size):
    from worlds import run_world

    names = CASES
    only = os.environ.get("COMMLIB_TEST_CASES")
    if only:
        names = [n for n in names if n in only.split(",")]
    results = run_world(world_size, "fanout_cases", names, use_gpu=True, group_backend="gloo", timeout_s=900,
                        case_timeout_s=300)
    failed = {k: v for k, v in results.items() if v}
    assert not failed, "\n\n".join(f"--- {k} ---\n{v}" for k, v in failed.items())
