"""Internode benchmark: the internode engine on emulated nodes against the flat all-to-all, a K sweep.

    python -m benchmarks.bench_internode [--ranks 2 --ranks-per-node 1] [--tokens 4096] [--chunks 1,2,4,8]
                                         [--emulate-hosts] [--json [PATH]]

Runs commlib.bench.main's checked workload (V3 on GPUs, scaled down on CPUs) with
``backend="internode"`` once per network chunk cap (``--chunks``: COMMLIB_NETWORK_CHUNKS), beside
the flat all_to_all_single of the same rows and the reference backend, all in one run, and reports
per op and rank:
  time          median of the timed calls (CUDA events on GPUs);
  host us       host time of one call: its wall time less the time spent blocked in its one host
                read (non-cached dispatch), each call issued on an idle device; busy us: the same
                behind a ~30 ms kernel (GPU only); engine: either less the time inside
                torch.distributed's calls and waits;
  K             network chunks the call used (every rank runs the same number);
  network GB/s  rows that crossed between (emulated) nodes x row bytes / time;
  NVLink GB/s   rows moved between two ranks of one node x row bytes / time.
The JSON adds, per rank (GPU): host time with the host running ahead of the GPU
(``host_steady_us_by_rank``), the calling thread's CPU time behind running work and running ahead
(``host_busy_cpu_us_by_rank``, ``host_steady_cpu_us_by_rank``), its context switches
([voluntary, involuntary]: ``host_busy_switches_by_rank``, ``host_steady_switches_by_rank``) and the
allocator's cudaMalloc calls (``host_mallocs_by_rank``), each a median per call, and the device
operations one call issues (``device_ops``: launches, copies, allocations, event ops, collectives,
counted by the engine's probe, backends/probe.py); ``--profile``
prints the same wall / CPU split per step of the engine's call.
``--host`` times the host alone (bench_host's JSON shape); where the internode C++ call path
(csrc/callpath_internode.cpp) loaded on every rank, its rows (``*_cpp``) carry ``phases_us``, rank 0's
median us per phase of the C++ call, also printed as ``# phases (rank 0, median us) ...`` lines.
``--emulate-hosts`` gives every rank its own NCCL_HOSTID (NCCL's socket transport between them,
and processes may share a GPU: host times are then meaningful, device times are not).
On one machine the "network" is not InfiniBand: 2 GPUs as 2 nodes x 1 send the network hop over
NVLink (NCCL), and CPU ranks over loopback (gloo). The figures show the engine's data path and
its once-per-node traffic, not IB performance; experiments/model_internode.py predicts that.
Every row (the internode engine's, the flat baseline's, the reference backend's) is checked
against commlib.bench.oracle, #wrong summed over the ranks; exit status 1 when any is wrong.
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time

import torch
import torch.distributed as dist

from benchmarks.cpu_siblings import cpu_times, loop_seconds, steal_percent
from commlib.backends.internode import kernels as IK
from commlib.backends.internode.exchange import row_len as exchange_row_len
from commlib.backends.probe import NULL_PROBE, RecordingProbe
from commlib.bench import main as B
from commlib.bench import results
from commlib.cuda import callpath
from commlib.utils.timing import slowest, thread_usage

OPS = ["dispatch_bf16", "dispatch_bf16_cached", "dispatch_fp8", "combine"]
BASELINE_OPS = ["a2a_dispatch_bf16", "a2a_combine"]  # flat all_to_all_single over every rank, same run


# The two-GPU targets (issue: the internode engine): engine time / flat all-to-all time over NCCL's
# NVLink transport, and over its socket transport the network leg's GB/s against the flat
# all-to-all's bus bandwidth.
NVLINK_TARGETS = {"dispatch_bf16": 1.25, "dispatch_bf16_cached": 1.1, "combine": 1.3}
SOCKET_NET_SHARE = 0.85
HOST_BASE_US, HOST_PER_CHUNK_US = 200.0, 20.0   # host time per dispatch <= 0.2 ms + 20 us per chunk


def target_verdicts(rows: list, socket: bool, shared_gpu: bool) -> list:
    """The targets this run speaks to, each with its value, limit, the chunk cap that did best and
    whether it is met. ``socket``: NCCL ran over its socket transport (--emulate-hosts); ``shared_gpu``:
    ranks shared a GPU, so the verdicts are printed but mean nothing (time-sliced)."""
    best = {}
    for r in rows:
        if "vs_flat_a2a" in r and (r["op"] not in best or r["vs_flat_a2a"] < best[r["op"]]["vs_flat_a2a"]):
            best[r["op"]] = r
    out = []
    if not socket:
        for op, limit in NVLINK_TARGETS.items():
            if op in best:
                v = best[op]["vs_flat_a2a"]
                out.append({"target": f"{op}: engine time / flat all-to-all time (NCCL over NVLink)", "value": round(v, 3),
                            "limit": f"<= {limit}", "chunk_cap": best[op]["chunk_cap"], "met": v <= limit})
    else:
        flat = next((r for r in rows if r["op"] == "a2a_dispatch_bf16"), None)
        eng = [r for r in rows if r["op"] == "dispatch_bf16"]
        if flat is not None and eng and flat.get("busbw_gbps"):
            top = max(eng, key=lambda r: r["net_gbps"])
            share = top["net_gbps"] / flat["busbw_gbps"]
            out.append({"target": "dispatch network leg GB/s / flat all-to-all busbw (NCCL socket transport)",
                        "value": round(share, 3), "limit": f">= {SOCKET_NET_SHARE}", "chunk_cap": top["chunk_cap"],
                        "met": share >= SOCKET_NET_SHARE})
    for t in out:
        t["meaningful"] = not shared_gpu
    # host time per non-cached dispatch, issued behind running work (as in a training step): the host's
    # own time, so ranks sharing a GPU measure it too
    host = [r for r in rows if r["op"] == "dispatch_bf16" and r.get("host_busy_us")]
    if host:
        top = min(host, key=lambda r: r["host_busy_us"] / (HOST_BASE_US + HOST_PER_CHUNK_US * r["chunks"]))
        limit = HOST_BASE_US + HOST_PER_CHUNK_US * top["chunks"]
        out.append({"target": f"dispatch host time (us, behind running work) at K = {top['chunks']} chunks",
                    "value": round(top["host_busy_us"], 1), "limit": f"<= {limit:.0f}", "chunk_cap": top["chunk_cap"],
                    "met": top["host_busy_us"] <= limit, "meaningful": True})
        floor = next((r["host_floor_busy_us"] for r in host if r.get("host_floor_busy_us")), None)
        if floor:   # the same host's bare operations (dispatch_floor): what no code of commlib can go under
            out[-1]["floor_us"] = round(floor, 1)
    return out


def _row_bytes(op: str, hidden: int) -> int:
    return hidden + hidden // 128 * 4 if op == "dispatch_fp8" else hidden * 2


BUSY_CYCLES = 60_000_000   # ~30 ms of a spinning kernel at H200 clocks: longer than any call's issue
COLLECTIVES = ("all_to_all_single", "all_gather_single", "all_gather_into_tensor", "all_gather")


class _CollectiveClock:
    """Host time spent inside torch.distributed's collectives (issue) and their works' ``wait()``:
    the share of a call's host time that is NCCL's (or gloo's), not the engine's. Installed by
    wrapping the module functions the engine calls (``dist.<name>``) for the duration of a measure."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._saved = {}

    def __enter__(self):
        clock = self

        class _Work:
            def __init__(self, work):
                self._work = work

            def wait(self, *a, **k):
                t0 = time.perf_counter()
                try:
                    return self._work.wait(*a, **k)
                finally:
                    clock.seconds += time.perf_counter() - t0

            def __getattr__(self, name):
                return getattr(self._work, name)

        def timed(fn):
            def call(*a, **k):
                t0 = time.perf_counter()
                try:
                    out = fn(*a, **k)
                finally:
                    clock.seconds += time.perf_counter() - t0
                return _Work(out) if out is not None and hasattr(out, "wait") else out
            return call
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is not None:
                self._saved[name] = fn
                setattr(dist, name, timed(fn))
        return self

    def __exit__(self, *exc):
        for name, fn in self._saved.items():
            setattr(dist, name, fn)
        self._saved.clear()


def attach_probe(buf, count_ops: bool = False, tracing: bool = False) -> RecordingProbe:
    """A recording probe on ``buf``'s engine (backends/probe.py): what its steps, reads and device
    operations report. A backend without probes (the reference) keeps reporting nothing."""
    probe = RecordingProbe(count_ops=count_ops, tracing=tracing)
    if hasattr(buf.backend, "set_probe"):
        buf.backend.set_probe(probe)
    return probe


def device_ops(buf, fn) -> dict:
    """The device operations one call of ``fn`` issues ({kind: n, "total": n}), counted by the probe."""
    probe = attach_probe(buf, count_ops=True)
    fn()
    return probe.last_ops() if probe.calls else {}


def _idle_or_busy(buf, busy: bool, steady: bool = False) -> None:
    """Before a timed call: the device idle, or (``busy``) idle then behind a ~30 ms spinning kernel;
    ``steady``: behind one more spinning kernel without waiting for the device first (the host runs
    ahead of the GPU, as a training step's host does between its reads)."""
    if buf.device.type == "cuda":
        if not steady:
            torch.cuda.synchronize(buf.device)
        if busy or steady:
            torch.cuda._sleep(BUSY_CYCLES)


def _host_us(buf, fn, reps: int, busy: bool = False, steady: bool = False) -> tuple:
    """Median host time of ``fn()`` in us: wall time less time blocked in the engine's host read.
    Each call starts on an idle device; ``busy``: behind a ~30 ms spinning kernel on the current
    stream instead, as in a training step where the GPU is still working when the host issues the
    call (the issue cost without the first-launch-after-idle penalty; a host read then waits for the
    spin, and that wait is not counted). ``steady``: the host never waits for the device between
    calls (a call with a host read still waits in it, and that wait is not counted).
    Returns (that, the median of the part spent inside torch.distributed's collective calls and
    waits, {"cpu_us", "voluntary", "involuntary"}: medians of the calling thread's CPU time and
    context switches per call, the read's excluded: wall well above CPU means blocked or preempted).
    The collectives' share is what the engine's probe timed where the backend reports to one (it may
    issue them without torch.distributed's wrappers), else what wrapping those functions saw."""
    probe = RecordingProbe(timing=True)
    probed = hasattr(buf.backend, "set_probe")
    if probed:
        buf.backend.set_probe(probe)
    spent = (lambda: probe.collective_s) if probed else (lambda: clock.seconds)
    times, inside, cpu, vol, invol, mallocs = [], [], [], [], [], []
    cuda = buf.device.type == "cuda"
    # device memory the caching allocator had to ask the driver for (cudaMalloc), per call
    segments = (lambda: torch.cuda.memory_stats(buf.device).get("segment.all.allocated", 0)) if cuda else (lambda: 0)
    if steady and cuda:
        torch.cuda.synchronize(buf.device)
    with _CollectiveClock() as clock:
        for _ in range(reps):
            _idle_or_busy(buf, busy, steady)
            blocked, c0, r0, s0 = probe.read_s, spent(), probe.read_usage, segments()
            u0 = thread_usage()
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            u1, r1 = thread_usage(), probe.read_usage
            mallocs.append(segments() - s0)
            times.append((t1 - t0 - (probe.read_s - blocked)) * 1e6)
            inside.append((spent() - c0) * 1e6)
            probe.take_collectives()   # (kept only to replay them bare: not here)
            cpu.append(((u1[0] - u0[0]) - (r1[0] - r0[0])) * 1e6)
            vol.append((u1[1] - u0[1]) - (r1[1] - r0[1]))
            invol.append((u1[2] - u0[2]) - (r1[2] - r0[2]))
    if cuda:
        torch.cuda.synchronize(buf.device)
    med = lambda v: float(statistics.median(v))
    return med(times), med(inside), {"cpu_us": med(cpu), "voluntary": med(vol), "involuntary": med(invol),
                                     "mallocs": med(mallocs)}


def _worker(ctx, w, iters: int, warmup: int, chunk_caps: list, rpn: int, profile: bool = False,
            torch_steps: bool = False):
    from commlib.buffer import Buffer
    from commlib.fp8 import per_token_cast_to_fp8

    R = ctx.world_size
    nvl, rdma = B.buffer_bytes(w.hidden, R, rpn, R // rpn)
    ref = Buffer(ctx.group, nvl, rdma, backend="reference", ranks_per_node=rpn)
    table = []
    # every chunk cap with the per-token steps as kernels; --torch-steps: the first cap again with the
    # torch steps (COMMLIB_INTERNODE_KERNELS=0), its rows named <op>_torch_steps
    runs = [(cap, True) for cap in chunk_caps] + ([(chunk_caps[0], False)] if torch_steps else [])
    for i, (cap, kernels) in enumerate(runs):
        os.environ["COMMLIB_NETWORK_CHUNKS"] = str(cap)
        os.environ["COMMLIB_INTERNODE_KERNELS"] = "1" if kernels else "0"
        buf = Buffer(ctx.group, nvl, rdma, backend="internode", ranks_per_node=rpn)
        rows = B.measure(buf, ref if i == 0 else None, ctx.group, w, OPS + (BASELINE_OPS if i == 0 else []), iters,
                         warmup)
        _annotate(ctx, buf, w, rows, cap, per_token_cast_to_fp8, iters, profile and i == 0, floor=i == 0)
        # the table's host figures are rank 0's; every rank's go with them (ranks sharing a GPU differ)
        everyone = [None] * ctx.world_size
        # host times and the same calls' CPU time on the calling thread (us, rounded), context switches
        # [voluntary, involuntary] (the read's excluded: wall far above CPU means blocked), cudaMalloc calls
        timed = ("host_us", "host_busy_us", "host_steady_us", "host_busy_cpu_us", "host_steady_cpu_us",
                 "host_busy_mallocs", "host_steady_mallocs")
        switches = ("host_busy_switches", "host_steady_switches")   # GPU only (None on CPU ranks)
        dist.all_gather_object(everyone, {r["op"]: {**{k: r.get(k, 0.0) for k in timed}, **{k: r.get(k) for k in switches}}
                                          for r in rows}, group=ctx.group)
        for r in rows:
            r["device_steps"] = bool(getattr(buf.backend, "device_steps", False))
            mine = [e[r["op"]] for e in everyone]
            for k in timed[:5]:
                r[k + "_by_rank"] = [round(m[k], 1) for m in mine]
            for k in switches:
                r[k + "_by_rank"] = [m[k] for m in mine]
            r["host_mallocs_by_rank"] = [(m["host_busy_mallocs"], m["host_steady_mallocs"]) for m in mine]
        part = B.gather(rows, ctx.group)
        if part is not None:
            for r in part if not kernels else []:
                r["op"] += "_torch_steps"   # after the gather: it looks ops up by name
            table += part
        info = {"backend": buf.backend_name, "buffer_device": str(buf.device),
                "process_group": dist.get_backend(ctx.group), "num_nodes": buf.topology.num_nodes,
                "ranks_per_node": buf.topology.ranks_per_node,
                "bare_a2a_host_us": _bare_a2a_host_us(buf, ctx.group, w, max(5, iters)),
                "bare_a2a_host_busy_us": _bare_a2a_host_us(buf, ctx.group, w, max(5, iters), busy=True),
                "bare_a2a_host_steady_us": _bare_a2a_host_us(buf, ctx.group, w, max(5, iters), steady=True)}
        buf.destroy()
    # the reference backend (the specification, torch collectives for both hops) in the same run,
    # its outputs checked against the oracle like every other row
    ref_table = B.gather(B.measure(ref, None, ctx.group, w, OPS, iters, warmup), ctx.group)
    if table is not None and ref_table is not None:
        for r in ref_table:
            r.update(op="reference_" + r["op"], net_rows=0.0, nvl_rows=0.0, chunk_cap=0, chunks=0, host_us=0.0,
                     host_busy_us=0.0, host_busy_collective_us=0.0, host_busy_engine_us=0.0,
                     host_collective_us=0.0, host_engine_us=0.0)
        table += ref_table
    ref.destroy()
    return {"rows": table, "info": info}


def _bare_a2a_host_us(buf, group, w, reps: int, busy: bool = False, steady: bool = False) -> float:
    """Host time of one bare all_to_all_single of a rank's tokens (equal splits) issued and waited for
    as the engine does: the floor a call that moves its rows in one collective cannot go under."""
    R = dist.get_world_size(group)
    rows = max(R, w.num_tokens // R * R)
    send = torch.zeros(rows, w.hidden, dtype=torch.bfloat16, device=buf.device)
    recv = torch.empty_like(send)
    comm = buf.comm_stream

    def call():
        if comm is not None:
            with torch.cuda.stream(comm):
                dist.all_to_all_single(recv, send, group=group, async_op=True).wait()
        else:
            dist.all_to_all_single(recv, send, group=group, async_op=True).wait()
    for _ in range(2):  # warm-up
        call()
    if (busy or steady) and buf.device.type != "cuda":
        return 0.0
    return _host_us(buf, call, reps, busy=busy, steady=steady)[0]


def one_rank_per_node(ctx, w):
    """For experiments: a Buffer on the internode engine with one rank per node, this rank's inputs of
    workload ``w`` and a non-cached BF16 dispatch of them. Returns (buffer, x, dispatch callable)."""
    from commlib.buffer import Buffer

    R = ctx.world_size
    nvl, rdma = B.buffer_bytes(w.hidden, R, 1, R)
    buf = Buffer(ctx.group, nvl, rdma, backend="internode", ranks_per_node=1)
    inp = B.make_inputs(w, ctx.rank, buf.device)
    x, idx, wts = inp["x"], inp["topk_idx"], inp["topk_weights"]
    ntr, _, nte, tir, _ = buf.get_dispatch_layout(idx, w.num_experts)

    def dispatch():
        return buf.dispatch(x, num_tokens_per_rank=ntr, is_token_in_rank=tir, num_tokens_per_expert=nte,
                            topk_idx=idx, topk_weights=wts)
    return buf, x, dispatch


def dispatch_floor(buf, handle, w):
    """A call of the device operations a one-chunk dispatch of this engine cannot do without, issued
    bare (no engine code, no Buffer): the exchange row and its all-gather, the digest's read, the send
    rows and their all-to-all over the rail (``handle``'s first chunk), the four outputs, five launches
    of a small kernel standing in for meta, digest, pack, land and recv_chan. Its host time is what a
    dispatch costs on this host before any code of commlib runs: the target's floor here."""
    be, dev = buf.backend, buf.device
    plan = handle.extra["plan"]
    probe = attach_probe(buf)
    R, C, H, K = be.topology.num_ranks, 8, w.hidden, w.num_topk
    W = 2 * H + 4 + 12 * K + 4   # a BF16 row with its source index, ids, weights, final row
    topo = be.topology
    row_len = exchange_row_len(R, topo.num_nodes, topo.ranks_per_node, be.max_chunks, w.num_experts)
    src = torch.zeros(64, dtype=torch.int32, device=dev)
    small_g = torch.zeros(R, 16, dtype=torch.int64, device=dev)
    chan = torch.empty(R, C, dtype=torch.int32, device=dev)
    launch = lambda: IK.recv_chan(src, small_g, chan, n_sig=1, me=be.topology.rank)
    n = plan.num_recv

    def run():
        row = torch.empty(row_len, dtype=torch.int64, device=dev)
        launch()
        g = torch.empty(R * row_len, dtype=torch.int64, device=dev)
        dist.all_gather_into_tensor(g, row, group=be.group, async_op=True).wait()
        digest = torch.empty(16, dtype=torch.int64, device=dev)
        launch()
        probe.read(digest).tolist()
        send = torch.empty(plan.send_starts[1], W, dtype=torch.uint8, device=dev)
        launch()
        recv = torch.empty(plan.recv_starts[1], W, dtype=torch.uint8, device=dev)
        dist.all_to_all_single(recv, send, plan.recv_splits[0], plan.send_splits[0], group=be.rail_group,
                               async_op=True).wait()
        outs = [torch.empty(n, H, dtype=torch.bfloat16, device=dev), torch.empty(n, dtype=torch.int32, device=dev),
                torch.empty(n, K, dtype=torch.int64, device=dev), torch.empty(n, K, dtype=torch.float32, device=dev)]
        launch()
        launch()
        return outs
    return run


def _profile(ctx, buf, op: str, fn, reps: int = 10, probe=None) -> None:
    """Where each rank's host time goes (--profile): the engine's step marks (its probe's) over
    ``reps`` calls on an idle device, ``reps`` behind running work and ``reps`` with the host running
    ahead of the GPU; per step the median us of wall time and of the thread's CPU time it took, less
    what the host read took. Every rank makes the calls (collective); rank 0 prints them, a column
    per rank and mode. ``probe``: a tracing RecordingProbe to attach (default: a new one)."""
    if not hasattr(buf.backend, "set_probe"):
        return
    if probe is None:
        probe = attach_probe(buf, tracing=True)
    else:
        buf.backend.set_probe(probe)
    modes = ("idle", "busy", "steady")
    table = {}
    for mode in modes:
        calls = []
        if mode == "steady" and buf.device.type == "cuda":
            torch.cuda.synchronize(buf.device)
        for _ in range(reps):
            _idle_or_busy(buf, mode != "idle", mode == "steady")
            probe.marks = []
            probe.mark("call")
            fn()
            probe.mark("return")
            calls.append(probe.marks)
        if buf.device.type == "cuda":
            torch.cuda.synchronize(buf.device)
        for marks in calls:
            spent = {}
            for (_, t0, r0, u0, q0), (step, t1, r1, u1, q1) in zip(marks, marks[1:]):
                wall = ((t1 - t0) - (r1 - r0)) * 1e6
                cpu = ((u1[0] - u0[0]) - (q1[0] - q0[0])) * 1e6
                w0, c0 = spent.get(step, (0.0, 0.0))
                spent[step] = (w0 + wall, c0 + cpu)
            spent["total"] = tuple(sum(v[i] for v in spent.values()) for i in range(2))
            spent["(blocked in the read)"] = ((marks[-1][2] - marks[0][2]) * 1e6, (marks[-1][4][0] - marks[0][4][0]) * 1e6)
            for step, v in spent.items():
                table.setdefault(step, {m: [] for m in modes})[mode].append(v)
    mine = {step: {m: tuple(statistics.median(v[i] for v in vals) if vals else 0.0 for i in range(2))
                   for m, vals in per.items()} for step, per in table.items()}
    everyone = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine, group=ctx.group)
    if ctx.rank != 0:
        return
    R = ctx.world_size
    print(f"# --profile {op}: host us per step and rank, wall/cpu (median of {reps} calls; a step ends at its mark, "
          "'return': after the last mark until the Buffer returns; cpu: the calling thread's CPU time)")
    print(f"# {'step':>24} " + " ".join(f"{m + ' r' + str(r):>13}" for m in modes for r in range(R)))
    for step in mine:
        cells = [e.get(step, {}).get(m, (0.0, 0.0)) for m in modes for e in everyone]
        print(f"# {step:>24} " + " ".join(f"{c[0]:>6.0f}/{c[1]:<6.0f}" for c in cells))


def _annotate(ctx, buf, w, rows, cap, per_token_cast_to_fp8, iters, profile=False, floor=False):
    """Per op: rows moved (counters), chunks used, host time per call; ``floor``: also the host time of
    ``dispatch_floor`` (one-chunk dispatches only)."""
    R = ctx.world_size
    # rows per call that crossed nodes / moved inside a node: counter deltas over one call of each op
    inp = B.make_inputs(w, ctx.rank, buf.device)
    x, idx, wts = inp["x"], inp["topk_idx"], inp["topk_weights"]
    ntr, _, nte, tir, _ = buf.get_dispatch_layout(idx, w.num_experts)

    def dispatch(xx):
        return buf.dispatch(xx, num_tokens_per_rank=ntr, is_token_in_rank=tir, num_tokens_per_expert=nte,
                            topk_idx=idx, topk_weights=wts)
    recv_x, _, recv_w, _, handle, _ = dispatch(x)
    y = B.expert_output(recv_x, ctx.rank)
    x_fp8 = per_token_cast_to_fp8(x)
    calls = {"dispatch_bf16": lambda: dispatch(x), "dispatch_bf16_cached": lambda: buf.dispatch(x, handle=handle),
             "dispatch_fp8": lambda: dispatch(x_fp8),
             "combine": lambda: buf.combine(y, handle, topk_weights=recv_w)}
    for r in rows:
        r["chunk_cap"] = cap
        r["chunks"] = handle.extra["plan"].num_chunks if r["op"] in calls else 0
        if r["op"] not in calls:
            r["net_rows"] = r["nvl_rows"] = r["host_us"] = r["host_busy_us"] = 0.0  # the flat baseline has no node hops
            r["host_busy_collective_us"] = r["host_busy_engine_us"] = r["host_collective_us"] = r["host_engine_us"] = 0.0
            continue
        r["device_ops"] = device_ops(buf, calls[r["op"]])
        r["host_us"], r["host_collective_us"], _ = _host_us(buf, calls[r["op"]], max(5, iters))
        r["host_engine_us"] = r["host_us"] - r["host_collective_us"]
        if buf.device.type == "cuda":
            for mode in ("busy", "steady"):
                r[f"host_{mode}_us"], collective, usage = _host_us(buf, calls[r["op"]], max(5, iters), **{mode: True})
                r[f"host_{mode}_cpu_us"], r[f"host_{mode}_mallocs"] = usage["cpu_us"], usage["mallocs"]
                r[f"host_{mode}_switches"] = [usage["voluntary"], usage["involuntary"]]
                if mode == "busy":
                    r["host_busy_collective_us"] = collective
        else:
            r["host_busy_us"] = r["host_busy_collective_us"] = r["host_steady_us"] = 0.0
        # the engine's own share: host time less what torch.distributed's calls and waits took
        r["host_busy_engine_us"] = r["host_busy_us"] - r["host_busy_collective_us"]
        # the floor is a one-chunk dispatch's: measured once per run, on the first chunk cap's run
        if floor and r["op"] == "dispatch_bf16" and getattr(buf.backend, "device_steps", False) and r["chunks"] == 1:
            bare = dispatch_floor(buf, handle, w)
            bare()
            r["host_floor_busy_us"] = _host_us(buf, bare, max(5, iters), busy=True)[0]
            r["host_floor_steady_us"] = _host_us(buf, bare, max(5, iters), steady=True)[0]
        if profile:  # every rank makes the calls (collective), rank 0 prints
            _profile(ctx, buf, r["op"], calls[r["op"]])
        before = buf.counters
        calls[r["op"]]()
        after = buf.counters
        moved = torch.tensor([after["internode_rows"] - before["internode_rows"],
                              after["intranode_rows"] - before["intranode_rows"]], dtype=torch.float64)
        everyone = [None] * R
        dist.all_gather_object(everyone, moved.tolist(), group=ctx.group)
        r["net_rows"] = sum(e[0] for e in everyone) / R  # mean rows per rank
        r["nvl_rows"] = sum(e[1] for e in everyone) / R


# ------------------------------------------------------------------------------------------------
# --host: the host-time figures of the internode engine, in bench_host's shape
# ------------------------------------------------------------------------------------------------

HOST_OPS = ("dispatch_bf16", "dispatch_fp8", "cached_bf16", "cached_fp8", "combine",
            "cached_bf16_first", "combine_first")
# Host-time targets (issue: the internode engine rebuilt): us, device operations per call; the
# NCCL calls' limit is relative (each one against a bare NCCL call of the same size, same run)
HOST_TARGETS = {"dispatch_own_us": 200.0, "cached_own_us": 60.0, "combine_own_us": 60.0,
                "dispatch_total_us_k1": 400.0, "cached_total_us_k1": 150.0, "combine_total_us_k1": 150.0,
                "dispatch_ops": 20, "cached_ops": 10, "combine_ops": 10, "ops_per_extra_chunk": 1,
                "nccl_calls": "1 + K", "nccl_over_bare": 1.1}


def host_verdicts(r: dict) -> list:
    """Every host-time target one row (``host_rows``) speaks to: {target, value, limit, met}."""
    kind = r["op"].split("_")[0]            # dispatch / cached / combine
    K = r["chunks"]
    out = [{"target": f"{r['op']}: engine's own host time (us, inside the backend, outside NCCL calls and the "
                      "count read)", "value": round(r["backend_us"], 1), "limit": HOST_TARGETS[f"{kind}_own_us"]},
           {"target": f"{r['op']}: NCCL calls per call", "value": r["nccl_calls"], "limit": 1 + K},
           {"target": f"{r['op']}: device operations per call (probe count, deterministic)",
            "value": r["probe_ops"].get("total", 0), "limit": HOST_TARGETS[f"{kind}_ops"] + (K - 1),
            "also": r["probe_ops"] == r.get("probe_ops_again")}]
    if K == 1:
        out.append({"target": f"{r['op']}: whole call's host time at K = 1 (us, the count read's wait excluded)",
                    "value": round(r["total_us"], 1), "limit": HOST_TARGETS[f"{kind}_total_us_k1"]})
    for i, c in enumerate(r["nccl"]):
        if c.get("floor_us"):
            out.append({"target": f"{r['op']}: NCCL call {i} ({c['name']}, {c['bytes']} B) host time / a bare "
                                  "call of the same size (10% for noise)",
                        "value": round(c["host_us"] / c["floor_us"], 2), "limit": HOST_TARGETS["nccl_over_bare"]})
    for t in out:
        t["met"] = t["value"] <= t["limit"] and t.pop("also", True)
    return out


# the caching allocator's counters read around each traced call: retries (a malloc that freed cached
# blocks, a device sync, and tried again), cudaMalloc / cudaFree calls, segments, syncs of all streams
ALLOC_STATS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "segment.all.allocated",
               "num_sync_all_streams", "num_ooms")
HOST_PROBE_ALLOCS, HOST_PROBE_LOOP = 50, 5000


def _host_probe(dev) -> float:
    """us of a fixed host workload (small allocations on ``dev``, a pure-Python loop): timed right after
    a call returns, beside the same on a quiet device, it shows whether what runs beside the host
    (NCCL's socket threads moving the call's rows) slows the host's own work down."""
    t0 = time.perf_counter()
    for _ in range(HOST_PROBE_ALLOCS):
        torch.empty(64, dtype=torch.int32, device=dev)
    loop_seconds(HOST_PROBE_LOOP)
    return (time.perf_counter() - t0) * 1e6


def _step_trace(buf, fn, iters: int, ahead: bool, group, quiet: bool = False) -> dict:
    """Where one op's host time goes, called as the --host timing calls it (back to back; ``ahead``:
    behind running work; ``quiet``: each call on an idle device, after the last one's rows landed):
    per step of the engine's probe marks ('buffer': the Buffer's own work before the engine;
    'return': after the engine's last mark), the median us per call of wall and of the calling
    thread's CPU time, the count read's wait taken out; per call the allocator's ALLOC_STATS (median
    and max); and ``host_probe_us`` (median) after each call against ``host_probe_quiet_us`` on a
    quiet device."""
    from benchmarks import host_timing as HT
    probe = RecordingProbe(tracing=True)
    buf.backend.set_probe(probe)
    cuda = buf.device.type == "cuda"
    stats = (lambda: torch.cuda.memory_stats(buf.device)) if cuda else (lambda: {})
    quiet = []
    for _ in range(5):
        if cuda:
            torch.cuda.synchronize(buf.device)
        quiet.append(_host_probe(buf.device))
    if cuda:
        torch.cuda.synchronize(buf.device)
    dist.barrier(group=group)
    if ahead:
        HT.device_busy(iters * 4000.0)
    steps, allocs, after = {}, {k: [] for k in ALLOC_STATS}, []
    for _ in range(iters):
        if quiet and cuda:
            torch.cuda.synchronize(buf.device)
        s0 = stats()
        probe.marks = []
        probe.mark("call")
        fn()
        probe.mark("return")
        after.append(_host_probe(buf.device))
        s1 = stats()
        for k in ALLOC_STATS:
            allocs[k].append(s1.get(k, 0) - s0.get(k, 0))
        for (_, t0, r0, u0, q0), (step, t1, r1, u1, q1) in zip(probe.marks, probe.marks[1:]):
            wall, cpu = ((t1 - t0) - (r1 - r0)) * 1e6, ((u1[0] - u0[0]) - (q1[0] - q0[0])) * 1e6
            w0, c0 = steps.get(step, ([], []))
            steps.setdefault(step, (w0, c0))
            w0.append(wall)
            c0.append(cpu)
    if cuda:
        torch.cuda.synchronize(buf.device)
    med = statistics.median
    return {"steps": {step: [round(med(w), 1), round(med(c), 1)] for step, (w, c) in steps.items()},
            "alloc": {k: [med(v), max(v)] for k, v in allocs.items()},
            "host_probe_us": round(med(after), 1), "host_probe_quiet_us": round(med(quiet), 1)}


def print_steps(traces: list, ops: list) -> None:
    """``traces`` [rank] {op: _step_trace(...)}: per rank, the steps of ``ops`` side by side (wall/cpu
    us per call), then each op's allocator counters per call and the host probe."""
    for rank, mine in enumerate(traces):
        have = [op for op in ops if op in mine]
        print(f"# rank {rank}: host us per step (median per call, wall/cpu, the count read's wait taken out; "
              "'buffer': the Buffer's own before the engine, 'return': after the engine's last mark)")
        print(f"#   {'step':>14} " + " ".join(f"{op:>21}" for op in have))
        names = []
        for op in have:
            names += [st for st in mine[op]["steps"] if st not in names]
        for st in names + ["total"]:
            cells = []
            for op in have:
                v = [sum(c[i] for c in mine[op]["steps"].values()) for i in range(2)] if st == "total" \
                    else mine[op]["steps"].get(st)
                cells.append(f"{v[0]:>10.0f}/{v[1]:<10.0f}" if v else f"{'':>21}")
            print(f"#   {st:>14} " + " ".join(cells))
        for op in have:
            t = mine[op]
            print(f"#   {op}: allocator per call (median/max) " + ", ".join(f"{k} {a:g}/{b:g}" for k, (a, b)
                                                                          in t["alloc"].items())
                  + f"; host probe {t['host_probe_us']:.0f} us after a call, {t['host_probe_quiet_us']:.0f} us quiet")


def _bare_collective(c):
    """A call issuing probe Collective ``c`` again on the stream it was issued on, and waiting as the
    engine does (the stream waits: NCCL; the host: gloo; nothing: a collective on the current stream)."""
    def run():
        work = c.fn(*c.args, **c.kwargs)
        if work is not None:
            work.wait()
    return run


def _quiet_mains(me: int, R: int, group) -> list:
    """--pin quiet: each rank's main-thread CPU, the R quietest right now (host_timing.quiet_cpus),
    measured by rank 0 while the others sleep (a rank spinning in a collective's wait would slow the
    CPU it is on), then sent to every rank."""
    from benchmarks import host_timing as HT
    dist.barrier(group=group)
    if me == 0:
        mains = HT.quiet_cpus(R)
    else:
        time.sleep(QUIET_PROBE_S)
        mains = None
    got = [mains]
    dist.broadcast_object_list(got, src=0, group=group)
    return got[0]


QUIET_PROBE_S = 1.0   # longer than rank 0's quiet_cpus on 16 CPUs (~0.2 s)


def _bare_sequence_us(colls: list, iters: int, group, read_after: int = 0) -> list:
    """Median host us of each probe Collective of ``colls`` replayed bare in the order a non-cached
    dispatch issues them, the host waiting for the device after call ``read_after`` (the count read),
    call after call: each bare call meets the conditions the engine's does (the all-gather issued
    behind the last call's rows on the wire, the network chunks right after the host waited).
    host_times's replay of one call back to back, each behind the one before, meets neither."""
    bares = [_bare_collective(c) for c in colls]
    per = [[] for _ in colls]
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    dist.barrier(group=group)
    for _ in range(iters):
        for i, (c, run) in enumerate(zip(colls, bares)):
            prev = torch.cuda.current_stream() if cuda and c.stream is not None else None
            if prev is not None:
                torch.cuda.set_stream(c.stream)
            try:
                t0 = time.perf_counter_ns()
                run()
                per[i].append((time.perf_counter_ns() - t0) / 1e3)
                if i == read_after and cuda:
                    torch.cuda.current_stream().synchronize()
            finally:
                if prev is not None:
                    torch.cuda.set_stream(prev)
    if cuda:
        torch.cuda.synchronize()
    return [statistics.median(p) for p in per]


def _host_worker(ctx, w, iters: int, warmup: int, chunk_caps: list, rpn: int, pin: str | None = None):
    from benchmarks import host_timing as HT
    from commlib.buffer import Buffer
    from commlib.fp8 import per_token_cast_to_fp8

    R, me, group = ctx.world_size, ctx.rank, ctx.group
    nvl, rdma = B.buffer_bytes(w.hidden, R, rpn, R // rpn)
    rows, cpp_rows, pinned = [], [], {}
    cpus = {"at start": len(os.sched_getaffinity(0))}   # the main thread's CPUs (what NCCL's set-up leaves it)
    times0 = cpu_times()

    def repin():
        """--pin: this rank's main thread on a core of its own, NCCL's threads elsewhere (again before each
        op: a thread started since is moved too); quiet: on the R CPUs that run a fixed loop fastest, measured
        again each time."""
        if pin:
            pinned.update(HT.pin_host(me, R, _quiet_mains(me, R, group) if pin == "quiet" else None))
    for cap in chunk_caps:
        os.environ["COMMLIB_NETWORK_CHUNKS"] = str(cap)
        os.environ["COMMLIB_INTERNODE_KERNELS"] = "1"
        buf = Buffer(group, nvl, rdma, backend="internode", ranks_per_node=rpn)
        # COMMLIB_CALLPATH_INTERNODE_DISPATCH (on unless 0): for the C++ rows' non-cached dispatches only
        cpp_dispatch = getattr(buf.backend, "_full_twins", False)
        buf.backend._full_twins = False
        dev = buf.device
        inp = B.make_inputs(w, me, dev)
        x, idx, wts = inp["x"], inp["topk_idx"], inp["topk_weights"]
        xq = per_token_cast_to_fp8(x)
        ntr, _, nte, tir, _ = buf.get_dispatch_layout(idx, w.num_experts)

        def full(xx):
            return lambda: buf.dispatch(xx, num_tokens_per_rank=ntr, is_token_in_rank=tir, num_tokens_per_expert=nte,
                                        topk_idx=idx, topk_weights=wts)
        recv_x, _, recv_w, _, handle, _ = full(x)()
        cpus.setdefault("after the first call", len(os.sched_getaffinity(0)))
        repin()
        y = B.expert_output(recv_x, me)
        ops = {"dispatch_bf16": full(x), "dispatch_fp8": full(xq),
               "cached_bf16": lambda: buf.dispatch(x, handle=handle), "cached_fp8": lambda: buf.dispatch(xq, handle=handle),
               "combine": lambda: buf.combine(y, handle, topk_weights=recv_w)}
        # a handle's first cached dispatch and first combine: the Python path, which builds the handle's kept
        # call (the C++ path serves its later ones). A training step's cached dispatch (the combine's backward)
        # is its handle's first, so this is what a step pays there; each call takes a handle no call used yet
        fresh = FreshHandles(lambda: full(x)()[4], warmup + 2 * iters + 4)
        ops["cached_bf16_first"] = lambda: buf.dispatch(x, handle=fresh.next("cached"))
        ops["combine_first"] = lambda: buf.combine(y, fresh.next("combine"), topk_weights=recv_w)
        K = handle.extra["plan"].num_chunks
        traces = {}
        for op, fn in ops.items():
            reads = op.startswith("dispatch")
            for _ in range(warmup):
                fn()
            repin()
            counts = HT.count_device_ops(fn)
            probe_ops, probe_again = device_ops(buf, fn), device_ops(buf, fn)
            probe = RecordingProbe(timing=True)
            buf.backend.set_probe(probe)
            marks = {"read": probe.read_s, "coll": probe.collective_s, "last_read": 0.0}
            per_call, backend = [], []   # per timed call: [seconds of NCCL call i]; the backend's own us

            def read_ns():
                marks["last_read"] = probe.read_s - marks["read"]
                marks["read"] = probe.read_s
                return marks["last_read"] * 1e9

            def coll_ns():   # called after read_ns, once per timed call
                v = probe.collective_s - marks["coll"]
                marks["coll"] = probe.collective_s
                last[:] = probe.take_collectives()
                per_call.append([c.seconds for c in last])
                backend.append((probe.calls_s[-1][1] - marks["last_read"] - v) * 1e6 if probe.calls_s else 0.0)
                return v * 1e9
            last = []
            t = HT.host_times(fn, iters, ahead=not reads, group=group, wait_ns=read_ns if reads else None,
                              excluded_ns=coll_ns)
            backend_us = statistics.median(backend) if backend else 0.0
            traces[op] = _step_trace(buf, fn, iters, not reads, group)
            if reads:   # the same calls each on an idle device: no earlier call's rows on the wire beside them
                traces[op + " quiet"] = _step_trace(buf, fn, iters, False, group, quiet=True)
            buf.backend.set_probe(RecordingProbe())
            n = len(last)
            nccl = []
            for i, c in enumerate(last):   # every rank replays the same collectives in the same order
                bare = _bare_collective(c)
                stream = c.stream
                prev = torch.cuda.current_stream() if stream is not None else None
                if stream is not None:
                    torch.cuda.set_stream(stream)
                try:
                    for _ in range(warmup):
                        bare()
                    f = HT.host_times(bare, iters, ahead=not reads, group=group)
                finally:
                    if stream is not None:
                        torch.cuda.set_stream(prev)
                mine = [p[i] * 1e6 for p in per_call if len(p) == n]
                nccl.append({"name": c.name, "bytes": c.nbytes, "host_us": statistics.median(mine) if mine else 0.0,
                             "floor_us": f["host_us"]})
            if reads and last:   # the dispatch's calls in its own order, the host waiting after the all-gather
                for c, v in zip(nccl, _bare_sequence_us(last, iters, group)):
                    c["floor_back_to_back_us"], c["floor_us"] = c["floor_us"], v
            last.clear()
            floor = HT.floor_fn(counts, dev, 1 if reads else 0)
            for _ in range(warmup):
                floor()
            fl = HT.host_times(floor, iters, ahead=not reads, group=group)
            rows.append({"op": op, "tokens": w.num_tokens, "world": R, "nodes": R // rpn, "ranks_per_node": rpn,
                         "chunk_cap": cap, "chunks": K, **t, "backend_us": backend_us,
                         "nccl_us": t.get("excluded_us", 0.0), "nccl_calls": n, "nccl": nccl, "ops": counts,
                         "probe_ops": probe_ops, "probe_ops_again": probe_again, "floor_us": fl["host_us"],
                         "nccl_floor_us": sum(c["floor_us"] for c in nccl)})
        cpp_rows += _cpp_rows(buf, ops, iters, warmup, group, cap, K, HT, cpp_dispatch, repin)
        everyone = [None] * R
        dist.all_gather_object(everyone, traces, group=group)
        for r in rows[-len(ops):]:
            r["steps_by_rank"] = [e[r["op"]] for e in everyone]
            if r["op"] + " quiet" in traces:
                r["steps_quiet_by_rank"] = [e[r["op"] + " quiet"] for e in everyone]
        buf.destroy()
    # the slowest rank's figures
    keys = ["host_us", "cpu_us", "wait_us", "own_us", "total_us", "nccl_us", "backend_us", "floor_us", "nccl_floor_us"]
    for r in rows:
        per = ("host_us", "floor_us", "floor_back_to_back_us")
        vals = slowest([float(r.get(k) or 0.0) for k in keys] + [c.get(k, 0.0) for c in r["nccl"] for k in per],
                       group)
        r.update({k: v for k, v in zip(keys, vals) if r.get(k) is not None})
        for j, c in enumerate(r["nccl"]):
            c.update(zip(per, vals[len(keys) + len(per) * j:len(keys) + len(per) * (j + 1)]))
    for r in cpp_rows:
        keys = ["host_us", "cpu_us", "nccl_us", "own_us"]
        everyone = [None] * R   # each rank's own figures (BY_RANK)
        dist.all_gather_object(everyone, [round(r[k], 1) for k in BY_RANK[:-1]] + [r["cpu"]], group=group)
        r["by_rank"] = everyone
        phases = [None] * R   # and each rank's phases: the slowest rank's are printed beside rank 0's
        dist.all_gather_object(phases, r.get("phases_us") or {}, group=group)
        r["phases_by_rank"] = phases
        r.update(zip(keys, slowest([float(r[k]) for k in keys], group)))
        r["cpp_calls"] = -slowest([-float(r["cpp_calls"])], group)[0]   # the fewest of any rank
    return {"rows": rows, "cpp_rows": cpp_rows, "device": str(dev), "pinned": pinned, "main_cpus": cpus,
            "steal_percent": steal_percent(times0, cpu_times())}


class FreshHandles:
    """``n`` handles made up front by ``make`` (a non-cached dispatch, collective: every rank makes the same
    number in the same order), handed out one per call and per kind (``next(kind)``), so that each timed
    call is the first of its kind on its handle; more are made (inside the timing) only past ``n``."""

    def __init__(self, make, n: int) -> None:
        self.make, self.handles, self.used = make, [make() for _ in range(n)], {}

    def next(self, kind: str):
        i = self.used.get(kind, 0)
        self.used[kind] = i + 1
        while i >= len(self.handles):
            self.handles.append(self.make())
        return self.handles[i]


def _cpp_rows(buf, ops: dict, iters: int, warmup: int, group, cap: int, K: int, HT, dispatch: bool = False,
              repin=lambda: None) -> list:
    """The cached dispatches and the combine through the internode C++ call path
    (csrc/callpath_internode.cpp), where it loaded on every rank, and (``dispatch``: where
    COMMLIB_CALLPATH_INTERNODE_DISPATCH is on, the default) the non-cached dispatches: host wall / CPU us per call with
    the host ahead (a dispatch: each waits for its digest read, that wait left out of ``host_us``),
    ``nccl_us`` (the engine's own clock around its NCCL calls and waits), ``own_us`` (the rest: the
    Buffer's checks and the engine's work, both in C++), ``cpp_calls`` (timed calls it ran),
    ``phases_us`` (this rank's median us per phase of the same calls timed once more with the C++
    engine's per-phase marks on: commlib.cuda.callpath.phases)."""
    everyone = -slowest([-float(buf.call_path == "cpp")], group)[0] > 0
    if not everyone:
        return []
    buf.backend.set_probe(NULL_PROBE)   # a recording probe sends calls to the Python path
    dispatch = -slowest([-float(dispatch)], group)[0] > 0
    buf.backend._full_twins = dispatch   # the next non-cached dispatch leaves its C++ twin
    out = []
    for op, fn in ops.items():
        kind = op.split("_")[0]
        if (kind not in ("cached", "combine") and not (kind == "dispatch" and dispatch)) or op.endswith("_first"):
            continue   # (a handle's first cached call is the Python path's: the C++ path serves later ones)
        for _ in range(warmup + 1):   # (a dispatch: the first of its signature is the Python path's, kept)
            fn()
        repin()
        cpp = buf._cpp
        mark = {"ns": cpp.nccl_ns, "wait": cpp.wait_ns}

        def nccl_ns():
            v, mark["ns"] = cpp.nccl_ns - mark["ns"], cpp.nccl_ns
            return v

        def wait_ns():
            v, mark["wait"] = cpp.wait_ns - mark["wait"], cpp.wait_ns
            return v
        reads = kind == "dispatch"
        before = cpp.served[kind]
        t = HT.host_times(fn, iters, ahead=not reads, group=group, wait_ns=wait_ns if reads else None,
                          excluded_ns=nccl_ns)
        served = cpp.served[kind] - before
        cpu = HT.current_cpu()   # where this rank's main thread ran, and that host's speed right then
        probe_us = statistics.median(_host_probe(buf.device) for _ in range(5))
        callpath.phases(True)   # where the C++ call's time goes: the same calls again, timed per phase
        again = HT.host_times(fn, iters, ahead=not reads, group=group, wait_ns=wait_ns if reads else None,
                              excluded_ns=nccl_ns)
        raw = callpath.phases(False, raw=True)
        host = t["total_us"] if reads else t["host_us"]   # a dispatch: its digest read's wait left out
        out.append({"op": op + "_cpp", "chunk_cap": cap, "chunks": K, "host_us": host, "cpu_us": t["cpu_us"],
                    "nccl_us": t.get("excluded_us", 0.0), "own_us": host - t.get("excluded_us", 0.0),
                    "wait_us": t.get("wait_us", 0.0), "cpp_calls": served, "iters": iters,
                    "phases_us": {k: statistics.median(v) for k, v in raw.items()},
                    "phased_host_us": again["total_us"] if reads else again["host_us"],
                    "phased_call_sum_us": _call_sums(raw), "host_probe_us": probe_us, "cpu": cpu})
    buf.backend._full_twins = False
    return out


def _call_sums(raw: dict) -> float:
    """The median over calls of one call's phases summed (the count read's wait left out), from
    callpath.phases(raw=True): each phase has one sample per call (``outside``, the time before a call,
    none for the first), so the last n samples of every phase are the last n calls."""
    mine = {k: v for k, v in raw.items() if not k.endswith((".read_wait", ".wait"))}
    n = min((len(v) for v in mine.values()), default=0)
    if not n:
        return 0.0
    return statistics.median(sum(v[len(v) - n + i] for v in mine.values()) for i in range(n))


# a C++ row's figures per rank: host and own us, the phased pass's host us and its median per-call phase
# sum, the host probe's us right after the timed pass (the host's speed then: compare ranks by it), the
# CPU the main thread was on
BY_RANK = ("host_us", "own_us", "phased_host_us", "phased_call_sum_us", "host_probe_us", "cpu")


def cpp_phase_lines(r: dict, layout: str) -> list:
    """A C++ row's printed lines: rank 0's phases, every rank's BY_RANK figures, and the slowest rank's
    phases where that is not rank 0."""
    from benchmarks import host_timing as HT
    label = f"{layout} {r['op']} cap {r['chunk_cap']}"
    out = [HT.phases_line(label, r["phases_us"])] if r.get("phases_us") else []
    by_rank = r.get("by_rank") or []
    if by_rank:
        out.append(f"#   {r['op']} cap {r['chunk_cap']} per rank [host, own, phased pass's host, median per-call "
                   f"phase sum, host probe, cpu]: {by_rank}")
        slow = max(range(len(by_rank)), key=lambda i: by_rank[i][0])
        phases = r.get("phases_by_rank") or []
        if slow and slow < len(phases) and phases[slow]:
            out.append(HT.phases_line(label + " (the slowest rank)", phases[slow], slow))
    return out


def cpp_verdicts(r: dict) -> list:
    """The host-time targets a C++ call path row speaks to (own: the Buffer's and the engine's, outside NCCL)."""
    kind = r["op"].split("_")[0]
    out = [{"target": f"{r['op']}: own host time (us, the Buffer's and the engine's, outside NCCL calls)",
            "value": round(r["own_us"], 1), "limit": HOST_TARGETS[f"{kind}_own_us"]},
           {"target": f"{r['op']}: timed calls the C++ path ran", "value": r["iters"] - r["cpp_calls"], "limit": 0}]
    if r["chunks"] == 1:
        out.append({"target": f"{r['op']}: whole call's host time at K = 1 (us)", "value": round(r["host_us"], 1),
                    "limit": HOST_TARGETS[f"{kind}_total_us_k1"]})
    for t in out:
        t["met"] = t["value"] <= t["limit"]
    return out


# the C++ call's phases that are NCCL calls' issue: (phase, the Python row's NCCL calls it stands for)
CPP_NCCL_PHASES = {"dispatch": (("exchange", slice(0, 1)), ("a2a", slice(1, None))),
                   "cached": (("a2a", slice(0, None)),), "combine": (("a2a", slice(0, None)),)}


def cpp_nccl_verdicts(r: dict, py: dict | None) -> list:
    """A C++ row's NCCL calls against the bare calls of the Python row of the same op (same run): each
    phase that issues NCCL calls (the dispatch's all-gather, the network chunks), the slowest rank's
    median, over the sum of those calls' bare host time (the slowest rank's, issued as the engine
    issues them)."""
    kind = r["op"].split("_")[0]
    phases = r.get("phases_by_rank") or []
    if not py or not py.get("nccl") or not phases:
        return []
    prefix = {"dispatch": "in_dispatch", "cached": "in_cached", "combine": "in_combine"}[kind]
    out = []
    for phase, calls in CPP_NCCL_PHASES[kind]:
        bare = sum(c["floor_us"] for c in py["nccl"][calls])
        mine = max((p.get(f"{prefix}.{phase}", 0.0) for p in phases), default=0.0)
        if bare and mine:
            out.append({"target": f"{r['op']}: NCCL issue in phase '{phase}' (slowest rank's median us) / its bare "
                                  "calls' (10% for noise)",
                        "value": round(mine / bare, 2), "limit": HOST_TARGETS["nccl_over_bare"],
                        "met": mine / bare <= HOST_TARGETS["nccl_over_bare"]})
    return out


def host_main(a, gpus: int) -> int:
    """--host: the host-time figures and their targets (module docstring of bench_host for the method)."""
    from commlib.utils.launch import parallel_launch

    w = B.Workload(a.tokens, a.hidden, a.experts, a.topk, a.groups, a.topk_groups, a.seed)
    caps = [int(c) for c in a.chunks.split(",")]
    if a.ranks_per_node == 1:
        caps = caps[:1]
    kw = dict(ranks_per_node=1, use_gpu=bool(gpus), group_backend="nccl" if gpus else None, emulate_hosts=True) \
        if a.emulate_hosts else dict(ranks_per_node=a.ranks_per_node, use_gpu=bool(gpus))
    out = parallel_launch(a.ranks, _host_worker, w, a.iters, a.warmup, caps, a.ranks_per_node, a.pin, **kw)
    rows = out["rows"]
    for r in rows:
        r["host_over_floor"] = r["total_us"] / (r["floor_us"] + r["nccl_floor_us"]) \
            if r["floor_us"] + r["nccl_floor_us"] else None
        r["targets"] = host_verdicts(r)
        r["met"] = all(t["met"] for t in r["targets"])
    shared = bool(gpus) and gpus < a.ranks
    note = ("HBM loopback (ranks share one GPU under MPS)" if shared else "one process per GPU" if gpus else "CPU ranks")
    if out.get("pinned"):
        note += (f"; main threads pinned{' to the quietest CPUs before each op' if a.pin == 'quiet' else ''} "
                 f"(rank 0 on cpu {out['pinned']['main']}, other threads on {len(out['pinned']['others'])} cpus)")
    elif a.pin:
        note += "; --pin asked, too few cores: not pinned"
    if out.get("main_cpus"):
        note += "; rank 0's main thread may run on " + ", ".join(f"{n} CPUs {k}" for k, n in out["main_cpus"].items())
    steal = out.get("steal_percent") or {}
    if steal:   # the hypervisor's: a lent machine's vCPUs can lose time to its neighbours
        worst = max(steal, key=steal.get)
        note += (f"; steal over the run {sum(steal.values()) / len(steal):.1f}% of the CPUs' time on average, "
                 f"{steal[worst]:.1f}% on cpu {worst}")
    nodes = a.ranks // a.ranks_per_node
    print(f"# bench_internode --host: {nodes} emulated nodes x {a.ranks_per_node}, {note}; tokens {a.tokens}, hidden "
          f"{a.hidden}, {a.experts} experts; device {out['device']}; the slowest rank's medians of {a.iters} calls (us)")
    print("# host: wall per call; total: less the count read's wait; nccl: inside NCCL calls (issue + wait); own: "
          "total less nccl (the Buffer's and the engine's); backend: the engine's alone (inside backend.dispatch / "
          "combine, less NCCL and the read; the 'own host time' target); floor: bare primitives of the call's device "
          "ops (bench_host) | the same NCCL calls replayed bare")
    print(f"# {'op':>14} {'cap':>3} {'K':>2} {'host':>8} {'wait':>8} {'total':>8} {'nccl':>8} {'own':>8} {'backend':>8} "
          f"{'cpu':>8} {'floor':>8} {'ncclflr':>8} {'ops':>4} {'probe':>5} {'calls':>5}  verdict")
    for r in rows:
        print(f"  {r['op']:>14} {r['chunk_cap']:>3} {r['chunks']:>2} {r['host_us']:8.1f} {r.get('wait_us', 0.0):8.1f} "
              f"{r['total_us']:8.1f} {r['nccl_us']:8.1f} {r['own_us']:8.1f} {r['backend_us']:8.1f} {r['cpu_us']:8.1f} "
              f"{r['floor_us']:8.1f} {r['nccl_floor_us']:8.1f} {r['ops']['total']:>4} {r['probe_ops'].get('total', 0):>5} "
              f"{r['nccl_calls']:>5}  {'PASS' if r['met'] else 'FAIL'}")
        for i, c in enumerate(r["nccl"]):
            print(f"#   {r['op']} NCCL call {i}: {c['name']} {c['bytes']} B, {c['host_us']:.1f} us, bare {c['floor_us']:.1f} us"
                  + (f" (in the dispatch's sequence; {c['floor_back_to_back_us']:.1f} us replayed back to back)"
                     if c.get("floor_back_to_back_us") else ""))
    cpp_rows = out.get("cpp_rows", [])
    if cpp_rows:
        print(f"# C++ call path (csrc/callpath_internode.cpp), host ahead: {'op':>12} {'cap':>3} {'K':>2} {'host':>8} "
              f"{'nccl':>8} {'own':>8} {'cpu':>8} {'calls':>5}  verdict")
    by_op = {(r["op"], r["chunk_cap"]): r for r in rows}
    for r in cpp_rows:
        r["targets"] = cpp_verdicts(r) + cpp_nccl_verdicts(r, by_op.get((r["op"][:-len("_cpp")], r["chunk_cap"])))
        r["met"] = all(t["met"] for t in r["targets"])
        print(f"  {r['op']:>14} {r['chunk_cap']:>3} {r['chunks']:>2} {r['host_us']:8.1f} {r['nccl_us']:8.1f} "
              f"{r['own_us']:8.1f} {r['cpu_us']:8.1f} {int(r['cpp_calls']):>5}  {'PASS' if r['met'] else 'FAIL'}")
        for t in r["targets"]:
            print(f"# target {t['target']} [cap {r['chunk_cap']}]: {t['value']} (needs <= {t['limit']}): "
                  + ("PASS" if t["met"] else "FAIL"))
    for r in cpp_rows:
        for line in cpp_phase_lines(r, f"{a.ranks // a.ranks_per_node} x {a.ranks_per_node}"):
            print(line)
    for cap in caps:
        mine = [r for r in rows if r["chunk_cap"] == cap]
        if mine and mine[0].get("steps_by_rank"):
            print(f"# chunk cap {cap}, K = {mine[0]['chunks']}:")
            quiet = [r for r in mine if r.get("steps_quiet_by_rank")]
            print_steps([{**{r["op"]: r["steps_by_rank"][rank] for r in mine},
                          **{r["op"] + " quiet": r["steps_quiet_by_rank"][rank] for r in quiet}} for rank in range(a.ranks)],
                        [r["op"] for r in mine] + [r["op"] + " quiet" for r in quiet])
    for r in rows:
        for t in r["targets"]:
            print(f"# target {t['target']} [cap {r['chunk_cap']}]: {t['value']} (needs <= {t['limit']}): "
                  + ("PASS" if t["met"] else "FAIL"))
    passed = all(r["met"] for r in rows)
    print(f"[bench_internode --host] {'PASS' if passed else 'FAIL'}: "
          f"{sum(t['met'] for r in rows for t in r['targets'])} of {sum(len(r['targets']) for r in rows)} targets met"
          + ("" if gpus else " (CPU ranks: not the targets' setting)"))
    if a.json is not None:
        cmd = "python -m benchmarks.bench_internode " + " ".join(shlex.quote(v) for v in a.argv)
        doc = results.result_document("bench_internode_host", cmd.strip(), rows + cpp_rows, world_size=a.ranks,
                                      targets=HOST_TARGETS, mode=note, passed=passed,
                                      steal_percent=out.get("steal_percent") or {})
        print(f"# wrote {results.write_result(doc, a.json)}")
    return 0


def main(argv=None) -> int:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096 if gpus else 128)
    p.add_argument("--hidden", type=int, default=7168 if gpus else 512)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--topk-groups", type=int, default=4)
    p.add_argument("--ranks", type=int, default=gpus if gpus >= 2 else 4)
    p.add_argument("--ranks-per-node", type=int, default=1 if gpus >= 2 else 2)
    p.add_argument("--iters", type=int, default=20 if gpus else 3)
    p.add_argument("--warmup", type=int, default=5 if gpus else 1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunks", default="4", help="network chunk caps to sweep (COMMLIB_NETWORK_CHUNKS), e.g. 1,2,4,8; "
                   "with one rank per node a call is always one chunk, and only the first cap runs")
    p.add_argument("--profile", action="store_true", help="rank 0 prints where each op's host time goes, step by step")
    p.add_argument("--torch-steps", action="store_true",
                   help="also run the first chunk cap with the per-token steps as torch ops (COMMLIB_INTERNODE_KERNELS=0)")
    p.add_argument("--emulate-hosts", action="store_true",
                   help="one NCCL_HOSTID per rank: NCCL between processes (sharing a GPU, or over its socket transport)")
    p.add_argument("--host", action="store_true",
                   help="only the host-time figures and their targets (bench_host's JSON shape), nothing checked")
    p.add_argument("--pin", nargs="?", const="fixed", default=None, choices=("fixed", "quiet"),
                   help="--host: each rank's main thread on a core of its own, every other thread (NCCL's proxy and "
                        "socket threads) off those cores, as a launcher that binds ranks does; quiet: on the CPUs "
                        "that run a fixed loop fastest, measured before each op (a lent machine's CPUs differ)")
    p.add_argument("--json", nargs="?", const="auto", default=None, metavar="PATH",
                   help="a .json file, or a folder for the standard name (default: benchmarks/results/)")
    a = p.parse_args(argv)
    a.argv = list(argv) if argv is not None else sys.argv[1:]
    from commlib.utils.launch import parallel_launch

    if a.ranks % a.ranks_per_node or a.ranks // a.ranks_per_node < 2:
        raise SystemExit("--ranks must be a multiple of --ranks-per-node with at least 2 nodes")
    w = B.Workload(a.tokens, a.hidden, a.experts, a.topk, a.groups, a.topk_groups, a.seed)
    w.validate(a.ranks)
    if a.host:
        return host_main(a, gpus)
    caps = [int(c) for c in a.chunks.split(",")]
    if a.ranks_per_node == 1 and len(caps) > 1:   # the engine sends one chunk there, whatever the cap
        print(f"# one rank per node: every call is one network chunk, so the chunk caps {caps} are one run (cap {caps[0]})")
        caps = caps[:1]
    if a.emulate_hosts:  # every rank its own host for NCCL; the Buffer still sees --ranks-per-node
        res = parallel_launch(a.ranks, _worker, w, a.iters, a.warmup, caps, a.ranks_per_node, a.profile, a.torch_steps, ranks_per_node=1,
                              use_gpu=bool(gpus), group_backend="nccl" if gpus else None, emulate_hosts=True)
    else:
        res = parallel_launch(a.ranks, _worker, w, a.iters, a.warmup, caps, a.ranks_per_node, a.profile, a.torch_steps,
                              ranks_per_node=a.ranks_per_node, use_gpu=bool(gpus))
    rows, info = res["rows"], res["info"]
    nodes = a.ranks // a.ranks_per_node
    link = ("NCCL's socket transport (emulated hosts; processes may share a GPU: device times are not "
            "meaningful, host times are)" if a.emulate_hosts else "NVLink via NCCL" if gpus else "loopback via gloo")
    print(f"# bench_internode: {nodes} emulated nodes x {a.ranks_per_node}, backend {info['backend']} on "
          f"{info['buffer_device']}; the 'network' here is {link}, not InfiniBand")
    print(f"# {'op':>30} {'cap':>4} {'K':>3} {'tokens':>7} {'time(us)':>10} {'host us':>8} {'engine':>8} {'busy us':>8} {'engine':>8} {'algbw':>8} "
          f"{'net rows':>9} {'net GB/s':>9} {'nvl rows':>9} {'nvl GB/s':>9} {'#wrong':>7}")
    for r in rows:
        rb = _row_bytes(r["op"], a.hidden)
        t = r["time_us"]
        r["net_gbps"] = r["net_rows"] * rb / t / 1e3 if t else 0.0
        r["nvl_gbps"] = r["nvl_rows"] * rb / t / 1e3 if t else 0.0
        print(f"  {r['op']:>30} {r.get('chunk_cap', 0):>4} {r.get('chunks', 0):>3} {r['tokens']:>7} {t:>10.1f} "
              f"{r.get('host_us', 0.0):>8.1f} {r.get('host_engine_us', 0.0):>8.1f} {r.get('host_busy_us', 0.0):>8.1f} {r.get('host_busy_engine_us', 0.0):>8.1f} {r['algbw_gbps']:>8.2f} {r['net_rows']:>9.0f} "
              f"{r['net_gbps']:>9.2f} {r['nvl_rows']:>9.0f} {r['nvl_gbps']:>9.2f} {results.wrong_cell(r):>7}")
    flat = {r["op"]: r["time_us"] for r in rows if r["op"] in BASELINE_OPS}
    for r in rows:
        base = flat.get("a2a_combine" if r["op"] == "combine" else "a2a_dispatch_bf16")
        if r["op"] in OPS and base:
            r["vs_flat_a2a"] = r["time_us"] / base
    print("# engine time / flat all-to-all time: " + ", ".join(
        f"{r['op']}@cap{r['chunk_cap']}={r['vs_flat_a2a']:.2f}x" for r in rows if "vs_flat_a2a" in r))
    print(f"# host time of one bare all_to_all_single of a rank's tokens, issued and waited for as the engine "
          f"does: {info.get('bare_a2a_host_us', 0.0):.1f} us on an idle device, "
          f"{info.get('bare_a2a_host_busy_us', 0.0):.1f} us behind running work ('busy us': each call issued "
          f"behind a ~30 ms kernel, as in a training step), {info.get('bare_a2a_host_steady_us', 0.0):.1f} us with "
          f"the host running ahead (the floor of a one-collective call here); "
          f"'engine': the host time before it less the time inside torch.distributed's collective calls and waits")
    by_rank = [r for r in rows if r.get("host_busy_us_by_rank") and any(r["host_busy_us_by_rank"])]
    if by_rank:
        print("# host us behind running work on each rank (the table: rank 0): " + ", ".join(
            f"{r['op']}@cap{r['chunk_cap']}={'/'.join(f'{v:.0f}' for v in r['host_busy_us_by_rank'])}" for r in by_rank))
    steady = [r for r in rows if any(r.get("host_steady_us_by_rank") or [])]
    if steady:
        print("# host us per call with the host running ahead of the GPU (no wait before a call; each rank): "
              + ", ".join(f"{r['op']}@cap{r['chunk_cap']}={'/'.join(f'{v:.0f}' for v in r['host_steady_us_by_rank'])}"
                          for r in steady))
    cpu = [r for r in rows if any(r.get("host_busy_cpu_us_by_rank") or [])]
    if cpu:
        print("# the same calls' CPU time on the calling thread, behind running work | host running ahead (us, each "
              "rank; wall far above CPU: blocked or preempted), its context switches voluntary:involuntary and the "
              "allocator's cudaMalloc calls behind running work:running ahead (medians per call): "
              + ", ".join(f"{r['op']}@cap{r['chunk_cap']}="
                          + "/".join(f"{v:.0f}" for v in r["host_busy_cpu_us_by_rank"]) + " | "
                          + "/".join(f"{v:.0f}" for v in r["host_steady_cpu_us_by_rank"]) + " ("
                          + "/".join(f"{s[0]:.0f}:{s[1]:.0f}" for s in r["host_busy_switches_by_rank"] if s) + "; cudaMalloc "
                          + "/".join(f"{m[0]:.0f}:{m[1]:.0f}" for m in r["host_mallocs_by_rank"]) + ")"
                          for r in cpu))
    bare = info.get("bare_a2a_host_busy_us", 0.0)
    if bare and by_rank:   # host times differ 2x between machines; this ratio much less (docs/internode.md)
        for r in by_rank:
            r["host_busy_in_bare_a2a"] = r["host_busy_us"] / bare
        print("# host time behind running work, in bare all-to-alls of this run (rank 0; compare runs by this): "
              + ", ".join(f"{r['op']}@cap{r['chunk_cap']}={r['host_busy_in_bare_a2a']:.1f}" for r in by_rank))
    shared = bool(gpus) and gpus < a.ranks
    targets = target_verdicts(rows, socket=a.emulate_hosts, shared_gpu=shared) if gpus else []
    for t in targets:
        print(f"# target {t['target']}: {t['value']:.3f} (needs {t['limit']}, best at chunk cap {t['chunk_cap']}): "
              + ("met" if t["met"] else "NOT met") + ("" if t["meaningful"] else " -- ranks share a GPU: not a measurement")
              + (f"; the bare device operations of a one-chunk dispatch take {t['floor_us']:.0f} us on this host"
                 if t.get("floor_us") else ""))
    print(results.check_footer(rows))
    if a.json is not None:
        cmd = "python -m benchmarks.bench_internode " + " ".join(shlex.quote(v) for v in (argv or sys.argv[1:]))
        doc = B.result_document("bench_internode", cmd.strip(), rows, world_size=a.ranks,
                                network_is=link, targets=targets, **info)
        print(f"# wrote {results.write_result(doc, a.json)}")
    wrong = results.total_wrong(rows)
    unchecked = [r["op"] for r in rows if not r.get("checked")]
    verdict = (f"FAILED: {wrong} wrong elements" if wrong else
               f"not checked: {', '.join(unchecked)}; the other rows: #wrong 0" if unchecked else
               "all results verified: #wrong 0")
    print(f"[bench_internode] {verdict}")
    return results.exit_status(rows)


if __name__ == "__main__":
    sys.exit(main())
