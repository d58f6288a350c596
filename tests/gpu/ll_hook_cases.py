"""GPU cases for test_ll_hooks_gpu.py: the nvlink low-latency engine where DeepEP's tests look: what a
call and its receive hook launch, and shrink mode with a rank that stops calling.

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


def _inputs(rank: int, E: int):
    """Rank ``rank``'s x [M, H] bf16, topk_idx [M, K] int64, topk_weights [M, K] float32 (on the CPU)."""
    g = torch.Generator(device="cpu").manual_seed(11 + rank)
    x = torch.randn(M, H, generator=g, device="cpu").to(torch.bfloat16)
    idx = torch.rand(M, E, generator=g, device="cpu").topk(K, dim=1).indices
    w = torch.rand(M, K, generator=g, device="cpu")
    return x, idx, w


def _setup(ctx, **kw):
    R = ctx.world_size
    E = E_PER_RANK * R
    buf = Buffer(ctx.group, 0, Buffer.get_low_latency_rdma_size_hint(M, H, R, E), low_latency_mode=True,
                 backend="nvlink", explicitly_destroy=True, **kw)
    x, idx, w = (t.to(ctx.device) for t in _inputs(ctx.rank, E))
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


def case_stopped_rank(ctx):
    """Shrink mode (DeepEP's --shrink-test): every rank calls once; then rank R - 1 stops calling. The
    others mask it after one timeout (the roll call), their dispatch counts only the live sources'
    rows, their combine completes, and the mask reads back with it set."""
    R, me = ctx.world_size, ctx.rank
    buf, x, idx, w, E = _setup(ctx, enable_shrink=True)
    L, gone = E // R, R - 1
    rx, _, handle, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    buf.low_latency_combine(rx, idx, w, handle)
    torch.cuda.synchronize()
    if me != gone:
        rx, count, handle, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
        live = [_inputs(r, E)[1] for r in range(R) if r != gone]
        want = [sum(int((i == me * L + e).sum()) for i in live) for e in range(L)]
        assert count.cpu().tolist() == want, (count.cpu().tolist(), want)
        out, _, _ = buf.low_latency_combine(rx, idx, w, handle)
        torch.cuda.synchronize()
        assert not torch.isnan(out.float()).any()
        status = torch.zeros(R, dtype=torch.int32, device=ctx.device)
        buf.low_latency_query_mask_buffer(status)
        assert status.cpu().tolist() == [int(r == gone) for r in range(R)], status
        buf.clean_low_latency_buffer(M, H, E)   # with a rank masked: the roll call again, nothing hangs
    torch.distributed.barrier()
    buf.destroy()
