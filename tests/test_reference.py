"""The reference backend against the independent oracle, on spawned CPU (gloo) worlds of 1, 2, 4
and 8 ranks, with every topology the world allows (nodes x ranks per node: 1x8, 2x4, 4x2, 8x1, ...).
One world per size; all cases run inside it."""

import cases_reference as C
from worlds import case_tests

ROUTING_CASES = [f"routing_{name}" for name in C.ROUTINGS]
CASES = {
    1: ROUTING_CASES + ["options", "bad_input", "error_kinds"],
    2: ROUTING_CASES + ["options", "bad_input", "one_channel", "error_kinds"],
    4: ROUTING_CASES + ["options"],
    8: ROUTING_CASES + ["options", "node_limit"],
}


world, test_case = case_tests("cases_reference", CASES, timeout_s=600)
