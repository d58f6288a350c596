"""DeepEP v1 compatibility through ``import deep_ep``, on spawned CPU (gloo) worlds of 2 and 4 ranks:
the API surface, high-throughput and low-latency semantics, shrink mode, and the call sequences of
Megatron-LM, SGLang and vLLM (tests/cases_deep_ep.py). One world per size; all cases run inside it."""
from worlds import case_tests

CASES = {
    2: ["surface", "intranode", "low_latency", "shrink", "megatron", "sglang", "vllm"],
    4: ["surface", "intranode", "internode_handle", "low_latency", "shrink", "megatron"],
}


world, test_case = case_tests("cases_deep_ep", CASES, timeout_s=600)
