"""Low-latency (decode) benchmark: nvlink low-latency dispatch / combine vs NCCL, issue 8's workload.

    python -m benchmarks.bench_low_latency [--tokens 128 --hidden 7168 --experts 288 --topk 8]
                                          [--sms N] [--iters 50] [--json PATH]

Two ranks (one per GPU). Per rank: T tokens, top-k of E experts (random, distinct), FP8 dispatch
(cast in the kernel), BF16 combine. Reports, slowest rank's median over iterations (CUDA events,
L2 flushed before each):
  dispatch / combine launched from a CUDA graph (the target: dispatch <= 25 us, combine <= 32 us)
  dispatch / combine called eagerly (host launch overhead included)
  send and receive phases with return_recv_hook=True (two graphs: send, then the hook)
  NCCL baseline: all_to_all_single of the same rows (dispatch: E4M3 + scales per (token, expert)
  pair, combine: bf16 rows back), split sizes precomputed (no count exchange), in the same run.
Checked against the reference backend (#wrong = bytes that differ, summed over the ranks): the
first call of each kind, and every timed commlib figure's outputs after its timing loop (the graph
replays', the eager calls', the hooks'). The NCCL rows move unset buffers: not checked (N/A). Exit
status 1 when anything compared is wrong.
"""
from __future__ import annotations

import argparse
import shlex
import sys

import torch
import torch.distributed as dist

from commlib.bench import main as B
from commlib.bench import results
from commlib.utils.timing import bench_cuda, capture_graph as _graph, reduce_times, summarize

TARGETS_US = {"dispatch_graph": 25.0, "combine_graph": 32.0}
DEEPEP_2XH200_US = {"dispatch": 29.0, "combine": 40.0, "send": 20.0, "recv": 8.0}


def _inputs(rank: int, a, dev):
    g = torch.Generator().manual_seed(a.seed * 1000 + rank)
    x = torch.randn(a.tokens, a.hidden, generator=g).to(torch.bfloat16).to(dev)
    idx = torch.rand(a.tokens, a.experts, generator=g).topk(a.topk, dim=1).indices.to(dev)
    w = torch.rand(a.tokens, a.topk, generator=g).to(dev)
    return x, idx, w


def _wrong(got, want) -> int:
    a = got.contiguous().view(torch.uint8).reshape(-1)
    b = want.contiguous().view(torch.uint8).reshape(-1).to(a.device)
    return int((a != b).sum().item()) if a.numel() == b.numel() else max(a.numel(), b.numel())


def reference_outputs(ref, x, idx, w, y, M: int, E: int, kw: dict) -> dict:
    """The reference backend's low-latency dispatch and combine of the same inputs (copies)."""
    rx, rcount, rh, _, _ = ref.low_latency_dispatch(x, idx, M, E, **kw)
    combined = ref.low_latency_combine(y, idx, w, rh)[0]
    return {"x": rx[0].clone(), "scales": rx[1].clone(), "count": rcount.clone(), "src_info": rh.src_info.clone(),
            "layout_range": rh.layout_range.clone(), "combined": combined.clone()}


def check_dispatch(out, want: dict) -> int:
    """Bytes of a low-latency dispatch's outputs (recv_x, recv_count, handle) that differ from the
    reference's: the count, the handle's source info and layout ranges, each expert's rows up to
    its count (FP8 rows and scales)."""
    got_x, got_count, got_h = out[0], out[1], out[2]
    wrong = (_wrong(got_count, want["count"]) + _wrong(got_h.src_info, want["src_info"])
             + _wrong(got_h.layout_range, want["layout_range"]))
    for e, n in enumerate(want["count"].cpu().tolist()):
        wrong += _wrong(got_x[0][e, :n], want["x"][e, :n]) + _wrong(got_x[1][e, :n], want["scales"][e, :n])
    return wrong


def check_combine(out, want: dict) -> int:
    """Bytes of a low-latency combine's output that differ from the reference's."""
    return _wrong(out[0], want["combined"])


def _worker(ctx, a):
    from commlib.buffer import Buffer

    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    M, H, E = a.tokens, a.hidden, a.experts
    L = E // R
    nbytes = Buffer.get_low_latency_rdma_size_hint(M, H, R, E)
    from commlib.cuda import loader as K
    variant = K.parse_variant(a.variant)
    if a.trace:  # every rank builds the kernels with the %globaltimer points (before the Buffer compiles)
        variant["LL_TRACE"] = 1
    if variant:
        K.set_variant(variant)
    buf = Buffer(ctx.group, 0, nbytes, low_latency_mode=True, backend="nvlink", explicitly_destroy=True)
    if a.sms:
        buf._low_latency.num_sms = a.sms
    x, idx, w = _inputs(me, a, dev)
    kw = dict(use_fp8=True, round_scale=a.round_scale, use_ue8m0=a.ue8m0)

    def dispatch():
        return buf.low_latency_dispatch(x, idx, M, E, **kw)

    recv_x, _, handle, _, _ = dispatch()
    g = torch.Generator().manual_seed(a.seed * 1000 + 500 + me)
    y = torch.randn(recv_x[0].shape, generator=g).to(torch.bfloat16).to(dev)   # the experts' outputs

    def combine():
        return buf.low_latency_combine(y, idx, w, handle)

    # correctness: the first call of each against the reference transport
    ref = Buffer(ctx.group, 0, nbytes, low_latency_mode=True, backend="reference", explicitly_destroy=True)
    want = reference_outputs(ref, x, idx, w, y, M, E, kw)
    ref.destroy()
    got = dispatch()
    wrong = check_dispatch(got, want)
    wrong_c = check_combine(buf.low_latency_combine(y, idx, w, got[2]), want)

    fig = {}
    checked = {}  # figure -> bytes that differ from the reference in its outputs after the timing
    it, wu = a.iters, a.warmup

    def timed(name, fn):
        fig[name] = reduce_times(bench_cuda(fn, warmup=wu, iters=it), ctx.group)["median_us"]

    # CUDA graphs: dispatch alone, combine alone; each replay's outputs checked after its timing
    g_d, out_d = _graph(dispatch)
    g_c, out_c = _graph(combine)
    timed("dispatch_graph", g_d.replay)
    torch.cuda.synchronize()
    checked["dispatch_graph"] = check_dispatch(out_d, want)
    timed("combine_graph", g_c.replay)
    torch.cuda.synchronize()
    checked["combine_graph"] = check_combine(out_c, want)
    traces = None
    if a.trace:  # one more replay of each, then where each launch spent its time, per CTA
        from commlib.backends.low_latency.nvlink import trace_summary
        ll = buf._low_latency
        grids = (ll.dispatch_grid(a.tokens, L), ll.combine_grid(M))
        mine = {}
        for kernel, (name, g) in enumerate((("dispatch", g_d), ("combine", g_c))):
            dist.barrier(group=ctx.group)
            torch.cuda.synchronize()
            g.replay()
            torch.cuda.synchronize()
            mine[name] = trace_summary(ll.state, kernel, grids[kernel])
            if name == "combine":  # CTAs [0, (R - 1) M) send the peers' partials, the rest this rank's own
                mine["combine: peers' items"] = trace_summary(ll.state, 1, grids[1], range(0, (R - 1) * M))
                mine["combine: own items"] = trace_summary(ll.state, 1, grids[1], range((R - 1) * M, R * M))
        traces = [None] * R
        dist.all_gather_object(traces, mine, group=ctx.group)
    last = {}
    timed("dispatch_eager", lambda: last.__setitem__("dispatch", dispatch()))
    torch.cuda.synchronize()
    checked["dispatch_eager"] = check_dispatch(last["dispatch"], want)
    timed("combine_eager", lambda: last.__setitem__("combine", combine()))
    torch.cuda.synchronize()
    checked["combine_eager"] = check_combine(last["combine"], want)

    # hooks: the send phase and the receive phase as two graphs, timed with events in between
    state = {}

    def send_d():
        r = buf.low_latency_dispatch(x, idx, M, E, return_recv_hook=True, **kw)
        state["d_hook"] = r[4]
        return r

    def send_c():
        r = buf.low_latency_combine(y, idx, w, handle, return_recv_hook=True)
        state["c_hook"] = r[2]
        return r

    graphs = {}
    for name, send in (("dispatch", send_d), ("combine", send_c)):
        key = name[0] + "_hook"
        send()                      # warm up both halves eagerly, then capture send, then the hook
        state[key]()
        g_send, out = _graph(send, warm=False)
        g_recv, _ = _graph(lambda: state[key](), warm=False)
        graphs[name] = (g_send, g_recv, out)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    for name, (send_g, recv_g, _) in graphs.items():
        for _ in range(wu):
            send_g.replay()
            recv_g.replay()
        ev = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(it)]
        torch.cuda.synchronize()
        for e0, e1, e2 in ev:
            flush.zero_()
            e0.record()
            send_g.replay()
            e1.record()
            recv_g.replay()
            e2.record()
        torch.cuda.synchronize()
        for key, pairs in ((f"{name}_send_hook", [(e0, e1) for e0, e1, _ in ev]),
                           (f"{name}_recv_hook", [(e1, e2) for _, e1, e2 in ev])):
            samples = [s.elapsed_time(t) * 1e3 for s, t in pairs]
            fig[key] = reduce_times(summarize(samples), ctx.group)["median_us"]
        # the last send + hook replay's outputs (one result for both figures of the pair)
        n_wrong = check_dispatch(graphs[name][2], want) if name == "dispatch" else check_combine(graphs[name][2], want)
        checked[f"{name}_send_hook"] = checked[f"{name}_recv_hook"] = n_wrong
    del flush

    # NCCL baseline: the same rows through all_to_all_single, splits known in advance
    dest = (idx // L)
    send_rows = torch.bincount(dest[idx >= 0].flatten(), minlength=R)
    everyone = [None] * R
    dist.all_gather_object(everyone, send_rows.tolist(), group=ctx.group)
    send_counts = everyone[me]
    recv_counts = [everyone[r][me] for r in range(R)]
    row_fp8 = H + H // 128 * 4
    d_send = torch.empty(sum(send_counts), row_fp8, dtype=torch.uint8, device=dev)
    d_recv = torch.empty(sum(recv_counts), row_fp8, dtype=torch.uint8, device=dev)
    c_send = torch.empty(sum(recv_counts), 2 * H, dtype=torch.uint8, device=dev)
    c_recv = torch.empty(sum(send_counts), 2 * H, dtype=torch.uint8, device=dev)

    def nccl_dispatch():
        dist.all_to_all_single(d_recv, d_send, recv_counts, send_counts, group=ctx.group)

    def nccl_combine():
        dist.all_to_all_single(c_recv, c_send, send_counts, recv_counts, group=ctx.group)

    timed("nccl_dispatch", nccl_dispatch)
    timed("nccl_combine", nccl_combine)
    buf.destroy()
    ops = list(fig)
    counts = results.reduce_wrong([checked.get(op) for op in ops] + [wrong, wrong_c], ctx.group)
    rows = [{"op": op, "time_us": fig[op], **results.checked_fields(n)} for op, n in zip(ops, counts)]
    wrong, wrong_c = counts[-2], counts[-1]
    return {"figures": fig, "rows": rows, "wrong_dispatch": wrong, "wrong_combine": wrong_c,
            "num_sms": int(buf._low_latency.num_sms) if buf._low_latency else None,
            "send_rows": send_counts, "recv_rows": recv_counts, "trace": traces}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=128, help="tokens per rank = num_max_dispatch_tokens_per_rank")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=288)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--sms", type=int, default=0, help="CTAs per launch (0: up to two per SM)")
    p.add_argument("--round-scale", action="store_true")
    p.add_argument("--ue8m0", action="store_true")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", nargs="?", const="auto", default=None, metavar="PATH",
                   help="a .json file, or a folder for the standard name (default: benchmarks/results/)")
    p.add_argument("--variant", default="", metavar="KEY=V,...",
                   help="kernel build variant (commlib.cuda.loader.DEFAULT_VARIANT keys, e.g. LL_PARTS=1) for A/B runs")
    p.add_argument("--trace", action="store_true",
                   help="build with the LL_TRACE kernel variant and print per-CTA time points of one graph replay")
    a = p.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.device_count() < a.ranks:
        print(f"[bench_low_latency] needs {a.ranks} GPUs; skipped")
        return 0
    from commlib.utils.launch import parallel_launch

    res = parallel_launch(a.ranks, _worker, a, use_gpu=True, timeout_s=600)
    fig = res["figures"]
    ratios = {"dispatch_nccl_over_graph": fig["nccl_dispatch"] / fig["dispatch_graph"],
              "combine_nccl_over_graph": fig["nccl_combine"] / fig["combine_graph"],
              "dispatch_deepep_over_graph": DEEPEP_2XH200_US["dispatch"] / fig["dispatch_graph"],
              "combine_deepep_over_graph": DEEPEP_2XH200_US["combine"] / fig["combine_graph"]}
    met = {k: fig[k] <= v for k, v in TARGETS_US.items()}
    print(f"# bench_low_latency: {a.ranks} ranks, {a.tokens} tokens/rank, hidden {a.hidden}, top-{a.topk} of "
          f"{a.experts} experts, FP8 dispatch (round_scale={a.round_scale}, ue8m0={a.ue8m0}), BF16 combine, "
          f"{res['num_sms']} CTAs")
    for r, tr in enumerate(res.get("trace") or []):
        for kernel, points in tr.items():
            print(f"# trace rank {r} {kernel} (us after the first CTA's start: min / median / max over CTAs)")
            for name, (lo, med, hi) in points.items():
                print(f"#   {name:>18} {lo:8.2f} {med:8.2f} {hi:8.2f}")
    print(f"# {'op':>20} {'time(us)':>10} {'target':>8} {'vs_nccl':>8} {'#wrong':>7}")
    by_op = {r["op"]: r for r in res["rows"]}
    for op, t in fig.items():
        target = TARGETS_US.get(op)
        base = {"dispatch_graph": "nccl_dispatch", "dispatch_eager": "nccl_dispatch",
                "combine_graph": "nccl_combine", "combine_eager": "nccl_combine"}.get(op)
        vs = f"{fig[base] / t:.2f}" if base else ""
        print(f"  {op:>20} {t:>10.1f} {(f'{target:.0f}' if target else ''):>8} {vs:>8} "
              f"{results.wrong_cell(by_op[op]):>7}")
    for k, ok in met.items():
        print(f"[target] {k} {fig[k]:.1f} us <= {TARGETS_US[k]:.0f} us: {'met' if ok else 'NOT met'}")
    first = [{"op": "first_dispatch", **results.checked_fields(res["wrong_dispatch"])},
             {"op": "first_combine", **results.checked_fields(res["wrong_combine"])}]
    wrong = results.total_wrong(res["rows"] + first)
    print(results.check_footer(res["rows"] + first))
    if a.json is not None:
        cmd = "python -m benchmarks.bench_low_latency " + " ".join(shlex.quote(v) for v in (argv or sys.argv[1:]))
        doc = B.result_document("bench_low_latency", cmd.strip(), res["rows"], world_size=a.ranks,
                                workload={"tokens": a.tokens, "hidden": a.hidden, "experts": a.experts,
                                          "topk": a.topk, "fp8": True, "round_scale": a.round_scale,
                                          "ue8m0": a.ue8m0},
                                figures_us=fig, targets_us=TARGETS_US, targets_met=met,
                                kernel_variant=a.variant or "default",
                                deepep_2xh200_us=DEEPEP_2XH200_US, num_sms=res["num_sms"],
                                wrong={"first_dispatch": res["wrong_dispatch"], "first_combine": res["wrong_combine"]},
                                ratios=ratios)
        print(f"# wrote {results.write_result(doc, a.json)}")
    print(f"[bench_low_latency] {'FAILED: %d bytes differ from the reference' % wrong if wrong else 'checked against the reference: #wrong 0'}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
