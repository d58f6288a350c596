"""benchmarks/peers on CPU: the argument parsing, the checks against the oracle (each fed a planted
wrong row), the ratios and the JSON, the path imports (a fake DeepEP build beside commlib's own
deep_ep, commlib at the pre-rings commit beside HEAD), build_deepep.sh against a fake setup.py, and
one 2-rank CPU world of the whole benchmark with HEAD and 917fdc0 (reference backends)."""
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
from benchmarks.peers import engines as pe

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------ arguments
def test_parse_args_defaults_and_refusals():
    a = bp.parse_args([])
    assert (a.world_sizes, a.sms_list, a.engine_names) == ([2, 4], [20, 24], ["head", "917fdc0", "deepep"])
    assert (a.tokens, a.hidden, a.experts, a.topk) == (4096, 7168, 256, 8)
    a = bp.parse_args(["--world", "2", "--sms", "24", "--engines", "deepep,head", "--json"])
    assert (a.world_sizes, a.sms_list, a.engine_names, a.json) == ([2], [24], ["deepep", "head"], "auto")
    for bad in (["--engines", "nccl"], ["--sms", "21"], ["--world", "0"], ["--engines", ""]):
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
    assert bp.wrong_up_to_row_order(got, got_rank, got_idx, want) == 0     # another row order: equal
    planted = got.clone()
    planted[5, 3] += 1.0                                                    # one element
    assert bp.wrong_up_to_row_order(planted, got_rank, got_idx, want) == 1
    planted = got.clone()
    planted[7] = torch.randn(want.shape[1]).to(torch.bfloat16)              # one row
    assert bp.wrong_up_to_row_order(planted, got_rank, got_idx, want) == want.shape[1]
    swapped = got_idx.clone()
    swapped[[2, 9]] = swapped[[9, 2]]                                       # rows under the wrong tokens
    assert bp.wrong_up_to_row_order(got, got_rank, swapped, want) > 0
    dup = got_idx.clone()
    dup[1] = dup[0]
    dup_rank = got_rank.clone()
    dup_rank[1] = dup_rank[0]
    assert bp.wrong_up_to_row_order(got, dup_rank, dup, want) == want.numel()   # two rows, one token
    assert bp.wrong_up_to_row_order(got[1:], got_rank[1:], got_idx[1:], want) == want.numel()
    assert bp.wrong_up_to_row_order(None, got_rank, got_idx, want) == want.numel()


def test_rows_through_a_handle_bf16_and_fp8():
    want, src_rank, src_idx = _rows(n=10, h=256)
    me, R = 1, 3
    counts = torch.bincount(src_rank, minlength=R)
    rpm = torch.zeros(R, R, dtype=torch.int32)
    rpm[:, me] = torch.cumsum(counts, 0).to(torch.int32)
    assert torch.equal(bp.source_of_rows(rpm, me), src_rank)
    handle = (rpm, None, None, src_idx.to(torch.int32), None, None)
    assert bp.wrong_rows(want, handle, me, want) == 0
    scales = torch.rand(10, 2)
    data = want.float().to(torch.float8_e4m3fn)
    assert bp.wrong_rows((data, scales), handle, me, (data, scales)) == 0
    bad = scales.clone()
    bad[4, 1] = 7.0
    assert bp.wrong_rows((data, bad), handle, me, (data, scales)) == 1
    assert bp.wrong_rows(data, handle, me, (data, scales)) == data.numel() + scales.numel()


def test_combined_within_bf16_rounding_and_a_planted_row():
    x = torch.randn(8, 32).to(torch.bfloat16)
    tir = torch.ones(8, 2, dtype=torch.bool)
    want = (x.float() * 2).to(torch.bfloat16)
    assert bp.wrong_combined(want.clone(), want, x, tir) == 0
    ulp = (want.float() * (1 + 2.0 ** -8)).to(torch.bfloat16)   # a different rounding: within bound
    assert bp.wrong_combined(ulp, want, x, tir) == 0
    planted = want.clone()
    planted[3] = x[3]                                            # one rank's row left out
    assert bp.wrong_combined(planted, want, x, tir) > 16


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
    result = {"rows": rows, "ratios": bp.ratios(rows), "engines": {"head": {"label": "commlib HEAD"}},
              "errors": {2: {}}, "modes": {2: "HBM loopback under MPS"}, "device": "cpu",
              "args": {"tokens": 64, "hidden": 32, "topk": 4, "experts": 16}}
    path = bp.write_json(result, str(tmp_path / "peers.json"), ["--world", "2"])
    doc = json.loads(path.read_text())
    assert doc["tool"] == "bench_peers" and doc["command"].endswith("--world 2")
    assert doc["rows"][1]["wrong"] == 3 and doc["ratios"][0]["x_deepep"] == pytest.approx(1.5)
    assert doc["modes"] == {"2": "HBM loopback under MPS"} and "NVSHMEM" in doc["low_latency"]
    assert all(r["mode"] == "HBM loopback under MPS" for r in doc["rows"])
    named = bp.write_json(result, str(tmp_path), [])
    assert named.parent == tmp_path and named.name.startswith("bench_peers_") and named.suffix == ".json"
    bp.print_report(result)
    out = capsys.readouterr().out
    assert "HBM loopback under MPS" in out and "Out of bounds values : 3 FAILED" in out


# ------------------------------------------------------------------------------ path imports
def _fake_deepep(tmp: Path) -> Path:
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

    so = _fake_deepep(tmp_path)
    with pytest.raises(ImportError, match="build_deepep.sh"):
        pe.import_extension("deep_ep_cpp", tmp_path)          # no extension there
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
        eng = pe.deepep_engine(tmp_path / "build", 2)
        assert eng.module.__name__ == pe.DEEPEP_ALIAS and eng.module.Buffer.__module__ == "deep_ep_v1.buffer"
        assert sys.modules["deep_ep"] is commlib_deep_ep and commlib_deep_ep.__implementation__ == "commlib"
        assert eng.config("dispatch", 24, 4096).fields == (24, 24, 256, 6, 128)   # its table, 24 SMs
        assert eng.config("combine", 24, 4096).fields == (24, 10, 256, 6, 128)
        assert eng.config("tuned_dispatch", 20, 4096).fields == (20, 24, 256, 6, 128)
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
    assert eng.config("tuned_combine", 20, 4096) is None


def test_cpu_world_head_and_old_commit(old_tree, tmp_path, capsys):
    """The whole benchmark on 2 CPU ranks (reference backends), tiny V3-like shape: every row
    compared with the oracle and right; DeepEP asked for from an empty folder is reported, not run."""
    out = tmp_path / "peers.json"
    rc = bp.main(["--world", "2", "--engines", "head,917fdc0,deepep", "--old", str(old_tree),
                  "--deepep", str(tmp_path / "none"), "--tokens", "48", "--hidden", "256", "--experts", "16",
                  "--groups", "4", "--topk-groups", "2", "--topk", "4", "--sms", "20",
                  "--warmup", "0", "--iters", "1", "--host-iters", "1", "--json", str(out)])
    text = capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert rc == 1 and "# [failed] EP2 deepep: load: ImportError" in text   # DeepEP missing fails the run
    rows = doc["rows"]
    assert {r["engine"] for r in rows} == {"head", bp.OLD_COMMIT}
    assert len(rows) == 2 * 2 * len(bp.OPS)   # engines x (sms20, tuned) x ops
    assert all(r["checked"] and r["wrong"] == 0 for r in rows), [r for r in rows if r["wrong"]]
    assert all(r["size_bytes"] > 0 and r["gpu_us"] > 0 for r in rows)
    assert any(q["x_old"] for q in doc["ratios"] if q["engine"] == "head")
    assert "Out of bounds values : 0 OK" in text


# ------------------------------------------------------------------------------ the build script
FAKE_SETUP = r'''
import importlib.util, os, sys, sysconfig
assert importlib.util.find_spec("nvidia.nvshmem") is None, "NVSHMEM visible to setup.py"
assert "NVSHMEM_DIR" not in os.environ
import torch.utils.cpp_extension as ce
assert ce.CUDAExtension.__name__ == "extension", "no device-link step"
assert os.environ["TORCH_CUDA_ARCH_LIST"] == "9.0" and os.environ["MAX_JOBS"] == "16"
assert sys.argv[1:] == ["build_ext", "--inplace"], sys.argv
with open("deep_ep_cpp" + sysconfig.get_config_var("EXT_SUFFIX"), "w") as f:
    f.write("fake")
with open(os.environ["FAKE_BUILD_LOG"], "a") as f:
    f.write("built\n")
'''


def test_build_script_hides_nvshmem_and_reuses_its_build(tmp_path):
    src = tmp_path / "DeepEP"
    for f in ("csrc/deep_ep.cpp", "csrc/kernels/intranode.cu", "deep_ep/buffer.py"):
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        (src / f).write_text("// source\n")
    (src / "setup.py").write_text(FAKE_SETUP)
    nv = tmp_path / "site" / "nvidia" / "nvshmem"    # a pip NVSHMEM the build must not see
    nv.mkdir(parents=True)
    (nv / "__init__.py").write_text("")
    (nv.parent / "__init__.py").write_text("")
    log = tmp_path / "builds.log"
    env = dict(os.environ, PYTHON=sys.executable, FAKE_BUILD_LOG=str(log), NVSHMEM_DIR="/opt/nvshmem",
               DEEPEP_IMPORT_CHECK="0",
               PYTHONPATH=f"{tmp_path / 'site'}:{ROOT}", MAX_JOBS="16")
    build = tmp_path / "out" / "DeepEP"

    def run():
        proc = subprocess.run(["bash", str(ROOT / "benchmarks/peers/build_deepep.sh"), str(src), str(build)],
                              capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    first = run()
    assert "[deepep-build] built in" in first and first.strip().endswith(f"ok {build}")
    assert "reused" in run() and log.read_text() == "built\n"
    (src / "csrc/kernels/intranode.cu").write_text("// changed\n")
    assert "built in" in run() and log.read_text() == "built\nbuilt\n"
    (src / "setup.py").write_text(FAKE_SETUP.replace('"9.0"', '"8.0"'))   # a failing build fails the script
    proc = subprocess.run(["bash", str(ROOT / "benchmarks/peers/build_deepep.sh"), str(src), str(build)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode != 0
    missing = subprocess.run(["bash", str(ROOT / "benchmarks/peers/build_deepep.sh"), str(tmp_path / "none")],
                             capture_output=True, text=True, env=env, timeout=60)
    assert missing.returncode != 0


def test_setup_runner_adds_the_device_link_only_where_needed():
    from benchmarks.peers import deepep_setup

    seen = []
    make = deepep_setup.with_device_link(lambda name, sources, **kw: seen.append(kw) or name)
    make("deep_ep_cpp", ["a.cu"], extra_compile_args={"cxx": [], "nvcc": ["-O3", "-rdc=true"]})
    make("deep_ep_cpp", ["a.cu"], extra_compile_args={"nvcc": ["-O3"]})                     # no rdc: none
    make("deep_ep_cpp", ["a.cu"], extra_compile_args={"nvcc": ["-rdc=true"], "nvcc_dlink": ["-dlink", "-lx"]})
    assert [kw["extra_compile_args"].get("nvcc_dlink") for kw in seen] == [["-dlink"], None, ["-dlink", "-lx"]]
    assert seen[0]["extra_compile_args"]["nvcc"] == ["-O3", "-rdc=true"]   # DeepEP's flags untouched
