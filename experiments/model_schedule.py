"""Model: a forward+backward run's sequential step durations replayed in another schedule's order.

benchmarks.bench_overlap records every step's span in the sequential and the dual run (JSON
``figures.forward_backward.spans_sequential``). This replays the sequential durations in the issue
order of two schedules of two forwards then two backwards, built by commlib.training.pipeline's own
``interleave`` on stand-in steps (no model, no GPU):

  split   dual_forward, then dual_backward
  joint   dual_forward_backward (micro-batch 0's backward starts beside micro-batch 1's last
          forward steps), with its turn on the comm stream as on the GPUs, and without (``joint_compute``)

Each step starts when the step before it on its stream and the step before it in its micro-batch
have ended (``benchmarks.overlap.analysis.schedule_bound_ms``): no interference, no host delay, no clock change.
Printed over max(comm, compute) of the recorded run, with the halves floor (forward comm-or-compute
plus backward comm-or-compute).

    python -m experiments.model_schedule benchmarks/results/overlap_<tag>.json [...] [--light finish]
"""
from __future__ import annotations

import argparse
import json
import os

from benchmarks.overlap.analysis import schedule_bound_ms
from commlib.training import pipeline as P


def chain_stages(spans: list) -> list:
    """(name, kind) of micro-batch 0's forward stages, in order, from the sequential spans."""
    out = []
    for s in spans:
        tag, phase, name = s["label"].split(".", 2)
        if tag == "0" and phase == "F":
            out.append((name, "comm" if s["stream"] == "comm" else "compute"))
    return out


def orders(stages: list, light: set) -> dict:
    """Issue order (label, stream) of each schedule for two chains of ``stages``."""
    issued: list = []
    on = ["compute"]  # the stream a compute step's work goes to (the turn may move it to comm)

    def steps(tag: str) -> tuple:
        def step(phase, name, kind):
            label = f"{tag}.{phase}.{name}"
            return P.Step(kind, label, lambda: issued.append([label, "comm" if kind == "comm" else on[0]]),
                          light=name in light, stream="comm" if kind == "comm" else None)
        return [step("F", n, k) for n, k in stages], [step("B", n, k) for n, k in reversed(stages)]

    def on_comm(stream, run):
        def moved():
            on[0] = stream
            try:
                run()
            finally:
                on[0] = "compute"
        return moved

    result = {}
    (f0, b0), (f1, b1) = steps("0"), steps("1")
    P.interleave(f0, f1)
    P.interleave(b0, b1)
    result["split"], issued = issued, []
    for name, moved in (("joint", True), ("joint_compute", False)):
        lists = []
        for tag in ("0", "1"):
            fwd, bwd = steps(tag)
            lst = fwd + [P.Step("none", f"{tag}.turn", lambda: None)] + bwd
            if moved:  # as dual_forward_backward does on the GPUs
                P.turn_on_comm_stream(lst, len(fwd), wrap=on_comm)
            lists.append(lst)
        P.interleave(lists[0], lists[1], after_comm_first=True)
        result[name], issued = issued, []
    return result


def model(path: str, light: set) -> dict:
    with open(path) as f:
        fig = json.load(f)["figures"]["forward_backward"]
    seq = fig["spans_sequential"]
    # durations are keyed by (label, stream): a step moved to the comm stream keeps its compute time
    dur = {s["label"]: s for s in seq}
    busiest = max(fig["comm_ms"], fig["compute_ms"])
    out = {"measured": fig["dual_over_max_comm_compute"], "halves_floor": fig.get("halves_floor_over_max")}
    for name, order in orders(chain_stages(seq), light).items():
        spans = [{"label": label, "stream": stream, "start_ms": float(i), "end_ms": float(i)}
                 for i, (label, stream) in enumerate(order)]
        seq_moved = [dict(dur[label], stream=stream) for label, stream in order]
        out[name] = schedule_bound_ms(seq_moved, spans) / busiest
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("json", nargs="+", help="benchmarks.bench_overlap result files")
    p.add_argument("--light", default="finish", help="stage names that are light (never paired; comma list)")
    args = p.parse_args(argv)
    light = {x for x in args.light.split(",") if x}
    print(f"{'file':>60} {'measured':>9} {'split':>7} {'joint':>7} {'joint*':>7} {'halves':>7}")
    for path in args.json:
        m = model(path, light)
        halves = f"{m['halves_floor']:7.3f}" if m["halves_floor"] is not None else "      -"
        print(f"{os.path.basename(path)[-60:]:>60} {m['measured']:9.3f} {m['split']:7.3f} {m['joint']:7.3f} "
              f"{m['joint_compute']:7.3f} {halves}")
    print("# over max(comm, compute); joint* = the joint order with its turn on the compute stream")


if __name__ == "__main__":
    main()
