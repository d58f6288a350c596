"""Hierarchical engine on 2 GPUs: 2 emulated nodes x 1 GPU, and 2 x 2 (two processes per GPU)."""
import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs 2 GPUs")]


@pytest.mark.parametrize("world_size,case", [(2, "two_nodes_of_one"), (4, "two_nodes_of_two")])
def test_hierarchical_matches_reference(world_size, case):
    from worlds import run_world
    os.environ.setdefault("COMMLIB_TIMEOUT_S", "60")
    results = run_world(world_size, "hierarchical_cases", [case], use_gpu=True, timeout_s=300)
    assert results[case] is None, results[case]
