"""commlib whatever torch's default device is: the reference backend's dispatch / combine / cached /
num_worst_tokens / layout, the low-latency reference and autograd, run on spawned CPU (gloo) worlds
of 2 ranks and of 4 ranks as 2 nodes x 2, under a meta default device (and a bf16 default dtype, as
DeepEP's tests set) inside the ranks, against the same calls with the defaults left alone
(cases_default_device.py says how)."""
from __future__ import annotations

import pytest

from worlds import run_world

CASES = ["normal", "normal_context", "low_latency", "autograd"]
WORLDS = {2: 2, 4: 2}  # world size -> ranks per node


@pytest.fixture(scope="module", params=sorted(WORLDS))
def world(request):
    size = request.param
    return size, run_world(size, "cases_default_device", CASES, ranks_per_node=WORLDS[size], timeout_s=600)


@pytest.mark.parametrize("case", CASES)
def test_case(world, case):
    size, results = world
    assert results[case] is None, results[case]
