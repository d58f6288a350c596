"""What the host-time benchmarks share (bench_host: the NVLink call path; bench_internode --host: the
internode engine): the device-operation count of one call (PyTorch profiler), host wall / CPU time
per call with the host running ahead or not, the floor of bare primitives, a cProfile of an op.

Legend: a "device operation" is one of CATEGORIES: a launch, a copy (memcpy / memset), an
allocation (aten::empty*), an event record, an event wait, a host sync, a collective.
"""
from __future__ import annotations

import collections
import os
import statistics
import threading
import time

import torch
import torch.distributed as dist

from benchmarks.cpu_siblings import loop_seconds

# profiler event name -> category (CPU-side API calls; kernels and copies are read from device events)
_API = {"cudaEventRecord": "event_record", "cudaEventRecordWithFlags": "event_record",
        "cudaStreamWaitEvent": "event_wait", "cudaEventSynchronize": "sync", "cudaStreamSynchronize": "sync",
        "cudaDeviceSynchronize": "sync", "cudaEventQuery": "event_query"}
CATEGORIES = ("launch", "copy", "alloc", "event_record", "event_wait", "sync", "collective")


def pin_host(rank: int, ranks: int, mains: list | None = None) -> dict:
    """Pins the calling (main) thread of rank ``rank`` of ``ranks`` to a physical core of its own and
    every other thread of this process (NCCL's proxy and socket threads, torch's watchdog) off the
    ranks' cores: what a launcher binding ranks to cores does, so that an emulated transport's
    socket threads (which move every byte through host memory, unlike an RDMA NIC) do not run on, or
    beside, the core whose host time is measured. Call it again after new threads may have started;
    returns {"main": cpu, "others": [cpus]}, or {} where the host has too few cores.
    ``mains``: each rank's main-thread CPU, chosen by the caller (quiet_cpus); the others are every CPU of
    the process's first affinity but those."""
    if "allowed" not in _pinned:
        _pinned["allowed"] = sorted(os.sched_getaffinity(0))   # before any pinning
    allowed = _pinned["allowed"]
    if mains is not None:
        if len(allowed) < ranks + 2 or len(mains) != ranks:
            return {}
        _pinned.update(main=mains[rank], others=[c for c in allowed if c not in mains])
    elif "main" not in _pinned:   # the layout, once
        cores = {}
        for cpu in allowed:   # one entry per physical core: its hyperthreads
            try:
                with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
                    sib = f.read().strip()
            except OSError:
                sib = str(cpu)
            cores.setdefault(sib, []).append(cpu)
        phys = list(cores.values())
        if len(phys) < ranks + 2:
            return {}
        mains = phys[1:ranks + 1]   # core 0 left to the system
        taken = {c for core in mains for c in core}
        _pinned.update(main=mains[rank][0], others=[c for c in allowed if c not in taken])
    main, others = _pinned["main"], _pinned["others"]
    me = threading.get_native_id()
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), {main} if int(tid) == me else others)
        except OSError:   # a thread that ended meanwhile
            pass
    return {"main": main, "others": others}


_pinned: dict = {}


def quiet_cpus(n: int, iters: int = 50_000, reps: int = 3) -> list:
    """The ``n`` CPUs of this process's first affinity that run a short pure-Python loop fastest right now,
    fastest first, each timed alone on the calling thread (pinned there in turn, its affinity restored
    after). A lent machine's vCPUs are not alike: a neighbour of the machine can leave some at half
    speed for minutes (benchmarks.cpu_siblings); a rank's main thread pinned to one of the quiet ones
    measures the code, not the neighbour."""
    allowed = _pinned.get("allowed") or sorted(os.sched_getaffinity(0))
    me = threading.get_native_id()
    before = os.sched_getaffinity(me)
    best = {}
    try:
        for cpu in allowed:
            os.sched_setaffinity(me, {cpu})
            best[cpu] = min(loop_seconds(iters) for _ in range(reps))
    finally:
        os.sched_setaffinity(me, before)
    return sorted(best, key=best.get)[:n]


def current_cpu() -> int:
    """The CPU the calling thread last ran on (field 39 of /proc/thread-self/stat), -1 where unknown."""
    try:
        with open("/proc/thread-self/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[36])
    except (OSError, IndexError, ValueError):
        return -1


def count_device_ops(fn) -> dict:
    """Device operations ``fn()`` issues, by category (see CATEGORIES), from one profiled call, less
    what the profiler itself issues around an empty function (its own synchronisations)."""
    base = _profiled_ops(lambda: None)
    counts = _profiled_ops(fn)
    counts = {c: max(0, counts[c] - base[c]) for c in CATEGORIES}
    counts["total"] = sum(counts.values())
    return counts


def _profiled_ops(fn) -> dict:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    counts = collections.Counter({c: 0 for c in CATEGORIES})
    for ev in prof.events():
        name = ev.name
        on_device = ev.device_type == torch.autograd.DeviceType.CUDA
        if on_device:
            low = name.lower()
            if low.startswith(("memcpy", "memset")):
                counts["copy"] += 1
            elif "nccl" not in low:   # a collective's kernel: counted once, by its c10d op below
                counts["launch"] += 1
        elif name in _API:
            counts[_API[name]] += 1
        elif name in ("aten::empty", "aten::empty_strided"):
            counts["alloc"] += 1
        elif name.startswith("c10d::"):   # one per collective (its "gloo:" / "nccl:" record is inside it)
            counts["collective"] += 1
    return dict(counts)


def device_busy(us: float) -> None:
    if torch.cuda.is_available():
        torch.cuda._sleep(int(us * 2000))   # ~2 cycles per ns at the H200's clocks: busy well past the loop


def phases_line(label: str, phases_us: dict, rank: int = 0) -> str:
    """The printed line of a C++ call's per-phase medians (commlib.cuda.callpath.phases: {"op.phase": us})."""
    parts = " ".join(f"{k.split('.', 1)[1]} {v:.2f}" for k, v in phases_us.items())
    total = sum(phases_us.values())
    # the full dispatches' count poll and digest wait (not the host's own time)
    wait = phases_us.get("dispatch.wait", 0.0) + phases_us.get("in_dispatch.read_wait", 0.0)
    own = f", own {total - wait:.1f} without wait" if wait else ""
    return f"# phases (rank {rank}, median us) {label}: {parts} (sum {total:.1f}{own})"


QUANTILES = (10, 50, 90)


def percentiles(values, qs=QUANTILES) -> list:
    """The ``qs`` percentiles of ``values``, interpolated linearly between the sorted values (numpy's
    default); a single value is every percentile of itself."""
    v = sorted(values)
    if not v:
        raise ValueError("percentiles: no values")
    out = []
    for q in qs:
        pos = (len(v) - 1) * q / 100.0
        lo = int(pos)
        hi = min(lo + 1, len(v) - 1)
        out.append(v[lo] + (v[hi] - v[lo]) * (pos - lo))
    return out


def host_times(fn, iters: int, ahead: bool, group, wait_ns=None, excluded_ns=None, samples=False) -> dict:
    """Median wall / CPU us per call of ``iters`` back-to-back calls; ``ahead``: the device is kept
    busy so no call waits for it; else (calls that read counts) ``wait_ns()`` reports the time each
    call spent blocked in its count read (on the device's earlier work, the notify kernel, the peers).
    ``excluded_ns()``: time of the call just made spent in code that is not the caller's own (the
    collectives' issue and wait): its median is ``excluded_us``, and ``own_us`` leaves it out too.
    ``samples``: also ``samples_us``, each call's figures ({wall, cpu[, wait, own]}: a list each)."""
    walls, cpus, waits, excluded = [], [], [], []
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dist.barrier(group=group)
    if ahead:
        device_busy(iters * 2000.0)
    for _ in range(iters):
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        fn()
        t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        walls.append((t1 - t0) / 1e3)
        cpus.append((c1 - c0) / 1e3)
        waits.append(wait_ns() / 1e3 if wait_ns is not None else 0.0)
        excluded.append(excluded_ns() / 1e3 if excluded_ns is not None else 0.0)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    out = {"host_us": statistics.median(walls), "cpu_us": statistics.median(cpus)}
    if wait_ns is not None or excluded_ns is not None:
        own = [w - x - e for w, x, e in zip(walls, waits, excluded)]
        out.update(wait_us=statistics.median(waits), own_us=statistics.median(own))
    if excluded_ns is not None:
        out.update(total_us=statistics.median([w - x for w, x in zip(walls, waits)]),
                   excluded_us=statistics.median(excluded))
    if samples:
        out["samples_us"] = {"wall": walls, "cpu": cpus}
        if wait_ns is not None or excluded_ns is not None:
            out["samples_us"].update(wait=waits, own=own)
    return out


def allocations(fn) -> list:
    """(shape, dtype) of each tensor ``fn()`` makes through ``torch.empty`` (one call, spied)."""
    made, real = [], torch.empty

    def spy(*size, **kw):
        t = real(*size, **kw)
        made.append((tuple(t.shape), t.dtype))
        return t

    torch.empty = spy
    try:
        fn()
    finally:
        torch.empty = real
    return made


def floor_fn(counts: dict, device: torch.device, reads: int, shapes: tuple = ()):
    """The bare primitives of a call with ``counts``: what no implementation of the call can skip.
    Its allocations take ``shapes`` (the call's own (shape, dtype) list, see allocations), the rest
    of the counted ones 16 int32 words."""
    cuda = device.type == "cuda"
    src = torch.zeros(16, dtype=torch.int32, device=device)
    dst = torch.empty_like(src)
    ev = torch.cuda.Event() if cuda else None
    stream = torch.cuda.current_stream() if cuda else None
    n = dict(counts)
    sized = list(shapes)[:n["alloc"]]
    small = n["alloc"] - len(sized)

    def run():
        held = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in sized]
        for _ in range(small):
            torch.empty(16, dtype=torch.int32, device=device)
        del held
        if cuda:
            for _ in range(n["launch"]):
                torch.cuda._sleep(0)
            for _ in range(n["copy"]):
                dst.copy_(src, non_blocking=True)
            for _ in range(n["event_record"]):
                ev.record(stream)
            for _ in range(n["event_wait"]):
                stream.wait_event(ev)
            for _ in range(reads):
                src[0].item()
    return run


def cprofile(op: str, fn, iters: int) -> str:
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        fn()
    prof.disable()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
    return f"# [profile] {op} ({iters} calls)\n{s.getvalue()}"
