"""torch.profiler helpers: kernel time per category, and a chrome trace of one run."""
from __future__ import annotations

import gzip
import os
import shutil

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

KERNEL_CATEGORIES = (  # (category, substrings of the lower-cased kernel name), first match wins
    # commlib's communication kernels as a profiler names them (commlib.cuda.loader.FAMILIES)
    ("comm", ("commlib::intranode::", "commlib::layout::", "commlib::low_latency::", "commlib::copy_engine::",
              "commlib::internode::", "commlib::fanout::")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas")),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
)


def _kernel_category(name: str) -> str:
    low = name.lower()
    return next((cat for cat, keys in KERNEL_CATEGORIES if any(k in low for k in keys)), "other")


def kernel_profile(fn) -> dict:
    """Run fn once under torch.profiler (CUDA activity): kernel time per category (sum of kernel
    durations, ms), kernel count, and the 20 kernels with the most time (ms, launches). This rank's figures."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    cats: dict = {}
    names: dict = {}
    for e in prof.events():
        if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        ms = (e.time_range.end - e.time_range.start) / 1e3
        c = cats.setdefault(_kernel_category(e.name), {"ms": 0.0, "kernels": 0})
        c["ms"] += ms
        c["kernels"] += 1
        ms0, n0 = names.get(e.name, (0.0, 0))
        names[e.name] = (ms0 + ms, n0 + 1)
    top = sorted(names.items(), key=lambda kv: -kv[1][0])[:20]
    return {"categories": cats, "top": [{"name": n[:120], "ms": ms, "launches": k} for n, (ms, k) in top]}


def chrome_trace(fn, out_dir: str, name: str) -> str:
    """Run fn once (after a synchronised start) under torch.profiler with host and CUDA activity and
    write the chrome trace, gzipped, to out_dir/name.json.gz: where the host waited, what each stream
    ran and when. Returns the path."""
    os.makedirs(out_dir, exist_ok=True)
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    raw = os.path.join(out_dir, name + ".json")
    prof.export_chrome_trace(raw)
    with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(raw)
    return raw + ".gz"
