"""The internode engine against the reference backend on spawned CPU (gloo) worlds: 2 ranks (2x1),
4 (2x2, 4x1) and 8 (2x4, 4x2, 8x1). One world per size; every case runs inside it
(tests/cases_internode.py; the device runs the same cases over NCCL, tests/gpu/test_internode_gpu.py)."""

from worlds import case_tests

CASES = {
    2: ["matches_reference", "chunk_boundaries", "without_topk", "worst_no_read", "device_ops", "default_device_meta"],
    4: ["matches_reference", "chunk_boundaries", "random_stalls", "random_routings", "bad_expert_ids",
        "worst_no_read", "worst_kernel_route", "worst_over_cap", "mismatched_calls", "device_ops",
        "default_device_meta", "network_timeout"],
    8: ["matches_reference", "random_stalls", "without_topk", "worst_no_read", "network_timeout"],
}

world, test_case = case_tests("cases_internode", CASES, timeout_s=900)
