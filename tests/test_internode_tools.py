"""The internode model: node-limited routing, once-per-node saves network rows, output is JSON; and
the pure helpers of the other model-side benchmark tools (the comm trace split, the direct NCCL
binding's unique id)."""
import json

import pytest
import torch

from benchmarks import bench_internode
from experiments import bench_comm_interference
from experiments import model_internode as M
from experiments.host_cost import nccl_direct
from commlib.utils.errors import CommlibError


def test_traffic_once_per_node_and_node_limit():
    for ep in (16, 64, 128):
        t = M.traffic(ep, 8, tokens=512, sample=64, experts=256, topk=8, max_nodes=4, seed=ep)
        assert t["max_nodes_per_token"] <= 4
        assert t["hier_net_rows"] <= t["flat_net_rows"]
        # one network row per (token, other node it needs): at most 4 (the home node need not be one)
        assert t["hier_net_rows"] <= 512 * 4 + 1e-6


def test_main_writes_json(tmp_path):
    out = tmp_path / "model.json"
    assert M.main(["--sample", "32", "--ep", "16,64", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert {r["ep"] for r in rows} == {16, 64} and {r["machine"] for r in rows} == {"H800", "H200"}
    assert all(r["time_us"] > 0 and r["speedup_vs_flat"] >= 1.0 for r in rows)
    assert doc["assumptions"]["net_efficiency"] == 0.85


def test_bench_internode_smoke(capsys):
    assert bench_internode.main(["--tokens", "32", "--hidden", "256", "--iters", "1", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert "not InfiniBand" in out and "#wrong 0" in out


def test_nvlink_leg_takes_newest_default_row(tmp_path, monkeypatch):
    """The NVLink leg comes from the newest 20-SM default row, not from an A/B run at another SM
    count that sorts last by name (a 4-SM run once became the leg and made EP16 NVLink-bound)."""
    res = tmp_path / "benchmarks" / "results"
    res.mkdir(parents=True)

    def write(name, date, num_sms, gbps):
        row = {"tokens": 4096, "op": "dispatch_bf16", "nvlbw_kernel": gbps, "tag": "main", "num_sms": num_sms}
        (res / name).write_text(json.dumps({"date": date, "rows": [row]}))

    write("bench_intranode_NVIDIA_H200_x2_20261130_080023.json", "20261130_080023", 20, 228.0)
    write("bench_intranode_NVIDIA_H200_x2_20261130_143749.json", "20261130_143749", 20, 246.0)
    write("bench_intranode_share_NVIDIA_H200_sms4_x.json", "20261130_150000", 4, 47.6)
    monkeypatch.setattr(M, "ROOT", str(tmp_path))
    gbps, source = M.nvlink_engine_gbps()
    assert gbps == 246.0 and source.endswith("_143749.json"), (gbps, source)


def test_comm_trace_role_split():
    """bench_comm_interference's split of a COMM_TRACE launch: even CTAs are senders, odd ones
    receivers; means in us from the earliest start."""
    B = bench_comm_interference
    trace = [(1_000, 3_000, 9_000), (1_000, 8_000, 9_000), (2_000, 5_000, 11_000), (1_500, 10_000, 11_000)]
    t = B.role_times(trace)
    assert t == {"sender_own_us": 3.0, "sender_end_us": 9.0, "receiver_own_us": 8.0, "receiver_end_us": 9.0}


def test_collective_clock_times_calls_and_waits(monkeypatch):
    """bench_internode's split of host time: time inside a torch.distributed collective and inside its
    work's wait() counts, the function is restored afterwards."""
    import time

    import torch.distributed as dist

    class Work:
        def wait(self):
            time.sleep(0.02)

    def fake(*args, **kwargs):
        time.sleep(0.03)
        return Work()
    monkeypatch.setattr(dist, "all_to_all_single", fake)
    with bench_internode._CollectiveClock() as clock:
        dist.all_to_all_single(None, None).wait()
        time.sleep(0.05)   # outside any collective: not counted
    assert 0.045 <= clock.seconds < 0.09, clock.seconds
    assert dist.all_to_all_single is fake


def test_target_verdicts():
    """The two-GPU targets: the best chunk cap per op against the flat all-to-all (NVLink), and the
    network leg's share of the flat all-to-all's busbw (socket)."""
    rows = [{"op": "dispatch_bf16", "chunk_cap": 1, "vs_flat_a2a": 1.4, "net_gbps": 100.0},
            {"op": "dispatch_bf16", "chunk_cap": 4, "vs_flat_a2a": 1.2, "net_gbps": 150.0},
            {"op": "dispatch_bf16_cached", "chunk_cap": 4, "vs_flat_a2a": 1.15, "net_gbps": 0.0},
            {"op": "combine", "chunk_cap": 4, "vs_flat_a2a": 1.3, "net_gbps": 0.0},
            {"op": "a2a_dispatch_bf16", "chunk_cap": 1, "busbw_gbps": 160.0}]
    nv = {t["target"].split(":")[0]: t for t in bench_internode.target_verdicts(rows, socket=False, shared_gpu=False)}
    assert nv["dispatch_bf16"]["met"] and nv["dispatch_bf16"]["chunk_cap"] == 4 and nv["dispatch_bf16"]["value"] == 1.2
    assert not nv["dispatch_bf16_cached"]["met"] and nv["combine"]["met"]
    (sock,) = bench_internode.target_verdicts(rows, socket=True, shared_gpu=True)
    assert sock["value"] == round(150 / 160, 3) and sock["met"] and not sock["meaningful"]


def test_nccl_unique_id_survives_the_broadcast_with_its_zero_bytes():
    """The id carries zero bytes (an address, a port): reading the char array field would cut it at the
    first one and the peers would dial the wrong address."""
    raw = bytes([7, 0, 0, 9] + [0] * 60 + list(range(1, 65)))
    uid = nccl_direct.id_from(raw)
    assert nccl_direct.id_bytes(uid) == raw
    assert nccl_direct.id_bytes(nccl_direct.id_from(nccl_direct.id_bytes(uid))) == raw
    with pytest.raises(CommlibError, match="128 bytes"):
        nccl_direct.id_from(raw[:100])


def test_main_job_counts_the_flat_all_to_all_rows_that_cross_nodes():
    """The main job's net_bytes of the flat all-to-all: one row per (token, destination rank on another
    node), counted by hand; the summary sets each engine op against its baseline op."""
    from commlib.bench import main as bench
    from commlib.topology import Topology
    topo = Topology(rank=1, num_ranks=4, ranks_per_node=2)     # node 0 = ranks 0, 1; node 1 = ranks 2, 3
    idx = torch.tensor([[0, 5], [6, 7], [2, 3], [-1, 4], [1, 1], [4, 6]])   # 2 experts per rank
    # token 0: ranks 0, 2 -> 1 row off-node; 1: rank 3 -> 1; 2: rank 1 -> 0; 3: rank 2 -> 1; 4: rank 0 -> 0;
    # 5: ranks 2, 3 -> 2
    assert bench._flat_internode_rows(idx, 8, 4, topo) == 5
    rows = [{"op": "dispatch_bf16", "net_bytes": 300.0}, {"op": "a2a_dispatch_bf16", "net_bytes": 600.0},
            {"op": "combine", "net_bytes": 50.0}, {"op": "a2a_combine", "net_bytes": 0.0}]
    assert bench.net_bytes_summary(rows) == "dispatch_bf16 300 vs all_to_all 600 (0.50x)"


def test_host_mode_writes_every_figure_and_verdict(tmp_path, capsys):
    """bench_internode --host on CPU ranks: per op the host, wait, NCCL, own and floor figures, each
    collective beside its bare replay, the device-operation counts and a verdict per target."""
    out = tmp_path / "host.json"
    assert bench_internode.main(["--host", "--ranks", "2", "--ranks-per-node", "1", "--tokens", "32", "--hidden", "256",
                                 "--iters", "2", "--warmup", "0", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["tool"] == "bench_internode_host" and "passed" in doc
    assert [r["op"] for r in doc["rows"]] == list(bench_internode.HOST_OPS)
    for r in doc["rows"]:
        assert r["host_us"] > 0 and r["own_us"] <= r["total_us"] <= r["host_us"] + 1e-6, r
        assert 0 < r["backend_us"] <= r["total_us"], r
        assert r["nccl_calls"] == len(r["nccl"]) >= 1 and all(c["bytes"] > 0 and c["floor_us"] > 0 for c in r["nccl"])
        assert r["probe_ops"]["total"] > 0 and r["probe_ops"] == r["probe_ops_again"], r
        assert {t["target"].split(": ")[1].split(" (")[0] for t in r["targets"]} >= {"NCCL calls per call"}
        assert all(isinstance(t["met"], bool) for t in r["targets"])
    assert "[bench_internode --host]" in capsys.readouterr().out


def test_host_verdicts():
    """Each target's limit: own time by op kind, 1 + K NCCL calls, ops + 1 per extra chunk, the whole
    call at K = 1 only, every NCCL call against its bare replay; a count that differs between two
    calls fails however small."""
    row = {"op": "cached_bf16", "chunks": 1, "backend_us": 59.0, "own_us": 90.0, "total_us": 149.0, "nccl_calls": 2,
           "probe_ops": {"total": 10}, "probe_ops_again": {"total": 10},
           "nccl": [{"name": "all_to_all_single", "bytes": 64, "host_us": 20.0, "floor_us": 19.0}]}
    v = bench_internode.host_verdicts(row)
    assert len(v) == 5 and all(t["met"] for t in v), v
    slow = dict(row, nccl=[dict(row["nccl"][0], host_us=30.0)], probe_ops_again={"total": 9})
    met = [t["met"] for t in bench_internode.host_verdicts(slow)]
    assert met == [True, True, False, True, False], met
    four = dict(row, op="dispatch_bf16", chunks=4, backend_us=201.0, nccl_calls=5, probe_ops={"total": 23},
                probe_ops_again={"total": 23})
    v = {t["target"].split(": ")[1][:12]: t for t in bench_internode.host_verdicts(four)}
    assert not v["engine's own"]["met"] and v["NCCL calls p"]["met"] and v["device opera"]["limit"] == 23
    assert not any(t.startswith("whole") for t in v)


def test_recording_probe_times_collectives_and_keeps_them_for_a_replay():
    from commlib.backends.probe import NULL_PROBE, RecordingProbe

    issued = []

    class Work:
        def wait(self):
            issued.append("wait")

    def coll(out, send, group=None, async_op=False):
        issued.append((out.numel(), send.numel()))
        return Work()
    out, send = torch.zeros(6, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)
    NULL_PROBE.wait(NULL_PROBE.collective(coll, out, send, async_op=True))
    probe = RecordingProbe(timing=True)
    work = probe.collective(coll, out, send, group=None, async_op=True)
    probe.wait(work)
    (c,) = probe.take_collectives()
    assert c.name == "coll" and c.nbytes == 48 and c.stream is None and c.wait_s > 0 and c.issue_s > 0
    assert probe.collective_s == c.seconds and not probe.collectives
    c.fn(*c.args, **c.kwargs).wait()   # the bare replay: the same call again
    assert issued == [(6, 3), "wait"] * 3


def test_host_compare_pairs_rounds_and_refuses_mixed_devices(tmp_path):
    """benchmarks.host_compare: per op the baseline's and the change's means over ranks, averaged over
    their rounds, and the ratio (hand-computed here); ops missing from a file are left out; inputs
    from two devices are refused; the JSON names its inputs and their device, not this machine's."""
    from benchmarks import host_compare as HC

    def doc(own_by_rank, device="H200", extra_op=False):
        rows = [{"op": "combine_cpp", "chunk_cap": 1, "own_us": max(own_by_rank), "host_us": 2 * max(own_by_rank),
                 "by_rank": [[2 * o, o] for o in own_by_rank]}]
        if extra_op:
            rows.append({"op": "cached_bf16_cpp", "chunk_cap": 1, "own_us": 1.0, "host_us": 2.0, "by_rank": [[2, 1]]})
        return {"device": {"name": device}, "git": {"commit": "abc"}, "command": "x", "rows": rows}
    files = {}
    for name, d in {"a": doc([80, 60]), "b": doc([70, 70], extra_op=True), "c": doc([50, 30]),
                    "d": doc([40, 40])}.items():
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(json.dumps(d))
    out = tmp_path / "cmp.json"
    assert HC.main(["--base", str(files["a"]), str(files["b"]), "--new", str(files["c"]), str(files["d"]),
                    "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert [r["op"] for r in got["rows"]] == ["combine_cpp"]          # cached_bf16 is in one file only
    own = got["rows"][0]["own_mean"]
    assert own["base"] == [70.0, 70.0] and own["new"] == [40.0, 40.0] and abs(own["ratio"] - 40 / 70) < 1e-12
    assert got["rows"][0]["own_slowest"]["base"] == [80, 70]
    assert got["device"] == {"name": "H200"} and [i["role"] for i in got["inputs"]] == ["base", "base", "new", "new"]
    assert got["ratios"][0]["own_mean_ratio"] == round(40 / 70, 4)
    files["d"].write_text(json.dumps(doc([40, 40], device="A100")))
    with pytest.raises(SystemExit, match="different devices"):
        HC.main(["--base", str(files["a"]), "--new", str(files["d"])])


def test_fresh_handles_give_each_call_a_handle_unused_for_its_kind():
    """bench_internode --host's first-call rows (cached_bf16_first, combine_first): every call of a kind
    gets a handle no earlier call of that kind had, made up front (a collective, the same count on every
    rank), more made only past the count."""
    made = []

    def make():
        made.append(object())
        return made[-1]
    fresh = bench_internode.FreshHandles(make, 3)
    assert len(made) == 3
    cached = [fresh.next("cached") for _ in range(3)]
    combine = [fresh.next("combine") for _ in range(2)]
    assert cached == made and combine == made[:2] and len(made) == 3
    assert fresh.next("cached") is made[3] and len(made) == 4 and fresh.next("combine") is made[2]
