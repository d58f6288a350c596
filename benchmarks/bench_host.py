"""Host time of a call: what a client's dispatch / combine / layout costs the CPU, beside its floor.

    python -m benchmarks.bench_host                     # world 1 and 2 (2 ranks share a GPU: run under MPS)
    python -m benchmarks.bench_host --world 2 --json benchmarks/results --profile

Workload: DeepSeek-V3 (hidden 7168, top-8 of 256 experts, group-limited routing), --tokens per rank,
20 SMs, the NVLink engine (or the reference backend on CPU ranks). Per op and call path (``path``:
python, and cpp where the C++ call path loads: Buffer.set_call_path, csrc/callpath.cpp), on every rank:
  host_us   wall time from call to return, median of --iters back-to-back calls. Cached dispatch,
            combine and the layout run with the host ahead of the device (a long device sleep queued
            first, so the call never waits for the GPU); the full dispatch must read its counts, so
            its time splits into wait_us (blocked in the count read: the device's earlier work, the
            notify kernel, the peers) and own_us (everything else: the engine's host time).
  cpu_us    the calling thread's CPU time over the same calls.
  ops       device operations one call issues, counted by the PyTorch profiler: kernel launches,
            copies (memcpy / memset), allocations (aten::empty*), event records and waits, host syncs,
            collectives.
  floor_us  those bare primitives (a torch launch, torch.empty of the shapes the call allocates, an
            event record / wait, a small copy, one blocking read where the op has one) issued in the
            same order of magnitude and timed in the same run, in the same mode as the op; host /
            floor is the ratio to beat. One floor per op (the Python path's counts), on both its rows.
  cpp_calls (path cpp) how many of the timed calls the C++ path ran: all --iters of them, or the row
            is not the C++ path's figure.
  phases_us (path cpp) rank 0's median host time per phase of the C++ call (csrc/callpath.h Phases),
            over --iters more calls timed per phase; what the sum leaves of host_us is Python's part.
  gpu_us    the call's device time (CUDA events, L2 flushed); for the full dispatch also the cached
            call and the notify kernel, so gpu_us - cached - notify is the time the GPU waits for the
            host inside a full call.
  dist_us   each rank's p10 / p50 / p90 of the calls' figures ({wall, cpu[, wait, own]: [[p10, p50,
            p90] per rank]}); printed as `# dist` lines for the full dispatch (its phases, the C++
            path's full dispatch included: dispatch.wait is the count poll, so own = sum - wait).
  repeats   (--repeat N: the whole measurement N times in one process, the op counts once) each
            repeat's figures (slowest rank), cpp_calls, phases_us and dist_us; the row's figures are
            the median over repeats of those (phases_us: each phase's; cpp_calls: the fewest; dist_us:
            all repeats' calls), and the targets (TARGETS; targets_missed per row, printed for the
            client's path) are judged on them.
With two ranks on one GPU under CUDA MPS the device figures are "HBM loopback": the peers' rows move
through the GPU's own memory, not NVLink. Without MPS the ranks are time-sliced: host times are then
not the host's.
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys

import torch

from benchmarks.host_timing import (CATEGORIES, QUANTILES, allocations, count_device_ops, cprofile, floor_fn,
                                    host_times, percentiles, phases_line)
from commlib.bench import results
from commlib.utils.timing import bench_cuda, slowest

# Targets of the call path (docs/nvlink_engine.md, "Host time"): microseconds, ops per call.
TARGETS = {"dispatch_own_us": 150.0, "dispatch_ops": 25, "cached_us": 40.0, "combine_us": 40.0,
           "layout_us": 20.0, "fp8_extra_us": 10.0, "host_over_floor": 1.5, "gpu_gap_us": 40.0}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", default="1,2", help="comma list of world sizes (one spawned world each)")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--num-sms", type=int, default=20)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeat", type=int, default=1,
                   help="the whole measurement N times in one process: each repeat's medians, the rows and "
                        "targets on their median")
    p.add_argument("--profile", action="store_true", help="also print rank 0's cProfile of each op")
    p.add_argument("--backend", default=None, help="Buffer backend (default: auto)")
    p.add_argument("--json", nargs="?", const="auto", default=None, metavar="PATH")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------------
# the worker (one per rank)
# ------------------------------------------------------------------------------------------------

def worker(ctx, a: dict):
    args = argparse.Namespace(**a)
    from commlib import routing
    from commlib.buffer import Buffer
    from commlib.cuda import callpath
    from commlib.cuda import loader as K
    from commlib.fp8 import per_token_cast_to_fp8

    R, me, dev, group = ctx.world_size, ctx.rank, ctx.device, ctx.group
    cuda = dev.type == "cuda"
    T, H, E = args.tokens, args.hidden, args.experts
    Buffer.set_num_sms(args.num_sms)
    cfg, ccfg = Buffer.get_dispatch_config(R), Buffer.get_combine_config(R)
    nbytes = max(c.get_nvl_buffer_size_hint(H * 2, R) for c in (cfg, ccfg))
    buf = Buffer(group, nbytes, backend=args.backend, explicitly_destroy=True)
    g = torch.Generator().manual_seed(1000 + 7 * me)
    idx, w = routing.group_limited_topk(torch.sigmoid(torch.randn(T, E, generator=g)), 8, 4, 8)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    x, idx, w = x.to(dev), idx.to(dev), w.to(dev)
    xq = per_token_cast_to_fp8(x)
    ntpr, nrr, ntpe, tir, _ = buf.get_dispatch_layout(idx, E)

    def full(xx):
        return lambda: buf.dispatch(xx, num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=nrr, is_token_in_rank=tir,
                                    num_tokens_per_expert=ntpe, topk_idx=idx, topk_weights=w, config=cfg)

    recv_x, _, _, _, handle, _ = full(x)()
    y = recv_x
    ops = {"layout": lambda: buf.get_dispatch_layout(idx, E),
           "dispatch_bf16": full(x), "dispatch_fp8": full(xq),
           "cached_bf16": lambda: buf.dispatch(x, handle=handle, config=cfg),
           "cached_fp8": lambda: buf.dispatch(xq, handle=handle, config=cfg),
           "combine": lambda: buf.combine(y, handle, config=ccfg)}
    wait_ns = getattr(buf.backend, "last_wait_ns", None)
    # every rank measures the same paths: the C++ one where it loaded on all of them (the minimum over ranks)
    everyone_cpp = -slowest([-float(buf.call_path == "cpp")], group)[0] > 0
    paths = ["python", "cpp"] if everyone_cpp else ["python"]
    counted, floors, profiles, reps = {}, {}, [], []
    for rep in range(args.repeat):   # the whole measurement again; the op counts (deterministic) once
        rows, floor_us = [], {}
        for op, fn in ops.items():
            reads = 1 if op.startswith("dispatch") else 0
            for path in paths:
                buf.set_call_path(path)
                for _ in range(args.warmup):
                    fn()
                kind = op.split("_")[0]   # layout, dispatch, cached, combine: what the C++ engine counts
                before = buf._cpp.served[kind] if path == "cpp" else 0
                t = host_times(fn, args.iters, ahead=not reads, group=group, samples=True,
                               wait_ns=(lambda: buf.backend.last_wait_ns) if reads and wait_ns is not None else None)
                samples = t.pop("samples_us")
                if path == "cpp":   # the timed calls the C++ path ran (all of them, or the row is not its figure)
                    t["cpp_calls"] = buf._cpp.served[kind] - before
                    callpath.phases(True)   # where the C++ call's time goes: the same calls again, timed per phase
                    host_times(fn, args.iters, ahead=not reads, group=group)
                    t["phases_us"] = callpath.phases(False)
                if (op, path) not in counted:
                    counted[op, path] = count_device_ops(fn)
                counts = counted[op, path]
                if op not in floors:   # the primitives of the Python path's call (the C++ one issues the same)
                    shapes = allocations(fn)
                    floors[op] = (floor_fn(counts, dev, reads, shapes),
                                  [[list(sh), str(dt)] for sh, dt in shapes[:counts["alloc"]]])
                if op not in floor_us:   # timed once per op and repeat, on both its rows
                    floor_run = floors[op][0]
                    for _ in range(args.warmup):
                        floor_run()
                    floor_us[op] = host_times(floor_run, args.iters, ahead=not reads, group=group)["host_us"]
                row = {"op": op, "path": path, "tokens": T, "world": R, **t, "ops": counts, "floor_us": floor_us[op],
                       "floor_allocs": floors[op][1]}
                if cuda:
                    row["gpu_us"] = bench_cuda(fn, warmup=3, iters=20)["median_us"]
                    if reads:
                        with K.record_launches(sleep_cycles=0) as rec:   # launches through Python while recording
                            for _ in range(5):
                                fn()
                            torch.cuda.synchronize()
                        notify = [s.elapsed_time(e) * 1e3 for n, s, e in rec if n == "notify_kernel"]
                        row["notify_us"] = statistics.median(notify) if notify else None
                if args.profile and path == "python" and rep == 0:   # every rank (collective calls); rank 0's printed
                    text = cprofile(op, fn, args.iters)
                    if me == 0:
                        profiles.append(text)
                rows.append((row, samples))
        reps.append(rows)
    served = dict(buf._cpp.served) if buf._cpp is not None else {}
    buf.destroy()
    return {"rows": combine_repeats(reps, group), "profiles": profiles, "device": str(dev), "served": served}


# figures each repeat reduces to the slowest rank's, then the row to the median over repeats
SLOWEST_KEYS = ("host_us", "cpu_us", "floor_us", "own_us", "wait_us", "gpu_us", "notify_us")


def per_rank(obj, group) -> list:
    """``obj`` of every rank of ``group``, in rank order (``[obj]`` with no process group up)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return [obj]
    got = [None] * dist.get_world_size(group)
    dist.all_gather_object(got, obj, group=group)
    return got


def dist_of(samples: dict, group) -> dict:
    """{figure: [[p10, p50, p90] per rank]} of each call's figures ({figure: [us per call]} on each rank)."""
    ranks = per_rank({k: percentiles(v) for k, v in samples.items()}, group)
    return {k: [r[k] for r in ranks] for k in samples}


def combine_repeats(reps: list, group) -> list:
    """One row per op and path from ``reps`` (per repeat, [(row, samples)] in the same order on every
    rank): each repeat's figures at the slowest rank and its per-call percentiles per rank (``repeats``),
    the row's figures the median over repeats of those, ``dist_us`` the percentiles of all repeats' calls,
    ``phases_us`` each phase's median over repeats, ``cpp_calls`` the fewest of any repeat."""
    out = []
    for i, (first, _) in enumerate(reps[0]):
        per_rep, pooled = [], {}
        for rows in reps:
            row, samples = rows[i]
            vals = slowest([float(row.get(k) or 0.0) for k in SLOWEST_KEYS], group)
            fig = {k: v for k, v in zip(SLOWEST_KEYS, vals) if row.get(k) is not None}
            for k in ("cpp_calls", "phases_us"):
                if k in row:
                    fig[k] = row[k]
            fig["dist_us"] = dist_of(samples, group)
            per_rep.append(fig)
            for k, v in samples.items():
                pooled.setdefault(k, []).extend(v)
        row = {k: v for k, v in first.items() if k not in SLOWEST_KEYS}
        for k in SLOWEST_KEYS:
            if k in per_rep[0]:
                row[k] = statistics.median(f[k] for f in per_rep)
        if "cpp_calls" in row:
            row["cpp_calls"] = min(f["cpp_calls"] for f in per_rep)
        if "phases_us" in row:
            names = dict.fromkeys(k for f in per_rep for k in f["phases_us"])
            row["phases_us"] = {k: statistics.median(f["phases_us"].get(k, 0.0) for f in per_rep) for k in names}
        row["dist_us"] = dist_of(pooled, group)
        row["repeats"] = per_rep
        out.append(row)
    return out


def _finish(rows: list) -> list:
    """Ratios and the target checks, per world and call path."""
    by = {(r["world"], r["op"], r.get("path", "python")): r for r in rows}
    for r in rows:
        path = r.get("path", "python")
        r["host_over_floor"] = r.get("own_us", r["host_us"]) / r["floor_us"] if r["floor_us"] else None
        if r["op"].endswith("fp8"):
            bf = by.get((r["world"], r["op"].replace("fp8", "bf16"), path))
            if bf:
                r["fp8_extra_us"] = r.get("own_us", r["host_us"]) - bf.get("own_us", bf["host_us"])
        if r["op"].startswith("dispatch") and r.get("gpu_us") is not None:
            cached = by.get((r["world"], r["op"].replace("dispatch", "cached"), path))
            if cached and cached.get("gpu_us") is not None and r.get("notify_us") is not None:
                r["gpu_gap_us"] = r["gpu_us"] - cached["gpu_us"] - r["notify_us"]
    return rows


def judge(rows: list) -> None:
    """Each row's ``targets_missed`` (TARGETS its figures speak to, as "name value > target"), on the
    row's figures: with --repeat, the median of the repeats' medians."""
    for r in rows:
        kind = r["op"].split("_")[0]
        checks = [("host_over_floor", r.get("host_over_floor")), ("fp8_extra_us", r.get("fp8_extra_us"))]
        if kind == "dispatch":
            checks += [("dispatch_own_us", r.get("own_us", r["host_us"])), ("dispatch_ops", r["ops"]["total"]),
                       ("gpu_gap_us", r.get("gpu_gap_us"))]
        else:
            checks.append((f"{kind}_us", r["host_us"]))
        r["targets_missed"] = [f"{name} {round(v, 2):g} > {TARGETS[name]:g}" for name, v in checks
                               if v is not None and v > TARGETS[name]]


def judged_rows(rows: list) -> list:
    """The rows of the path a client gets: C++ where it was measured in that world, else Python."""
    cpp_worlds = {r["world"] for r in rows if r.get("path") == "cpp"}
    return [r for r in rows if r.get("path", "python") == ("cpp" if r["world"] in cpp_worlds else "python")]


def _triple(v: list) -> str:
    return "/".join(f"{x:.1f}" for x in v)


def dist_line(r: dict, dist: dict, label: str) -> str:
    """The printed per-call percentiles (QUANTILES) of a row's wall / wait / own time, per rank."""
    figs = [k for k in ("wall", "wait", "own") if k in dist]
    ranks = "; ".join(f"rank {i} " + " ".join(f"{k} {_triple(dist[k][i])}" for k in figs)
                      for i in range(len(dist["wall"])))
    q = "/".join(f"p{x}" for x in QUANTILES)
    return f"# dist ({q} us per call) world {r['world']} {r['op']} {r.get('path', 'python')}{label}: {ranks}"


def print_repeats(rows: list, n: int) -> None:
    print(f"# repeats: each repeat's median us per call (slowest rank), repeat 1..{n}; the table holds their median")
    for r in rows:
        figs = " | ".join(f"{k[:-3]} " + " ".join(f"{f[k]:.1f}" for f in r["repeats"])
                          for k in ("host_us", "own_us", "wait_us", "floor_us") if k in r["repeats"][0])
        print(f"  {r['world']:>5} {r['op']:>14} {r.get('path', 'python'):>6}  {figs}")


def print_table(rows: list) -> None:
    print("# host time per call (us); ops = device operations issued (launch/copy/alloc/record/wait/sync/coll)")
    print(f"# {'world':>5} {'op':>14} {'path':>6} {'host':>8} {'own':>8} {'wait':>8} {'cpu':>8} {'floor':>8} "
          f"{'own/floor':>9} {'ops':>5}  {'breakdown':<22} {'gpu':>8} {'gap':>7}")
    for r in rows:
        o = r["ops"]
        brk = "/".join(str(o[c]) for c in CATEGORIES)
        fmt = (lambda v: f"{v:8.1f}" if isinstance(v, (int, float)) else f"{'-':>8}")
        ratio = r.get("host_over_floor")
        print(f"  {r['world']:>5} {r['op']:>14} {r.get('path', 'python'):>6} {fmt(r['host_us'])} "
              f"{fmt(r.get('own_us'))} {fmt(r.get('wait_us'))} "
              f"{fmt(r['cpu_us'])} {fmt(r['floor_us'])} {ratio if ratio is None else round(ratio, 2):>9} "
              f"{o['total']:>5}  {brk:<22} {fmt(r.get('gpu_us'))} {fmt(r.get('gpu_gap_us'))[1:]}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.repeat < 1 or args.iters < 1:
        raise SystemExit(f"bench_host: --repeat and --iters take a count >= 1, got {args.repeat} and {args.iters}")
    from commlib.utils.launch import parallel_launch
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    rows, device, served = [], "cpu", {}
    for world in (int(w) for w in args.world.split(",") if w):
        out = parallel_launch(world, worker, vars(args), use_gpu=gpus > 0, timeout_s=900)
        rows += out["rows"]
        device = out["device"]
        served[world] = out["served"]
        for p in out["profiles"]:
            print(p)
    rows = _finish(rows)
    judge(rows)
    note = ("HBM loopback (ranks share one GPU under MPS)" if gpus and gpus < max(r["world"] for r in rows)
            else "one process per GPU" if gpus else "CPU ranks")
    print(f"# bench_host: {note}; tokens {args.tokens}, hidden {args.hidden}, {args.experts} experts, "
          f"{args.num_sms} SMs; device {device}")
    print_table(rows)
    n = args.repeat
    if n > 1:
        print_repeats(rows, n)
    for r in rows:   # the full dispatch's per-call spread, per repeat
        if r["op"].startswith("dispatch"):
            for i, f in enumerate(r["repeats"]):
                print(dist_line(r, f["dist_us"], f" repeat {i + 1}/{n}" if n > 1 else ""))
    cpp_rows = [r for r in rows if r.get("path") == "cpp"]
    for r in cpp_rows:
        if r.get("phases_us"):
            print(phases_line(f"world {r['world']} {r['op']}" + (f" median of {n} repeats" if n > 1 else ""),
                              r["phases_us"]))
        if n > 1 and r["op"].startswith("dispatch"):
            for i, f in enumerate(r["repeats"]):
                if f.get("phases_us"):
                    print(phases_line(f"world {r['world']} {r['op']} repeat {i + 1}/{n}", f["phases_us"]))
    if cpp_rows:
        short = [f"{r['world']}:{r['op']} {r['cpp_calls']}" for r in cpp_rows if r["cpp_calls"] != args.iters]
        print("# C++ path: " + (f"every timed call ran in C++ (calls served, per world: {served})" if not short
                                else f"NOT every timed call ran in C++: {short} of {args.iters}"))
    judged = judged_rows(rows)
    missed = [f"world {r['world']} {r['op']} {r.get('path', 'python')}: " + ", ".join(r["targets_missed"])
              for r in judged if r["targets_missed"]]
    on = f"the median of {n} repeats' medians" if n > 1 else "one run's medians"
    met = sum(not r["targets_missed"] for r in judged)
    print(f"# targets (judged on {on}, slowest rank; the client's path per world): {met} of {len(judged)} rows "
          "meet all" + ("" if not missed else "; missed: " + "; ".join(missed)))
    if args.json:
        doc = results.result_document("bench_host", "python -m benchmarks.bench_host " + shlex.join(sys.argv[1:]
                                      if argv is None else argv), rows, world_size=max(r["world"] for r in rows),
                                      targets=TARGETS, mode=note, repeat=n, targets_judged_on=on)
        print(f"# wrote {results.write_result(doc, None if args.json == 'auto' else args.json)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
