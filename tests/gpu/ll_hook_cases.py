"""GPU cases for test_ll_hooks_gpu.py: what a low-latency call and its receive hook launch (nvlink engine).

DeepEP's hooked call launches its send kernel and the hook its receive kernel (the same kernel, two
phases), so a profiler sees two ``::dispatch`` / ``::combine`` kernels per hooked call and one per
plain call; DeepEP's test counts them that way (bench_kineto, num_kernels_per_period=2).
"""
from __future__ import annotations

import json
import os
import tempfile

import torch

from commlib.buffer import Buffer
from commlib.cuda import loader

M, H, E_PER_RANK, K = 32, 1024, 4, 4


def _setup(ctx):
    R = ctx.world_size
    E = E_PER_RANK * R
    buf = Buffer(ctx.group, 0, Buffer.get_low_latency_rdma_size_hint(M, H, R, E), low_latency_mode=True,
                 backend="nvlink", explicitly_destroy=True)
    g = torch.Generator(device="cpu").manual_seed(11 + ctx.rank)
    x = torch.randn(M, H, generator=g, device="cpu").to(torch.bfloat16).to(ctx.device)
    idx = torch.rand(M, E, generator=g, device="cpu").topk(K, dim=1).indices.to(ctx.device)
    w = torch.rand(M, K, generator=g, device="cpu").to(ctx.device)
    return buf, x, idx, w, E


def _names(launches, word):
    return [name for name, _, _ in launches if word in name]


def case_launch_counts(ctx):
    """Per call: plain 1 dispatch / 1 combine launch; hooked 1 in the call and 1 in the hook."""
    buf, x, idx, w, E = _setup(ctx)
    for fp8 in (False, True):
        with loader.record_launches() as plain:
            buf.low_latency_dispatch(x, idx, M, E, use_fp8=fp8)
        assert len(_names(plain, "dispatch")) == 1, plain
        with loader.record_launches() as call:
            _, _, _, _, hook = buf.low_latency_dispatch(x, idx, M, E, use_fp8=fp8, return_recv_hook=True)
        with loader.record_launches() as received:
            hook()
        assert len(_names(call, "dispatch")) == 1 and len(_names(received, "dispatch")) == 1, (call, received)
    y, _, handle, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    with loader.record_launches() as plain:
        buf.low_latency_combine(y, idx, w, handle)
    assert len(_names(plain, "combine")) == 1, plain
    with loader.record_launches() as call:
        _, _, hook = buf.low_latency_combine(y, idx, w, handle, return_recv_hook=True)
    with loader.record_launches() as received:
        hook()
    assert len(_names(call, "combine")) == 1 and len(_names(received, "combine")) == 1, (call, received)
    torch.cuda.synchronize()
    buf.destroy()


def _kernel_events(prof) -> list:
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    return [e["name"] for e in events if e.get("cat") == "kernel"]


def case_profiler_view(ctx):
    """What DeepEP's bench_kineto reads: each kernel name holds ``::dispatch`` / ``::combine``, one
    kernel name per op (one line of the profiler's table), two kernels per hooked call, one per plain."""
    buf, x, idx, w, E = _setup(ctx)
    n = 3
    counts = {}
    for hook in (False, True):
        def step():
            _, _, handle, _, h = buf.low_latency_dispatch(x, idx, M, E, use_fp8=True, return_recv_hook=hook)
            if hook:
                h()
            y = torch.zeros((E // ctx.world_size, ctx.world_size * M, H), dtype=torch.bfloat16, device=ctx.device)
            _, _, h = buf.low_latency_combine(y, idx, w, handle, return_recv_hook=hook)
            if hook:
                h()
        step()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                step()
            torch.cuda.synchronize()
        names = _kernel_events(prof)
        for op in ("dispatch", "combine"):
            mine = [s for s in names if f"::{op}" in s]
            distinct = {s for s in names if op in s}
            assert len(distinct) == 1, f"rank {ctx.rank}: kernels naming {op!r}: {sorted(distinct)} (want one name)"
            counts[(op, hook)] = len(mine)
    assert counts == {("dispatch", False): n, ("combine", False): n, ("dispatch", True): 2 * n,
                      ("combine", True): 2 * n}, counts
    buf.destroy()
