"""What torch's SM carveout (commlib.pipeline.sm_carveout) costs the MoE layer's GEMMs on one GPU,
alone: each GEMM timed (CUDA events, mean of 30 after 3 warm-ups) on the default cuBLAS path with
0 / 4 / 12 SMs carved out, and with cuBLASLt preferred (0 / 4 carved out). Prints a table in
microseconds; --json PATH also writes it.

Run: python3 benchmarks/bench_gemm_carveout.py [--json benchmarks/results/gemm_carveout_H200.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

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


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None, help="also write the table here")
    args = p.parse_args(argv)
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
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"benchmark": "bench_gemm_carveout", "device": torch.cuda.get_device_name(dev),
                       "torch": torch.__version__, "git_commit": os.environ.get("COMMLIB_GIT_COMMIT"),
                       "command": " ".join([os.path.basename(sys.executable)] + sys.argv), "unit": "us",
                       "columns": {h: {"blas": b, "sm_carveout": c or 0} for h, (b, c) in zip(HEADERS, COLUMNS)},
                       "gemms": results}, f, indent=1)
        print(f"[gemm_carveout] wrote {args.json}")
    return results


if __name__ == "__main__":
    main()
