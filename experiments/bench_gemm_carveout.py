"""What torch's SM carveout (commlib.training.pipeline.sm_carveout) costs the MoE layer's GEMMs on one GPU,
alone: each GEMM timed (CUDA events, mean of 30 after 3 warm-ups) on the default cuBLAS path with
0 / 4 / 12 SMs carved out, and with cuBLASLt preferred (0 / 4 carved out). Prints a table in
microseconds; --json PATH also writes it.

--neighbour N[,N]: instead, each GEMM with N SMs carved out, timed alone, beside N spinning
1024-thread CTAs launched one by one (where comm CTAs land without clusters), and beside N/2
two-CTA clusters (kernel variant COMM_CLUSTER=2): what a comm kernel's placement costs the GEMM.

Run: python -m experiments.bench_gemm_carveout [--neighbour 4,12] [--json benchmarks/results/gemm_carveout_H200.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from commlib.bench.main import git_commit

COLUMNS = (("cublas", None), ("cublas", 4), ("cublas", 12), ("cublaslt", None), ("cublaslt", 4))
HEADERS = ("default", "cv4", "cv12", "lt", "lt+cv4")


def _cases(dev: torch.device) -> dict:
    """name -> zero-argument GEMM, at the bench_overlap shapes (hidden 7168, 8192 rows per expert)."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dev, torch.bfloat16) / 16

    offs = torch.tensor([8192, 16384], device=dev, dtype=torch.int32)  # two experts of 8192 rows
    mats = {"q": (rnd(8192, 7168), rnd(7168, 512)), "o": (rnd(8192, 512), rnd(512, 7168)),
            "big": (rnd(16384, 7168), rnd(7168, 1536)), "g512": (rnd(16384, 7168), rnd(2, 7168, 512)),
            "g4096": (rnd(16384, 7168), rnd(2, 7168, 4096)), "down": (rnd(16384, 2048), rnd(2, 2048, 7168)),
            "dw": (rnd(7168, 16384), rnd(16384, 4096))}
    return {
        "mm 8192x7168x512 (q-proj)": lambda: torch.mm(*mats["q"]),
        "mm 8192x512x7168 (o-proj)": lambda: torch.mm(*mats["o"]),
        "mm 16384x7168x1536": lambda: torch.mm(*mats["big"]),
        "grouped 16384x7168x512 (2 experts)": lambda: torch._grouped_mm(*mats["g512"], offs=offs),
        "grouped 16384x7168x4096 (I 2048)": lambda: torch._grouped_mm(*mats["g4096"], offs=offs),
        "grouped 16384x2048x7168 (down)": lambda: torch._grouped_mm(*mats["down"], offs=offs),
        "grouped dW 7168x16384x4096": lambda: torch._grouped_mm(*mats["dw"], offs=offs),
    }


def _time_us(fn, reps: int = 30) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3


# A stand-in for a comm CTA: 1024 threads and 48 KB of shared memory, so it holds its SM alone (no
# GEMM CTA fits beside it), spinning on %globaltimer until its time is up. Two builds: plain launch
# and 2-CTA clusters.
_SPIN_SRC = r"""
#define SPIN_BODY                                                                                   \
    __shared__ unsigned int pad[12288];                                                           \
    unsigned long long t0, t;                                                                     \
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));                                        \
    pad[threadIdx.x] = threadIdx.x;                                                               \
    if (threadIdx.x == 0) { unsigned int id; asm volatile("mov.u32 %0, %%smid;" : "=r"(id)); smids[blockIdx.x] = id; } \
    do { __nanosleep(2000); asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < ns); \
    __syncthreads();                                                                              \
    if (pad[(threadIdx.x + 1) & 1023] == 0xffffffffu) smids[0] = 0;
extern "C" __global__ void __launch_bounds__(1024, 1) spin(unsigned long long ns, unsigned int* smids) { SPIN_BODY }
extern "C" __global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(1024, 1) spin_cluster2(unsigned long long ns, unsigned int* smids) { SPIN_BODY }
"""


def _time_beside(fn, spin, ctas: int, alone_us: float, reps: int = 30):
    """fn's mean time (us) while ``ctas`` CTAs of ``spin`` hold their SMs, and the SM ids they took.
    ``alone_us``: fn's time alone (fn is warm), which sizes how long the spinners hold on."""
    import cupy as cp

    side = torch.cuda.Stream(priority=-1)
    smids = torch.zeros(ctas, dtype=torch.int32, device="cuda")
    ns = int((alone_us * reps * 4 + 5000) * 1e3)  # holds on well past the timed loop
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        spin((ctas,), (1024,), (cp.uint64(ns), cp.uint64(smids.data_ptr())),
             stream=cp.cuda.ExternalStream(side.cuda_stream))
    torch.cuda._sleep(2_000_000)  # the spinners are resident before the first GEMM is queued
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3, sorted(smids.tolist())


def neighbour(counts) -> dict:
    import cupy as cp

    dev = torch.device("cuda", 0)
    mod = cp.RawModule(code=_SPIN_SRC, options=("-std=c++17", "--gpu-architecture=sm_90"))
    spins = {"plain": mod.get_function("spin"), "cluster2": mod.get_function("spin_cluster2")}
    carveout0 = torch._C._get_sm_carveout_experimental()
    out = {}
    heads = [f"{h}{n}" for n in counts for h in ("cv", "+ctas", "+pairs")]
    print("%-36s" % "us" + "".join("%9s" % h for h in heads))
    try:
        for name, fn in _cases(dev).items():
            row, rec = [], {}
            for n in counts:
                torch._C._set_sm_carveout_experimental(n)
                alone = _time_us(fn)
                plain, sm_plain = _time_beside(fn, spins["plain"], n, alone)
                pairs, sm_pairs = _time_beside(fn, spins["cluster2"], n, alone)
                row += [alone, plain, pairs]
                rec[str(n)] = {"alone": alone, "beside_ctas": plain, "beside_pairs": pairs,
                               "smids_ctas": sm_plain, "smids_pairs": sm_pairs}
            out[name] = rec
            print("%-36s" % name + "".join("%9.0f" % t for t in row))
    finally:
        torch._C._set_sm_carveout_experimental(carveout0)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None, help="also write the table here")
    p.add_argument("--neighbour", default="", help="comma list of SM counts: GEMMs beside spinning CTAs")
    args = p.parse_args(argv)
    if args.neighbour:
        counts = [int(v) for v in args.neighbour.split(",")]
        if any(n < 2 or n % 2 for n in counts):
            p.error("--neighbour counts must be even (clusters of two)")
        results = neighbour(counts)
        _write(args.json, {"mode": "neighbour", "unit": "us", "gemms": results})
        return results
    dev = torch.device("cuda", 0)
    blas0, carveout0 = torch.backends.cuda.preferred_blas_library(), torch._C._get_sm_carveout_experimental()
    results = {}
    print("%-36s" % "us" + "".join("%9s" % h for h in HEADERS))
    try:
        for name, fn in _cases(dev).items():
            row = []
            for blas, carveout in COLUMNS:
                torch.backends.cuda.preferred_blas_library(blas)
                torch._C._set_sm_carveout_experimental(carveout)
                row.append(_time_us(fn))
            results[name] = dict(zip(HEADERS, row))
            print("%-36s" % name + "".join("%9.0f" % t for t in row))
    finally:
        torch.backends.cuda.preferred_blas_library(blas0)
        torch._C._set_sm_carveout_experimental(carveout0)
    _write(args.json, {"unit": "us", "gemms": results,
                       "columns": {h: {"blas": b, "sm_carveout": c or 0} for h, (b, c) in zip(HEADERS, COLUMNS)}})
    return results


def _write(path, body: dict) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"benchmark": "bench_gemm_carveout", "device": torch.cuda.get_device_name(0),
                   "torch": torch.__version__, "git_commit": git_commit()["commit"],
                   "command": " ".join([os.path.basename(sys.executable)] + sys.argv), **body}, f, indent=1)
    print(f"[gemm_carveout] wrote {path}")


if __name__ == "__main__":
    main()
