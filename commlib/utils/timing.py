"""Timing helpers shared by the main job and the benchmarks (docs/launch.md, "The performance method").

``bench_cuda(fn)``: one CUDA event pair per iteration around ``fn()``, an L2 flush before each
timed run, median of ``iters`` samples. On a machine without CUDA (or with ``device="cpu"``) it
times each call with ``time.perf_counter``; no barrier is added between iterations (a collective
inside ``fn`` keeps the ranks in step, exactly as it does on the GPU).

``kernel_time(fn, names)``: GPU time of the kernels whose names contain one of ``names`` (e.g.
``"dispatch"``), from the PyTorch profiler, per call: "kernel-only" time without launch gaps and
host work. ``None`` without CUDA.

``reduce_times(result, group)``: the slowest rank's figures, so one rank's table reports what
every rank waited for.

``thread_usage()``: this thread's CPU seconds and context switches (voluntary, involuntary), to tell
host time spent computing from host time spent blocked or preempted.
"""
from __future__ import annotations

try:
    import resource
except ImportError:   # not on Windows: thread_usage() falls back to time.thread_time()
    resource = None
import statistics
import time
from typing import Callable, Iterable, Optional, Sequence

import torch

# Bigger than any L2 we target (H100/H200: 50/60 MB); writing it evicts the previous run's rows.
L2_FLUSH_BYTES = 256 << 20


def _on_cuda(device) -> bool:
    if device is not None:
        return torch.device(device).type == "cuda"
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def capture_graph(fn: Callable[[], object], warm: bool = True, capture_error_mode: str = "global"):
    """(graph, fn's outputs): fn captured into a CUDA graph on the current device. With ``warm``,
    fn runs once eagerly on a side stream first, as torch recommends before a capture (lazy
    allocations and set-up happen outside the graph)."""
    if warm:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode=capture_error_mode):
        out = fn()
    return graph, out


def thread_usage() -> tuple:
    """(CPU seconds, voluntary switches, involuntary switches) of the calling thread so far. A step
    whose wall time is well above its CPU time was blocked (voluntary: it slept on a lock or a wait)
    or preempted (involuntary). CPU time from the thread's CPU clock (nanoseconds; getrusage's is
    counted in scheduler ticks, 4 ms on some kernels); switches 0 where the OS does not count them
    per thread."""
    try:
        u = resource.getrusage(resource.RUSAGE_THREAD)
    except (AttributeError, OSError):
        return time.thread_time(), 0, 0
    return time.thread_time(), u.ru_nvcsw, u.ru_nivcsw


def summarize(samples_us: Sequence[float]) -> dict:
    """dict(median_us, mean_us, min_us, max_us, samples) of per-iteration times in microseconds."""
    samples = [float(s) for s in samples_us]
    if not samples:
        raise ValueError("summarize: no samples")
    return {
        "median_us": statistics.median(samples),
        "mean_us": statistics.fmean(samples),
        "min_us": min(samples),
        "max_us": max(samples),
        "samples": samples,
    }


def bench_cuda(fn: Callable[[], object], warmup: int = 5, iters: int = 20, flush_l2: bool = True,
               device: Optional[torch.device | str] = None) -> dict:
    """Time ``fn()``: ``warmup`` untimed calls, then ``iters`` timed ones.

    GPU (``device`` is CUDA, or unset and CUDA is initialised): each timed call sits between two
    CUDA events on the current stream; before it, a 256 MB buffer is zeroed so the call starts
    with a cold L2 (the flush is outside the event pair). CPU: ``time.perf_counter`` around each
    call; ``flush_l2`` is ignored there (zeroing 256 MB per iteration would dominate a 2-core run).

    Returns dict(median_us, mean_us, min_us, max_us, samples) for this rank.
    """
    if iters <= 0:
        raise ValueError(f"bench_cuda: iters must be positive, got {iters}")
    if warmup < 0:
        raise ValueError(f"bench_cuda: warmup must be >= 0, got {warmup}")
    if not _on_cuda(device):
        for _ in range(warmup):
            fn()
        samples = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e6)
        return summarize(samples)

    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=dev) if flush_l2 else None
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(dev)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        if flush is not None:
            flush.zero_()
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize(dev)
    samples = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]
    del flush
    return summarize(samples)


def loop_ms(fn: Callable[[], object], reps: int, end: Optional[list] = None) -> float:
    """Mean ms per call of ``reps`` back-to-back ``fn()`` calls on the current CUDA stream: one event
    pair around the whole loop, one device sync; no warm-up, no L2 flush (for loops timed while other
    streams run beside them). ``end``: a list that receives the end event."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    stop.record()
    torch.cuda.synchronize()
    if end is not None:
        end.append(stop)
    return start.elapsed_time(stop) / reps


def kernel_time(fn: Callable[[], object], names: str | Iterable[str], warmup: int = 5, iters: int = 20,
                flush_l2: bool = True) -> Optional[dict]:
    """Per-call GPU time (us) of the kernels whose names contain each of ``names``.

    Returns {name: us per call} (the sum over matching kernels, divided by ``iters``), or ``None``
    without CUDA. Uses the PyTorch profiler (kineto), as DeepEP's ``bench_kineto`` does.
    """
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    names = [names] if isinstance(names, str) else list(names)
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda") if flush_l2 else None
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    try:  # acc_events keeps every event of the run (torch >= 2.4); older versions keep them anyway
        prof_ctx = profile(activities=[ProfilerActivity.CUDA], acc_events=True)
    except TypeError:
        prof_ctx = profile(activities=[ProfilerActivity.CUDA])
    with prof_ctx as prof:
        for _ in range(iters):
            if flush is not None:
                flush.zero_()
            fn()
        torch.cuda.synchronize()
    totals = {name: 0.0 for name in names}
    for evt in prof.key_averages():
        # device_time_total in newer torch, cuda_time_total in older
        dev_us = getattr(evt, "device_time_total", None)
        if dev_us is None:
            dev_us = getattr(evt, "cuda_time_total", 0.0)
        for name in names:
            if name in evt.key:
                totals[name] += float(dev_us)
    return {name: total / iters for name, total in totals.items()}


def slowest(values: Sequence[float], group=None) -> list[float]:
    """Each value maximised over the ranks of ``group`` (the slowest rank's figure); the values as
    they are when no process group is up."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return [float(v) for v in values]
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    t = torch.tensor(list(values), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def reduce_times(result: dict, group=None) -> dict:
    """The slowest rank's median/mean/min/max (each maximised over ranks); ``samples`` stay local."""
    keys = ("median_us", "mean_us", "min_us", "max_us")
    out = dict(result)
    out.update(zip(keys, slowest([result[k] for k in keys], group)))
    return out
