"""benchmarks/peers on CPU: the argument parsing, the checks against the oracle (each fed a planted
wrong row), the sweep's pick, the ratios and the JSON (rewritten after each world), the path imports
(a fake DeepEP build beside commlib's own deep_ep, commlib at the pre-rings commit beside HEAD), and
one 2-rank CPU world of the whole benchmark (reference backends) with HEAD, 917fdc0 and a fake DeepEP
build (commlib's Buffer under DeepEP's names) that returns a wrong element at one send chunk.
DeepEP's build recipe is not in the repository (docs/peers.md): nothing here builds."""
from __future__ import annotations

import importlib.machinery
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from benchmarks.peers import bench_peers as bp
from benchmarks.peers import calls as pcalls
from benchmarks.peers import checks as pc
from benchmarks.peers import engines as pe

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------ arguments
def test_parse_args_defaults_and_refusals():
    a = bp.parse_args([])
    assert (a.world_sizes, a.sms_list, a.engine_names) == ([2, 4], [20, 24], ["head", "917fdc0", "deepep"])
    assert (a.tokens, a.hidden, a.experts, a.topk) == (4096, 7168, 256, 8)
    assert (a.tune_sms, a.tune_chunk_list, a.tune_combine_list) == (24, [4, 8, 12, 16, 20, 24, 28, 32],
                                                                     [1, 2, 4, 6, 8, 10, 12, 16])
    assert a.deepep_so_places == [str(ROOT / ".peers_build" / "DeepEP"), str(ROOT / ".peers" / "prebuilt")]
    assert a.deepep == str(ROOT / ".peers" / "DeepEP")
    a = bp.parse_args(["--world", "2", "--sms", "24", "--engines", "deepep,head", "--json", "--deepep-so", "/x.so"])
    assert (a.world_sizes, a.sms_list, a.engine_names, a.json) == ([2], [24], ["deepep", "head"], "auto")
    assert a.deepep_so_places == ["/x.so"]
    for bad in (["--engines", "nccl"], ["--sms", "21"], ["--world", "0"], ["--engines", ""], ["--tune-sms", "23"],
                ["--tune-chunks", "0,8"], ["--tune-combine-chunks", "256"], ["--tune-chunks", ""]):
        with pytest.raises(SystemExit):
            bp.parse_args(bad)


# ------------------------------------------------------------------------------ checks
def _rows(n=12, h=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    src_rank = torch.sort(torch.randint(0, 3, (n,), generator=g))[0]
    src_idx = torch.zeros(n, dtype=torch.int64)
    for r in range(3):   # distinct tokens per source, increasing: the oracle's order
        m = src_rank == r
        src_idx[m] = torch.sort(torch.randperm(50, generator=g)[: int(m.sum())])[0]
    want = torch.randn(n, h, generator=g).to(torch.bfloat16)
    return want, src_rank, src_idx


def test_rows_compare_up_to_row_order_and_catch_a_planted_row():
    want, src_rank, src_idx = _rows()
    perm = torch.randperm(want.shape[0], generator=torch.Generator().manual_seed(3))
    got, got_rank, got_idx = want[perm], src_rank[perm], src_idx[perm]
    assert pc.wrong_up_to_row_order(got, got_rank, got_idx, want) == 0     # another row order: equal
    planted = got.clone()
    planted[5, 3] += 1.0                                                    # one element
    assert pc.wrong_up_to_row_order(planted, got_rank, got_idx, want) == 1
    planted = got.clone()
    planted[7] = torch.randn(want.shape[1]).to(torch.bfloat16)              # one row
    assert pc.wrong_up_to_row_order(planted, got_rank, got_idx, want) == want.shape[1]
    swapped = got_idx.clone()
    swapped[[2, 9]] = swapped[[9, 2]]                                       # rows under the wrong tokens
    assert pc.wrong_up_to_row_order(got, got_rank, swapped, want) > 0
    dup = got_idx.clone()
    dup[1] = dup[0]
    dup_rank = got_rank.clone()
    dup_rank[1] = dup_rank[0]
    assert pc.wrong_up_to_row_order(got, dup_rank, dup, want) == want.numel()   # two rows, one token
    assert pc.wrong_up_to_row_order(got[1:], got_rank[1:], got_idx[1:], want) == want.numel()
    assert pc.wrong_up_to_row_order(None, got_rank, got_idx, want) == want.numel()


def test_rows_through_a_handle_bf16_and_fp8():
    want, src_rank, src_idx = _rows(n=10, h=256)
    me, R = 1, 3
    counts = torch.bincount(src_rank, minlength=R)
    rpm = torch.zeros(R, R, dtype=torch.int32)
    rpm[:, me] = torch.cumsum(counts, 0).to(torch.int32)
    assert torch.equal(pc.source_of_rows(rpm, me), src_rank)
    handle = (rpm, None, None, src_idx.to(torch.int32), None, None)
    assert pc.wrong_rows(want, handle, me, want) == 0
    scales = torch.rand(10, 2)
    data = want.float().to(torch.float8_e4m3fn)
    assert pc.wrong_rows((data, scales), handle, me, (data, scales)) == 0
    bad = scales.clone()
    bad[4, 1] = 7.0
    assert pc.wrong_rows((data, bad), handle, me, (data, scales)) == 1
    assert pc.wrong_rows(data, handle, me, (data, scales)) == data.numel() + scales.numel()


def test_combined_within_bf16_rounding_and_a_planted_row():
    x = torch.randn(8, 32).to(torch.bfloat16)
    tir = torch.ones(8, 2, dtype=torch.bool)
    want = (x.float() * 2).to(torch.bfloat16)
    assert pc.wrong_combined(want.clone(), want, x, tir) == 0
    ulp = (want.float() * (1 + 2.0 ** -8)).to(torch.bfloat16)   # a different rounding: within bound
    assert pc.wrong_combined(ulp, want, x, tir) == 0
    planted = want.clone()
    planted[3] = x[3]                                            # one rank's row left out
    assert pc.wrong_combined(planted, want, x, tir) > 16


# ------------------------------------------------------------------------------ ratios, labels, JSON
def _row(engine, op, gpu, host, world=2, setting="sms20", wrong=0):
    return {"engine": engine, "label": engine, "world": world, "setting": setting, "op": op, "tokens": 64,
            "num_sms": 20, "config": None, "size_bytes": 1e6, "gpu_us": gpu, "algbw": 1e6 / gpu / 1e3,
            "host_us": host, "cpu_us": host, "checked": True, "wrong": wrong, "mode": "HBM loopback under MPS"}


def test_ratios_against_deepep_and_the_old_commit():
    rows = [_row("deepep", "combine", 300.0, 60.0), _row("head", "combine", 200.0, 30.0),
            _row("917fdc0", "combine", 400.0, 90.0), _row("head", "cached_bf16", 100.0, 20.0)]
    got = {(q["engine"], q["op"]): q for q in bp.ratios(rows)}
    assert got[("head", "combine")]["x_deepep"] == pytest.approx(1.5)
    assert got[("head", "combine")]["x_deepep_host"] == pytest.approx(2.0)
    assert got[("head", "combine")]["x_old"] == pytest.approx(2.0)
    assert got[("917fdc0", "combine")]["x_deepep"] == pytest.approx(0.75)
    assert got[("head", "cached_bf16")]["x_deepep"] is None     # DeepEP did not run that op
    assert ("deepep", "combine") not in got
    assert all(q["mode"] == "HBM loopback under MPS" for q in got.values())


def test_mode_labels():
    assert bp.mode_label(2, 1, {"CUDA_MPS_PIPE_DIRECTORY": "/tmp/p"}) == "HBM loopback under MPS"
    assert "time-sliced" in bp.mode_label(2, 1, {})
    assert bp.mode_label(2, 2, {}) == "one process per GPU"
    assert bp.mode_label(2, 0, {}).startswith("CPU ranks")


def test_json_document(tmp_path, capsys):
    rows = [_row("deepep", "combine", 300.0, 60.0), _row("head", "combine", 200.0, 30.0, wrong=3)]
    tuning = [{"engine": "deepep", "op": "combine", "num_sms": 24, "chunk": c, "ring": 256, "gpu_us": t,
               "wrong": bad, "best": c == 4, "world": 2, "mode": "HBM loopback under MPS"}
              for c, t, bad in ((2, 9.0, 0), (4, 7.0, 0), (6, 5.0, 12))]
    result = {"rows": rows, "ratios": bp.ratios(rows), "engines": {"head": {"label": "commlib HEAD"}},
              "tuning": tuning, "errors": {2: {}}, "modes": {2: "HBM loopback under MPS"}, "device": "cpu",
              "args": {"tokens": 64, "hidden": 32, "topk": 4, "experts": 16}}
    path = bp.write_json(result, str(tmp_path / "peers.json"), ["--world", "2"])
    doc = json.loads(path.read_text())
    assert doc["tool"] == "bench_peers" and doc["command"].endswith("--world 2")
    assert doc["rows"][1]["wrong"] == 3 and doc["ratios"][0]["x_deepep"] == pytest.approx(1.5)
    assert doc["modes"] == {"2": "HBM loopback under MPS"} and "NVSHMEM" in doc["low_latency"]
    assert all(r["mode"] == "HBM loopback under MPS" for r in doc["rows"] + doc["tuning"])
    assert [t["chunk"] for t in doc["tuning"] if t["best"]] == [4]
    named = bp.write_json(result, str(tmp_path), [])
    assert named.parent == tmp_path and named.name.startswith("bench_peers_") and named.suffix == ".json"
    bp.print_report(result)
    out = capsys.readouterr().out
    assert "HBM loopback under MPS" in out and "Out of bounds values : 3 FAILED" in out
    assert "# [sweep] EP2 deepep combine at 24 SMs, ring 256" in out and "2:9.0 4:7.0* 6:5.0!" in out


def test_sweep_picks_the_fastest_right_candidate():
    assert pcalls.best_index([5.0, 3.0, 4.0], [0, 0, 0]) == 1
    assert pcalls.best_index([5.0, 3.0, 4.0], [0, 7, 0]) == 2          # the fastest is wrong: not picked
    assert pcalls.best_index([5.0, 3.0, 3.0], [0, 0, 0]) == 1          # a tie: the first
    assert pcalls.best_index([5.0, 3.0], [1, 1]) == 1                  # none right: the fastest (its rows fail)


def test_json_rewritten_after_each_world(tmp_path, monkeypatch):
    """A later world that dies keeps the earlier world's figures in the JSON and its own finished
    engines (the rank-0 partial file), with the world's error."""
    row = _row("head", "combine", 200.0, 30.0)

    def fake_launch(world, worker, a, **kw):
        if world == 2:
            return {"rows": [row], "tuning": [], "errors": {}, "engines": {"head": {"label": "x"}}, "device": "cpu"}
        with open(a["partial"], "a") as f:
            f.write(json.dumps({"rows": [{**row, "world": 4}], "tuning": [], "engine": {"head": {}}}) + "\n")
        raise RuntimeError("rank 3 timed out")

    monkeypatch.setattr(bp.launch, "parallel_launch", fake_launch)
    seen = []
    out = tmp_path / "p.json"
    result = bp.run(bp.parse_args(["--world", "2,4", "--json", str(out)]),
                    lambda r: seen.append(json.loads(bp.write_json(r, str(out), []).read_text())))
    assert [len(d["rows"]) for d in seen] == [1, 2]
    assert seen[0]["rows"][0]["world"] == 2 and seen[1]["errors"]["4"]["world"].endswith("rank 3 timed out")
    assert result["rows"][1]["world"] == 4 and result["errors"][2] == {}


# ------------------------------------------------------------------------------ path imports
def _fake_so(tmp: Path) -> Path:
    pkg = tmp / "build" / "deep_ep"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .buffer import Buffer\nfrom deep_ep_cpp import Config, topk_idx_t\n")
    (pkg / "buffer.py").write_text(
        "import deep_ep_cpp\nfrom deep_ep_cpp import Config\n\n"
        "class Buffer:\n    num_sms = 20\n\n"
        "    @staticmethod\n    def get_dispatch_config(num_ranks):\n"
        "        return Config(Buffer.num_sms, 24 if num_ranks == 2 else 6, 256, 6, 128)\n\n"
        "    @staticmethod\n    def get_combine_config(num_ranks):\n"
        "        return Config(Buffer.num_sms, 10, 256, 6, 128)\n")
    so = tmp / "build" / ("deep_ep_cpp" + importlib.machinery.EXTENSION_SUFFIXES[0])
    so.write_bytes(b"")
    return so


def test_deepep_loads_by_path_beside_commlibs_deep_ep(tmp_path, monkeypatch):
    import deep_ep as commlib_deep_ep

    so = _fake_so(tmp_path)
    with pytest.raises(ImportError, match="kept out of the repository"):
        pe.import_extension("deep_ep_cpp", [tmp_path, tmp_path / "nothing"])      # no extension there
    assert pe.extension_files("deep_ep_cpp", [tmp_path / "nothing", tmp_path / "build"]) == [so.resolve()]
    assert pe.extension_files("deep_ep_cpp", [so, tmp_path / "build"]) == [so.resolve(), so.resolve()]
    ext = types.ModuleType("deep_ep_cpp")                     # stands in for the compiled module
    ext.__file__ = str(so)
    ext.topk_idx_t = torch.int64
    ext.Config = type("Config", (), {"__init__": lambda self, *f: setattr(self, "fields", f),
                                     "num_sms": property(lambda self: self.fields[0]),
                                     "num_max_nvl_chunked_send_tokens": property(lambda self: self.fields[1]),
                                     "num_max_nvl_chunked_recv_tokens": property(lambda self: self.fields[2]),
                                     "num_max_rdma_chunked_send_tokens": property(lambda self: self.fields[3]),
                                     "num_max_rdma_chunked_recv_tokens": property(lambda self: self.fields[4])})
    monkeypatch.setitem(sys.modules, "deep_ep_cpp", ext)
    for name in [n for n in sys.modules if n.startswith(pe.DEEPEP_ALIAS)]:
        monkeypatch.delitem(sys.modules, name)
    try:
        with pytest.raises(ImportError, match="already loaded"):
            pe.import_extension("deep_ep_cpp", [Path(__file__)])   # a file, but another one
        eng = pe.deepep_engine(tmp_path / "build", so, 2)      # the package beside, the .so by its path
        assert eng.module.__name__ == pe.DEEPEP_ALIAS and eng.module.Buffer.__module__ == "deep_ep_v1.buffer"
        assert sys.modules["deep_ep"] is commlib_deep_ep and commlib_deep_ep.__implementation__ == "commlib"
        assert eng.config("dispatch", 24, 4096).fields == (24, 24, 256, 6, 128)   # its table, 24 SMs
        assert eng.config("combine", 24, 4096).fields == (24, 10, 256, 6, 128)
        assert eng.candidate(24, 12, 256).fields == (24, 12, 256, 6, 128)         # the sweep's Configs
        assert pe.import_package(pe.DEEPEP_ALIAS, tmp_path / "build" / "deep_ep") is eng.module   # once
        other = tmp_path / "other"
        (other / "deep_ep").mkdir(parents=True)
        (other / "deep_ep" / "__init__.py").write_text("")
        with pytest.raises(ImportError, match="already"):
            pe.import_package(pe.DEEPEP_ALIAS, other / "deep_ep")
        with pytest.raises(ImportError, match="no package"):
            pe.import_package("nothing_here", tmp_path)
    finally:
        for name in [n for n in sys.modules if n.startswith(pe.DEEPEP_ALIAS)]:
            del sys.modules[name]


@pytest.fixture(scope="module")
def old_tree(tmp_path_factory):
    """commlib at 917fdc0: the prepared .peers copy, else exported from git."""
    have = ROOT / ".peers" / f"commlib_{bp.OLD_COMMIT}"
    if (have / "commlib" / "__init__.py").is_file():
        return have
    dest = tmp_path_factory.mktemp("old")
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", bp.OLD_COMMIT, "commlib", "csrc"],
                             capture_output=True, timeout=60)
    if archive.returncode != 0:
        pytest.skip(f"no {bp.OLD_COMMIT} in this clone: {archive.stderr.decode()[-200:]}")
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True, timeout=60)
    return dest


def test_old_commit_imports_beside_head(old_tree):
    import commlib

    eng = pe.old_commlib_engine(old_tree, bp.OLD_COMMIT)
    assert eng.module.__name__ == f"commlib_{bp.OLD_COMMIT}" and eng.module.Buffer is not commlib.Buffer
    assert Path(eng.module.__file__).is_relative_to(old_tree)
    assert sys.modules["commlib"] is commlib
    cfg = eng.config("dispatch", 20, 4096)
    assert (cfg.num_sms, cfg.num_max_nvl_chunked_recv_tokens) == (20, 410)   # a channel's whole share
    assert eng.candidate is None                                              # tuned: config=None


# A DeepEP build for CPU ranks: commlib's Buffer under DeepEP's names, its "extension" a Python file.
# PEERS_FAKE_BAD_CHUNK: a dispatch whose Config has that send chunk returns one byte flipped.
FAKE_EXTENSION = '''import torch

import commlib

topk_idx_t = torch.int64


class Config:
    """Like DeepEP's pybind Config: built from positions, no field to read back."""
    __slots__ = ("_real",)

    def __init__(self, *args):
        self._real = commlib.Config(*args)

    def get_nvl_buffer_size_hint(self, hidden_bytes, num_ranks):
        return self._real.get_nvl_buffer_size_hint(hidden_bytes, num_ranks)

    def get_rdma_buffer_size_hint(self, hidden_bytes, num_ranks):
        return self._real.get_rdma_buffer_size_hint(hidden_bytes, num_ranks)
'''
FAKE_BUFFER = '''import os

import deep_ep_cpp  # noqa: F401 - the extension, by the name DeepEP's package imports it
import torch

import commlib
from deep_ep_cpp import Config


def _real(config):
    return None if config is None else config._real


def _table(c):
    return Config(c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens,
                  c.num_max_rdma_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens)


class Buffer(commlib.Buffer):
    @staticmethod
    def get_dispatch_config(num_ranks):
        return _table(commlib.Buffer.get_dispatch_config(num_ranks))

    @staticmethod
    def get_combine_config(num_ranks):
        return _table(commlib.Buffer.get_combine_config(num_ranks))

    def dispatch(self, x, *args, config=None, **kwargs):
        real = _real(config)
        out = super().dispatch(x, *args, config=real, **kwargs)
        bad = int(os.environ.get("PEERS_FAKE_BAD_CHUNK", "0"))
        rows = out[0][0] if isinstance(out[0], tuple) else out[0]
        if real is not None and real.num_max_nvl_chunked_send_tokens == bad and rows.shape[0]:
            rows.view(-1).view(torch.uint8)[0] ^= 1
        return out

    def combine(self, *args, config=None, **kwargs):
        return super().combine(*args, config=_real(config), **kwargs)
'''


def _fake_build(tmp: Path) -> Path:
    build = tmp / "fake_deepep"
    (build / "deep_ep").mkdir(parents=True)
    (build / "deep_ep" / "__init__.py").write_text("from .buffer import Buffer\n"
                                                   "from deep_ep_cpp import Config, topk_idx_t\n")
    (build / "deep_ep" / "buffer.py").write_text(FAKE_BUFFER)
    (build / "deep_ep_cpp.py").write_text(FAKE_EXTENSION)
    (build / "COMMIT").write_text("fake0123\n")
    return build


def test_missing_deepep_build_is_named(tmp_path):
    args = bp.parse_args(["--deepep", str(tmp_path), "--deepep-so", str(tmp_path / "none")])
    with pytest.raises(ImportError, match="build_deepep.sh, kept out of the repository"):
        bp._load("deepep", args, 2)


def test_cpu_world_three_engines(old_tree, tmp_path, capsys, monkeypatch):
    """The whole benchmark on 2 CPU ranks (reference backends), tiny V3-like shape, the fake DeepEP
    wrong at send chunk 24 (its table's dispatch chunk at EP2): its sms20 dispatch rows are caught, the
    sweep flags chunk 24 and picks another, every other row is right; the run fails."""
    build = _fake_build(tmp_path)
    monkeypatch.setenv("PEERS_FAKE_BAD_CHUNK", "24")
    out = tmp_path / "peers.json"
    rc = bp.main(["--world", "2", "--engines", "head,917fdc0,deepep", "--old", str(old_tree),
                  "--deepep", str(build), "--deepep-so", str(build / "deep_ep_cpp.py"),
                  "--tokens", "48", "--hidden", "256", "--experts", "16", "--groups", "4", "--topk-groups", "2",
                  "--topk", "4", "--sms", "20", "--tune-chunks", "8,24", "--tune-combine-chunks", "4,8",
                  "--warmup", "0", "--iters", "1", "--host-iters", "1", "--tune-iters", "1", "--json", str(out)])
    text = capsys.readouterr().out
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert rc == 1 and "FAILED" in text, text[-2000:]
    assert {r["engine"] for r in rows} == {"head", bp.OLD_COMMIT, "deepep"} and not doc["errors"]["2"]
    assert len(rows) == 3 * 2 * len(bp.OPS)   # engines x (sms20, tuned) x ops
    wrong = {(r["engine"], r["setting"], r["op"]) for r in rows if r["wrong"]}
    assert wrong == {("deepep", "sms20", op) for op in bp.OPS if op != "combine"}, wrong
    assert all(r["checked"] and r["size_bytes"] > 0 and r["gpu_us"] > 0 for r in rows)
    assert doc["engines"]["deepep"]["source"] == "fake0123"
    assert doc["engines"]["deepep"]["extension"] == str((build / "deep_ep_cpp.py").resolve())
    sweep = {(t["engine"], t["op"], t["chunk"]): t for t in doc["tuning"]}
    assert len(sweep) == 2 * 3 * 2                   # engines with a sweep x ops x chunks
    assert sweep[("deepep", "cached_bf16", 24)]["wrong"] > 0 and not sweep[("deepep", "cached_bf16", 24)]["best"]
    assert sweep[("deepep", "cached_bf16", 8)]["best"] and sweep[("deepep", "cached_fp8", 8)]["best"]
    assert not sweep[("head", "cached_bf16", 24)]["wrong"]
    tuned = {(r["engine"], r["op"]): r for r in rows if r["setting"] == "tuned"}
    assert tuned[("deepep", "cached_bf16")]["config"]["num_max_nvl_chunked_send_tokens"] == 8
    assert tuned[("deepep", "combine")]["num_sms"] == 24 and tuned[(bp.OLD_COMMIT, "combine")]["config"] is None
    assert {t["mode"] for t in doc["tuning"]} == {r["mode"] for r in rows} == {doc["modes"]["2"]}
    x = {(q["engine"], q["setting"], q["op"]): q for q in doc["ratios"]}
    assert x[("head", "tuned", "combine")]["x_deepep"] > 0 and x[("head", "sms20", "combine")]["x_old"] > 0
    assert "# [sweep] EP2 deepep cached_bf16 at 24 SMs" in text and "# [low-latency] not run" in text


def test_config_fields_of_a_config_without_attributes():
    """DeepEP's pybind Config has no readable fields: its table's arguments are read by watching its own
    getter build them, and every Config made here reports the arguments it was made with."""
    import types

    from benchmarks.peers import engines

    class OpaqueConfig:          # like deep_ep_cpp.Config: built from positions, nothing to read back
        def __init__(self, *args):
            self._hidden = args

    home = types.ModuleType("fake_deepep_buffer")
    home.Config = OpaqueConfig

    class Buffer:
        num_sms = 20

        @staticmethod
        def get_dispatch_config(R):
            table = {2: home.Config(Buffer.num_sms, 24, 256, 6, 128), 4: home.Config(Buffer.num_sms, 6, 256, 6, 128)}
            return table[R]

        @staticmethod
        def get_combine_config(R):
            table = {2: home.Config(Buffer.num_sms, 10, 256, 6, 128), 4: home.Config(Buffer.num_sms, 9, 256, 6, 128)}
            return table[R]

    Buffer.__module__ = home.__name__
    home.Buffer = Buffer
    sys.modules[home.__name__] = home
    try:
        mod = types.SimpleNamespace(Buffer=Buffer, Config=OpaqueConfig)
        make = engines._table_config(mod, 4)
        assert engines.config_fields(make("dispatch", 24, 4096)) == dict(zip(engines.CONFIG_FIELDS, (24, 6, 256, 6, 128)))
        assert engines.config_fields(make("combine", 20, 4096))["num_max_nvl_chunked_send_tokens"] == 9
        cand = engines._candidate(mod, 2)(24, 28, 256)
        assert engines.config_fields(cand) == dict(zip(engines.CONFIG_FIELDS, (24, 28, 256, 6, 128)))
        assert home.Config is OpaqueConfig   # the watch is undone
        assert engines.config_fields(None) is None
    finally:
        del sys.modules[home.__name__]
