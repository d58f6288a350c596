"""The reference backend against the independent oracle, on spawned CPU (gloo) worlds of 1, 2, 4
and 8 ranks, with every topology the world allows (nodes x ranks per node: 1x8, 2x4, 4x2, 8x1, ...).
One world per size; all cases run inside it."""
import pytest

import cases_reference as C
from worlds import run_world

ROUTING_CASES = [f"routing_{name}" for name in C.ROUTINGS]
CASES = {
    1: ROUTING_CASES + ["options", "bad_input"],
    2: ROUTING_CASES + ["options", "bad_input", "hierarchical_engine", "one_channel"],
    4: ROUTING_CASES + ["options", "hierarchical_engine"],
    8: ROUTING_CASES + ["options", "node_limit", "hierarchical_engine"],
}


@pytest.fixture(scope="module", params=sorted(CASES))
def world(request):
    size = request.param
    return size, run_world(size, "cases_reference", CASES[size], timeout_s=600)


@pytest.mark.parametrize("case", sorted({c for cs in CASES.values() for c in cs}))
def test_case(world, case):
    size, results = world
    if case not in results:
        pytest.skip(f"not run at world size {size}")
    assert results[case] is None, results[case]
