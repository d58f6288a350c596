"""Megatron-Core's MoELayer with the flex dispatcher on commlib (``import deep_ep``), on a spawned
2-rank CPU (gloo) world, against Megatron's alltoall dispatcher and an FP32 oracle
(tests/cases_megatron.py). Skipped where megatron-core is not installed (the ``test`` extra installs
it: pyproject.toml). The GPU version is ``python -m benchmarks.megatron_moe`` (gpu_check stage ``megatron``)."""
import pytest

from benchmarks.megatron_moe import megatron_available

if not megatron_available():   # not importorskip: importing megatron.core costs seconds, and a missing
    # optional module inside it (triton) would read as "not installed"
    pytest.skip("megatron-core is not installed", allow_module_level=True)

from worlds import case_tests  # noqa: E402

CASES = {2: ["top4", "top1", "dropped", "uses_commlib", "bench_worker"]}

world, test_case = case_tests("cases_megatron", CASES, timeout_s=600)
