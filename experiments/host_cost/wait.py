"""How a dispatch's host read waits, and what the steps after it then cost (one GPU, 2 emulated hosts).

``bench_internode --profile`` shows a non-cached dispatch's steps after its host read costing more
when the read waited long (pack 310-400 us after a ~30-80 ms wait against 190-290 us after a ~2 ms
one, on the H200's host), while the calling thread is neither blocked nor preempted. The read waits
inside ``Tensor.cpu()`` (a synchronous copy: the driver waits for the stream). This runs the same
dispatch with the read waiting three ways, in one run, and prints bench_internode's step profile
for each (result: the same step costs whichever way it waited, docs/internode.md):

  sync    ``t.cpu()``, the engine's read
  event   an async copy into a kept pinned buffer, an event, ``Event.synchronize()``
  spin    the same copy and event, then the host polls ``Event.query()`` in Python until it is done

Run: python -m experiments.host_cost.wait [--tokens 4096] [--reps 10]
"""
from __future__ import annotations

import argparse

import torch

from benchmarks import bench_internode as BI
from commlib.backends.probe import RecordingProbe
from commlib.bench import main as B

MODES = ("sync", "event", "spin")


def _waiting_copy(mode: str):
    """How the engine's host read brings a tensor to the host, waiting by ``mode`` (a probe's ``read``,
    backends/probe.py)."""
    kept = {}

    def copy(t: torch.Tensor) -> torch.Tensor:
        if mode == "sync" or not t.is_cuda:
            return t.cpu()
        key = (tuple(t.shape), t.dtype)
        if key not in kept:
            kept[key] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out = kept[key]
        out.copy_(t, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        if mode == "event":
            done.synchronize()
        else:
            while not done.query():
                pass
        return out.clone()   # the kept buffer is rewritten by the next read
    return copy


def _worker(ctx, w, reps: int):
    buf, _, dispatch = BI.one_rank_per_node(ctx, w)
    for mode in MODES:
        probe = RecordingProbe(tracing=True, copy=_waiting_copy(mode))   # the engine's reads wait by mode
        buf.backend.set_probe(probe)
        ref = dispatch()   # the outputs do not depend on how the read waited
        for _ in range(3):
            dispatch()
        BI._profile(ctx, buf, f"dispatch_bf16, read waits by {mode}", dispatch, reps, probe=probe)
        again = dispatch()
        assert torch.equal(ref[0], again[0]) and ref[3] == again[3], f"rank {ctx.rank}: {mode} changed the outputs"
    buf.destroy()
    return {}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--reps", type=int, default=10)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_cost_wait: needs a GPU (the read's wait is a device wait)")
        return 0
    from commlib.utils.launch import parallel_launch
    w = B.Workload(a.tokens, a.hidden, 256, 8, 8, 4, 0)
    parallel_launch(2, _worker, w, a.reps, ranks_per_node=1, use_gpu=True, group_backend="nccl", emulate_hosts=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
