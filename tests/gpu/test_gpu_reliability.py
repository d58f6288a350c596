"""Long GPU run: 10,000 rounds on the NVLink engine, hashes equal to the reference, memory flat."""
import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_long_run_10k_rounds():
    from worlds import run_world
    os.environ.setdefault("COMMLIB_TIMEOUT_S", "60")
    results = run_world(2, "reliability_cases", ["long_run"], use_gpu=True, timeout_s=900)
    assert results["long_run"] is None, results["long_run"]
