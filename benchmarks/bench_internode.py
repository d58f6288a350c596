"""Internode benchmark: the hierarchical engine on emulated nodes, network and NVLink GB/s.

    python -m benchmarks.bench_internode [--ranks 2 --ranks-per-node 1] [--tokens 4096] [--json [PATH]]

Runs commlib.bench.main's checked workload (V3 on GPUs, scaled down on CPUs) with
``backend="hierarchical"`` and, from the Buffer's row counters, reports per op and rank:
  network GB/s  rows that crossed between (emulated) nodes x row bytes / time;
  NVLink GB/s   rows moved between two ranks of one node x row bytes / time.
On one machine the "network" is not InfiniBand: 2 GPUs as 2 nodes x 1 send the network hop over
NVLink (NCCL), and CPU ranks over loopback (gloo). The figures show the engine's data path and
its once-per-node traffic, not IB performance; experiments/model_internode.py predicts that.
Every row (the hierarchical engine's, the flat baseline's, the reference backend's) is checked
against commlib.bench.oracle, #wrong summed over the ranks; exit status 1 when any is wrong.
"""
from __future__ import annotations

import argparse
import shlex
import sys

import torch
import torch.distributed as dist

from commlib.bench import main as B
from commlib.bench import results

OPS = ["dispatch_bf16", "dispatch_bf16_cached", "dispatch_fp8", "combine"]
BASELINE_OPS = ["a2a_dispatch_bf16", "a2a_combine"]  # flat all_to_all_single over every rank, same run


def _row_bytes(op: str, hidden: int) -> int:
    return hidden + hidden // 128 * 4 if op == "dispatch_fp8" else hidden * 2


def _worker(ctx, w, iters: int, warmup: int):
    from commlib.buffer import Buffer
    from commlib.fp8 import per_token_cast_to_fp8

    R = ctx.world_size
    nvl, rdma = B.buffer_bytes(w.hidden, R, ctx.ranks_per_node, R // ctx.ranks_per_node)
    buf = Buffer(ctx.group, nvl, rdma, backend="hierarchical", ranks_per_node=ctx.ranks_per_node)
    ref = Buffer(ctx.group, nvl, rdma, backend="reference", ranks_per_node=ctx.ranks_per_node)
    rows = B.measure(buf, ref, ctx.group, w, OPS + BASELINE_OPS, iters, warmup)
    # the reference backend (same algorithm, torch collectives for both hops) timed in the same run,
    # its outputs checked against the oracle like every other row
    ref_table = B.gather(B.measure(ref, None, ctx.group, w, OPS, iters, warmup), ctx.group)
    # rows per call that crossed nodes / moved inside a node: counter deltas over one call of each op
    inp = B.make_inputs(w, ctx.rank, buf.device)
    x, idx, wts = inp["x"], inp["topk_idx"], inp["topk_weights"]
    ntr, _, nte, tir, _ = buf.get_dispatch_layout(idx, w.num_experts)

    def dispatch(xx):
        return buf.dispatch(xx, num_tokens_per_rank=ntr, is_token_in_rank=tir, num_tokens_per_expert=nte,
                            topk_idx=idx, topk_weights=wts)
    recv_x, _, recv_w, _, handle, _ = dispatch(x)
    y = B.expert_output(recv_x, ctx.rank)
    calls = {"dispatch_bf16": lambda: dispatch(x), "dispatch_bf16_cached": lambda: buf.dispatch(x, handle=handle),
             "dispatch_fp8": lambda: dispatch(per_token_cast_to_fp8(x)),
             "combine": lambda: buf.combine(y, handle, topk_weights=recv_w)}
    for r in rows:
        if r["op"] not in calls:
            r["net_rows"] = r["nvl_rows"] = 0.0  # not counted: the flat baseline has no node hops
            continue
        before = buf.counters
        calls[r["op"]]()
        after = buf.counters
        moved = torch.tensor([after["internode_rows"] - before["internode_rows"],
                              after["intranode_rows"] - before["intranode_rows"]], dtype=torch.float64)
        everyone = [None] * R
        dist.all_gather_object(everyone, moved.tolist(), group=ctx.group)
        r["net_rows"] = sum(e[0] for e in everyone) / R  # mean rows per rank
        r["nvl_rows"] = sum(e[1] for e in everyone) / R
    table = B.gather(rows, ctx.group)
    if table is not None:
        for r in ref_table:
            r.update(op="reference_" + r["op"], net_rows=0.0, nvl_rows=0.0)
        table += ref_table
    info = {"backend": buf.backend_name, "buffer_device": str(buf.device), "process_group": dist.get_backend(ctx.group),
            "num_nodes": buf.topology.num_nodes, "ranks_per_node": buf.topology.ranks_per_node}
    buf.destroy()
    ref.destroy()
    return {"rows": table, "info": info}


def main(argv=None) -> int:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096 if gpus else 128)
    p.add_argument("--hidden", type=int, default=7168 if gpus else 512)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--topk-groups", type=int, default=4)
    p.add_argument("--ranks", type=int, default=gpus if gpus >= 2 else 4)
    p.add_argument("--ranks-per-node", type=int, default=1 if gpus >= 2 else 2)
    p.add_argument("--iters", type=int, default=20 if gpus else 3)
    p.add_argument("--warmup", type=int, default=5 if gpus else 1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", nargs="?", const="auto", default=None, metavar="PATH",
                   help="a .json file, or a folder for the standard name (default: benchmarks/results/)")
    a = p.parse_args(argv)
    from commlib.utils.launch import parallel_launch

    if a.ranks % a.ranks_per_node or a.ranks // a.ranks_per_node < 2:
        raise SystemExit("--ranks must be a multiple of --ranks-per-node with at least 2 nodes")
    w = B.Workload(a.tokens, a.hidden, a.experts, a.topk, a.groups, a.topk_groups, a.seed)
    w.validate(a.ranks)
    res = parallel_launch(a.ranks, _worker, w, a.iters, a.warmup, ranks_per_node=a.ranks_per_node,
                          use_gpu=bool(gpus))
    rows, info = res["rows"], res["info"]
    nodes = a.ranks // a.ranks_per_node
    link = "NVLink via NCCL" if gpus else "loopback via gloo"
    print(f"# bench_internode: {nodes} emulated nodes x {a.ranks_per_node}, backend {info['backend']} on "
          f"{info['buffer_device']}; the 'network' here is {link}, not InfiniBand")
    print(f"# {'op':>30} {'tokens':>7} {'time(us)':>10} {'algbw':>8} {'net rows':>9} {'net GB/s':>9} "
          f"{'nvl rows':>9} {'nvl GB/s':>9} {'#wrong':>7}")
    for r in rows:
        rb = _row_bytes(r["op"], a.hidden)
        t = r["time_us"]
        r["net_gbps"] = r["net_rows"] * rb / t / 1e3 if t else 0.0
        r["nvl_gbps"] = r["nvl_rows"] * rb / t / 1e3 if t else 0.0
        print(f"  {r['op']:>30} {r['tokens']:>7} {t:>10.1f} {r['algbw_gbps']:>8.2f} {r['net_rows']:>9.0f} "
              f"{r['net_gbps']:>9.2f} {r['nvl_rows']:>9.0f} {r['nvl_gbps']:>9.2f} {results.wrong_cell(r):>7}")
    print(results.check_footer(rows))
    if a.json is not None:
        cmd = "python -m benchmarks.bench_internode " + " ".join(shlex.quote(v) for v in (argv or sys.argv[1:]))
        doc = B.result_document("bench_internode", cmd.strip(), rows, world_size=a.ranks,
                                network_is=link, **info)
        print(f"# wrote {results.write_result(doc, a.json)}")
    wrong = results.total_wrong(rows)
    unchecked = [r["op"] for r in rows if not r.get("checked")]
    verdict = (f"FAILED: {wrong} wrong elements" if wrong else
               f"not checked: {', '.join(unchecked)}; the other rows: #wrong 0" if unchecked else
               "all results verified: #wrong 0")
    print(f"[bench_internode] {verdict}")
    return results.exit_status(rows)


if __name__ == "__main__":
    sys.exit(main())
