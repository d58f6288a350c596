"""How many Python and C calls one internode Buffer call makes, per step (one GPU, 2 emulated hosts).

``bench_internode --profile`` shows every step of a call costing 3-10x what its pieces cost in a
tight loop, with the thread computing all along (no switch, no allocation, no wait). If the cost is
per operation, it follows the number of operations a call makes. This counts them: with
``sys.setprofile`` on, one call of each op (non-cached dispatch, cached dispatch, combine) is
traced, and its Python function calls and C calls (torch ops, builtins) are counted per step (the
engine's probe marks end the steps, as in ``--profile``). The same calls are timed without the
profiler as ``bench_internode`` times them (median of ``--reps``, the read's wait excluded; behind
running work, and with the host running ahead of the GPU). A fourth row, ``dispatch_floor``, is
``bench_internode.dispatch_floor``: the device operations a one-chunk dispatch cannot do without,
issued bare, timed and counted alike.

Run: python -m experiments.host_cost.calls [--tokens 4096] [--reps 20] [--json DIR]
"""
from __future__ import annotations

import argparse
import collections
import sys

import torch
import torch.distributed as dist

from benchmarks import bench_internode as BI
from commlib.backends.probe import Probe
from commlib.bench import main as B
from experiments import write_json

class _StepProbe(Probe):
    """The engine's probe: each ``mark`` ends a step of the counter (``mark``'s own calls count too)."""

    recording = True   # the engine reports steps only to a recording probe

    def __init__(self, counter) -> None:
        self.counter = counter

    def mark(self, step: str) -> None:
        self.counter.step = "after " + step


class _Counter:
    """sys.setprofile hook: Python calls and C calls, per step (a step ends at each probe mark)."""

    def __init__(self) -> None:
        self.step = "buffer"
        self.steps = collections.OrderedDict()
        self.py = collections.Counter()
        self.c = collections.Counter()

    def __call__(self, frame, event, arg) -> None:
        if event == "call":
            code = frame.f_code
            self.py[getattr(code, "co_qualname", code.co_name)] += 1
            kind = 0
        elif event == "c_call":
            self.c[getattr(arg, "__qualname__", repr(arg))] += 1
            kind = 1
        else:
            return
        cell = self.steps.setdefault(self.step, [0, 0])
        cell[kind] += 1


def _count(buf, fn) -> _Counter:
    counter = _Counter()
    buf.backend.set_probe(_StepProbe(counter))
    sys.setprofile(counter)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return counter


def _worker(ctx, w, reps: int):
    buf, x, one = BI.one_rank_per_node(ctx, w)
    res = {}

    def dispatch():
        res["d"] = one()

    dispatch()
    recv_x, handle = res["d"][0], res["d"][4]
    ops = {"dispatch_bf16": dispatch,
           "dispatch_bf16_cached": lambda: buf.dispatch(x, handle=handle),
           "combine": lambda: buf.combine(recv_x, handle, topk_weights=res["d"][2]),
           "dispatch_floor": BI.dispatch_floor(buf, handle, w)}
    out = {}
    for name, fn in ops.items():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        dist.barrier(group=ctx.group)
        busy, busy_nccl, _ = BI._host_us(buf, fn, reps, busy=True)
        steady, steady_nccl, _ = BI._host_us(buf, fn, reps, steady=True)
        torch.cuda.synchronize()
        dist.barrier(group=ctx.group)
        c = _count(buf, fn)
        torch.cuda.synchronize()
        out[name] = {"host_us_busy": busy, "engine_us_busy": busy - busy_nccl, "host_us_steady": steady,
                     "engine_us_steady": steady - steady_nccl, "python_calls": sum(c.py.values()), "c_calls": sum(c.c.values()),
                     "steps": dict(c.steps),
                     "top_python": c.py.most_common(25), "top_c": c.c.most_common(25)}
    buf.destroy()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", default=None, help="directory for host_cost_calls_<GPU>x<n>_<date>_<commit>.json")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_cost_calls: needs a GPU (the device steps run only there)")
        return 0
    from commlib.utils.launch import parallel_launch
    w = B.Workload(a.tokens, a.hidden, 256, 8, 8, 4, 0)
    out = parallel_launch(2, _worker, w, a.reps, ranks_per_node=1, use_gpu=True, group_backend="nccl",
                          emulate_hosts=True)
    for name, o in out.items():
        n = o["python_calls"] + o["c_calls"]
        print(f"# {name}: host us per call (rank 0, the read's wait excluded) {o['host_us_busy']:.0f} behind running "
              f"work, {o['host_us_steady']:.0f} with the host running ahead; less torch.distributed's calls: "
              f"{o['engine_us_busy']:.0f} / {o['engine_us_steady']:.0f}; {o['python_calls']} Python calls + "
              f"{o['c_calls']} C calls = {n}")
        for step, (py, cc) in o["steps"].items():
            print(f"#   {step:>24}: {py:>5} Python {cc:>5} C")
        print("#   most made (Python): " + ", ".join(f"{k} {v}" for k, v in o["top_python"][:15]))
        print("#   most made (C): " + ", ".join(f"{k} {v}" for k, v in o["top_c"][:15]))
    if a.json:
        rows = [{"op": name, **o} for name, o in out.items()]
        write_json("host_cost_calls", argv, rows, 2, a.json, module="experiments.host_cost.calls")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
