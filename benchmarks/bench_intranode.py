"""NVLink engine benchmark: DeepSeek-V3 dispatch / combine on one node vs the NCCL all-to-all baseline.

    python -m benchmarks.bench_intranode                       # 2 ranks, 512..8192 tokens
    python -m benchmarks.bench_intranode --json --plot --plain --sms 8,12,16,20,24

Workload (docs/launch.md, "The performance method"): hidden 7168, top-8 of 256 experts, group-limited routing
(8 groups, top-4 groups), per rank 512..8192 tokens; BF16 dispatch, FP8 dispatch (E4M3 + one float
scale per 128 channels), BF16 combine. Every figure is the slowest rank's median of --iters timed
calls after --warmup calls, with a 256 MB L2 flush before each (commlib.utils.timing.bench_cuda).

Columns, per op and token count:
  full      the call a user waits for (dispatch: count exchange + the one host sync + the kernel)
  cached    dispatch with the handle reused (no count exchange, no sync): how DeepEP measures
  kernel    CUDA events around the data kernel's launch alone (commlib.cuda.loader.record_launches)
  size      logical bytes: dispatch = received rows x row bytes (local rows included; FP8 rows count
            (1 + 4/128) / 2 of a BF16 row), combine = rows sent back x BF16 row bytes
  nvl       bytes that crossed NVLink to the peers (rows to/from other ranks)
  algbw     size / time (GB/s = 1e9 B/s);  nvlbw = nvl / time
  nccl      the baseline (commlib.bench.baseline: count exchange + permute + all_to_all_single (+ reverse
            + unpermute)), same inputs, same process; x_nccl = nccl time / commlib time
  #wrong    elements of commlib's output that differ from the baseline's (both are bit-exact on one node),
            summed over the ranks, for every row (main, sweeps, variants, plain) after its timing;
            N/A with --no-check. Exit status 1 when any compared row is wrong.
--plain runs the cached dispatch and the combine a second time with plain loads/stores (no PTX cache
hints) to show what the hints buy; --sms sweeps the SM budget at --sweep-tokens.
"""
from __future__ import annotations

import argparse
import math
import shlex
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from commlib.bench import baseline, results
from commlib.utils.timing import slowest

# DeepEP's published intranode figures (GB/s) the brief compares against, and this engine's targets.
DEEPEP = {"dispatch_bf16": 339.0, "dispatch_fp8": 246.0, "combine": 287.0}
TARGETS = {"dispatch_bf16": 450.0, "dispatch_fp8": 330.0, "combine": 380.0, "layout_us": 15.0, "x_nccl": 1.5}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="512,1024,2048,4096,8192")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--topk-groups", type=int, default=4)
    p.add_argument("--num-sms", type=int, default=20)
    p.add_argument("--send-chunk", type=int, default=32, help="num_max_nvl_chunked_send_tokens")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--no-baseline", action="store_true", help="do not time the NCCL baseline (rows are still checked)")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip the comparisons with the baseline's outputs (#wrong N/A)")
    p.add_argument("--plain", action="store_true", help="also time plain loads/stores (A/B of the PTX hints)")
    p.add_argument("--sms", default="", help="comma list of num_sms to sweep at --sweep-tokens")
    p.add_argument("--chunks", default="", help="comma list of send chunks to sweep at --sweep-tokens")
    p.add_argument("--sweep-tokens", type=int, default=4096)
    p.add_argument("--variants", default="", help="kernel variants to A/B at --sweep-tokens: "
                   "'name:KEY=V,KEY=V;name2:...' (keys: commlib.cuda.loader.DEFAULT_VARIANT)")
    p.add_argument("--json", nargs="?", const="auto", default=None, metavar="PATH",
                   help="write the results: a .json file, or a folder for the standard name "
                        "(default: benchmarks/results/bench_intranode_<gpu>x<n>_<yyyymmdd>_<commit>.json)")
    p.add_argument("--plot", action="store_true", help="write a PNG next to the JSON")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------------------------
# timing helpers
# ------------------------------------------------------------------------------------------------

def _bench(fn, warmup: int, iters: int) -> float:
    try:
        from commlib.utils.timing import bench_cuda
        return bench_cuda(fn, warmup=warmup, iters=iters, flush_l2=True)["median_us"]
    except ImportError:  # minimal private version
        flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        samples = []
        for _ in range(iters):
            flush.zero_()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            torch.cuda.synchronize()
            samples.append(s.elapsed_time(e) * 1e3)
        return statistics.median(samples)


def measure(fn, kernels: list[str], args, group) -> dict:
    """{'full': us, 'host': us, kernel name: us} (slowest rank's medians). Three passes:
      full    the call as a user makes it: events around fn() on the current stream, L2 flushed
      host    host-side duration of fn() (what the Python path costs; full ~ host means host-bound)
      kernel  events around each kernel launch, with the device queue running behind the host (one
              long device sleep first), so neither launch overhead nor host gaps land inside the
              events; calls that sync the host (non-cached dispatch) still see the peer's skew."""
    import time

    from commlib.cuda import loader as K

    full = _bench(fn, args.warmup, args.iters)
    torch.cuda.synchronize()
    host = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    dist.barrier(group=group)
    torch.cuda.synchronize()
    with K.record_launches() as rec:
        torch.cuda._sleep(40_000_000)  # ~20 ms: the host queues every call before the device starts
        for _ in range(args.iters):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    per = []
    for name in kernels:
        times = [s.elapsed_time(e) * 1e3 for n, s, e in rec if n == name][-args.iters:]
        per.append(statistics.median(times) if times else float("nan"))
    vals = slowest([full, statistics.median(host)] + per, group)
    return {"full": vals[0], "host": vals[1], **{k: v for k, v in zip(kernels, vals[2:])}}


# ------------------------------------------------------------------------------------------------
# the worker (one per rank)
# ------------------------------------------------------------------------------------------------

def worker(ctx, a: dict):
    args = argparse.Namespace(**a)
    from commlib.cuda import loader as K
    from commlib import routing
    from commlib.buffer import Buffer
    from commlib.config import Config
    from commlib.fp8 import per_token_cast_to_fp8

    R, me, dev, group = ctx.world_size, ctx.rank, ctx.device, ctx.group
    H, E, Kk = args.hidden, args.experts, args.topk
    tokens = [int(t) for t in args.tokens.split(",") if t]
    sms_list = [int(s) for s in args.sms.split(",") if s]
    chunk_list = [int(c) for c in args.chunks.split(",") if c]
    variants = []
    for item in (v for v in args.variants.split(";") if v.strip()):
        name, _, kvs = item.partition(":")
        variants.append((name.strip(), K.parse_variant(kvs)))
    max_t = max(tokens + ([args.sweep_tokens] if (sms_list or chunk_list or args.plain or variants) else []))

    def cfg_for(num_sms: int, chunk: int = args.send_chunk) -> Config:
        cap = max(chunk, math.ceil(max_t / (num_sms // 2)))
        return Config(num_sms, chunk, cap, 64, 1024)

    all_cfgs = [cfg_for(n) for n in set(sms_list + [args.num_sms])] + [cfg_for(args.num_sms, c) for c in chunk_list]
    nbytes = max(c.get_nvl_buffer_size_hint(H * 2, R) for c in all_cfgs)
    buf = Buffer(group, nbytes, backend="nvlink", explicitly_destroy=True)
    rows_out = []

    def inputs(T: int):
        g = torch.Generator().manual_seed(1000 + 7 * me + T)
        scores = torch.sigmoid(torch.randn(T, E, generator=g))
        idx, w = routing.group_limited_topk(scores, args.groups, args.topk_groups, Kk)
        x = torch.randn(T, H, generator=g).to(torch.bfloat16)
        return x.to(dev), idx.to(dev), w.to(dev)

    def one_size(T: int, cfg: Config, with_fp8: bool, with_baseline: bool, tag: str, check: bool = True):
        x, idx, w = inputs(T)
        xq = per_token_cast_to_fp8(x)
        ntpr, _, ntpe, tir, _ = buf.get_dispatch_layout(idx, E)
        layout = measure(lambda: buf.get_dispatch_layout(idx, E), ["layout_kernel"], args, group)

        def disp(xx):
            return buf.dispatch(xx, num_tokens_per_rank=ntpr, is_token_in_rank=tir, num_tokens_per_expert=ntpe,
                                topk_idx=idx, topk_weights=w, config=cfg)

        recv_x, _, _, _, handle, _ = disp(x)
        rpm = handle.rank_prefix_matrix.cpu()
        recv_from = [int(rpm[s, me] - (rpm[s - 1, me] if s else 0)) for s in range(R)]
        sent_to = [int(v) for v in ntpr.cpu()]
        N = sum(recv_from)
        remote_in, remote_out = N - recv_from[me], sum(sent_to) - sent_to[me]
        bf16_row = 2 * H
        res = {}
        res["dispatch_bf16"] = measure(lambda: disp(x), ["notify_kernel", "dispatch_kernel"], args, group)
        res["dispatch_bf16"]["cached"] = measure(lambda: buf.dispatch(x, handle=handle, config=cfg),
                                                 ["dispatch_kernel"], args, group)
        if with_fp8:
            res["dispatch_fp8"] = measure(lambda: disp(xq), ["notify_kernel", "dispatch_kernel"], args, group)
            res["dispatch_fp8"]["cached"] = measure(lambda: buf.dispatch(xq, handle=handle, config=cfg),
                                                    ["dispatch_kernel"], args, group)
        y = recv_x
        res["combine"] = measure(lambda: buf.combine(y, handle, config=cfg), ["combine_kernel"], args, group)
        wrong = {}  # op -> elements that differ from the baseline's outputs (compared ops only)
        base = {}
        if with_baseline or check:
            b_recv, state = baseline.a2a_dispatch(x, idx, E, group)
        if check:
            wrong["dispatch_bf16"] = baseline.count_wrong(disp(x)[0], b_recv)
            wrong["dispatch_bf16"] += baseline.count_wrong(buf.dispatch(x, handle=handle, config=cfg)[0], b_recv)
            c_mine = buf.combine(y, handle, config=cfg)[0]
            wrong["combine"] = baseline.count_wrong(c_mine, baseline.a2a_combine(b_recv, state, group))
            if with_fp8:
                (bq, bs), _ = baseline.a2a_dispatch(xq, idx, E, group)
                (mq, ms) = disp(xq)[0]
                wrong["dispatch_fp8"] = baseline.count_wrong(mq, bq) + baseline.count_wrong(ms, bs)
        if with_baseline:
            base["dispatch_bf16"] = slowest([_bench(lambda: baseline.a2a_dispatch(x, idx, E, group),
                                                     args.warmup, args.iters)], group)[0]
            base["combine"] = slowest([_bench(lambda: baseline.a2a_combine(b_recv, state, group),
                                               args.warmup, args.iters)], group)[0]
            if with_fp8:
                base["dispatch_fp8"] = slowest([_bench(lambda: baseline.a2a_dispatch(xq, idx, E, group),
                                                        args.warmup, args.iters)], group)[0]
        wrong = dict(zip(res, results.reduce_wrong([wrong.get(op) for op in res], group)))  # summed over ranks
        # bytes (mean over ranks)
        sizes = torch.tensor([N, remote_in, remote_out], dtype=torch.float64, device=dev)
        dist.all_reduce(sizes, group=group)
        N_mean, rin_mean, rout_mean = (float(v) / R for v in sizes.tolist())
        out = []
        for op, m in res.items():
            scale = (1 + 4 / 128) / 2 if op == "dispatch_fp8" else 1.0
            size = N_mean * bf16_row * scale
            nvl = (rout_mean if op.startswith("dispatch") else rin_mean) * bf16_row * scale
            kern = m.get("dispatch_kernel", m.get("combine_kernel"))
            row = {"op": op, "tokens": T, "num_sms": cfg.num_sms, "send_chunk": cfg.num_max_nvl_chunked_send_tokens,
                   "tag": tag, "plain": K.plain_mode(), "variant": K.variant(), **results.checked_fields(wrong[op]),
                   "size_bytes": size, "nvl_bytes": nvl,
                   "full_us": m["full"], "host_us": m["host"], "kernel_us": kern, "notify_us": m.get("notify_kernel"),
                   "cached_us": m.get("cached", {}).get("full"), "cached_host_us": m.get("cached", {}).get("host"),
                   "cached_kernel_us": m.get("cached", {}).get("dispatch_kernel"),
                   "layout_us": layout["full"], "layout_kernel_us": layout["layout_kernel"],
                   "nccl_us": base.get(op)}
            best = row["cached_us"] or row["full_us"]
            # kernel-only: the cached call's kernel for dispatch (no host sync, so no skew inside)
            kern_best = row["cached_kernel_us"] or kern
            row["algbw_full"] = size / row["full_us"] / 1e3
            row["algbw_cached"] = size / row["cached_us"] / 1e3 if row["cached_us"] else None
            row["algbw_kernel"] = size / kern_best / 1e3 if kern_best else None
            row["nvlbw_kernel"] = nvl / kern_best / 1e3 if kern_best else None
            row["nvlbw"] = nvl / best / 1e3
            row["nccl_algbw"] = size / row["nccl_us"] / 1e3 if row["nccl_us"] else None
            row["x_nccl"] = row["nccl_us"] / row["full_us"] if row["nccl_us"] else None
            row["x_deepep"] = (size / best / 1e3) / DEEPEP[op]
            out.append(row)
        return out

    for T in tokens:
        rows_out += one_size(T, cfg_for(args.num_sms), True, not args.no_baseline, "main", check=args.check)
    for n in sms_list:
        rows_out += one_size(args.sweep_tokens, cfg_for(n), False, False, "sms_sweep", check=args.check)
    for c in chunk_list:
        rows_out += one_size(args.sweep_tokens, cfg_for(args.num_sms, c), False, False, "chunk_sweep", check=args.check)
    for name, knobs in variants:
        K.set_variant(knobs)
        try:
            rows_out += one_size(args.sweep_tokens, cfg_for(args.num_sms), True, False, name, check=True)
        finally:
            K.set_variant(None)
    if args.plain:
        K.set_plain(True)
        try:
            rows_out += one_size(args.sweep_tokens, cfg_for(args.num_sms), True, False, "plain", check=True)
        finally:
            K.set_plain(None)
    dev_name = torch.cuda.get_device_name(dev)
    buf.destroy()
    return {"rows": rows_out, "device": dev_name, "world": R}


# ------------------------------------------------------------------------------------------------
# output
# ------------------------------------------------------------------------------------------------

def _f(v, fmt="8.1f"):
    if isinstance(v, (int, float)) and v == v:
        return format(v, fmt)
    width = fmt.split(".")[0]
    return " " * (int(width) - 1 if width else 0) + "-"


def print_table(result: dict) -> None:
    print(f"# commlib NVLink engine, {result['world']} x {result['device']}; times in us, bandwidths in GB/s")
    hdr = (f"#{'op':>14} {'tag':>11} {'tokens':>6} {'sms':>3} {'size(B)':>11} {'full':>8} {'algbw':>7} "
           f"{'cached':>8} {'algbw':>7} {'kernel':>8} {'algbw':>7} {'nvl_k':>7} {'nccl':>8} {'ncclbw':>7} "
           f"{'x_nccl':>6} {'x_deepep':>8} {'#wrong':>6}")
    print(hdr)
    for r in result["rows"]:
        print(f" {r['op']:>14} {r['tag'][:11]:>11} "
              f"{r['tokens']:>6} {r['num_sms']:>3} {r['size_bytes']:>11.0f} {_f(r['full_us'])} "
              f"{_f(r['algbw_full'], '7.1f')} {_f(r['cached_us'])} {_f(r['algbw_cached'], '7.1f')} "
              f"{_f(r['cached_kernel_us'] or r['kernel_us'])} {_f(r['algbw_kernel'], '7.1f')} {_f(r['nvlbw_kernel'], '7.1f')} "
              f"{_f(r['nccl_us'])} {_f(r['nccl_algbw'], '7.1f')} {_f(r['x_nccl'], '6.2f')} "
              f"{_f(r['x_deepep'], '8.2f')} {results.wrong_cell(r):>6}")
    lay = [r for r in result["rows"] if r["op"] == "dispatch_bf16" and r["tag"] == "main"]
    for r in lay:
        print(f"# [layout] tokens {r['tokens']}: get_dispatch_layout {r['layout_us']:.1f} us full, "
              f"{r['layout_kernel_us']:.1f} us kernel; notify kernel {r['notify_us']:.1f} us")
    print("# [host] host-side us per call (Python + launches; full ~ host means the call is host-bound):")
    for r in result["rows"]:
        if r["tag"] == "main":
            print(f"#   {r['op']:>14} {r['tokens']:>5}: full call {r['host_us']:.0f} us host"
                  + (f", cached call {r['cached_host_us']:.0f} us host" if r.get("cached_host_us") else ""))
    print(results.check_footer(result["rows"]))
    for line in verdicts(result):
        print(line)


def verdicts(result: dict) -> list[str]:
    out = []
    main = {(r["op"], r["tokens"]): r for r in result["rows"] if r["tag"] == "main"}
    for op in ("dispatch_bf16", "dispatch_fp8", "combine"):
        r = main.get((op, 4096))
        if r is None:
            continue
        bw = r["algbw_cached"] or r["algbw_full"]
        ok = bw >= TARGETS[op] and (r["x_nccl"] or 0) >= TARGETS["x_nccl"]
        out.append(f"# [target] {op} @4096 tok: {bw:.0f} GB/s ({'cached' if r['algbw_cached'] else 'full'}) "
                   f"vs target {TARGETS[op]:.0f}; full call {r['algbw_full']:.0f} GB/s, "
                   f"{_f(r['x_nccl'], '.2f')} x NCCL (target {TARGETS['x_nccl']}): {'MET' if ok else 'NOT MET'}")
    r = main.get(("dispatch_bf16", 4096))
    if r is not None:
        out.append(f"# [target] get_dispatch_layout @4096 tok: {r['layout_us']:.1f} us full call, "
                   f"{r['layout_kernel_us']:.1f} us kernel (target {TARGETS['layout_us']:.0f} us)")
    return out


def write_json(result: dict, target: str, argv=None) -> Path:
    """The result document (``commlib.bench.results``) at ``target`` (a .json file or a folder)."""
    command = "python -m benchmarks.bench_intranode " + shlex.join(sys.argv[1:] if argv is None else argv)
    doc = results.result_document("bench_intranode", command.strip(), result["rows"], world_size=result["world"],
                                  device_name=result["device"], deepep_reference_gbps=DEEPEP, targets=TARGETS,
                                  verdicts=verdicts(result), ratios=[
                                      {"op": r["op"], "tokens": r["tokens"], "tag": r["tag"], "x_nccl": r["x_nccl"],
                                       "x_deepep": r["x_deepep"]} for r in result["rows"]])
    return results.write_result(doc, target)


def plot(result: dict, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    main = [r for r in result["rows"] if r["tag"] == "main"]
    for op, color in (("dispatch_bf16", "C0"), ("dispatch_fp8", "C1"), ("combine", "C2")):
        rs = sorted((r for r in main if r["op"] == op), key=lambda r: r["tokens"])
        if not rs:
            continue
        t = [r["tokens"] for r in rs]
        ax.plot(t, [r["algbw_cached"] or r["algbw_full"] for r in rs], "-o", color=color, label=f"commlib {op}")
        ax.plot(t, [r["algbw_full"] for r in rs], ":", color=color, label=f"commlib {op} (full call)")
        if all(r["nccl_algbw"] for r in rs):
            ax.plot(t, [r["nccl_algbw"] for r in rs], "--x", color=color, alpha=0.6, label=f"NCCL a2a {op}")
        ax.axhline(DEEPEP[op], color=color, lw=0.6, alpha=0.5)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per rank")
    ax.set_ylabel("logical GB/s")
    ax.set_title(f"commlib NVLink engine, V3 shape, {result['world']} x {result['device']}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv=None) -> int:
    from commlib.utils.launch import parallel_launch

    args = parse_args(argv)
    result = parallel_launch(args.world, worker, vars(args), use_gpu=True, timeout_s=540)
    print_table(result)
    if args.json is not None:
        path = write_json(result, args.json, argv)
        print(f"# [json] {path}")
        if args.plot:
            png = path.with_suffix(".png")
            plot(result, png)
            print(f"# [plot] {png}")
    return results.exit_status(result["rows"])


if __name__ == "__main__":
    sys.exit(main())
