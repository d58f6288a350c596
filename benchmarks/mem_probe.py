"""Device memory per rank: what a Buffer and its calls hold, stage by stage (ranks may share one GPU).

    python -m benchmarks.mem_probe [--ranks 16 --ranks-per-node 8] [--tokens 4096 --hidden 7168
                                   --experts 256 --topk 8] [--nvl-bytes 2e9 --rdma-bytes 1e9]
                                   [--backend auto] [--no-worst] [--json PATH]
    python -m benchmarks.mem_probe --low-latency [--ranks 8 --tokens 128 --experts 288 ...]

Defaults: DeepEP's test_internode.py (2 emulated nodes x 8 on one GPU, every rank its own NCCL host).
Stages: ``init`` (process group, CUDA context), ``buffer`` (Buffer built), ``inputs`` (x, top-k made),
``dispatch`` / ``combine`` (BF16, with top-k), ``cached`` (a cached dispatch and its combine),
``worst`` (num_worst_tokens = tokens x ranks, and its combine), ``idle`` (outputs dropped, gc).
``--low-latency``: DeepEP's test_low_latency.py shape (8 ranks of one node, 128 tokens, top-8 of 288,
a low-latency Buffer of ``get_low_latency_rdma_size_hint`` bytes); ``dispatch`` / ``combine`` are the
BF16 low-latency calls, ``cached`` an FP8 dispatch and its combine, no ``worst``.
Per rank and stage:
  torch_alloc / torch_resv   torch's caching allocator: bytes in tensors / bytes it holds
  peer_ipc                   bytes in commlib's IPC buffers (every live PeerMemory of this process)
  cupy_pool                  bytes CuPy's memory pool holds (0 when CuPy is not loaded)
  process                    this process's device memory as NVML reports it (pynvml; "-" without it)
Device used (total - free of torch.cuda.mem_get_info) is printed once per stage: ranks sharing a GPU
all count there. A rank's "own" memory beyond the Buffer's num_nvl_bytes + num_rdma_bytes is
torch_resv + peer_ipc + cupy_pool + what CUDA and NCCL take (process minus those three).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch
import torch.distributed as dist

from commlib import Buffer
from commlib.backends.nvlink.peer_memory import PeerMemory
from commlib.routing import group_limited_topk, random_scores
from commlib.utils.launch import parallel_launch

GIB = float(1 << 30)
STAGES = ("init", "buffer", "inputs", "dispatch", "combine", "cached", "worst", "idle")


def _peer_ipc_bytes() -> int:
    return sum(o.num_bytes for o in gc.get_objects() if isinstance(o, PeerMemory) and o.base is not None)


def _cupy_pool_bytes() -> int:
    cp = sys.modules.get("cupy")
    return int(cp.get_default_memory_pool().total_bytes()) if cp is not None else 0


def _process_bytes(device: torch.device):
    try:
        import pynvml
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device.index)
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if p.pid == os.getpid():
                return int(p.usedGpuMemory) if p.usedGpuMemory is not None else None
    except Exception:  # noqa: BLE001 - no NVML (or no per-process numbers under MPS): not reported
        return None
    return None


def device_used_nvml(index: int = 0):
    """Bytes used on GPU ``index`` as NVML sees it (None without pynvml); makes no CUDA context."""
    try:
        import pynvml
        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).used)
    except Exception:  # noqa: BLE001
        return None


def sample(device: torch.device) -> dict:
    """This process's memory figures now (bytes), after a device sync and a barrier (so the device-wide
    figure is read when every rank has reached the same stage)."""
    torch.cuda.synchronize(device)
    dist.barrier()
    free, total = torch.cuda.mem_get_info(device)
    return {"torch_alloc": torch.cuda.memory_allocated(device), "torch_resv": torch.cuda.memory_reserved(device),
            "torch_peak_resv": torch.cuda.max_memory_reserved(device), "peer_ipc": _peer_ipc_bytes(),
            "cupy_pool": _cupy_pool_bytes(), "process": _process_bytes(device), "device_used": total - free}


def _inputs(a, rank: int, device: torch.device):
    g = torch.Generator(device="cpu").manual_seed(1000 + rank)
    nodes = max(1, a.ranks // a.ranks_per_node)
    scores = random_scores(a.tokens, a.experts, g)
    idx, w = group_limited_topk(scores, nodes, min(nodes, 4), a.topk)
    x = torch.randn(a.tokens, a.hidden, generator=g, device="cpu").to(torch.bfloat16)
    return x.to(device), idx.to(device), w.to(device)


def worker(ctx, a) -> dict:
    dev = ctx.device
    out = {"init": sample(dev)}
    buf = Buffer(ctx.group, int(a.nvl_bytes), int(a.rdma_bytes), backend=a.backend, ranks_per_node=a.ranks_per_node,
                 explicitly_destroy=True)
    out["backend"] = buf.backend_name
    out["buffer"] = sample(dev)
    x, idx, w = _inputs(a, ctx.rank, dev)
    out["inputs"] = sample(dev)
    ntr, nrr, nte, tir, _ = buf.get_dispatch_layout(idx, a.experts)
    layout = dict(num_tokens_per_rank=ntr, num_tokens_per_rdma_rank=nrr, is_token_in_rank=tir,
                  num_tokens_per_expert=nte)
    rx, ri, rw, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, **layout)
    out["dispatch"] = sample(dev)
    cx, _, _ = buf.combine(rx, handle, rw)
    out["combine"] = sample(dev)
    rx2, *_ = buf.dispatch(x, handle=handle)
    cx2, _, _ = buf.combine(rx2, handle)
    out["cached"] = sample(dev)
    del rx2, cx2
    if a.worst:
        wx, wi, ww, _, wh, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_worst_tokens=a.tokens * a.ranks,
                                            **layout)
        wcx, _, _ = buf.combine(wx, wh, ww)
        out["worst"] = sample(dev)
        del wx, wi, ww, wh, wcx
    del rx, ri, rw, handle, cx
    gc.collect()
    out["idle"] = sample(dev)
    dist.barrier()
    buf.destroy()
    return out


def worker_ll(ctx, a) -> dict:
    dev = ctx.device
    out = {"init": sample(dev)}
    R, E, T = ctx.world_size, a.experts, a.tokens
    buf = Buffer(ctx.group, 0, int(a.rdma_bytes), low_latency_mode=True, num_qps_per_rank=max(1, E // R),
                 explicitly_destroy=True)
    out["backend"] = buf.backend_name
    out["buffer"] = sample(dev)
    g = torch.Generator(device="cpu").manual_seed(1000 + ctx.rank)
    x = torch.randn(T, a.hidden, generator=g).to(torch.bfloat16).to(dev)
    idx = torch.randn(T, E, generator=g).abs().topk(a.topk, dim=-1).indices.to(dev)
    w = torch.rand(T, a.topk, generator=g).to(dev)
    out["inputs"] = sample(dev)
    rx, _, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
    out["dispatch"] = sample(dev)
    cx, _, _ = buf.low_latency_combine(rx, idx, w, handle)
    out["combine"] = sample(dev)
    fx, _, fh, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=True)
    cx2, _, _ = buf.low_latency_combine(rx, idx, w, fh)
    out["cached"] = sample(dev)
    del rx, handle, cx, fx, fh, cx2
    gc.collect()
    out["idle"] = sample(dev)
    dist.barrier()
    buf.destroy()
    return out


def _fmt(v) -> str:
    return "-" if v is None else f"{v / GIB:.2f}"


def report(results: list, a, before=None) -> list:
    """nccl-tests style lines: a # header, one data row per (stage, rank). ``before``: device bytes
    used before the ranks started (NVML), so ``init`` shows what a rank's context and group take."""
    mode = "low-latency, " if a.low_latency else ""
    lines = [f"# mem_probe: {mode}{a.ranks} ranks ({a.ranks_per_node} per node), tokens {a.tokens}, hidden {a.hidden}, "
             f"experts {a.experts}, top-{a.topk}; Buffer {a.nvl_bytes / 1e9:g} GB + {a.rdma_bytes / 1e9:g} GB; "
             f"backend {results[0].get('backend')}; GiB",
             "#  stage      rank  torch_alloc  torch_resv  peak_resv  peer_ipc  cupy_pool  process  other  device_used",
             "#  (other = process - torch_resv - peer_ipc - cupy_pool: the CUDA context, modules, NCCL)"]
    previous = before
    for stage in STAGES:
        for r, res in enumerate(results):
            s = res.get(stage) if res else None
            if s is None:
                continue
            other = (None if s["process"] is None
                     else s["process"] - s["torch_resv"] - s["peer_ipc"] - s["cupy_pool"])
            lines.append(f"{stage:>8} {r:>8} {_fmt(s['torch_alloc']):>12} {_fmt(s['torch_resv']):>11} "
                         f"{_fmt(s['torch_peak_resv']):>10} {_fmt(s['peer_ipc']):>9} {_fmt(s['cupy_pool']):>10} "
                         f"{_fmt(s['process']):>8} {_fmt(other):>6} {_fmt(s['device_used']):>12}")
        first = results[0].get(stage) if results and results[0] else None
        if first is not None:
            if previous is not None:
                grew = first["device_used"] - previous
                lines.append(f"# {stage}: device used {_fmt(first['device_used'])} GiB, "
                             f"{grew / GIB:+.2f} GiB since the stage before ({grew / len(results) / GIB:+.3f} per rank)")
            previous = first["device_used"]
    last = [res["idle"] for res in results if res]
    if last:
        own = max(s["torch_peak_resv"] + s["peer_ipc"] + s["cupy_pool"] for s in last)
        lines.append(f"# largest rank: torch peak reserved + IPC + CuPy pool = {own / GIB:.2f} GiB "
                     f"(Buffer sizes {(a.nvl_bytes + a.rdma_bytes) / GIB:.2f} GiB)")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--low-latency", action="store_true",
                   help="test_low_latency.py's shape and Buffer (the defaults below change to it)")
    p.add_argument("--ranks", type=int, default=None, help="16 (low latency: 8)")
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--tokens", type=int, default=None, help="4096 (low latency: 128)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=None, help="256 (low latency: 288)")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--nvl-bytes", type=float, default=None, help="2e9 (low latency: 0)")
    p.add_argument("--rdma-bytes", type=float, default=None, help="1e9 (low latency: the size hint)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--no-worst", dest="worst", action="store_false", help="skip the num_worst_tokens calls")
    p.add_argument("--timeout-s", type=float, default=540)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    ll = a.low_latency
    a.ranks = a.ranks or (8 if ll else 16)
    a.tokens = a.tokens or (128 if ll else 4096)
    a.experts = a.experts or (288 if ll else 256)
    a.nvl_bytes = (0.0 if ll else 2e9) if a.nvl_bytes is None else a.nvl_bytes
    if a.rdma_bytes is None:
        a.rdma_bytes = (float(Buffer.get_low_latency_rdma_size_hint(a.tokens, a.hidden, a.ranks, a.experts))
                        if ll else 1e9)
    if not torch.cuda.is_available():
        print("# mem_probe: no CUDA device")
        return 0
    before = device_used_nvml(0)
    # several nodes: every rank its own NCCL host, so NCCL runs between processes sharing a GPU (the
    # Buffer gets the node layout from --ranks-per-node; its fan-out still maps the node's memory)
    multi = a.ranks > a.ranks_per_node
    results = parallel_launch(a.ranks, worker_ll if ll else worker, a, ranks_per_node=1 if multi else a.ranks_per_node, use_gpu=True,
                              group_backend="nccl" if multi else None, emulate_hosts=multi, return_all=True,
                              timeout_s=a.timeout_s)
    lines = report(results, a, before)
    print("\n".join(lines))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "device_used_before": before, "ranks": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
