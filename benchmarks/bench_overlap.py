"""Dual pipeline vs sequential: a MoE layer (attention + routed experts + shared expert) on two
micro-batches, expert-parallel over the ranks.

Three phases, each timed both ways (CUDA events, median of --iters after --warmup, ranks
barrier-aligned before every iteration):
  forward            F(mb0), F(mb1)           vs  dual_forward
  forward+backward   F0, F1, B0, B1           vs  dual_forward + dual_backward
  fwd(mb0)+bwd(mb1)  F(mb0), then B(mb1)      vs  overlapped_forward_backward (DualPipe's hook)
"sequential" runs the same stages with synchronous communication. comm and compute are the sums
of the comm-stream and compute-stream step spans of the sequential run (recorded with CUDA
events); the figure of merit is time(dual) / max(comm, compute) (1.0 = perfect overlap; target
<= 1.15) and the speedup over sequential (target >= 1.3 where comm ~ compute).

Shapes: ``--preset v3`` is DeepSeek-V3's MoE layer scaled to 2 GPUs (hidden 7168, 256 experts =
128 per GPU, top-8 in 4 of 8 groups, expert intermediate 2048, one shared expert, 4096 tokens per
micro-batch, attention stand-in: 56 heads x 128). On 2 x H200 compute dominates there (forward
~15 ms per micro-batch against ~1.3 ms of dispatch + combine), so overlap can hide the
communication (dual / max ~1.0) but cannot give much speedup. ``--preset balanced`` keeps the
token rows (4096 x 7168 bf16) and cuts the work per row (16 experts, top-2, expert intermediate
256, no shared expert, 4 heads x 128) to bring compute towards comm, where overlap matters most;
check the comm / compute columns. Every shape flag overrides the preset.

Writes JSON (device, git commit, command, figures, step spans) and a timeline PNG of the two
streams to --out-dir (default benchmarks/results/).

Run:
  torchrun --nproc-per-node 2 benchmarks/bench_overlap.py --preset v3       # GPUs
  python benchmarks/bench_overlap.py --ranks 2 --preset tiny                # CPU smoke test
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

PRESETS = {
    #           tokens hidden experts topk groups topk_groups expert_hidden shared heads head_dim
    "v3":       (4096, 7168, 256, 8, 8, 4, 2048, 1, 56, 128),
    "balanced": (4096, 7168, 16, 2, 2, 2, 256, 0, 4, 128),
    "tiny":     (32, 64, 8, 2, 2, 2, 32, 1, 4, 16),
}
_FIELDS = ("tokens", "hidden", "experts", "topk", "groups", "topk_groups", "expert_hidden", "shared", "heads",
           "head_dim")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="shape preset (default: v3 on GPUs, tiny on CPU)")
    p.add_argument("--tokens", type=int, help="tokens per micro-batch per rank (one sequence)")
    p.add_argument("--hidden", type=int)
    p.add_argument("--experts", type=int)
    p.add_argument("--topk", type=int)
    p.add_argument("--groups", type=int)
    p.add_argument("--topk-groups", type=int)
    p.add_argument("--expert-hidden", type=int)
    p.add_argument("--shared", type=int, help="shared experts (0 = none)")
    p.add_argument("--heads", type=int, help="attention heads")
    p.add_argument("--head-dim", type=int, help="attention head size (q/k/v project to heads * head_dim)")
    p.add_argument("--comm-priority", type=int, default=None,
                   help="replace the Buffer's comm stream by one of this CUDA priority (-1 = high); experiment")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--fp8", action="store_true", help="FP8 dispatch (E4M3 + scales), bf16 combine")
    p.add_argument("--backend", default=None, help="Buffer backend (auto | reference | nvlink)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--ranks", type=int, default=2, help="ranks to spawn when not under torchrun")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=os.path.join(ROOT, "benchmarks", "results"))
    p.add_argument("--tag", default=None, help="name of the output files (default: device + preset)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--json", action="store_true", help="also print the JSON to stdout")
    return p.parse_args(argv)


def _resolve_shapes(args, on_gpu: bool) -> dict:
    preset = args.preset or ("v3" if on_gpu else "tiny")
    shapes = dict(zip(_FIELDS, PRESETS[preset]))
    for f in _FIELDS:
        v = getattr(args, f.replace("-", "_"), None)
        if v is not None:
            shapes[f] = v
    shapes["preset"] = preset
    return shapes


def _git_commit() -> str | None:
    from commlib.bench import git_commit
    commit = git_commit()["commit"]
    return None if commit == "unknown" else commit


class _Clock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def time_ms(self, fn) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        dist.barrier()
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3


def _median_ms(clock, fn, warmup, iters) -> float:
    for _ in range(warmup):
        clock.time_ms(fn)
    return statistics.median(clock.time_ms(fn) for _ in range(iters))


def _sum_spans(spans, stream) -> float:
    return sum(s["end_ms"] - s["start_ms"] for s in spans if s["stream"] == stream)


def _check(model, P, h0, h1, g0, g1, device) -> dict:
    """Dual vs sequential forward+backward once: outputs and every gradient, relative L2 error.

    CPU: bit-identical (error 0). GPUs: index_add uses atomics, so float sums vary in order and
    bf16 results can differ in the last bit; the check allows 1e-2 relative (a wrong schedule,
    e.g. a missing wait, gives errors of order 1)."""
    def once(overlap):
        model.zero_grad(set_to_none=True)
        o0, o1 = P.dual_forward(model, (h0,), (h1,), overlap=overlap)
        P.dual_backward(o0, g0, o1, g1, overlap=overlap)
        out = {"out0": o0.detach().clone(), "out1": o1.detach().clone()}
        out.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        model.zero_grad(set_to_none=True)
        return out

    ref, dual = once(False), once(True)
    worst, worst_name = 0.0, None
    for name, r in ref.items():
        d = dual.get(name)
        if d is None:
            worst, worst_name = float("inf"), name
            break
        err = ((d.float() - r.float()).norm() / r.float().norm().clamp_min(1e-30)).item()
        if err > worst:
            worst, worst_name = err, name
    tol = 0.0 if device.type == "cpu" else 1e-2
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (worst, worst_name))
    worst, worst_name = max(everyone, key=lambda x: x[0])
    ok = worst <= tol
    if dist.get_rank() == 0:
        print(f"[overlap] check dual vs sequential (outputs + {len(ref) - 2} gradients): max relative error "
              f"{worst:.3e} ({worst_name}) {'ok' if ok else 'WRONG'} (tolerance {tol})")
    return {"max_relative_error": worst, "worst": worst_name, "tolerance": tol, "ok": ok}


def run(ctx, args) -> dict:
    """Run the benchmark on this rank (all ranks call it); rank 0 returns the result dict."""
    from commlib import Buffer
    from commlib import pipeline as P
    from commlib.moe import MoEConfig, MoEModel

    device = ctx.device
    on_gpu = device.type == "cuda"
    sh = _resolve_shapes(args, on_gpu)
    dtype = torch.bfloat16
    R = ctx.world_size
    dcfg = Buffer.get_dispatch_config(R)
    hidden_bytes = sh["hidden"] * 2
    buffer = Buffer(ctx.group, num_nvl_bytes=dcfg.get_nvl_buffer_size_hint(hidden_bytes, ctx.ranks_per_node),
                    num_rdma_bytes=(dcfg.get_rdma_buffer_size_hint(hidden_bytes, R)
                                    if ctx.ranks_per_node < R else 0),
                    backend=args.backend)
    cfg = MoEConfig(hidden=sh["hidden"], num_experts=sh["experts"], topk=sh["topk"],
                    expert_hidden=sh["expert_hidden"], num_groups=sh["groups"], topk_groups=sh["topk_groups"],
                    num_shared_experts=sh["shared"], expert_dtype=dtype, fp8_dispatch=args.fp8)
    torch.manual_seed(args.seed)  # replicated (attention, router, shared) parameters agree across ranks
    if args.comm_priority is not None and on_gpu:
        buffer.comm_stream = torch.cuda.Stream(device=device, priority=args.comm_priority)
    model = MoEModel(cfg, args.layers, sh["heads"], buffer=buffer, full_init=False, device=device,
                     attn_dtype=dtype, head_dim=sh["head_dim"]).to(dtype)
    g = torch.Generator(device="cpu").manual_seed(args.seed * 1000 + ctx.rank)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    h0, h1 = rnd(1, sh["tokens"], sh["hidden"]), rnd(1, sh["tokens"], sh["hidden"])
    g0, g1 = rnd(1, sh["tokens"], sh["hidden"]), rnd(1, sh["tokens"], sh["hidden"])
    clock = _Clock(device)

    def fwd(overlap, timeline=None):
        with torch.no_grad():
            P.dual_forward(model, (h0,), (h1,), timeline=timeline, overlap=overlap)

    def fwd_bwd(overlap, timeline=None):
        model.zero_grad(set_to_none=True)
        o0, o1 = P.dual_forward(model, (h0,), (h1,), timeline=timeline, overlap=overlap)
        P.dual_backward(o0, g0, o1, g1, timeline=timeline, overlap=overlap)

    def timed_f_and_b(overlap, timeline):
        """DualPipe's steady state: micro-batch 1's forward ran earlier (untimed); time micro-batch
        0's forward together with micro-batch 1's backward."""
        times = []
        for it in range(args.warmup + args.iters):
            model.zero_grad(set_to_none=True)
            o1 = model(h1)
            last = it == args.warmup + args.iters - 1
            t = clock.time_ms(lambda: P.overlapped_forward_backward(
                model, [h0], None, None, model, None, [o1], [g1], timeline=timeline if last else None,
                overlap=overlap))
            if it >= args.warmup:
                times.append(t)
        return statistics.median(times)

    check = _check(model, P, h0, h1, g0, g1, device)

    phases = {}
    for name, fn in (("forward", fwd), ("forward_backward", fwd_bwd)):
        seq_ms = _median_ms(clock, lambda: fn(False), args.warmup, args.iters)
        dual_ms = _median_ms(clock, lambda: fn(True), args.warmup, args.iters)
        tl_seq, tl_dual = P.Timeline(), P.Timeline()
        clock.time_ms(lambda: fn(False, tl_seq))
        clock.time_ms(lambda: fn(True, tl_dual))
        phases[name] = (seq_ms, dual_ms, tl_seq.spans(), tl_dual.spans())
    tl_seq, tl_dual = P.Timeline(), P.Timeline()
    seq_ms = timed_f_and_b(False, tl_seq)
    dual_ms = timed_f_and_b(True, tl_dual)
    phases["fwd0_bwd1"] = (seq_ms, dual_ms, tl_seq.spans(), tl_dual.spans())

    figures = {}
    for name, (seq_ms, dual_ms, spans_seq, spans_dual) in phases.items():
        comm_ms, compute_ms = _sum_spans(spans_seq, "comm"), _sum_spans(spans_seq, "compute")
        # Every rank's numbers: the slowest rank is what a step waits for.
        mine = torch.tensor([seq_ms, dual_ms, comm_ms, compute_ms], dtype=torch.float64, device=device)
        everyone = [torch.zeros_like(mine) for _ in range(R)]
        dist.all_gather(everyone, mine)
        worst = torch.stack(everyone).max(dim=0).values.tolist()
        seq_ms, dual_ms, comm_ms, compute_ms = worst
        figures[name] = {
            "sequential_ms": seq_ms, "dual_ms": dual_ms, "comm_ms": comm_ms, "compute_ms": compute_ms,
            "dual_over_max_comm_compute": dual_ms / max(comm_ms, compute_ms, 1e-9),
            "speedup_over_sequential": seq_ms / max(dual_ms, 1e-9),
            "spans_sequential": spans_seq, "spans_dual": spans_dual,
        }
    if ctx.rank != 0:
        return {}

    device_name = torch.cuda.get_device_name(device) if on_gpu else "cpu"
    result = {
        "benchmark": "bench_overlap",
        "device": device_name, "num_ranks": R, "ranks_per_node": ctx.ranks_per_node,
        "backend": buffer.backend_name, "git_commit": _git_commit(),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "shapes": dict(sh, layers=args.layers, fp8=args.fp8, dtype="bf16"),
        "comm_stream_priority": args.comm_priority,
        "timing": {"warmup": args.warmup, "iters": args.iters, "statistic": "median, slowest rank"},
        "targets": {"dual_over_max_comm_compute": "<= 1.15", "speedup_over_sequential": ">= 1.3 where comm ~ compute"},
        "check": check,
        "figures": figures,
    }
    _print_table(result)
    os.makedirs(args.out_dir, exist_ok=True)
    tag = args.tag or f"{device_name.replace(' ', '_')}_{sh['preset']}{'_fp8' if args.fp8 else ''}"
    json_path = os.path.join(args.out_dir, f"overlap_{tag}.json")
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)
    result["json_path"] = json_path
    print(f"[overlap] wrote {json_path}")
    if not args.no_plot:
        png = os.path.join(args.out_dir, f"overlap_{tag}.png")
        plot_timeline(result, png)
        print(f"[overlap] wrote {png}")
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "figures"}, indent=1))
    return result


def _print_table(result: dict) -> None:
    sh = result["shapes"]
    print(f"[overlap] device={result['device']} ranks={result['num_ranks']} backend={result['backend']} "
          f"tokens/micro-batch={sh['tokens']} hidden={sh['hidden']} experts={sh['experts']} "
          f"({sh['experts'] // result['num_ranks']}/rank) top-{sh['topk']} expert_hidden={sh['expert_hidden']} "
          f"heads={sh['heads']}x{sh['head_dim']} layers={sh['layers']} fp8={sh['fp8']} "
          f"comm_priority={result['comm_stream_priority']}")
    print(f"#{'phase':>18} {'sequential':>11} {'dual':>9} {'comm':>9} {'compute':>9} {'dual/max':>9} {'speedup':>8}")
    print(f"#{'':>18} {'(ms)':>11} {'(ms)':>9} {'(ms)':>9} {'(ms)':>9} {'':>9} {'':>8}")
    for name, f in result["figures"].items():
        print(f" {name:>18} {f['sequential_ms']:11.3f} {f['dual_ms']:9.3f} {f['comm_ms']:9.3f} "
              f"{f['compute_ms']:9.3f} {f['dual_over_max_comm_compute']:9.3f} {f['speedup_over_sequential']:8.3f}")
    print("# targets: dual/max(comm, compute) <= 1.15; speedup >= 1.3 where comm ~ compute")


def plot_timeline(result: dict, path: str) -> None:
    """One panel per phase and schedule; two rows (compute, comm); colour = micro-batch."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(name, sched, f[f"spans_{sched}"]) for name, f in result["figures"].items()
              for sched in ("sequential", "dual")]
    fig, axes = plt.subplots(len(panels), 1, figsize=(14, 1.6 * len(panels)), squeeze=False)
    colours = {"0": "tab:blue", "1": "tab:orange"}
    for ax, (name, sched, spans) in zip(axes[:, 0], panels):
        for s in spans:
            row = 1 if s["stream"] == "compute" else 0
            mb = s["label"].split(".")[0]
            width = max(s["end_ms"] - s["start_ms"], 1e-6)
            ax.broken_barh([(s["start_ms"], width)], (row - 0.4, 0.8), facecolors=colours.get(mb, "grey"),
                           edgecolor="black", linewidth=0.3, alpha=0.85 if ".B." in s["label"] else 1.0,
                           hatch="//" if ".B." in s["label"] else None)
            if width > 0.04 * max(x["end_ms"] for x in spans):
                ax.text(s["start_ms"] + width / 2, row, s["label"].split(".", 1)[1], ha="center", va="center",
                        fontsize=6)
        ax.set_yticks([0, 1], ["comm", "compute"])
        ax.set_title(f"{name}: {sched}", fontsize=8, loc="left")
        ax.set_xlabel("ms", fontsize=7)
    fig.suptitle(f"commlib dual pipeline on {result['device']} x{result['num_ranks']} "
                 "(blue: micro-batch 0, orange: 1, hatched: backward)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def _worker(ctx, args):
    return run(ctx, args)


def main(argv=None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        from commlib.dist import init_distributed
        from commlib.launch import RankContext
        group = init_distributed()
        rank, world = dist.get_rank(), dist.get_world_size()
        device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                  else torch.device("cpu"))
        rpn = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        run(RankContext(rank, world, rpn, device, group), args)
        dist.destroy_process_group()
    else:
        from commlib.launch import parallel_launch
        parallel_launch(args.ranks, _worker, args, use_gpu=True)


if __name__ == "__main__":
    main()
