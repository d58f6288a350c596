"""Probe: what a side load costs a GEMM loop on a power-capped GPU (the clock the cap leaves it).

The dual pipeline's 2F->2B run on 2 x H200 sits at the 700 W cap at ~1700 MHz, while the same
compute replayed without transfers sits at the cap at ~1880 MHz (bench_overlap's compute-dense
reference, docs/notes/2026-11-30_pipeline_log.md). This probe asks which part of the host-staged transport takes the
power: a bf16 GEMM loop (16384 x 7168 x 3072, every SM) runs for ``--seconds`` alone and beside
one side load at a time, launched first on a side stream and sized to last as long:

  alone      nothing beside it
  pcie       device -> pinned host and host -> device copies of 256 MB, one stream each (copy engines)
  spin_host  one warp polling a word of pinned host memory (system-scope loads), as the copy-engine
             path's flag kernels wait
  spin_dev   the same on a word of device memory
  spin_sleep spin_host with a 256 ns __nanosleep between polls (as the removed WAIT_BACKOFF_NS variant did)
  hbm4       4 CTAs of 1024 threads copying between two 2 GB device buffers (the packing and the
             sum's kind of work, without pause, on 4 SMs)
  gaps       no side load; the GEMMs run in bursts of ~12 ms with the GPU idle ~7 ms between (the
             sequential schedule's compute spans between its comm steps); ms per GEMM inside bursts
  zeros      no side load; the GEMM's 16384 x 7168 operand is all zeros (as the rows bench_overlap's
             compute-dense reference once replayed): the data's share of the power

Each row: ms per GEMM (CUDA events), its ratio to ``alone``, the mean SM clock, power and the
share of samples at the power cap (commlib.bench.clocks, nvidia-smi every 50 ms; the GPU is CUDA device
0, named by nvidia-smi's index ``--smi-index``).

    python -m experiments.probe_power [--seconds 5] [--loads alone,zeros,...] [--json PATH]

Needs a GPU and CuPy (the two spin kernels and the copy kernel); nothing of commlib's transport runs.
"""
from __future__ import annotations

import argparse
import json
import os
import time


LOADS = ("alone", "pcie", "spin_host", "spin_dev", "spin_sleep", "hbm4", "gaps", "zeros", "alone_again")

_SRC = r"""
__device__ __forceinline__ unsigned long long now() {
    unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t;
}
// One warp polls *flag (system scope, like the flag kernels' waits) until ns have passed, sleeping
// sleep_ns between polls when > 0.
extern "C" __global__ void spin_kernel(const unsigned long long* flag, unsigned long long ns, unsigned long long* sink,
                                       unsigned int sleep_ns) {
    const unsigned long long t0 = now();
    unsigned long long v = 0, seen = 0;
    while (now() - t0 < ns) {
        asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(flag) : "memory");
        seen += v;
        if (sleep_ns) __nanosleep(sleep_ns);
    }
    if (seen == 0x1234567ull) *sink = seen;
}
// Grid-stride 16-byte copies until ns have passed.
extern "C" __global__ void __launch_bounds__(1024, 1) copy_kernel(const int4* src, int4* dst, long long n4,
                                                                  unsigned long long ns) {
    const unsigned long long t0 = now();
    const long long step = (long long)gridDim.x * blockDim.x;
    while (now() - t0 < ns)
        for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n4; i += step) dst[i] = src[i];
}
"""


BURST_S, GAP_S = 0.012, 0.007  # "gaps": a compute span of the sequential schedule, then a comm step


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=5.0, help="length of each row's GEMM loop")
    p.add_argument("--smi-index", type=int, default=0, help="nvidia-smi's index of CUDA device 0")
    p.add_argument("--loads", default=",".join(LOADS), help="rows to run, in this order (first: the reference)")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    args.loads = [x for x in args.loads.split(",") if x]
    if not args.loads or set(args.loads) - set(LOADS):
        p.error(f"--loads: pick from {', '.join(LOADS)}, got {args.loads}")
    if not args.seconds > 0:
        p.error(f"--seconds must be positive, got {args.seconds}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    import cupy as cp
    import torch

    from commlib.bench.clocks import ClockMonitor

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    a = torch.randn(16384, 7168, device=dev, dtype=torch.bfloat16)
    a_zero = torch.zeros_like(a)
    b = torch.randn(7168, 3072, device=dev, dtype=torch.bfloat16)
    out = torch.empty(16384, 3072, device=dev, dtype=torch.bfloat16)
    for _ in range(20):
        torch.mm(a, b, out=out)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        torch.mm(a, b, out=out)
    torch.cuda.synchronize()
    gemm_s = (time.perf_counter() - t0) / 50
    n_gemm = max(10, int(args.seconds / gemm_s))
    burst = max(1, round(BURST_S / gemm_s))  # "gaps": GEMMs per burst
    ns = int(args.seconds * 1.2e9)  # side loads outlast the GEMM loop

    mod = cp.RawModule(code=_SRC, options=("-std=c++17",))
    spin, copy = mod.get_function("spin_kernel"), mod.get_function("copy_kernel")
    host_flag = torch.zeros(1, dtype=torch.int64).pin_memory()
    dev_flag = torch.zeros(1, dtype=torch.int64, device=dev)
    sink = torch.zeros(1, dtype=torch.int64, device=dev)
    big = 256 << 20
    pinned = torch.empty(big, dtype=torch.uint8).pin_memory()
    src_d = torch.empty(big, dtype=torch.uint8, device=dev)
    dst_d = torch.empty(big, dtype=torch.uint8, device=dev)
    hbm_a = torch.empty(2 << 30, dtype=torch.uint8, device=dev)
    hbm_b = torch.empty(2 << 30, dtype=torch.uint8, device=dev)
    side1, side2 = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    pcie_copies = max(1, int(args.seconds * 1.2 * 50e9 / big))  # ~50 GB/s per direction

    def side_load(kind: str) -> None:
        if kind == "pcie":
            with torch.cuda.stream(side1):
                for _ in range(pcie_copies):
                    pinned.copy_(src_d, non_blocking=True)
            with torch.cuda.stream(side2):
                for _ in range(pcie_copies):
                    dst_d.copy_(pinned, non_blocking=True)
        elif kind in ("spin_host", "spin_dev", "spin_sleep"):
            # a pinned host tensor's device address is its host pointer (UVA)
            flag = (dev_flag if kind == "spin_dev" else host_flag).data_ptr()
            with cp.cuda.ExternalStream(side1.cuda_stream):
                spin((1,), (32,), (cp.uint64(flag), cp.uint64(ns), cp.uint64(sink.data_ptr()),
                                   cp.uint32(256 if kind == "spin_sleep" else 0)))
        elif kind == "hbm4":
            with cp.cuda.ExternalStream(side1.cuda_stream):
                copy((4,), (1024,), (cp.uint64(hbm_a.data_ptr()), cp.uint64(hbm_b.data_ptr()),
                                     cp.int64(hbm_a.numel() // 16), cp.uint64(ns)))

    mon = ClockMonitor()
    have_clocks = mon.start()
    rows = {}
    for kind in args.loads:
        torch.cuda.synchronize()
        time.sleep(1.0)  # let the clock settle between rows
        side_load(kind)
        lhs = a_zero if kind == "zeros" else a
        name = kind if kind not in rows else f"{kind}#{sum(k.split('#')[0] == kind for k in rows) + 1}"
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with mon.window(name):
            if kind == "gaps":
                busy_ms = 0.0
                for _ in range(0, n_gemm, burst):
                    start.record()
                    for _ in range(burst):
                        torch.mm(lhs, b, out=out)
                    end.record()
                    end.synchronize()
                    busy_ms += start.elapsed_time(end)
                    time.sleep(GAP_S)
                gemm_ms = busy_ms / (burst * len(range(0, n_gemm, burst)))
            else:
                start.record()
                for _ in range(n_gemm):
                    torch.mm(lhs, b, out=out)
                end.record()
                end.synchronize()
                gemm_ms = start.elapsed_time(end) / n_gemm
        torch.cuda.synchronize()  # the side load's tail
        rows[name] = {"gemm_ms": gemm_ms}
    mon.stop()
    clocks = mon.summary() if have_clocks else {}
    base = rows[args.loads[0]]["gemm_ms"]
    print(f"# probe_power: GEMM 16384x7168x3072 bf16, {n_gemm} per row; clocks of nvidia-smi GPU {args.smi_index}")
    print(f"{'load':>12} {'ms/GEMM':>9} {'x ' + args.loads[0]:>8} {'MHz':>6} {'W':>6} {'cap':>5}")
    for kind, r in rows.items():
        c = clocks.get(kind, {}).get(str(args.smi_index))
        r["over_alone"] = r["gemm_ms"] / base
        r["clocks"] = c
        print(f"{kind:>12} {r['gemm_ms']:9.3f} {r['over_alone']:8.3f} "
              + (f"{c['sm_mhz_mean']:6.0f} {c['power_w_mean'] or 0:6.0f} {100 * c['power_cap_share']:4.0f}%"
                 if c else "     -      -     -"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"probe": "probe_power", "device": torch.cuda.get_device_name(dev), "gemm_per_row": n_gemm,
                       "seconds": args.seconds, "rows": rows,
                       "git_commit": os.environ.get("COMMLIB_GIT_COMMIT")}, f, indent=1)


if __name__ == "__main__":
    main()
