"""The internode model: node-limited routing, once-per-node saves network rows, output is JSON."""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import model_internode as M  # noqa: E402


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
    import bench_internode
    assert bench_internode.main(["--tokens", "32", "--hidden", "256", "--iters", "1", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert "not InfiniBand" in out and "#wrong 0" in out
