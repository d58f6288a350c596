"""Which threads of a command keep the host's CPUs busy while it runs: every thread of the command's
process tree, sampled from /proc.

Host times measured while other threads of the same job spin (NCCL's proxy threads progress posted
network steps until the GPU reaches them; a rank's main thread polls its reads) are the host's,
not the code's, once there are more busy threads than fast CPUs. This tool counts them.

    python -m benchmarks.thread_cpu [--interval 0.25] [--json PATH] -- COMMAND ...

Runs COMMAND, samples each thread's CPU time (utime + stime, /proc/PID/task/TID/stat) of COMMAND and
its descendants every ``interval`` seconds, and prints, after COMMAND exits: each thread that used
at least ``--min`` of a CPU over the run (process, thread name, share of one CPU), and over the
intervals the number of threads at least half busy (min / median / max) and the CPUs used in all.
NCCL names its threads where NCCL_SET_THREAD_NAME=1 (this tool sets it for COMMAND). Exits with
COMMAND's status.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def children(pid: int) -> list:
    """The pids of ``pid``'s children (/proc/PID/task/*/children)."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else ():
        text = _read(f"/proc/{pid}/task/{tid}/children")
        out += [int(c) for c in (text or "").split()]
    return out


def tree(root: int) -> list:
    """``root`` and its descendants."""
    seen, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen.append(pid)
            todo += children(pid)
    return seen


def thread_ticks(pid: int) -> dict:
    """{(pid, tid): (thread name, utime + stime ticks)} for ``pid``'s threads."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        stat = _read(f"/proc/{pid}/task/{tid}/stat")
        if not stat:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[(pid, int(tid))] = (name, int(fields[11]) + int(fields[12]))   # utime, stime (fields 14, 15)
    return out


def label(pid: int) -> str:
    cmd = (_read(f"/proc/{pid}/cmdline") or "").replace("\0", " ").replace("\n", " ").strip()
    return f"{pid} {cmd[:70]}"


def sample(root: int) -> tuple:
    """(monotonic seconds, {(pid, tid): (name, ticks)}) over ``root``'s tree."""
    now = time.monotonic()
    ticks = {}
    for pid in tree(root):
        ticks.update(thread_ticks(pid))
    return now, ticks


def summarize(samples: list, labels: dict, min_share: float) -> dict:
    """Per thread, its share of one CPU over the run; per interval, the threads at least half busy."""
    (t0, first), (t1, _) = samples[0], samples[-1]
    span = max(t1 - t0, 1e-9)
    latest = {}   # every thread's last sample (threads that ended before the command did too)
    for _, ticks in samples:
        latest.update(ticks)
    threads = []
    for key, (name, ticks) in latest.items():
        share = (ticks - first.get(key, (name, 0))[1]) / TICK / span
        if share >= min_share:
            threads.append({"process": labels.get(key[0], str(key[0])), "tid": key[1], "name": name,
                            "cpu_share": round(share, 3)})
    threads.sort(key=lambda r: -r["cpu_share"])
    busy, used = [], []
    for (ta, a), (tb, b) in zip(samples, samples[1:]):
        dt = max(tb - ta, 1e-9)
        shares = [(v[1] - a.get(k, (v[0], v[1]))[1]) / TICK / dt for k, v in b.items() if k in a]
        busy.append(sum(s >= 0.5 for s in shares))
        used.append(sum(shares))
    pick = lambda xs: {"min": min(xs), "median": statistics.median(xs), "max": max(xs)} if xs else {}
    return {"seconds": round(span, 2), "threads": threads, "busy_threads": pick(busy),
            "cpus_used": {k: round(v, 2) for k, v in pick(used).items()}, "cpus": os.cpu_count()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--interval", type=float, default=0.25)
    p.add_argument("--min", type=float, default=0.05, help="print threads using at least this share of a CPU")
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("command", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        p.error("no command given (after --)")
    proc = subprocess.Popen(cmd, env={**os.environ, "NCCL_SET_THREAD_NAME": "1"})
    samples, labels = [], {}
    while True:
        now, ticks = sample(proc.pid)
        for pid, _ in ticks:
            if pid not in labels:
                labels[pid] = label(pid)
        if ticks:
            samples.append((now, ticks))
        if proc.poll() is not None:
            break
        time.sleep(a.interval)
    rc = proc.wait()
    if len(samples) < 2:
        print("# thread_cpu: the command ended before two samples", file=sys.stderr)
        return rc
    s = summarize(samples, labels, a.min)
    shown = " ".join(cmd).replace("\n", " ")[:120]
    print(f"# thread_cpu: {s['seconds']} s of {shown}; {s['cpus']} CPUs")
    print(f"#   threads at least half busy per {a.interval} s: {s['busy_threads']}; CPUs used: {s['cpus_used']}")
    for r in s["threads"]:
        print(f"#   {r['cpu_share']:6.2f}  {r['name']:<16} {r['process']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"tool": "thread_cpu", "command": cmd, "interval_s": a.interval, **s}, f, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
