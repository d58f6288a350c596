"""DeepEP v1 compatibility through ``import deep_ep``, on spawned CPU (gloo) worlds of 2 and 4 ranks:
the API surface, high-throughput and low-latency semantics, shrink mode, and the call sequences of
Megatron-LM, SGLang and vLLM (tests/cases_deep_ep.py). One world per size; all cases run inside it."""
import pytest
from worlds import run_world

CASES = {
    2: ["surface", "intranode", "low_latency", "shrink", "megatron", "sglang", "vllm"],
    4: ["surface", "intranode", "internode_handle", "low_latency", "shrink", "megatron"],
}


@pytest.fixture(scope="module", params=sorted(CASES))
def world(request):
    size = request.param
    return size, run_world(size, "cases_deep_ep", CASES[size], timeout_s=600)


@pytest.mark.parametrize("case", sorted({c for cs in CASES.values() for c in cs}))
def test_case(world, case):
    size, results = world
    if case not in results:
        pytest.skip(f"not run at world size {size}")
    assert results[case] is None, results[case]
