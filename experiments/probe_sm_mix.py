"""Probe: can one SM push rows to the peer GPU and copy rows locally at the same time, each near
its own full rate? (The question behind splitting sender / receiver roles inside each comm CTA,
docs/notes/2026-11-30_pipeline_log.md.)

A 1024-thread CTA per SM, on both GPUs at once (each pushes into the other, as the dispatch does):
warps [0, P) copy rows from local memory into the peer's memory over NVLink, warps [P, 32) copy
rows from local memory to local memory, both register-staged like the comm kernels (4 x 16-byte
vectors in flight per lane, non-coherent loads). Each group records the %globaltimer at which its
last warp finished; the rate of a group is its bytes over that time. P = 32 (push only), P = 0
(local copies only) and mixes in between, on --sms SMs, GPU 0's figures (GPU 1 runs the mirror
image at the same time).

    python -m experiments.probe_sm_mix [--sms 4] [--rows 4096] [--hidden 7168] [--json PATH]

Needs two GPUs with peer access (CuPy); nothing of commlib runs here.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

_SRC = r"""
extern "C" __global__ void __launch_bounds__(1024, 1) mix_kernel(
        const int4* __restrict__ push_src, int4* push_dst, const int4* __restrict__ copy_src, int4* copy_dst,
        int push_warps, long long push_rows, long long copy_rows, int row_int4, unsigned long long* out) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const bool push = warp < push_warps;
    const int group_warps = push ? push_warps : 32 - push_warps;
    const int gw = (push ? warp : warp - push_warps) + blockIdx.x * group_warps;  // warp index in its group
    const int total = group_warps * gridDim.x;
    const long long rows = push ? push_rows : copy_rows;
    const int4* src = push ? push_src : copy_src;
    int4* dst = push ? push_dst : copy_dst;
    unsigned long long t0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    for (long long r = gw; r < rows; r += total) {
        const int4* s = src + r * row_int4;
        int4* d = dst + r * row_int4;
        for (int i = lane; i < row_int4; i += 128) {
            int4 v[4];
#pragma unroll
            for (int u = 0; u < 4; ++u)
                if (i + 32 * u < row_int4)
                    asm volatile("ld.global.nc.v4.s32 {%0,%1,%2,%3}, [%4];"
                                 : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w) : "l"(s + i + 32 * u));
#pragma unroll
            for (int u = 0; u < 4; ++u)
                if (i + 32 * u < row_int4) d[i + 32 * u] = v[u];
        }
    }
    __threadfence_system();
    unsigned long long t1;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
    if (lane == 0) {
        atomicMin(out + (push ? 0 : 2), t0);
        atomicMax(out + (push ? 1 : 3), t1);
    }
}
"""


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sms", type=int, default=4)
    p.add_argument("--rows", type=int, default=4096, help="rows per group per GPU at the 32-warp end (scaled by warps)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--mixes", default="32,24,16,8,0", help="push warps per CTA to try")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    import cupy as cp

    if cp.cuda.runtime.getDeviceCount() < 2:
        sys.exit("probe_sm_mix: needs two GPUs")
    row_int4 = args.hidden * 2 // 16
    kernels, bufs, streams = [], [], []
    cap = args.rows
    for dev in (0, 1):
        with cp.cuda.Device(dev):
            cp.cuda.runtime.deviceEnablePeerAccess(1 - dev)
            kernels.append(cp.RawModule(code=_SRC, options=("-std=c++17",)).get_function("mix_kernel"))
            bufs.append({name: cp.random.random(cap * row_int4 * 4, dtype=cp.float32).view(cp.int32)
                         for name in ("push_src", "recv", "copy_src", "copy_dst")})
            streams.append(cp.cuda.Stream(non_blocking=True))
    results = []
    for mix in (int(m) for m in args.mixes.split(",")):
        # rows per group in proportion to its warps, so that alone each group would take about as long
        push_rows, copy_rows = cap * mix // 32, cap * (32 - mix) // 32
        rates = []
        for _ in range(args.reps):
            outs = []
            for dev in (0, 1):
                with cp.cuda.Device(dev):
                    out = cp.array([2 ** 63, 0, 2 ** 63, 0], dtype=cp.uint64)
                    b, peer = bufs[dev], bufs[1 - dev]
                    kernels[dev]((args.sms,), (1024,),
                                 (b["push_src"], peer["recv"], b["copy_src"], b["copy_dst"], cp.int32(mix),
                                  cp.int64(push_rows), cp.int64(copy_rows), cp.int32(row_int4), out),
                                 stream=streams[dev])
                    outs.append(out)
            for dev in (0, 1):
                streams[dev].synchronize()
            o = [int(v) for v in outs[0].get()]
            row_bytes = row_int4 * 16
            push_us = (o[1] - o[0]) / 1e3 if push_rows else 0.0
            copy_us = (o[3] - o[2]) / 1e3 if copy_rows else 0.0
            rates.append({"push_gbps_per_sm": push_rows * row_bytes / push_us / 1e3 / args.sms if push_rows else 0.0,
                          "copy_gbps_per_sm": copy_rows * row_bytes / copy_us / 1e3 / args.sms if copy_rows else 0.0,
                          "push_us": push_us, "copy_us": copy_us})
        best = sorted(rates, key=lambda r: r["push_us"] + r["copy_us"])[len(rates) // 2]  # median by time
        row = {"push_warps": mix, "push_rows": push_rows, "copy_rows": copy_rows, **best}
        results.append(row)
        print(f"push warps {mix:2d}: push {row['push_gbps_per_sm']:6.1f} GB/s/SM in {row['push_us']:7.1f} us, "
              f"local copy {row['copy_gbps_per_sm']:6.1f} GB/s/SM in {row['copy_us']:7.1f} us, "
              f"sum {row['push_gbps_per_sm'] + row['copy_gbps_per_sm']:6.1f}", flush=True)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"benchmark": "probe_sm_mix", "device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                       "git_commit": os.environ.get("COMMLIB_GIT_COMMIT", ""), "args": vars(args),
                       "rows": results}, f, indent=1)
        print(f"[probe] wrote {args.json}")


if __name__ == "__main__":
    main()
