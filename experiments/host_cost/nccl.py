"""Host time of the primitives the internode engine is made of, on the GPU, over NCCL.

The engine's host time per call (``bench_internode``: wall time less its one host read) is far over
its target on one GPU shared by emulated hosts. This splits it into what the engine pays per torch
op and per NCCL step, each primitive timed on its own (median over ``--reps``, each rep started on
an idle device, as ``bench_internode`` times a call):

  launch           one small torch kernel (``x.add_(1)``)
  index_select     one gather of rows (the pack / land steps are made of these)
  a2a_issue        ``all_to_all_single(..., async_op=True)`` with split lists, not waited for
  a2a_wait         ``work.wait()`` of an issued one (the stream waits, not the host)
  a2a_issue_wait   both (what the engine pays per network chunk today)
  a2a_sync         ``all_to_all_single(..., async_op=False)`` (torch may run it on the current stream)
  a2a_equal        equal splits, no lists (the padded ``num_worst_tokens`` path)
  gather_issue_wait ``all_gather_into_tensor`` of a small int64 row, issued and waited for
  p2p_batch        ``batch_isend_irecv`` of one send + one recv per peer, waited for
  side_stream      a2a issued on a side stream, the current stream waits on an event
  raw_a2a_issue    the same all-to-all through experiments/nccl_direct.py (NCCL called directly, own
                   communicator, on the current stream: nothing to wait for)
  raw_gather_issue the small all-gather through experiments/nccl_direct.py
  raw_a2a_back_to_back  raw_a2a_issue without an idle device before each
  raw_a2a_issue_N_rows  with N rows to each rank; raw_a2a_issue_self_only: rows to this rank only
  raw_a2a_issue_after_sleep  a 2 ms host sleep between the idle device and the issue

Run (spawns 2 ranks on the GPU(s); with one GPU they are emulated hosts over NCCL's socket
transport): python -m experiments.host_cost.nccl [--ranks 2] [--reps 50] [--json PATH]
"""
from __future__ import annotations

import argparse
import statistics
import time

from experiments import write_json


def _median_us(fn, reps: int, sync) -> float:
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    sync()
    return statistics.median(times)


def worker(ctx, a):
    import torch
    import torch.distributed as dist
    R, dev, g = ctx.world_size, ctx.device, ctx.group
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    rows = max(R, a.rows // R * R)
    send = torch.zeros(rows, a.hidden, dtype=torch.bfloat16, device=dev)
    recv = torch.empty_like(send)
    splits = [rows // R] * R
    small = torch.zeros(64, dtype=torch.int64, device=dev)
    small_out = torch.empty(64 * R, dtype=torch.int64, device=dev)
    idx = torch.arange(rows, device=dev).flip(0)
    side = torch.cuda.Stream(device=dev) if dev.type == "cuda" else None

    def issue_wait():
        dist.all_to_all_single(recv, send, splits, splits, group=g, async_op=True).wait()

    pending = []

    def issue():
        pending.append(dist.all_to_all_single(recv, send, splits, splits, group=g, async_op=True))

    def wait():
        pending.pop().wait()

    def p2p():
        me = dist.get_rank(g)
        ops = []
        for r in range(R):
            if r == me:
                continue
            peer = dist.get_global_rank(g, r)
            ops.append(dist.P2POp(dist.isend, send[:rows // R], peer, g))
            ops.append(dist.P2POp(dist.irecv, recv[:rows // R], peer, g))
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    def on_side():
        ev = torch.cuda.Event()
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            dist.all_to_all_single(recv, send, splits, splits, group=g)
            ev.record(side)
        torch.cuda.current_stream(dev).wait_event(ev)

    out = {}
    for _ in range(3):   # warm every path
        issue_wait()
        p2p()
    out["launch"] = _median_us(lambda: send[:1].add_(1), a.reps, sync)
    out["index_select"] = _median_us(lambda: send.index_select(0, idx), a.reps, sync)
    # issue, then wait, timed apart (the issue's own rep leaves one pending for the wait's rep)
    t_issue, t_wait = [], []
    for _ in range(a.reps):
        sync()
        t0 = time.perf_counter()
        issue()
        t1 = time.perf_counter()
        wait()
        t2 = time.perf_counter()
        t_issue.append((t1 - t0) * 1e6)
        t_wait.append((t2 - t1) * 1e6)
    sync()
    out["a2a_issue"] = statistics.median(t_issue)
    out["a2a_wait"] = statistics.median(t_wait)
    out["a2a_issue_wait"] = _median_us(issue_wait, a.reps, sync)
    out["a2a_sync"] = _median_us(lambda: dist.all_to_all_single(recv, send, splits, splits, group=g), a.reps, sync)
    out["a2a_equal"] = _median_us(lambda: dist.all_to_all_single(recv, send, group=g, async_op=True).wait(),
                                  a.reps, sync)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    out["gather_issue_wait"] = _median_us(lambda: gather(small_out, small, group=g, async_op=True).wait(), a.reps, sync)
    out["p2p_batch"] = _median_us(p2p, a.reps, sync)
    if side is not None:
        out["side_stream"] = _median_us(on_side, a.reps, sync)
    # back to back: the per-call cost when calls do not start on an idle device
    sync()
    t0 = time.perf_counter()
    for _ in range(a.reps):
        issue_wait()
    out["a2a_issue_wait_back_to_back"] = (time.perf_counter() - t0) / a.reps * 1e6
    sync()
    if dev.type == "cuda":
        from experiments.host_cost.nccl_direct import NcclComm
        raw = NcclComm(g, dev, name="experiment")
        me = dist.get_rank(g)
        # the raw rows are checked: rank r's block j of recv is rank j's block r of send
        send.view(-1)[:1].zero_()
        stamp = torch.arange(rows, device=dev).to(torch.bfloat16).view(-1, 1) + 1000 * me
        send[:, :1].copy_(stamp)
        raw.all_to_all(recv, send, splits, splits, "check")
        sync()
        want = torch.cat([torch.arange(me * (rows // R), (me + 1) * (rows // R), device=dev).to(torch.bfloat16) + 1000 * j
                          for j in range(R)])
        assert torch.equal(recv[:, 0], want), "raw all_to_all moved the wrong rows"
        raw.all_gather(small_out.view(R, -1), small.fill_(me), "check")
        sync()
        assert torch.equal(small_out.view(R, -1)[:, 0].cpu(), torch.arange(R)), "raw all_gather wrong"
        for _ in range(3):
            raw.all_to_all(recv, send, splits, splits, "warm")
        def raw_a2a():   # an NVTX range, for `nsys profile` of this experiment (NCCL's own API calls in it)
            torch.cuda.nvtx.range_push("raw_a2a_issue")
            raw.all_to_all(recv, send, splits, splits, "a2a")
            torch.cuda.nvtx.range_pop()
        out["raw_a2a_issue"] = _median_us(raw_a2a, a.reps, sync)
        # what the issue's cost depends on: the rows (1 .. all), the peer (self only: no network step)
        for n in (1, 64, rows // R):
            sp = [n] * R
            out[f"raw_a2a_issue_{n}_rows"] = _median_us(lambda: raw.all_to_all(recv, send, sp, sp, "a2a"), a.reps, sync)
        only_me = [rows // R if r == me else 0 for r in range(R)]
        out["raw_a2a_issue_self_only"] = _median_us(lambda: raw.all_to_all(recv, send, only_me, only_me, "a2a"),
                                                    a.reps, sync)
        # the same all-to-all issued after a 2 ms host sleep on an idle device (a slow first call after the
        # host waited, whatever the transport, would show here as on the NCCL rows)
        def after_sleep():
            time.sleep(0.002)
        t_sleep = []
        for _ in range(a.reps):
            sync()
            after_sleep()
            t0 = time.perf_counter()
            raw.all_to_all(recv, send, splits, splits, "a2a")
            t_sleep.append((time.perf_counter() - t0) * 1e6)
        sync()
        out["raw_a2a_issue_after_sleep"] = statistics.median(t_sleep)
        out["raw_gather_issue"] = _median_us(lambda: raw.all_gather(small_out, small, "gather"), a.reps, sync)
        sync()
        t0 = time.perf_counter()
        for _ in range(a.reps):
            raw.all_to_all(recv, send, splits, splits, "a2a")
        out["raw_a2a_back_to_back"] = (time.perf_counter() - t0) / a.reps * 1e6
        sync()
        raw.close()
    everyone = [None] * R
    dist.all_gather_object(everyone, out, group=g)
    return everyone


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    import torch
    from commlib.utils.launch import parallel_launch
    gpus = torch.cuda.device_count()
    emulate = 0 < gpus < a.ranks
    per_rank = parallel_launch(a.ranks, worker, a, use_gpu=gpus > 0, timeout_s=600,
                               group_backend="nccl" if gpus else "gloo", emulate_hosts=emulate,
                               ranks_per_node=1 if emulate else None)
    keys = list(per_rank[0])
    print(f"host us per primitive ({a.ranks} ranks, {gpus} GPU(s){', emulated hosts' if emulate else ''}; "
          f"a2a of {a.rows} x {a.hidden} bf16):")
    for k in keys:
        print(f"  {k:28s} " + "  ".join(f"{r[k]:9.1f}" for r in per_rank))
    if a.json:
        rows = [{"op": k, "rank": r, "host_us": round(v[k], 2)} for r, v in enumerate(per_rank) for k in keys]
        write_json("host_cost_nccl", None, rows, a.ranks, a.json, module="experiments.host_cost.nccl", emulated_hosts=emulate, a2a_rows=a.rows,
                   hidden=a.hidden)


if __name__ == "__main__":
    main()
