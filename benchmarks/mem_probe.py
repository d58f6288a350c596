"""Device memory per rank: what a Buffer, its calls and a DeepEP test around them hold, stage by
stage, and whether the whole fits (ranks may share one GPU).

    python -m benchmarks.mem_probe [--ranks 16 --ranks-per-node 8] [--tokens 4096 --hidden 7168
                                   --experts 256 --topk 8] [--nvl-bytes 2e9 --rdma-bytes 1e9]
                                   [--backend auto] [--no-worst] [--no-test-load] [--json PATH]
    python -m benchmarks.mem_probe --low-latency [--ranks 8 --tokens 128 --experts 288 ...]

Defaults: DeepEP's test_internode.py (2 emulated nodes x 8 on one GPU, every rank its own NCCL host,
its Config(24, 8, 512, 16, 128), torch's default device CUDA and dtype BF16 as its init_dist sets).
First one process alone (gloo, no NCCL): ``context`` (CUDA context + torch) and ``modules`` (every
commlib kernel family loaded). Then the world, per rank:
  init       the default group (its NCCL communicator, made at init_process_group with device_id)
  group      the test's own group (dist.new_group of every rank) after an all_reduce on it
  buffer     Buffer(group, nvl, rdma) built: commlib's communicators (rail; a gloo node group)
  inputs     the test's inputs: x and a random x in BF16 and FP8, scores, top-k ids and weights
  dispatch   BF16 dispatch with top-k (the test's Config)
  worst      the same with num_worst_tokens = tokens x ranks (the call test_internode ran out in)
  combine    combine of the dispatch with the test's two biases
  cached     a cached dispatch of that handle and its combine
  fp8        what the test holds at its heaviest (``--no-test-load`` skips it): the float32 check it
             keeps after a combine, an FP8 dispatch with top-k cast back to BF16, then the FP8
             num_worst_tokens dispatch cast back (a copy of the FP8 rows, their float32 values, the
             scaled float32 and the BF16 result at once), the BF16 results of the checks before held
  idle       outputs dropped, gc
(``--low-latency``: DeepEP's test_low_latency.py shape, 8 ranks of one node, a low-latency Buffer
of ``get_low_latency_rdma_size_hint`` bytes; stages init, buffer, inputs, dispatch / combine (BF16),
cached (FP8 dispatch and its combine), idle.)
Per rank and stage (GiB):
  torch_alloc / torch_resv   torch's caching allocator: bytes in tensors / bytes it holds
  peak_alloc                 the most bytes in tensors since the stage before (a call's transients)
  peak_resv                  the most bytes torch held since the stage before
  peer_ipc                   bytes in commlib's IPC buffers (every live PeerMemory of this process)
  cupy_pool                  bytes CuPy's memory pool holds (0 when CuPy is not loaded)
  process                    this process's device memory as NVML reports it ("-" without pynvml)
  other                      process - torch_resv - peer_ipc - cupy_pool: CUDA context, modules, NCCL
Device used (total - free) is printed once per stage: every rank sharing a GPU counts there. The
summary splits ``other`` into context, modules and NCCL; takes each rank at its peak (the most of
other + peer_ipc + cupy_pool, plus the most peak_resv); says whether all ranks at their peaks fit the
device they share; and compares commlib's own memory (its IPC buffers and the most a call held
beyond its outputs) with num_nvl_bytes + num_rdma_bytes, and the forwarder's area (peer_ipc) at the
worst stage with the dispatch stage's: a num_worst_tokens dispatch lands its rows in windows within
what the dispatch reserved (``--require-fit`` also fails where it grew). Each sample is also appended
to a file per rank, so a world that fails (out of memory) still reports the stages it reached.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist

from commlib import Buffer, Config
from commlib.backends.nvlink.peer_memory import PeerMemory
from commlib.fp8 import per_token_cast_back, per_token_cast_to_fp8
from commlib.routing import group_limited_topk, random_scores
from commlib.utils.launch import parallel_launch

GIB = float(1 << 30)
SOLO = ("context", "modules")
STAGES = ("init", "group", "buffer", "inputs", "dispatch", "worst", "combine", "cached", "fp8", "idle")
CALLS = ("dispatch", "worst", "combine", "cached")   # stages that are commlib calls alone
TEST_CONFIG = (24, 8, 512, 16, 128)                  # test_internode's Config


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


def sample(device: torch.device, barrier: bool = True) -> dict:
    """This process's memory figures now (bytes), after a device sync and a barrier (so the device-wide
    figure is read when every rank has reached the same stage). ``peak_alloc``: the most bytes in
    tensors since the sample before (the allocator's peak is reset here)."""
    torch.cuda.synchronize(device)
    if barrier:
        dist.barrier()
    free, total = torch.cuda.mem_get_info(device)
    s = {"torch_alloc": torch.cuda.memory_allocated(device), "torch_resv": torch.cuda.memory_reserved(device),
         "peak_alloc": torch.cuda.max_memory_allocated(device), "torch_peak_resv": torch.cuda.max_memory_reserved(device),
         "peer_ipc": _peer_ipc_bytes(), "cupy_pool": _cupy_pool_bytes(), "process": _process_bytes(device),
         "device_used": total - free, "device_total": total}
    torch.cuda.reset_peak_memory_stats(device)   # peak_resv: the report keeps the running maximum
    return s


class Recorder:
    """A rank's samples by stage, each also appended (a JSON line) to ``<folder>/rank<R>.jsonl`` so
    the parent can report the stages a failed world reached."""

    def __init__(self, folder, rank: int, device: torch.device) -> None:
        self.out, self.device = {}, device
        self.path = os.path.join(folder, f"rank{rank}.jsonl") if folder else None

    def __call__(self, stage: str, **extra) -> None:
        self.out[stage] = dict(sample(self.device), **extra)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps({"stage": stage, **self.out[stage]}) + "\n")


def _test_inputs(a, rank: int, device: torch.device) -> dict:
    """What test_internode makes before its checks, at its sizes: x (BF16, every element ``rank``) and
    a random x, both also cast to FP8 with their scales; gate scores; top-k ids over group-limited
    nodes and weights (the test's routing has the same shape; the values are commlib's)."""
    g = torch.Generator(device="cpu").manual_seed(1000 + rank)
    nodes = max(1, a.ranks // a.ranks_per_node)
    scores = random_scores(a.tokens, a.experts, g, device=device)
    idx, w = group_limited_topk(scores, nodes, min(nodes, 4), a.topk)
    x = torch.full((a.tokens, a.hidden), float(rank), dtype=torch.bfloat16, device=device)
    x_rand = torch.randn(a.tokens, a.hidden, generator=g, device="cpu").to(torch.bfloat16).to(device)
    return {"x": x, "x_rand": x_rand, "x_fp8": per_token_cast_to_fp8(x), "x_rand_fp8": per_token_cast_to_fp8(x_rand),
            "scores": scores, "idx": idx.to(device), "w": w.to(device)}


def _cast_back_as_the_test(pair, errors: list):
    """FP8 rows back to BF16 holding what the test's cast back holds at once: its padded copy of the
    FP8 rows (a copy even when the width needs no padding), their float32 values, the scaled float32
    and the BF16 result. Out of memory (this rank's own work): noted in ``errors``, None returned."""
    x8, scales = pair
    try:
        return per_token_cast_back(x8.clone(), scales)
    except torch.OutOfMemoryError as e:
        errors.append(f"OutOfMemoryError in the test's cast back: {str(e).splitlines()[0][:200]}")
        return None


def worker(ctx, a) -> dict:
    dev = ctx.device
    rec = Recorder(a.log_dir, ctx.rank, dev)
    # as the test's init_dist: torch's default dtype BF16 and default device CUDA from here on
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device(dev)
    rec("init")
    group = dist.new_group(list(range(ctx.world_size)))   # the test's own group (init_dist returns it)
    dist.all_reduce(torch.ones(1, dtype=torch.int32, device=dev), group=group)
    rec("group")
    buf = Buffer(group, int(a.nvl_bytes), int(a.rdma_bytes), backend=a.backend, ranks_per_node=a.ranks_per_node,
                 explicitly_destroy=True)
    rec.out["backend"] = buf.backend_name
    rec("buffer")
    t = _test_inputs(a, ctx.rank, dev)
    rec("inputs")
    cfg = Config(*TEST_CONFIG)
    ntr, nrr, nte, tir, _ = buf.get_dispatch_layout(t["idx"], a.experts)
    args = dict(num_tokens_per_rank=ntr, num_tokens_per_rdma_rank=nrr, is_token_in_rank=tir,
                num_tokens_per_expert=nte, topk_idx=t["idx"], topk_weights=t["w"], config=cfg)
    rx, _, rw, _, handle, _ = buf.dispatch(t["x_rand"], **args)
    rec("dispatch")
    worst = a.tokens * a.ranks if a.worst else 0
    wx = None
    if worst:
        wx, *_ = buf.dispatch(t["x_rand"], **args, num_worst_tokens=worst)
        rec("worst")
    bias = (torch.ones(a.tokens, a.hidden, dtype=torch.bfloat16), torch.randn(a.tokens, a.hidden, dtype=torch.bfloat16))
    cx, _, _ = buf.combine(rx, handle, rw, bias=bias, config=cfg)
    rec("combine")
    rx2, *_ = buf.dispatch(t["x_rand"], handle=handle, config=cfg)
    cx2, _, _ = buf.combine(rx2, handle, config=cfg)
    rec("cached")
    del cx2, rx2   # the test holds two BF16 receives at its heaviest: its combine's x and the current one
    check = None
    if a.test_load:
        check = (cx.float() - bias[0].float() - bias[1].float()) / tir.sum(dim=1, keepdim=True)   # the test keeps it
        errors = []
        r8, *_ = buf.dispatch(t["x_rand_fp8"], **args)
        rb = _cast_back_as_the_test(r8, errors)
        del r8
        if worst:
            w8, *_ = buf.dispatch(t["x_rand_fp8"], **args, num_worst_tokens=worst)
            wx = None   # the test's variable takes the new rows: the BF16 ones go now
            wb = _cast_back_as_the_test(w8, errors)
            del w8, wb
        del rb
        rec("fp8", **({"error": errors[0]} if errors else {}))
    del rx, rw, handle, cx, check, wx, t, bias
    gc.collect()
    rec("idle")
    dist.barrier()
    buf.destroy()
    return rec.out


def worker_ll(ctx, a) -> dict:
    dev = ctx.device
    rec = Recorder(a.log_dir, ctx.rank, dev)
    rec("init")
    R, E, T = ctx.world_size, a.experts, a.tokens
    buf = Buffer(ctx.group, 0, int(a.rdma_bytes), low_latency_mode=True, num_qps_per_rank=max(1, E // R),
                 explicitly_destroy=True)
    rec.out["backend"] = buf.backend_name
    rec("buffer")
    g = torch.Generator(device="cpu").manual_seed(1000 + ctx.rank)
    x = torch.randn(T, a.hidden, generator=g).to(torch.bfloat16).to(dev)
    idx = torch.randn(T, E, generator=g).abs().topk(a.topk, dim=-1).indices.to(dev)
    w = torch.rand(T, a.topk, generator=g).to(dev)
    rec("inputs")
    rx, _, handle, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=False)
    rec("dispatch")
    cx, _, _ = buf.low_latency_combine(rx, idx, w, handle)
    rec("combine")
    fx, _, fh, _, _ = buf.low_latency_dispatch(x, idx, T, E, use_fp8=True)
    cx2, _, _ = buf.low_latency_combine(rx, idx, w, fh)
    rec("cached")
    del rx, handle, cx, fx, fh, cx2
    gc.collect()
    rec("idle")
    dist.barrier()
    buf.destroy()
    return rec.out


def solo(ctx, a) -> dict:
    """One process, no NCCL: the CUDA context with torch, then with every commlib kernel family loaded."""
    from commlib.cuda import loader
    dev = ctx.device
    torch.zeros(1, device=dev)
    out = {"context": sample(dev, barrier=False)}
    loader.compile_all()
    out["modules"] = sample(dev, barrier=False)
    return out


def _fmt(v) -> str:
    return "-" if v is None else f"{v / GIB:.2f}"


def _other(s: dict):
    return None if s.get("process") is None else s["process"] - s["torch_resv"] - s["peer_ipc"] - s["cupy_pool"]


def _stage_rows(results: list, label=None) -> list:
    lines = []
    for stage in SOLO + STAGES:
        for r, res in enumerate(results):
            s = res.get(stage) if res else None
            if s is None:
                continue
            lines.append(f"{stage:>8} {label or r:>6} {_fmt(s['torch_alloc']):>12} {_fmt(s['torch_resv']):>11} "
                         f"{_fmt(s.get('peak_alloc')):>10} {_fmt(s['torch_peak_resv']):>10} {_fmt(s['peer_ipc']):>9} "
                         f"{_fmt(s['cupy_pool']):>10} {_fmt(s['process']):>8} {_fmt(_other(s)):>6} "
                         f"{_fmt(s['device_used']):>12}" + (f"  # {s['error']}" if s.get("error") else ""))
    return lines


def summary(results: list, a, solo_out=None, before=None) -> list:
    """The report's closing lines (module docstring): where a rank's memory goes, each rank at its
    peak, whether they all fit the device, commlib's own memory against the Buffer's sizes."""
    lines = []
    ctx = (solo_out or {}).get("context")
    mod = (solo_out or {}).get("modules")
    if ctx and ctx.get("process") is not None:
        lines.append(f"# context (one process, CUDA + torch, no NCCL): {_fmt(ctx['process'])} GiB"
                     + (f"; commlib's kernel modules, all families: +{_fmt(mod['process'] - ctx['process'])} GiB"
                        if mod and mod.get("process") is not None else ""))
    ranks = [r for r in results if r]
    if not ranks:
        return lines + ["# no rank reported"]
    first = ranks[0]
    previous = before
    for stage in STAGES:   # device-wide growth per stage (every rank sharing the GPU counts there)
        s = first.get(stage)
        if s is None:
            continue
        if previous is not None:
            grew = s["device_used"] - previous
            lines.append(f"# {stage}: device used {_fmt(s['device_used'])} GiB, {grew / GIB:+.2f} GiB since the stage "
                         f"before ({grew / len(ranks) / GIB:+.3f} per rank)")
        previous = s["device_used"]
    others = {stage: [_other(r[stage]) for r in ranks if stage in r] for stage in ("init", "group", "buffer")}
    if ctx and ctx.get("process") is not None and all(v and None not in v for v in others.values()):
        avg = {k: sum(v) / len(v) for k, v in others.items()}
        lines.append(f"# other beyond the context, per rank: the default group (NCCL) {_fmt(avg['init'] - ctx['process'])}, "
                     f"the test's group +{_fmt(avg['group'] - avg['init'])}, the Buffer (its groups, the kernels "
                     f"it loads) +{_fmt(avg['buffer'] - avg['group'])} GiB")
    peaks = rank_peaks(ranks)
    big = max(range(len(peaks)), key=lambda i: peaks[i])
    lines.append(f"# each rank at its peak (other + IPC + CuPy pool, the most of any stage, + torch's peak reserved): "
                 f"{_fmt(min(peaks))} .. {_fmt(max(peaks))} GiB (largest: rank {big})")
    need, total = fit(ranks, before)
    if total:
        lines.append(f"# fit: {len(peaks)} ranks at their peaks together {_fmt(need)} GiB (used before them: "
                     f"{_fmt(before)}) of {_fmt(total)} GiB: {'fits' if need <= total else 'does NOT fit'}; per rank "
                     f"{_fmt(total / len(peaks))} GiB, the largest needs {_fmt(max(peaks))}")
    failed = [(i, r[k]["error"]) for i, r in enumerate(ranks) for k in STAGES if k in r and r[k].get("error")]
    if failed:
        lines.append(f"# out of memory on {len(failed)} rank(s), e.g. rank {failed[0][0]}: {failed[0][1]}")
    grew = worst_area_grew(ranks)
    if grew is not None:
        lines.append(f"# forwarder area (peer_ipc): dispatch {_fmt(grew[1])}, worst {_fmt(grew[2])} GiB (the most of any "
                     f"rank): {'GREW at the num_worst_tokens dispatch' if grew[0] else 'worst within dispatch'}")
    calls = [k for k in CALLS if k in first]
    if calls:
        held = max(r[k]["peak_alloc"] - r[k]["torch_alloc"] for r in ranks for k in calls if k in r)
        ipc = max(r[k]["peer_ipc"] for r in ranks for k in STAGES if k in r)
        budget = a.nvl_bytes + a.rdma_bytes
        lines.append(f"# commlib's own: IPC {_fmt(ipc)} + the most a call held beyond what it returned {_fmt(held)} = "
                     f"{_fmt(ipc + held)} GiB; Buffer's num_nvl_bytes + num_rdma_bytes {_fmt(budget)} GiB: "
                     f"{'within' if ipc + held <= budget else 'OVER'}")
    return lines


def worst_area_grew(ranks: list):
    """(whether any rank's IPC bytes at the worst stage exceed its dispatch stage's, the most at
    dispatch, the most at worst), or None where no rank reached both stages."""
    both = [r for r in ranks if r and "dispatch" in r and "worst" in r]
    if not both:
        return None
    return (any(r["worst"]["peer_ipc"] > r["dispatch"]["peer_ipc"] for r in both),
            max(r["dispatch"]["peer_ipc"] for r in both), max(r["worst"]["peer_ipc"] for r in both))


def rank_peaks(ranks: list) -> list:
    """Each rank at its peak (bytes): the most of other + IPC + CuPy pool over its stages, plus the
    most torch held. An upper bound where the two peaks fall in different stages."""
    peaks = []
    for r in ranks:
        stages = [r[k] for k in STAGES if k in r]
        fixed = max(((_other(s) or 0) + s["peer_ipc"] + s["cupy_pool"]) for s in stages)
        peaks.append(fixed + max(s["torch_peak_resv"] for s in stages))
    return peaks


def fit(ranks: list, before=None) -> tuple:
    """(bytes the ranks need at their peaks together, plus what was used before them; the device's
    bytes, or None when no rank reported it). The ranks of one test run in step, so they peak together."""
    ranks = [r for r in ranks if r]
    first = next((r[k] for r in ranks for k in STAGES if k in r), None)
    if first is None:
        return 0, None
    return sum(rank_peaks(ranks)) + (before or 0), first["device_total"]


def report(results: list, a, solo_out=None, before=None) -> list:
    """nccl-tests style lines: a # header, one data row per (stage, rank), the summary. ``before``:
    device bytes used before the ranks started (NVML)."""
    mode = "low-latency, " if a.low_latency else ""
    backend = next((r.get("backend") for r in results if r and r.get("backend")), None)
    lines = [f"# mem_probe: {mode}{a.ranks} ranks ({a.ranks_per_node} per node), tokens {a.tokens}, hidden {a.hidden}, "
             f"experts {a.experts}, top-{a.topk}; Buffer {a.nvl_bytes / 1e9:g} GB + {a.rdma_bytes / 1e9:g} GB; "
             f"backend {backend}; GiB",
             "#  stage   rank  torch_alloc  torch_resv peak_alloc  peak_resv  peer_ipc  cupy_pool  process  other  device_used",
             "#  (other = process - torch_resv - peer_ipc - cupy_pool: the CUDA context, modules, NCCL)"]
    lines += _stage_rows([solo_out] if solo_out else [], label="solo") + _stage_rows(results)
    lines += summary(results, a, solo_out, before)
    return lines


def _read_logs(folder: str, ranks: int) -> list:
    """Every rank's samples as its files have them (a world that failed)."""
    out = []
    for r in range(ranks):
        res = {}
        path = os.path.join(folder, f"rank{r}.jsonl")
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    d = json.loads(line)
                    res[d.pop("stage")] = d
        out.append(res or None)
    return out


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
    p.add_argument("--no-test-load", dest="test_load", action="store_false",
                   help="skip the fp8 stage (what test_internode holds at its heaviest)")
    p.add_argument("--require-fit", action="store_true",
                   help="exit 2 when the ranks at their peaks do not fit the device, or the forwarder's area grew at "
                        "the num_worst_tokens dispatch (a check stage)")
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
    solo_out = parallel_launch(1, solo, a, use_gpu=True, group_backend="gloo", timeout_s=120)
    a.log_dir = tempfile.mkdtemp(prefix="mem_probe_")
    # several nodes: every rank its own NCCL host, so NCCL runs between processes sharing a GPU (the
    # Buffer gets the node layout from --ranks-per-node; its fan-out still maps the node's memory)
    multi = a.ranks > a.ranks_per_node
    failure = None
    try:
        results = parallel_launch(a.ranks, worker_ll if ll else worker, a, ranks_per_node=1 if multi else a.ranks_per_node,
                                  use_gpu=True, group_backend="nccl" if multi else None, emulate_hosts=multi,
                                  return_all=True, timeout_s=a.timeout_s)
    except RuntimeError as e:   # a rank failed (out of memory in a call): report what every rank reached
        failure = str(e)
        results = _read_logs(a.log_dir, a.ranks)
    shutil.rmtree(a.log_dir, ignore_errors=True)
    lines = report(results, a, solo_out, before)
    if failure is not None:
        lines.append("# FAILED: " + " | ".join(failure.strip().splitlines()[-3:])[:600])
    print("\n".join(lines))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "device_used_before": before, "solo": solo_out, "ranks": results,
                       "failure": failure}, f, indent=1)
    if failure is not None:
        return 1
    need, total = fit(results, before)
    grew = worst_area_grew([r for r in results if r])
    return 2 if a.require_fit and ((total and need > total) or (grew and grew[0])) else 0


if __name__ == "__main__":
    sys.exit(main())
