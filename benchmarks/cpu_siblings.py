"""Which CPUs of this host slow each other down: each CPU's speed alone, then every pair's run together.

Two CPUs that share a physical core (SMT siblings, or vCPUs a hypervisor backs with one core's two
threads; a guest's lscpu need not say so) run the same work together at well under their speed
alone; so may CPUs whose core a neighbour of the machine keeps busy (their speed alone varies). Host
times measured on such a CPU are the host's, not the code's: bench_internode --host names the CPU
each rank ran on beside its figures.

    python -m benchmarks.cpu_siblings [--reps 3] [--json DIR]

Prints each CPU's time alone (min / median of ``reps``), then the pairs whose work took at least
``--flag`` x their time alone, and each CPU's steal time over the probe (/proc/stat: the hypervisor
running something else while the vCPU wanted to run); JSON (``--json``): every pair's ratio.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

WORK = 200_000   # iterations of a pure-Python loop: ~5-10 ms on one core


def loop_seconds(iters: int) -> float:
    """Seconds of a pure-Python loop of ``iters`` iterations on the calling thread."""
    t0 = time.perf_counter()
    acc = 0
    for i in range(iters):
        acc += i & 7
    return time.perf_counter() - t0


def _work() -> float:
    return loop_seconds(WORK)


def _worker(conn) -> None:
    """Runs the work on the CPU it is sent, starting at the time it is sent (CLOCK_MONOTONIC: the same
    clock in every process), and sends back how long it took."""
    while True:
        msg = conn.recv()
        if msg is None:
            return
        cpu, start = msg
        os.sched_setaffinity(0, {cpu})
        while time.perf_counter() < start:
            pass
        conn.send(_work())


def cpu_times() -> dict:
    """{cpu: (steal, total)} jiffies from /proc/stat: steal is the time the hypervisor ran something
    else while this vCPU wanted to run ({} where there is no /proc/stat)."""
    out = {}
    try:
        with open("/proc/stat") as f:
            for line in f:
                name, *vals = line.split()
                if name.startswith("cpu") and name != "cpu":
                    v = [int(x) for x in vals]
                    out[int(name[3:])] = (v[7] if len(v) > 7 else 0, sum(v[:8]))
    except OSError:
        pass
    return out


def steal_percent(before: dict, after: dict) -> dict:
    """{cpu: % of its time stolen by the hypervisor} between two cpu_times()."""
    out = {}
    for c, (s1, t1) in after.items():
        s0, t0 = before.get(c, (s1, t1))
        out[c] = round(100.0 * (s1 - s0) / (t1 - t0), 1) if t1 > t0 else 0.0
    return out


def probe(reps: int = 3) -> dict:
    """{"cpus": [...], "alone_us": {cpu: [min, median]}, "pairs": [[a, b, ratio], ...]}: ``ratio`` is
    the mean over both CPUs of (time together / time alone), the median of ``reps`` runs."""
    cpus = sorted(os.sched_getaffinity(0))
    before = cpu_times()
    ctx = mp.get_context("fork")
    ends = [ctx.Pipe() for _ in range(2)]
    procs = [ctx.Process(target=_worker, args=(child,), daemon=True) for _, child in ends]
    for p in procs:
        p.start()
    a, b = ends[0][0], ends[1][0]
    try:
        alone = {}
        for cpu in cpus:
            runs = []
            for _ in range(reps + 2):
                a.send((cpu, time.perf_counter() + 1e-3))
                runs.append(a.recv())
            alone[cpu] = runs[2:]   # the first two warm the worker on that CPU
        base = {c: min(v) for c, v in alone.items()}
        pairs = []
        for i, x in enumerate(cpus):
            for y in cpus[i + 1:]:
                ratios = []
                for _ in range(reps):
                    start = time.perf_counter() + 2e-3
                    a.send((x, start))
                    b.send((y, start))
                    tx, ty = a.recv(), b.recv()
                    ratios.append((tx / base[x] + ty / base[y]) / 2)
                pairs.append([x, y, round(statistics.median(ratios), 3)])
    finally:
        for conn in (a, b):
            conn.send(None)
        for p in procs:
            p.join(timeout=5)
    return {"cpus": cpus, "work_iters": WORK,
            "alone_us": {c: [round(min(v) * 1e6, 1), round(statistics.median(v) * 1e6, 1)] for c, v in alone.items()},
            "pairs": pairs, "steal_percent": steal_percent(before, cpu_times())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--flag", type=float, default=1.25, help="print pairs at least this much slower together")
    ap.add_argument("--json", nargs="?", const="auto", default=None, metavar="PATH",
                    help="a .json file, or a folder for the standard name (default: benchmarks/results/)")
    a = ap.parse_args(argv)
    out = probe(a.reps)
    fast = min(v[0] for v in out["alone_us"].values())
    print(f"# cpu_siblings: {len(out['cpus'])} CPUs, a {WORK}-iteration Python loop; alone: min / median us "
          f"(x the fastest CPU's min)")
    print("#   " + ", ".join(f"cpu {c}: {m:.0f} / {med:.0f} ({m / fast:.2f})" for c, (m, med) in out["alone_us"].items()))
    slow = sorted((p for p in out["pairs"] if p[2] >= a.flag), key=lambda p: -p[2])
    print(f"# pairs at least {a.flag} x slower together than alone: {len(slow)} of {len(out['pairs'])}"
          + ("" if not slow else ": " + ", ".join(f"{x}+{y} {r:.2f}" for x, y, r in slow)))
    steal = out["steal_percent"]
    if steal:
        print("# steal (% of each CPU's time the hypervisor gave to others during the probe): "
              + ", ".join(f"cpu {c}: {v:g}" for c, v in steal.items()))
    ratios = [p[2] for p in out["pairs"]]
    print(f"# all pairs' ratio: min {min(ratios):.2f}, median {statistics.median(ratios):.2f}, max {max(ratios):.2f}")
    if a.json is not None:   # (after the probe: its workers were forked before anything touched a GPU)
        from commlib.bench import results
        cmd = "python -m benchmarks.cpu_siblings " + " ".join(argv if argv is not None else sys.argv[1:])
        doc = results.result_document("cpu_siblings", cmd.strip(), [], **out)
        print(f"# wrote {results.write_result(doc, a.json)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
