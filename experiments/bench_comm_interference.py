"""What slows commlib's dispatch + combine while compute runs beside them (the comm interference of
the dual pipeline, docs/notes/2026-11-30_pipeline_log.md): a cached BF16 dispatch + combine at few
comm SMs, timed alone and while every rank keeps the other SMs busy with one kind of load, launched
first on a side stream:

  fma    1024-thread CTAs doing register FMAs only (SMs busy, no memory traffic)
  l2     CTAs re-reading a 24 MB buffer (L2 traffic, little HBM)
  hbm    CTAs copying between two 2 GB buffers (HBM read + write)
  gemm   torch.mm 16384x7168x1536 in a loop, SM carveout = the comm SMs (what the pipeline overlaps)

The load CTAs take 120 KB of shared memory each, so one fits per SM, and launch
as 2-CTA clusters like the comm kernels (COMM_CLUSTER=2), so the ``--comm-sms`` SMs left free come in
pairs. Each row: mean time of a cached dispatch and of a combine (CUDA events, slowest rank), and
their ratios to the alone times. If ``fma`` costs nothing and ``hbm`` / ``gemm`` cost what the pipeline loses,
the loss is the memory system's latency, not the SMs.

A third op, ``ce_push`` (off with ``--no-ce``), moves the dispatch's payload with the copy engines
instead: each rank pushes the bytes its dispatch sends to a peer with one cudaMemcpyAsync into the
peer's memory (CUDA IPC). It uses no SM, so its row says what a copy-engine data path would lose to
the same loads. The other side follows: a GEMM loop and a 2 GB copy loop timed alone and while the
SM comm kernels (GEMM: SM carveout) or ce_push (GEMM: every SM) run in a loop beside them.

With ``--kernel-variant COMM_TRACE=1`` each row also splits the last call of each op by role (mean
over CTAs, slowest rank): when the senders and the receivers finished their own work and when they
ended (with SHARE_WORK=1 a sender ends after the receiver rows it took over).

Run (GPUs, spawns 2 ranks): python -m experiments.bench_comm_interference [--comm-sms 4]
    [--kernel-variant KEY=V,...] [--no-ce] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys


LOADS = ("alone", "fma", "l2", "hbm", "gemm")

_LOAD_SRC = r"""
__device__ __forceinline__ unsigned long long now() {
    unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t;
}
extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(1024, 1) load_kernel(int kind, unsigned long long ns,
        const float4* src, float4* dst, long long n4, float* sink) {
    extern __shared__ float pad[];
    const unsigned long long t0 = now();
    float a = threadIdx.x, b = 1.0001f;
    pad[threadIdx.x] = a;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long step = (long long)gridDim.x * blockDim.x;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    while (now() - t0 < ns) {
        for (int r = 0; r < 64; ++r) {
            if (kind == 0) {
#pragma unroll
                for (int u = 0; u < 16; ++u) a = fmaf(a, b, 1e-7f);
            } else {
                const float4 v = src[i];
                if (kind == 2) dst[i] = v; else { acc.x += v.x; acc.y += v.w; }
                i += step;
                if (i >= n4) i -= n4;
            }
        }
    }
    if (a + acc.x + acc.y + pad[(threadIdx.x + 1) & 1023] == -1.f) sink[0] = a;
}
"""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # the shape of bench_overlap's `balanced` preset (16384 tokens of 7168, 16 experts, top-2), 4 comm SMs
    for flag, default in (("tokens", 16384), ("hidden", 7168), ("experts", 16), ("topk", 2), ("comm-sms", 4),
                          ("iters", 10), ("ranks", 2)):
        p.add_argument(f"--{flag}", type=int, default=default)
    p.add_argument("--kernel-variant", default="", metavar="KEY=V,...",
                   help="NVLink kernel build variant (commlib.cuda.loader.DEFAULT_VARIANT keys) on every rank")
    p.add_argument("--no-ce", dest="ce", action="store_false",
                   help="skip the ce_push row: the dispatch's payload pushed by the copy engines (cudaMemcpyAsync)")
    p.add_argument("--json", default="")
    return p.parse_args(argv)


def role_times(trace) -> dict:
    """Per-CTA (start, own work done, end) points of one launch -> mean us per role from the launch's start."""
    t0 = min(p[0] for p in trace)
    out = {}
    for role, name in ((0, "sender"), (1, "receiver")):
        pts = [p for i, p in enumerate(trace) if i % 2 == role]
        out[f"{name}_own_us"] = sum(p[1] - t0 for p in pts) / len(pts) / 1e3
        out[f"{name}_end_us"] = sum(p[2] - t0 for p in pts) / len(pts) / 1e3
    return out


def _worker(ctx, args):
    import cupy as cp
    import torch
    import torch.distributed as dist

    from commlib.cuda import loader as K
    from commlib import routing
    from commlib.utils import timing
    from commlib.buffer import Buffer
    from commlib.config import Config

    tracing = bool(K.set_variant(K.parse_variant(args.kernel_variant))["COMM_TRACE"])
    if tracing:
        os.environ["COMMLIB_DEBUG_SMID"] = "1"  # the trace buffer is allocated with the Buffer
    R, me, dev, group = ctx.world_size, ctx.rank, ctx.device, ctx.group
    T, H, E = args.tokens, args.hidden, args.experts
    n = args.comm_sms
    cfg = Config(n, 32, max(8192, math.ceil(T / (n // 2))), 64, 1024)
    buf = Buffer(group, cfg.get_nvl_buffer_size_hint(2 * H, R), backend="nvlink", explicitly_destroy=True)
    g = torch.Generator().manual_seed(7 + me)
    idx, w = routing.group_limited_topk(torch.sigmoid(torch.randn(T, E, generator=g)), 1, 1, args.topk)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev)
    idx, w = idx.to(dev), w.to(dev)
    ntpr, _, ntpe, tir, _ = buf.get_dispatch_layout(idx, E)
    recv_x, _, _, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=tir,
                                              num_tokens_per_expert=ntpe, topk_idx=idx, topk_weights=w, config=cfg)

    ops = {"dispatch": lambda: buf.dispatch(x, handle=handle, config=cfg),
           "combine": lambda: buf.combine(recv_x, handle, config=cfg)}
    ce = None
    if args.ce:
        # The dispatch's payload moved by the copy engines instead of SMs: one cudaMemcpyAsync per peer of
        # the bytes this rank's dispatch sends there, into a region of the peer's memory (CUDA IPC).
        ce = CopyEnginePush(group, me, R, T * H * x.element_size(),
                            [int(c) * H * x.element_size() for c in ntpr.tolist()], x.data_ptr())
        ops["ce_push"] = ce.push

    fn = cp.RawModule(code=_LOAD_SRC, options=("-std=c++17", "--gpu-architecture=sm_90")).get_function("load_kernel")
    fn.max_dynamic_shared_size_bytes = 120 * 1024
    big = torch.empty(2 * 2 ** 30 // 4, dtype=torch.float32, device=dev).uniform_()
    dst_buf = torch.empty_like(big)
    small = big[: 24 * 2 ** 20 // 4]
    sink = torch.zeros(1, device=dev)
    mats = (torch.randn(16384, H, device=dev, dtype=torch.bfloat16), torch.randn(H, 1536, device=dev,
                                                                                 dtype=torch.bfloat16))
    side = torch.cuda.Stream(device=dev, priority=0)
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count

    traces = {}
    spans = {}  # per load: how long it ran and when the timing ended, from the load's launch (this rank)

    def timed(row: str):
        """{op: mean ms}, and the event recorded after the last timed call."""
        out = {}
        for name, op in ops.items():
            for _ in range(2):
                op()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.iters):
                op()
            end.record()
            end.synchronize()
            out[name] = start.elapsed_time(end) / args.iters
            if tracing:
                traces.setdefault(row, {})[name] = role_times(buf.backend.last_trace(name))
        return out, end

    def with_load(kind: str, alone: dict):
        """{op: mean ms} beside the load, and whether the load outlasted the timing (else: not valid)."""
        torch.cuda.synchronize()
        dist.barrier(group=group)
        budget_ms = sum(alone.values()) * (args.iters + 2) * 3 + 20
        with torch.cuda.stream(side):
            load_start = torch.cuda.Event(enable_timing=True)
            load_start.record()
            if kind == "gemm":
                carve0 = torch._C._get_sm_carveout_experimental()
                torch._C._set_sm_carveout_experimental(n)
                t0 = torch.cuda.Event(enable_timing=True)
                t1 = torch.cuda.Event(enable_timing=True)
                for _ in range(3):  # the first call also picks the cuBLAS kernel
                    torch.mm(*mats)
                t0.record()
                for _ in range(5):
                    torch.mm(*mats)
                t1.record()
                t1.synchronize()
                for _ in range(int(budget_ms / max(t0.elapsed_time(t1) / 5, 0.05)) + 1):
                    torch.mm(*mats)
                torch._C._set_sm_carveout_experimental(carve0)
            else:
                src, n4 = (small, small.numel() // 4) if kind == "l2" else (big, big.numel() // 4)
                code = {"fma": 0, "l2": 1, "hbm": 2}[kind]
                fn((num_sms - n,), (1024,), (cp.int32(code), cp.uint64(int(budget_ms * 1e6)), cp.uint64(src.data_ptr()),
                                             cp.uint64(dst_buf.data_ptr()), cp.int64(n4), cp.uint64(sink.data_ptr())),
                   shared_mem=120 * 1024, stream=cp.cuda.ExternalStream(side.cuda_stream))
            load_end = torch.cuda.Event(enable_timing=True)
            load_end.record()
        torch.cuda._sleep(1_000_000)  # the load is resident before the first comm kernel is queued
        ms, end = timed(kind)
        torch.cuda.synchronize()
        spans[kind] = {"load_ms": load_start.elapsed_time(load_end), "timing_end_ms": load_start.elapsed_time(end),
                       "budget_ms": budget_ms}
        return ms, end.elapsed_time(load_end) > 0

    def slowest(v: dict) -> dict:
        return dict(zip(v, timing.slowest(list(v.values()), group)))

    # torch's sleep kernel is loaded lazily: its first launch, behind a running load, waited for the
    # load to end (the first load's row then timed the comm kernels alone). Load it now.
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    alone = slowest(timed("alone")[0])
    rows, covered = {"alone": alone}, {}
    for kind in LOADS[1:]:
        ms, ok = with_load(kind, alone)
        rows[kind] = slowest(ms)
        flag = torch.tensor([int(ok)], device=dev)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        covered[kind] = bool(flag.item())
    rows["alone_again"] = slowest(timed("alone_again")[0])
    split = {row: {op: slowest(t) for op, t in v.items()} for row, v in traces.items()}
    if ce is not None:
        rows["compute_beside_comm"] = compute_beside_comm(ops, rows["alone"], mats, big, dst_buf, n, group, slowest)
        torch.cuda.synchronize()
        dist.barrier(group=group)  # no peer still pushes into this rank's region
        rows["ce_push_bytes"] = ce.max_bytes(group)
        ce.close()
    buf.destroy()
    return rows, covered, split, spans


def compute_beside_comm(ops: dict, alone: dict, mats, src, dst, comm_sms: int, group, slowest) -> dict:
    """The other side of the interference: compute (a GEMM loop, a 2 GB copy loop) timed alone and
    while a comm loop runs on a side stream, launched first: the SM kernels (dispatch + combine on
    ``comm_sms`` SMs; the GEMM leaves them free, SM carveout) or the copy engines (ce_push; the GEMM
    gets every SM). {row: ms per compute call, slowest rank}; the rows' comm loop must outlast the
    compute (``covered``)."""
    import torch
    import torch.distributed as dist

    from commlib.utils import timing
    work = {"gemm": lambda: torch.mm(*mats), "copy": lambda: dst.copy_(src)}
    carve0 = torch._C._get_sm_carveout_experimental()

    def run(name: str, carveout: int, comm: list, reps: int = 20) -> tuple:
        """(ms per call, whether the comm loop was still running when the last call ended)."""
        torch._C._set_sm_carveout_experimental(carveout)
        fn = work[name]
        fn()  # the first call per carveout picks the cuBLAS kernel
        side = torch.cuda.Stream()
        torch.cuda.synchronize()
        dist.barrier(group=group)
        done = torch.cuda.Event(enable_timing=True)
        if comm:
            with torch.cuda.stream(side):
                for op in comm:
                    op()
                done.record()
            torch.cuda._sleep(1_000_000)  # the comm loop is running before the compute is queued
        end: list = []
        ms = timing.loop_ms(fn, reps, end)
        torch._C._set_sm_carveout_experimental(carve0)
        return ms, (not comm) or end[0].elapsed_time(done) > 0

    out = {}
    pair = alone["dispatch"] + alone["combine"]
    for name in work:
        base = slowest({"all": run(name, 0, [])[0], "carved": run(name, comm_sms, [])[0]})
        base_all, base_carved = base["all"], base["carved"]
        # ms the comm loop must cover, with margin; from the slowest rank's figures, so every rank
        # queues the same number of comm calls (the SM kernels wait for their peers' calls)
        budget = 3 * max(base_all, base_carved) * 20 + 20
        beside_sm, ok_sm = run(name, comm_sms, [ops["dispatch"], ops["combine"]] * (int(budget / pair) + 1))
        beside_ce, ok_ce = run(name, 0, [ops["ce_push"]] * (int(budget / alone["ce_push"]) + 1))
        flags = torch.tensor([int(ok_sm), int(ok_ce)], device=torch.cuda.current_device())
        dist.all_reduce(flags, op=dist.ReduceOp.MIN, group=group)
        out[name] = slowest({"alone_all_sms": base_all, "alone_carveout": base_carved,
                             "beside_sm_comm": beside_sm, "beside_ce_push": beside_ce})
        out[name]["comm_outlasted"] = {"sm": bool(flags[0]), "ce": bool(flags[1])}
    return out


class CopyEnginePush:
    """Pushes ``nbytes[p]`` bytes from ``src_ptr`` into peer p's memory with cudaMemcpyAsync (the copy
    engines over NVLink), on the current stream. Each rank owns a [R x region] receive area (the
    nvlink backend's PeerMemory: CUDA IPC); rank r writes its own slot of it."""

    def __init__(self, group, me: int, R: int, region: int, nbytes: list, src_ptr: int):
        import torch

        from commlib.backends.nvlink.peer_memory import PeerMemory
        self.me, self.region, self.src = me, region, src_ptr
        self.nbytes = [0 if p == me else n for p, n in enumerate(nbytes)]
        self.mem = PeerMemory(R * region, group, me, R, torch.device("cuda", torch.cuda.current_device()))
        self.mem.all_opened(group, me, R)

    def push(self) -> None:
        import cupy as cp
        import torch
        rt, stream = cp.cuda.runtime, torch.cuda.current_stream().cuda_stream
        for p, ptr in self.mem.peer_ptrs.items():
            if self.nbytes[p]:
                rt.memcpyAsync(ptr + self.me * self.region, self.src, self.nbytes[p], rt.memcpyDeviceToDevice, stream)

    def max_bytes(self, group) -> int:
        import torch
        import torch.distributed as dist
        t = torch.tensor([sum(self.nbytes)], dtype=torch.int64, device=torch.cuda.current_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return int(t.item())

    def close(self) -> None:
        self.mem.close()


def main(argv=None):
    args = parse_args(argv)
    from commlib.utils.launch import parallel_launch
    rows, covered, split, spans = parallel_launch(args.ranks, _worker, args, use_gpu=True)
    ce_bytes = rows.pop("ce_push_bytes", None)
    beside = rows.pop("compute_beside_comm", {})
    base = rows["alone"]
    print(f"[interference] {args.tokens} tokens x {args.hidden}, {args.comm_sms} comm SMs, {args.ranks} ranks, "
          f"variant {args.kernel_variant or 'default'} (ms per call, slowest rank)")
    ratios = {k: {op: t / base[op] for op, t in v.items()} for k, v in rows.items()}
    for k, v in rows.items():
        note = "" if covered.get(k, True) else "  (NOT VALID: the load ended before the timing did)"
        if k in spans:
            note += (f"  [rank 0: load ran {spans[k]['load_ms']:.1f} ms of a {spans[k]['budget_ms']:.0f} ms budget, "
                     f"timing ended at {spans[k]['timing_end_ms']:.1f} ms]")
        gbps = f"  (copy engines: {ce_bytes / v['ce_push'] / 1e6:.0f} GB/s)" if ce_bytes else ""
        print(f"  {k:12s} " + "  ".join(f"{op} {t:7.3f} ms x{ratios[k][op]:4.2f}" for op, t in v.items())
              + gbps + note)
        for op, t in split.get(k, {}).items():
            print(f"  {'':12s}   {op} by role (us from launch): sender own {t['sender_own_us']:7.0f} end "
                  f"{t['sender_end_us']:7.0f}, receiver own {t['receiver_own_us']:7.0f} end {t['receiver_end_us']:7.0f}")
    for name, v in beside.items():
        print(f"  compute {name:5s} alone {v['alone_all_sms']:6.3f} ms (all SMs) {v['alone_carveout']:6.3f} ms "
              f"({args.comm_sms} SMs left free); beside the SM comm kernels {v['beside_sm_comm']:6.3f} ms "
              f"x{v['beside_sm_comm'] / v['alone_carveout']:4.2f}; beside ce_push {v['beside_ce_push']:6.3f} ms "
              f"x{v['beside_ce_push'] / v['alone_all_sms']:4.2f}"
              + ("" if all(v["comm_outlasted"].values()) else f"  (NOT VALID: {v['comm_outlasted']})"))
    if args.json:
        import torch

        from commlib.bench.main import git_commit
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"benchmark": "bench_comm_interference", "device": torch.cuda.get_device_name(0),
                       "git_commit": git_commit()["commit"],
                       "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
                       "args": vars(args), "ms_per_call": rows, "ratio_to_alone": ratios,
                       "load_outlasted_timing": covered, "ce_push_bytes_max_rank": ce_bytes,
                       "compute_beside_comm": beside, "load_spans_rank0": spans,
                       "role_split_last_call": split}, f, indent=1)
        print(f"[interference] wrote {args.json}")


if __name__ == "__main__":
    main()
