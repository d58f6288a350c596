"""``python -m commlib.bench``: the main job. Runs the V3 workload on local ranks, checks every
result, times commlib against the all-to-all baseline in the same process, prints one table.

What it does, in order, on every rank:
  1. builds a Buffer (backend from COMMLIB_BACKEND / auto) and, when that is a GPU engine, a
     second Buffer with backend="reference" (the executable specification);
  2. makes the V3 inputs (seeded per rank, so every rank can rebuild every other rank's inputs)
     and computes the expected outputs in one process with ``commlib.bench.oracle``, which shares
     no code with the library (routing, expert ids, per-expert counts, channel prefixes and the
     FP8 cast are its own);
  3. times each op (``timing.bench_cuda``: CUDA events, L2 flush, median) and checks the output of
     the last timed call bit for bit against the oracle (combine across several emulated nodes:
     within the bf16 rounding of the node partials) and, on GPU engines, against the reference;
  4. rank 0 prints an nccl-tests-style table: per op the slowest rank's median time, the mean
     per-rank bytes, algbw = bytes / time, busbw = algbw * (R - 1) / R, #wrong summed over ranks
     (all_reduce; ``N/A`` for a row nothing was compared with), and the speed-up over the baseline
     (baseline time / commlib time). The exit status is 1 when any compared row is wrong.

Ops (rows):  dispatch_bf16         get_dispatch_layout + dispatch (the full call a user waits for)
             dispatch_bf16_cached  dispatch with the handle reused (no layout, no count exchange;
                                   how DeepEP's published figures are measured)
             dispatch_fp8          full call, E4M3 rows + float scales per 128 channels
             combine               combine with topk_weights
             a2a_*                 baseline (``commlib.bench.baseline``): count exchange + permute +
                                   all_to_all_single (+ reverse + unpermute for combine)
Bytes: dispatch = rows received x row bytes (local rows included), combine = rows sent back.

The helpers below (workload, expectation, ``measure``, table, JSON) are shared with
``benchmarks.alltoall_perf`` and ``benchmarks.bench_internode``.
"""
from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from typing import Any, Optional

import torch
import torch.distributed as dist

from commlib.bench import baseline, oracle, results
from commlib.bench.results import device_info, git_commit, repo_root  # noqa: F401  (the benchmarks' imports)
from commlib.buffer import Buffer
from commlib import fp8 as fp8_cast  # a module attribute, so tests can plant a bug in the cast
from commlib.routing import group_limited_topk
from commlib.utils.launch import parallel_launch
from commlib.utils.timing import bench_cuda

# DeepEP's intranode figures on 2 x H200, 4096 tokens/rank, V3 shapes (logical GB/s, cached mode).
DEEPEP_2XH200_GBPS = {"dispatch_bf16": 339.0, "dispatch_fp8": 246.0, "combine": 287.0}

# op -> (family, element type, the baseline op it is compared with)
OPS: dict[str, tuple[str, str, Optional[str]]] = {
    "dispatch_bf16": ("commlib", "bf16", "a2a_dispatch_bf16"),
    "dispatch_bf16_cached": ("commlib", "bf16", "a2a_dispatch_bf16"),
    "dispatch_fp8": ("commlib", "fp8", "a2a_dispatch_fp8"),
    "combine": ("commlib", "bf16", "a2a_combine"),
    "a2a_dispatch_bf16": ("baseline", "bf16", None),
    "a2a_dispatch_fp8": ("baseline", "fp8", None),
    "a2a_combine": ("baseline", "bf16", None),
}


def tag(msg: str) -> None:
    print(f"[bench] {msg}", flush=True)


# ------------------------------------------------------------------------------ workload
@dataclasses.dataclass(frozen=True)
class Workload:
    num_tokens: int = 4096        # tokens per rank
    hidden: int = 7168
    num_experts: int = 256
    num_topk: int = 8
    num_groups: int = 8           # expert groups of the group-limited gate
    num_topk_groups: int = 4      # groups a token may use
    seed: int = 0

    def validate(self, num_ranks: int) -> None:
        if self.num_tokens < 0 or self.hidden <= 0 or self.hidden % 128:
            raise ValueError(f"hidden ({self.hidden}) must be a positive multiple of 128 and tokens "
                             f"({self.num_tokens}) >= 0")
        if self.num_experts % num_ranks:
            raise ValueError(f"experts ({self.num_experts}) must be divisible by the ranks ({num_ranks})")
        if self.num_experts % self.num_groups:
            raise ValueError(f"experts ({self.num_experts}) must be divisible by the groups ({self.num_groups})")
        per_group = self.num_experts // self.num_groups
        if not 0 < self.num_topk <= self.num_topk_groups * per_group:
            raise ValueError(f"top-k ({self.num_topk}) must fit in {self.num_topk_groups} groups of {per_group}")

    def with_tokens(self, num_tokens: int) -> "Workload":
        return dataclasses.replace(self, num_tokens=num_tokens)


def make_inputs(w: Workload, rank: int, device: torch.device) -> dict:
    """This rank's x [T, H] bf16, topk_idx [T, K] int64, topk_weights [T, K] float32 (deterministic)."""
    g_cpu = torch.Generator().manual_seed(w.seed * 100_003 + rank)
    scores = torch.rand(w.num_tokens, w.num_experts, generator=g_cpu, device="cpu", dtype=torch.float32)
    topk_idx, topk_weights = group_limited_topk(scores, w.num_groups, w.num_topk_groups, w.num_topk)
    if device.type == "cuda":  # generate the big tensor where it lives (same bits on every rank)
        g_dev = torch.Generator(device=device).manual_seed(w.seed * 100_003 + rank)
        x = torch.randn(w.num_tokens, w.hidden, generator=g_dev, device=device, dtype=torch.float32)
    else:
        x = torch.randn(w.num_tokens, w.hidden, generator=g_cpu, device="cpu", dtype=torch.float32)
    return {"x": x.to(torch.bfloat16).contiguous(), "topk_idx": topk_idx.to(device),
            "topk_weights": topk_weights.to(device)}


def expert_output(recv_x: torch.Tensor, rank: int) -> torch.Tensor:
    """What the "experts" on ``rank`` return for the rows they received: a rank-dependent scale,
    so a row summed from the wrong rank or in the wrong place shows up in the check."""
    return (recv_x.float() * (1.0 + rank / 8.0)).to(torch.bfloat16)


def expected(w: Workload, rank: int, num_ranks: int, device: torch.device, fp8: bool) -> dict:
    """What ``rank`` must receive (dispatch) and get back (combine), from every rank's inputs, by
    ``commlib.bench.oracle`` (no code shared with the library)."""
    ins = [make_inputs(w, s, device) for s in range(num_ranks)]
    xs = [i["x"] for i in ins]
    idxs = [i["topk_idx"] for i in ins]
    ws = [i["topk_weights"] for i in ins]
    E = w.num_experts
    mine = oracle.expected_dispatch(xs, idxs, ws, E, rank)
    exp: dict[str, Any] = {k: mine[k] for k in ("recv_x", "recv_topk_idx", "recv_topk_weights", "recv_src_idx",
                                               "rank_prefix_matrix")}
    exp["num_recv_tokens_per_expert_list"] = mine["tokens_per_expert"]
    exp["topk_idxs"] = idxs  # channel prefixes depend on the Buffer's channels: computed when checked
    if fp8:
        casts = [oracle.cast_fp8(x) for x in xs]
        exp["recv_x_fp8"] = oracle.gather([c[0] for c in casts], mine["tokens"])
        exp["recv_scales"] = oracle.gather([c[1] for c in casts], mine["tokens"])
    rows_by_rank, tokens_by_rank = [], []
    for r in range(num_ranks):
        toks = mine["tokens"] if r == rank else oracle.tokens_to(idxs, E, r)
        rows_by_rank.append(expert_output(oracle.gather(xs, toks), r))
        tokens_by_rank.append(toks)
    exp["combined_x"], exp["combined_sum_abs"] = oracle.combine(rows_by_rank, tokens_by_rank, rank, w.num_tokens)
    own = ins[rank]
    exp["combined_topk_weights"] = torch.where(own["topk_idx"] >= 0, own["topk_weights"],
                                               torch.zeros_like(own["topk_weights"]))
    exp["inputs"] = own
    exp["num_experts"] = E
    return exp


def _channel_prefixes(exp: dict, rank: int, num_channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(channel_prefix_matrix, recv_channel_prefix_matrix) the oracle expects for ``num_channels``."""
    cache = exp.setdefault("channel_prefixes", {})
    if num_channels not in cache:
        idxs = exp["topk_idxs"]
        R, E = len(idxs), exp["num_experts"]
        mats = [oracle.channel_prefix_matrix(i, E, R, num_channels) for i in idxs]
        cache[num_channels] = (mats[rank], torch.stack([m[rank] for m in mats]))
    return cache[num_channels]


def _list_wrong(got, want: list) -> int:
    if got is None or len(got) != len(want):
        return len(want)
    return sum(int(a != b) for a, b in zip(got, want))


# ------------------------------------------------------------------------------ one size, all ops
def buffer_bytes(hidden: int, num_ranks: int, ranks_per_node: int, num_nodes: int) -> tuple[int, int]:
    """(num_nvl_bytes, num_rdma_bytes) for BF16 rows of ``hidden`` with the default configs."""

    configs = (Buffer.get_dispatch_config(num_ranks), Buffer.get_combine_config(num_ranks))
    nvl = max(c.get_nvl_buffer_size_hint(hidden * 2, ranks_per_node) for c in configs)
    rdma = max(c.get_rdma_buffer_size_hint(hidden * 2, num_ranks) for c in configs) if num_nodes > 1 else 0
    return nvl, rdma


def measure(buf, ref, group, w: Workload, ops: list[str], iters: int, warmup: int, check: bool = True,
            flush_l2: bool = True) -> list[dict]:
    """Time and check ``ops`` for one workload on this rank. Returns per-rank rows (see ``gather``).

    buf: the Buffer under test; ref: a reference-backend Buffer to compare with, or None.
    check: compare each op's last timed output with the oracle (and ``ref``). Compared rows carry
    ``checked: True`` and ``wrong`` summed over every rank; with ``check=False`` rows carry
    ``checked: False`` and no count. Collective: every rank calls it with the same arguments.
    """
    rank, R = dist.get_rank(group), dist.get_world_size(group)
    device = buf.device if buf is not None else torch.device("cpu")
    num_nodes = buf.topology.num_nodes if buf is not None else 1
    fp8 = any(OPS[op][1] == "fp8" for op in ops)
    exp = expected(w, rank, R, device, fp8) if check else None
    inp = exp["inputs"] if check else make_inputs(w, rank, device)
    x, topk_idx, topk_weights = inp["x"], inp["topk_idx"], inp["topk_weights"]
    E, H = w.num_experts, w.hidden
    x_fp8 = fp8_cast.per_token_cast_to_fp8(x) if fp8 else None
    combine_rounding = 1 if num_nodes > 1 else 0  # node partials are cast to bf16 before the network

    def full_dispatch(b, xx):
        n_rank, _, n_expert, in_rank, _ = b.get_dispatch_layout(topk_idx, E)
        return b.dispatch(xx, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank,
                          num_tokens_per_expert=n_expert, topk_idx=topk_idx, topk_weights=topk_weights)

    # One untimed round of each family: the handle / state that cached dispatch and combine
    # reuse, the expert outputs combine sends back, and the rows this rank receives.
    handle = y_c = recv_w = state = y_b = None
    num_recv = {}
    if any(OPS[op][0] == "commlib" for op in ops):
        recv_x, _, recv_w, _, handle, _ = full_dispatch(buf, x)
        y_c = expert_output(recv_x, rank)
        num_recv["commlib"] = recv_x.shape[0]
    if any(OPS[op][0] == "baseline" for op in ops):
        recv_b, state = baseline.a2a_dispatch(x, topk_idx, E, group)
        y_b = expert_output(recv_b, rank)
        num_recv["baseline"] = recv_b.shape[0]

    fns = {
        "dispatch_bf16": lambda: full_dispatch(buf, x),
        "dispatch_bf16_cached": lambda: buf.dispatch(x, handle=handle),
        "dispatch_fp8": lambda: full_dispatch(buf, x_fp8),
        "combine": lambda: buf.combine(y_c, handle, topk_weights=recv_w),
        "a2a_dispatch_bf16": lambda: baseline.a2a_dispatch(x, topk_idx, E, group),
        "a2a_dispatch_fp8": lambda: baseline.a2a_dispatch(x_fp8, topk_idx, E, group),
        "a2a_combine": lambda: baseline.a2a_combine(y_b, state, group),
    }
    fp8_row_bytes = H + H // 128 * 4
    row_bytes = {"bf16": H * 2, "fp8": fp8_row_bytes}
    # rows the flat all-to-all sends to ranks of other nodes: one per (token, destination rank there);
    # its combine sends as many back (the same mean per rank)
    flat_net_rows = _flat_internode_rows(topk_idx, E, R, buf.topology) if num_nodes > 1 else 0

    rows, counts = [], []
    for op in ops:
        family, dtype, _ = OPS[op]
        last: dict[str, Any] = {}

        def run(fn=fns[op]):
            last["out"] = fn()

        stats = bench_cuda(run, warmup=warmup, iters=iters, flush_l2=flush_l2, device=device)
        wrong = check_op(op, last["out"], exp, rank, combine_rounding) if check else None
        ref_wrong = None
        if check and ref is not None and family == "commlib":
            ref_wrong = compare_with_reference(op, last["out"], ref, x, x_fp8, topk_idx, topk_weights, E,
                                               rank)
        counts += [wrong, ref_wrong]
        row = {"op": op, "type": dtype, "tokens": w.num_tokens, "rows": num_recv[family],
               "bytes": num_recv[family] * row_bytes[dtype], **{k: v for k, v in stats.items() if k != "samples"}}
        if num_nodes > 1:   # payload bytes this rank sent across node boundaries in one call
            net_rows = flat_net_rows if family == "baseline" else _engine_internode_rows(buf, fns[op])
            row["net_bytes"] = net_rows * row_bytes[dtype]
        rows.append(row)
    counts = results.reduce_wrong(counts, group)  # every rank's count, summed into the row
    for i, row in enumerate(rows):
        wrong, ref_wrong = counts[2 * i], counts[2 * i + 1]
        row.update(results.checked_fields(None if wrong is None else wrong + (ref_wrong or 0)))
        if ref_wrong is not None:
            row["wrong_vs_reference"] = ref_wrong
    return rows


def check_op(op: str, out, exp: dict, rank: int, combine_rounding: int) -> int:
    """Wrong elements of one op's output against the oracle: rows (FP8: bytes and scales), and for
    full dispatches the local expert ids, weights, tokens per expert, source indices and the
    handle's rank / channel prefix matrices; combine: values (within ``combine_rounding`` bf16
    roundings of node partials) and weights."""
    if op in ("a2a_dispatch_bf16", "a2a_dispatch_fp8"):
        recv, state = out
        wrong = _list_wrong(state.num_recv_tokens_per_expert, exp["num_recv_tokens_per_expert_list"])
        if op.endswith("fp8"):
            return wrong + baseline.count_wrong(recv[0], exp["recv_x_fp8"]) + \
                baseline.count_wrong(recv[1], exp["recv_scales"])
        return wrong + baseline.count_wrong(recv, exp["recv_x"])
    if op == "a2a_combine":
        return baseline.count_wrong(out, exp["combined_x"])  # one flat sum in rank order: exact
    if op == "combine":
        combined_x, combined_w, _ = out
        return (baseline.count_wrong_close(combined_x, exp["combined_x"], exp["combined_sum_abs"], combine_rounding)
                + baseline.count_wrong(combined_w, exp["combined_topk_weights"]))
    recv_x, recv_idx, recv_w, per_expert, _, _ = out
    if op == "dispatch_fp8":
        wrong = baseline.count_wrong(recv_x[0], exp["recv_x_fp8"]) + baseline.count_wrong(recv_x[1], exp["recv_scales"])
    else:
        wrong = baseline.count_wrong(recv_x, exp["recv_x"])
    if op != "dispatch_bf16_cached":  # cached mode returns no topk outputs
        wrong += baseline.count_wrong(recv_idx, exp["recv_topk_idx"])
        wrong += baseline.count_wrong(recv_w, exp["recv_topk_weights"])
        wrong += _list_wrong(per_expert, exp["num_recv_tokens_per_expert_list"])
        wrong += check_handle(out[4], exp, rank)
    return wrong


def check_handle(handle, exp: dict, rank: int) -> int:
    """Wrong elements of a dispatch handle's layout (DeepEP's positional fields) against the oracle."""
    if handle is None:
        return 1
    cpm, rcpm = _channel_prefixes(exp, rank, int(handle.channel_prefix_matrix.shape[1]))
    num_recv = exp["recv_src_idx"].shape[0]
    return (baseline.count_wrong(handle.rank_prefix_matrix, exp["rank_prefix_matrix"])
            + baseline.count_wrong(handle.channel_prefix_matrix, cpm)
            + baseline.count_wrong(handle.recv_channel_prefix_matrix, rcpm)
            + baseline.count_wrong(handle.recv_src_idx[:num_recv], exp["recv_src_idx"]))


def compare_with_reference(op, out, ref, x, x_fp8, topk_idx, topk_weights, E, rank) -> int:
    """Elements where a GPU engine differs from the reference backend (the contract is bit-exact)."""
    n_rank, _, n_expert, in_rank, _ = ref.get_dispatch_layout(topk_idx, E)
    xx = x_fp8 if op == "dispatch_fp8" else x
    r_x, r_idx, r_w, _, r_handle, _ = ref.dispatch(xx, num_tokens_per_rank=n_rank, is_token_in_rank=in_rank,
                                                   num_tokens_per_expert=n_expert, topk_idx=topk_idx,
                                                   topk_weights=topk_weights)
    if op == "combine":
        y = expert_output(r_x, rank)
        c_x, c_w, _ = ref.combine(y, r_handle, topk_weights=r_w)
        return baseline.count_wrong(out[0], c_x) + baseline.count_wrong(out[1], c_w)
    if op == "dispatch_fp8":
        return baseline.count_wrong(out[0][0], r_x[0]) + baseline.count_wrong(out[0][1], r_x[1])
    wrong = baseline.count_wrong(out[0], r_x)
    if op == "dispatch_bf16":
        wrong += baseline.count_wrong(out[1], r_idx) + baseline.count_wrong(out[2], r_w)
    return wrong


def _flat_internode_rows(topk_idx: torch.Tensor, num_experts: int, num_ranks: int, topology) -> int:
    """Rows the flat all-to-all sends from this rank to ranks of other nodes (one per token and rank)."""
    per_rank = num_experts // num_ranks
    ids = topk_idx.cpu()
    in_rank = torch.zeros(ids.shape[0], num_ranks, dtype=torch.bool, device="cpu")
    ok = ids >= 0
    rows = torch.arange(ids.shape[0], device="cpu").unsqueeze(1).expand_as(ids)
    in_rank[rows[ok], (ids[ok] // per_rank)] = True
    other = torch.tensor([topology.node_of(r) != topology.node for r in range(num_ranks)], device="cpu")
    return int(in_rank[:, other].sum())


def _engine_internode_rows(buf, fn) -> int:
    """Rows one more call of ``fn`` moved across node boundaries (the backend's row counters)."""
    before = buf.counters["internode_rows"]
    fn()
    return buf.counters["internode_rows"] - before


def gather(rows: list[dict], group=None) -> Optional[list[dict]]:
    """Combine per-rank rows on rank 0: slowest rank's times, mean bytes (#wrong is already summed
    over the ranks by ``measure``). Adds algbw / busbw (GB/s) and, for commlib rows, ``speedup`` =
    baseline time / commlib time."""
    R = dist.get_world_size(group)
    everyone: list = [None] * R
    dist.all_gather_object(everyone, rows, group=group)
    if dist.get_rank(group) != 0:
        return None
    out = []
    for i, row in enumerate(rows):
        per_rank = [everyone[r][i] for r in range(R)]
        agg = dict(row)
        for k in ("median_us", "mean_us", "min_us", "max_us"):
            agg[k] = max(p[k] for p in per_rank)
        agg["bytes"] = sum(p["bytes"] for p in per_rank) / R
        agg["rows"] = sum(p["rows"] for p in per_rank) / R
        if "net_bytes" in row:
            agg["net_bytes"] = sum(p["net_bytes"] for p in per_rank) / R
        agg["time_us"] = agg["median_us"]
        agg["algbw_gbps"] = agg["bytes"] / agg["time_us"] / 1e3 if agg["time_us"] > 0 else 0.0
        agg["busbw_gbps"] = agg["algbw_gbps"] * (R - 1) / R
        out.append(agg)
    by_op = {r["op"]: r for r in out}
    for r in out:
        base = OPS[r["op"]][2]
        if base in by_op and r["time_us"] > 0:
            r["baseline_op"] = base
            r["speedup"] = by_op[base]["time_us"] / r["time_us"]
    return out


# ------------------------------------------------------------------------------ output
def nccl_table(rows: list[dict], columns: list[tuple[str, str, str, int, str]],
               footer_rows: Optional[list[dict]] = None) -> list[str]:
    """nccl-tests layout: a '#' header, a '#' units row, one line per row, 'Avg bus bandwidth'.

    columns: (header, unit, key, width, format) with format a str.format spec ('' = str(),
    'bw' = bandwidth: 2 decimals, 4 below 1 GB/s).
    The footer averages busbw over ``footer_rows`` (default: all rows).
    """
    def line(cells):
        return "".join(f"{c:>{wd}}" for c, (_, _, _, wd, _) in zip(cells, columns))

    head = line([h for h, *_ in columns])
    units = line([u for _, u, *_ in columns])
    lines = ["#" + head[1:], "#" + units[1:]]
    for r in rows:
        cells = []
        for _, _, key, _, fmt in columns:
            v = r.get(key, "")
            if key == "wrong":  # the count of a compared row, N/A for one nothing was compared with
                cells.append(results.wrong_cell(r))
            elif fmt == "bw" and isinstance(v, (int, float)):  # GB/s: 2 decimals, more below 1 (CPU runs)
                cells.append(format(v, ".2f" if v >= 1 else ".4f"))
            else:
                cells.append(format(v, fmt) if fmt and isinstance(v, (int, float)) else str(v))
        lines.append(line(cells))
    footer_rows = rows if footer_rows is None else footer_rows
    avg = sum(r["busbw_gbps"] for r in footer_rows) / len(footer_rows) if footer_rows else 0.0
    lines.append(results.check_footer(rows))
    lines.append(f"# Avg bus bandwidth    : {avg:.4g}")
    return lines


BENCH_COLUMNS = [
    ("op", "", "op", 22, ""),
    ("tokens", "", "tokens", 8, "d"),
    ("bytes", "(B)", "bytes", 13, ".0f"),
    ("time", "(us)", "time_us", 11, ".1f"),
    ("algbw", "(GB/s)", "algbw_gbps", 9, "bw"),
    ("busbw", "(GB/s)", "busbw_gbps", 9, "bw"),
    ("#wrong", "", "wrong", 8, ""),
    ("vs_a2a", "(x)", "speedup", 9, ".2f"),
]


NET_COLUMN = ("net_bytes", "(B)", "net_bytes", 13, ".0f")   # several nodes: bytes across node boundaries


def net_bytes_summary(rows: list[dict]) -> str:
    """Per commlib op, its cross-node bytes against the flat all-to-all's (the baseline op's)."""
    by_op = {r["op"]: r for r in rows}
    parts = []
    for r in rows:
        base = by_op.get(OPS[r["op"]][2])
        if OPS[r["op"]][0] == "commlib" and base is not None and "net_bytes" in r and base.get("net_bytes"):
            parts.append(f"{r['op']} {r['net_bytes']:.0f} vs all_to_all {base['net_bytes']:.0f} "
                         f"({r['net_bytes'] / base['net_bytes']:.2f}x)")
    return ", ".join(parts) or "none"


def result_document(tool: str, command: str, rows: list[dict], **extra) -> dict:
    """``results.result_document`` with DeepEP's published figures beside the rows."""
    return results.result_document(tool, command, rows, **extra, deepep_2xh200_gbps=DEEPEP_2XH200_GBPS)


# ------------------------------------------------------------------------------ the main job
def _worker(ctx, w: Workload, ops: list[str], iters: int, warmup: int, backend: Optional[str]) -> dict:

    R = ctx.world_size
    nvl, rdma = buffer_bytes(w.hidden, R, ctx.ranks_per_node, R // ctx.ranks_per_node)
    buf = Buffer(ctx.group, nvl, rdma, backend=backend, ranks_per_node=ctx.ranks_per_node)
    ref = None
    if buf.backend_name != "reference":
        ref = Buffer(ctx.group, nvl, rdma, backend="reference", ranks_per_node=ctx.ranks_per_node)
    rows = measure(buf, ref, ctx.group, w, ops, iters, warmup)
    table = gather(rows, ctx.group)
    info = {"backend": buf.backend_name, "reference_checked": ref is not None,
            "buffer_device": str(buf.device), "process_group": dist.get_backend(ctx.group),
            "num_nodes": buf.topology.num_nodes, "ranks_per_node": buf.topology.ranks_per_node}
    return {"rows": table, "info": info}


def parse_args(argv=None) -> argparse.Namespace:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    p = argparse.ArgumentParser(prog="python -m commlib.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    # GPU: the V3 workload; CPU: scaled down so 4 ranks on 2 cores finish in well under 2 minutes.
    p.add_argument("--tokens", type=int, default=4096 if gpus else 256, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=7168 if gpus else 1024)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--groups", type=int, default=8, help="expert groups of the group-limited gate")
    p.add_argument("--topk-groups", type=int, default=4, help="groups a token may use")
    p.add_argument("--ranks", type=int, default=gpus or 4, help="local ranks (default: one per GPU, or 4 on CPU)")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="ranks per (emulated) node (default: all ranks on GPU, 2 on CPU)")
    p.add_argument("--iters", type=int, default=20 if gpus else 10)
    p.add_argument("--warmup", type=int, default=5 if gpus else 2)
    p.add_argument("--fp8", action=argparse.BooleanOptionalAction, default=True, help="FP8 dispatch rows")
    p.add_argument("--backend", default=None, help="auto | reference | nvlink (default: COMMLIB_BACKEND)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", nargs="?", const="auto", default=None, metavar="PATH",
                   help="write results as JSON: a .json file, or a folder for the standard name "
                        "(default: benchmarks/results/bench_main_<gpu>x<n>_<yyyymmdd>_<commit>.json)")
    args = p.parse_args(argv)
    args.use_gpu = bool(gpus)
    if args.ranks_per_node is None:
        args.ranks_per_node = args.ranks if args.use_gpu else min(2, args.ranks)
    return args


def main(argv=None) -> int:

    args = parse_args(argv)
    w = Workload(args.tokens, args.hidden, args.experts, args.topk, args.groups, args.topk_groups, args.seed)
    w.validate(args.ranks)
    if args.ranks % args.ranks_per_node:
        raise SystemExit(f"--ranks-per-node ({args.ranks_per_node}) must divide --ranks ({args.ranks})")
    ops = ["dispatch_bf16", "dispatch_bf16_cached", "dispatch_fp8", "combine",
           "a2a_dispatch_bf16", "a2a_dispatch_fp8", "a2a_combine"]
    if not args.fp8:
        ops = [op for op in ops if OPS[op][1] != "fp8"]
    nodes = args.ranks // args.ranks_per_node
    tag(f"workload: {w.num_tokens} tokens/rank, hidden {w.hidden}, top-{w.num_topk} of {w.num_experts} experts, "
        f"group-limited {w.num_topk_groups}/{w.num_groups} groups")
    tag(f"ranks: {args.ranks} ({nodes} node{'s' if nodes > 1 else ''} x {args.ranks_per_node}), "
        f"{'GPU' if args.use_gpu else 'CPU'}, {args.iters} iters + {args.warmup} warm-ups")
    result = parallel_launch(args.ranks, _worker, w, ops, args.iters, args.warmup, args.backend,
                             ranks_per_node=args.ranks_per_node, use_gpu=args.use_gpu)
    rows, info = result["rows"], result["info"]
    tag(f"backend: {info['backend']} on {info['buffer_device']} ({info['process_group']}); checked against the "
        f"oracle{' and the reference backend' if info['reference_checked'] else ''}")
    print("#")
    print(f"# busbw = algbw x (n-1)/n, n = {args.ranks}; time = slowest rank's median; bytes = mean per rank")
    commlib_rows = [r for r in rows if OPS[r["op"]][0] == "commlib"]
    columns = BENCH_COLUMNS + ([NET_COLUMN] if nodes > 1 else [])
    for line in nccl_table(rows, columns, footer_rows=commlib_rows):
        print(line)
    if nodes > 1:
        tag("net_bytes: payload bytes a rank sends across node boundaries per call (mean per rank): "
            + net_bytes_summary(rows))
    speedups = ", ".join(f"{r['op']} {r['speedup']:.2f}x" for r in commlib_rows if "speedup" in r)
    tag(f"vs all_to_all_single baseline (baseline time / commlib time): {speedups}")
    if args.json is not None:
        command = "python -m commlib.bench " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
        doc = result_document("commlib.bench", command.strip(), rows, workload=dataclasses.asdict(w),
                              world_size=args.ranks, **info)
        tag(f"wrote {results.write_result(doc, args.json, name='bench_main')}")
    unchecked = [r["op"] for r in rows if not r.get("checked")]
    if results.exit_status(rows):
        tag(f"FAILED: {results.total_wrong(rows)} wrong elements")
        return 1
    if unchecked:
        tag(f"not checked: {', '.join(unchecked)}; the other rows: #wrong 0")
        return 0
    tag("all results verified: #wrong 0 passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
