"""GPU cases for test_default_device_gpu.py: the scenarios of tests/cases_default_device.py on the GPU
engines, with ``torch.set_default_device("cuda")`` (as DeepEP's test harness sets it) and under
``with torch.device("cuda")``, against the same calls with the default device left alone."""
from __future__ import annotations

import cases_default_device as D


def case_nvlink_normal(ctx):
    D.run_both(ctx, D.scenario_normal, default="cuda", backend="nvlink")


def case_nvlink_normal_context(ctx):
    D.run_with_device_context(ctx, D.scenario_normal, default="cuda", backend="nvlink")


def case_nvlink_low_latency(ctx):
    D.run_both(ctx, D.scenario_low_latency, default="cuda", backend="nvlink")


def case_nvlink_autograd(ctx):
    D.run_both(ctx, D.scenario_autograd, default="cuda", backend="nvlink")


def case_reference_normal(ctx):
    D.run_both(ctx, D.scenario_normal, default="cuda", backend="reference")


def case_reference_low_latency(ctx):
    D.run_both(ctx, D.scenario_low_latency, default="cuda", backend="reference")


def case_internode_normal(ctx):
    D.run_both(ctx, D.scenario_normal, default="cuda", backend="internode")


def case_internode_autograd(ctx):
    D.run_both(ctx, D.scenario_autograd, default="cuda", backend="internode")
