"""Predict internode dispatch / combine for EP16 .. EP256 from the V3 routing's traffic matrix.

    python -m experiments.model_internode [--tokens 4096] [--sample 1024] [--json [PATH]]

For each EP size (8 GPUs per node) it samples DeepSeek-V3 routing (256 experts, top-8, node-limited:
experts grouped by node, at most 4 nodes per token) and counts, per GPU, the rows that must leave
it over the network and over NVLink under two schemes:
  flat          a token goes to every destination *rank* directly (one all-to-all over the network:
                a rank in another node costs one network row per rank);
  hierarchical  commlib's: one network row per destination *node* (to the GPU with the same local
                rank there), then NVLink fan-out inside that node; combine reverses it, reducing
                inside the node before one row per node crosses back.
Time per leg = busiest GPU's bytes / (link bandwidth x efficiency); the legs overlap when the network
hop is pipelined in chunks, so a call takes max(legs) + a fixed latency. Reported "RDMA GB/s" is
network bytes / time, DeepEP's definition, set beside DeepEP's published H800 figures.

Calibration: the NVLink leg runs at min(95% of the link, the NVLink GB/s commlib's NVLink engine
measured on 2 x H200 in kernel time, from benchmarks/results/bench_intranode_*.json). The network efficiency and latency cannot be measured on
one machine: the defaults (0.85, 25 us) are assumptions, shown in the output, and every figure
scales with them.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import sys

import torch

from commlib.routing import group_limited_topk

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout: benchmarks/results lives there

# DeepEP's README, internode normal kernels on H800 (NVLink ~160 GB/s, CX7 IB 400 Gb/s = 50 GB/s per GPU):
# RDMA bandwidth of dispatch (FP8) / combine (BF16) at EP16, EP32, EP64.
DEEPEP_H800 = {16: (43, 43), 32: (58, 57), 64: (51, 50)}
MACHINES = {
    "H800": {"nvlink_gbps": 160.0, "ib_gbps": 50.0},
    "H200": {"nvlink_gbps": 400.0, "ib_gbps": 50.0},
}
SM_PUSH_GBPS_H200 = 330.0  # measured: 20 SMs push ~330 GB/s per direction into the peer (docs/launch.md)


def nvlink_engine_gbps() -> tuple[float, str]:
    """commlib's NVLink engine: measured kernel NVLink GB/s per direction on 2 x H200 (V3, 20 SMs)."""
    files = sorted(glob.glob(os.path.join(ROOT, "benchmarks", "results", "bench_intranode_*.json")))
    best = None  # (date, GB/s, file): the newest run's default row; A/B runs at other SM counts do not count
    for f in files:
        try:
            with open(f) as fh:
                doc = json.load(fh)
            # when it ran, as yyyymmddHHMMSS: "date" (older files) or the ISO "timestamp"
            rows, date = doc["rows"], "".join(ch for ch in str(doc.get("date") or doc.get("timestamp", "")) if ch.isdigit())[:14]
        except (OSError, ValueError, KeyError):
            continue
        for r in rows:
            if r.get("tokens") == 4096 and r.get("op") == "dispatch_bf16" and r.get("nvlbw_kernel") \
                    and r.get("tag", "main") == "main" and r.get("num_sms", 20) == 20 \
                    and (best is None or date >= best[0]):
                best = (date, r["nvlbw_kernel"], os.path.basename(f))
    if best is None:
        return 0.7 * SM_PUSH_GBPS_H200, "assumed (no bench_intranode JSON found)"
    return best[1], f"measured in {best[2]}"


def traffic(num_ranks: int, ranks_per_node: int, tokens: int, sample: int, experts: int, topk: int,
            max_nodes: int, seed: int) -> dict:
    """Rows per GPU (busiest GPU and mean) for each leg, from sampled routing, scaled to ``tokens``."""
    g = torch.Generator().manual_seed(seed)
    nodes = num_ranks // ranks_per_node
    per_rank = experts // num_ranks
    # V3's gate: 8 groups, top-4 groups; with more than 8 nodes, one group per node (node-limited)
    groups = max(8, nodes)
    topk_groups = min(max_nodes, groups)
    flat_net = torch.zeros(num_ranks)        # rows a GPU sends to ranks in other nodes (flat all-to-all)
    hier_net = torch.zeros(num_ranks)        # rows a GPU sends to other nodes (once per node)
    hier_nvl_in = torch.zeros(num_ranks)     # rows a forwarder fans out to other GPUs of its node
    hier_nvl_local = torch.zeros(num_ranks)  # rows of a GPU's own tokens to other GPUs of its node
    max_nodes_seen = 0
    for src in range(num_ranks):
        scores = torch.sigmoid(torch.randn(sample, experts, generator=g))
        idx, _ = group_limited_topk(scores, groups, topk_groups, topk)
        dest = torch.zeros(sample, num_ranks, dtype=torch.bool)
        dest.scatter_(1, idx // per_rank, True)
        dest_nodes = dest.view(sample, nodes, ranks_per_node).any(2)
        max_nodes_seen = max(max_nodes_seen, int(dest_nodes.sum(1).max()))
        home = src // ranks_per_node
        local = src % ranks_per_node
        other = torch.ones(nodes, dtype=torch.bool)
        other[home] = False
        flat_net[src] += dest.view(sample, nodes, ranks_per_node)[:, other].sum()
        hier_net[src] += dest_nodes[:, other].sum()
        # fan-out: the forwarder in node m (same local rank) sends to the node's other GPUs
        for m in range(nodes):
            fan = dest[:, m * ranks_per_node:(m + 1) * ranks_per_node].clone()
            fan[:, local] = False
            if m == home:
                hier_nvl_local[src] += fan.sum()
            else:
                hier_nvl_in[m * ranks_per_node + local] += fan.sum()
    scale = tokens / sample
    nvl = hier_nvl_in + hier_nvl_local
    return {
        "nodes": nodes, "max_nodes_per_token": max_nodes_seen,
        "flat_net_rows": float(flat_net.max() * scale), "hier_net_rows": float(hier_net.max() * scale),
        "hier_nvl_rows": float(nvl.max() * scale),
        "flat_net_rows_mean": float(flat_net.mean() * scale), "hier_net_rows_mean": float(hier_net.mean() * scale),
    }


def chunk_cost_from_bench(path: str) -> float:
    """Per-chunk cost (us) measured by benchmarks.bench_internode's K sweep: the least-squares slope of a
    cached dispatch's host time over the chunks K it used (the engine's per-chunk overhead on the host)."""
    with open(path) as f:
        rows = [r for r in json.load(f)["rows"] if r.get("op") == "dispatch_bf16_cached" and r.get("chunks")]
    pts = sorted({(r["chunks"], r["host_us"]) for r in rows})
    if len({k for k, _ in pts}) < 2:
        raise SystemExit(f"{path}: needs cached-dispatch rows at two chunk counts or more (bench_internode --chunks)")
    n = len(pts)
    mk, mh = sum(k for k, _ in pts) / n, sum(h for _, h in pts) / n
    return sum((k - mk) * (h - mh) for k, h in pts) / sum((k - mk) ** 2 for k, _ in pts)


def predict(t: dict, machine: dict, row_bytes: float, nvl_engine_gbps: float, net_eff: float,
            latency_us: float, chunk_cost_us: float = 0.0, max_chunks: int = 1) -> dict:
    """NVLink leg (the forwarder) at min(95% of the link, ``nvl_engine_gbps``); network leg at the link
    rate x the assumed efficiency. In K chunks the legs overlap but for one chunk of the shorter
    one, and each chunk costs ``chunk_cost_us``: the best K <= max_chunks is reported."""
    net_bw = machine["ib_gbps"] * net_eff
    nvl_bw = min(machine["nvlink_gbps"] * 0.95, nvl_engine_gbps)
    net_us = t["hier_net_rows"] * row_bytes / net_bw / 1e3
    nvl_us = t["hier_nvl_rows"] * row_bytes / nvl_bw / 1e3

    def total(k: int) -> float:
        return max(net_us, nvl_us) + min(net_us, nvl_us) / k + k * chunk_cost_us + latency_us
    best_k = min(range(1, max_chunks + 1), key=total)
    time_us = total(best_k)
    flat_us = t["flat_net_rows"] * row_bytes / net_bw / 1e3 + latency_us
    return {"time_us": time_us, "net_us": net_us, "nvl_us": nvl_us, "bound": "network" if net_us >= nvl_us else "nvlink",
            "chunks": best_k, "rdma_gbps": t["hier_net_rows"] * row_bytes / time_us / 1e3, "flat_time_us": flat_us,
            "speedup_vs_flat": flat_us / time_us}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--sample", type=int, default=1024, help="tokens sampled per rank (counts are scaled)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--max-nodes", type=int, default=4)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--ep", default="16,32,64,128,256")
    p.add_argument("--net-efficiency", type=float, default=0.85, help="assumed: achieved / line rate of IB")
    p.add_argument("--latency-us", type=float, default=25.0, help="assumed fixed cost of a call")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk-cost-us", type=float, default=None,
                   help="fixed cost of one network chunk (default: --from-bench's measured slope, else 0)")
    p.add_argument("--from-bench", default=None, metavar="JSON",
                   help="a bench_internode K sweep: its per-chunk host cost becomes --chunk-cost-us")
    p.add_argument("--forwarder-gbps", type=float, default=None,
                   help="the fan-out's rate (default: commlib's NVLink engine, measured)")
    p.add_argument("--max-chunks", type=int, default=8, help="the most chunks a call may use (the best K is shown)")
    p.add_argument("--json", nargs="?", const="auto", default=None)
    a = p.parse_args(argv)
    nvl_gbps, nvl_src = nvlink_engine_gbps()
    if a.forwarder_gbps is not None:
        nvl_gbps, nvl_src = a.forwarder_gbps, "(--forwarder-gbps)"
    chunk_cost = a.chunk_cost_us
    if chunk_cost is None:
        chunk_cost = chunk_cost_from_bench(a.from_bench) if a.from_bench else 0.0
    print(f"# per-chunk cost {chunk_cost:.1f} us" + (f" (measured: {a.from_bench})" if a.from_bench and
                                                      a.chunk_cost_us is None else " (given)"))
    bf16_row = a.hidden * 2
    fp8_row = a.hidden + a.hidden // 128 * 4
    print(f"# model_internode: V3 routing ({a.experts} experts, top-{a.topk}, <= {a.max_nodes} nodes/token), "
          f"{a.tokens} tokens/rank, {a.ranks_per_node} GPUs/node")
    print(f"# NVLink leg: min(95% of the link, {nvl_gbps:.0f} GB/s, commlib's NVLink engine {nvl_src}); "
          f"network: {a.net_efficiency:.2f} of line rate (assumed); latency {a.latency_us:.0f} us (assumed)")
    print("#   EP nodes  net rows  net rows  saving |  machine  op        time   net    nvl  bound   K     RDMA   vs flat  DeepEP")
    print("#              (flat)    (hier)         |                   (us)   (us)   (us)                (GB/s)   (x)    (GB/s)")
    rows = []
    for ep in [int(v) for v in a.ep.split(",")]:
        t = traffic(ep, a.ranks_per_node, a.tokens, a.sample, a.experts, a.topk, a.max_nodes, a.seed + ep)
        saving = t["flat_net_rows"] / max(t["hier_net_rows"], 1e-9)
        for mname, machine in MACHINES.items():
            for op, row_bytes in (("dispatch", fp8_row), ("combine", bf16_row)):
                pr = predict(t, machine, row_bytes, nvl_gbps, a.net_efficiency, a.latency_us, chunk_cost,
                             a.max_chunks)
                deepep = DEEPEP_H800.get(ep, (None, None))[0 if op == "dispatch" else 1] if mname == "H800" else None
                rows.append({"ep": ep, "machine": mname, "op": op, "row_bytes": row_bytes, **t, "net_saving": saving,
                             **pr, "deepep_h800_rdma_gbps": deepep})
                print(f"  {ep:>4} {t['nodes']:>5} {t['flat_net_rows']:>9.0f} {t['hier_net_rows']:>9.0f} {saving:>6.2f}x |"
                      f"  {mname:>6}  {op:<8} {pr['time_us']:>6.0f} {pr['net_us']:>6.0f} {pr['nvl_us']:>6.0f}"
                      f"  {pr['bound']:<7} K={pr['chunks']:<2} {pr['rdma_gbps']:>6.1f}  {pr['speedup_vs_flat']:>5.2f}"
                      f"  {deepep if deepep is not None else '-':>6}")
    print("# net rows: rows the busiest GPU sends over the network per call; saving = flat / hierarchical")
    print("# DeepEP's published RDMA GB/s (H800) exceed 0.85 x 50 GB/s at EP32/64: their figure counts bytes the")
    print("# way their test does; read the RDMA column as a ratio to the line rate, the time column as the claim")
    if a.json is not None:
        path = a.json if a.json != "auto" else os.path.join(
            ROOT, "benchmarks", "results", f"model_internode_{datetime.date.today():%Y%m%d}.json")
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        doc = {"tool": "experiments.model_internode", "command": " ".join(["python"] + sys.argv),
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "assumptions": {"net_efficiency": a.net_efficiency, "latency_us": a.latency_us,
                               "chunk_cost_us": chunk_cost, "max_chunks": a.max_chunks,
                               "nvlink_engine_gbps": nvl_gbps, "nvlink_engine_source": nvl_src,
                               "machines": MACHINES},
               "rows": rows}
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"# wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
