"""Where the host time of a call goes: cProfile over N cached dispatch / combine calls on 2 GPUs.

    python -m benchmarks.profile_host [--tokens 4096] [--hidden 7168] [--calls 200] [--fp8]

Prints the per-call host time and the functions with the most own time (rank 0). The GPU engines
are host-bound when this per-call time exceeds the kernel time (small batches, FP8).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch



def worker(ctx, a):
    from commlib import routing
    from commlib.buffer import Buffer
    from commlib.fp8 import per_token_cast_to_fp8
    cfg = Buffer.get_dispatch_config(ctx.world_size)
    buf = Buffer(ctx.group, cfg.get_nvl_buffer_size_hint(a.hidden * 2, ctx.world_size))
    g = torch.Generator(device=ctx.device).manual_seed(ctx.rank)
    scores = torch.rand(a.tokens, 256, generator=g, device=ctx.device)
    idx, w = routing.group_limited_topk(scores, 8, 4, 8)
    x = torch.randn(a.tokens, a.hidden, generator=g, device=ctx.device).to(torch.bfloat16)
    xin = per_token_cast_to_fp8(x) if a.fp8 else x
    ntr, nrr, nte, tir, _ = buf.get_dispatch_layout(idx, 256)
    rx, ri, rw, _, h, _ = buf.dispatch(xin, num_tokens_per_rank=ntr, is_token_in_rank=tir, num_tokens_per_expert=nte,
                                       topk_idx=idx, topk_weights=w, config=cfg)
    y = (rx[0].float() if a.fp8 else rx.float()).to(torch.bfloat16)
    ops = {"cached dispatch": lambda: buf.dispatch(xin, handle=h, config=cfg),
           "combine": lambda: buf.combine(y, h, config=cfg)}
    out = []
    for name, fn in ops.items():
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(a.calls):
            fn()
        prof.disable()
        per_call = (time.perf_counter() - t0) / a.calls * 1e6
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
        out.append(f"[profile] {name}: {per_call:.1f} us host per call (under cProfile)\n{s.getvalue()}")
        t0 = time.perf_counter()
        for _ in range(a.calls):
            fn()
        out.append(f"[profile] {name}: {(time.perf_counter() - t0) / a.calls * 1e6:.1f} us host per call (no profiler)")
        torch.cuda.synchronize()
    out.append(launch_path())
    return "\n".join(out) if ctx.rank == 0 else None


def launch_path() -> str:
    """Which path the data kernels were launched through: the ctypes cuLaunchKernel one needs a
    CUfunction handle (kernels.cu_function_handle: ``.ptr``, or ``.kernel.ptr`` on CuPy 14); without one
    every launch takes CuPy's."""
    from commlib.cuda import loader as K
    kinds = sorted({type(lau.fn).__name__ for lau in K._launchers.values()})
    with_handle = sum(1 for lau in K._launchers.values() if lau.handle)
    fast = K._fast_launch and with_handle == len(K._launchers)
    return (f"[profile] launch path: {'ctypes cuLaunchKernel' if fast else 'CuPy'} (COMMLIB_FAST_LAUNCH "
            f"{int(K._fast_launch)}; {with_handle} of {len(K._launchers)} kernels have a handle; "
            f"function objects: {', '.join(kinds)})")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--fp8", action="store_true")
    a = p.parse_args()
    from commlib.utils.launch import parallel_launch
    print(parallel_launch(2, worker, a, use_gpu=True, timeout_s=300))


if __name__ == "__main__":
    main()
