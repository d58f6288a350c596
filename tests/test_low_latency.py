"""Low-latency (decode) mode: reference transport vs an independent oracle, 2 and 4 CPU ranks."""
import pytest

from worlds import run_world

CASES = ["bf16", "fp8", "errors"]


@pytest.mark.parametrize("world_size", [2, 4])
def test_low_latency(world_size):
    results = run_world(world_size, "cases_low_latency", CASES, timeout_s=600)
    failed = {k: v for k, v in results.items() if v}
    assert not failed, "\n\n".join(f"--- {k} ---\n{v}" for k, v in failed.items())
