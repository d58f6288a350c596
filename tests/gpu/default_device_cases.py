"""GPU cases for test_default_device_gpu.py: the scenarios of tests/cases_default_device.py on the GPU
engines, with ``torch.set_default_device("cuda")`` (as DeepEP's test harness sets it) and under
``with torch.device("cuda")``, against the same calls with the default device left alone."""
from __future__ import annotations

import cases_default_device as D

# case name -> (how the default device is set, scenario, backend)
CASES = {
    "nvlink_normal": (D.run_both, D.scenario_normal, "nvlink"),
    "nvlink_normal_context": (D.run_with_device_context, D.scenario_normal, "nvlink"),
    "nvlink_low_latency": (D.run_both, D.scenario_low_latency, "nvlink"),
    "nvlink_autograd": (D.run_both, D.scenario_autograd, "nvlink"),
    "reference_normal": (D.run_both, D.scenario_normal, "reference"),
    "reference_low_latency": (D.run_both, D.scenario_low_latency, "reference"),
    "internode_normal": (D.run_both, D.scenario_normal, "internode"),
    "internode_autograd": (D.run_both, D.scenario_autograd, "internode"),
}


def _case(run, scenario, backend):
    return lambda ctx: run(ctx, scenario, default="cuda", backend=backend)


for _name, _spec in CASES.items():
    globals()[f"case_{_name}"] = _case(*_spec)
