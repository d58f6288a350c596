"""DeepEP V2's module layout on commlib's ``deep_ep`` (what V2's own test files import), and, where
they are staged (scripts/stage_deepep_v2_tests.sh into .deepep_v2_tests), those test files run
unchanged on 2 CPU ranks through scripts/deepep_tests.sh with the CPU emulation harness
(tests/deepep_v2_cpu/sitecustomize.py). The GPU runs are gpu_check.sh's v2* stages."""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
STAGED = REPO / ".deepep_v2_tests"

# every name V2's test files (tests/elastic/*.py, tests/utils/test_gate.py at DeepEP dd758ca) import
# from a module commlib provides, and V2's package-level names its clients use
V2_IMPORTS = {
    "deep_ep": ["ElasticBuffer", "EPHandle", "Buffer", "Config", "EventOverlap", "EventHandle", "topk_idx_t",
                "get_physical_domain_size", "get_logical_domain_size"],
    "deep_ep.utils": ["EventHandle"],
    "deep_ep.utils.event": ["EventHandle", "EventOverlap"],
    "deep_ep.utils.envs": ["init_dist", "init_seed", "dist_print", "get_rdma_gbs", "get_nvlink_gbs",
                           "get_local_seed", "get_global_seed", "check_nvlink_connections",
                           "check_torch_deterministic", "check_fast_rdma_atomic_support"],
    "deep_ep.utils.math": ["align", "ceil_div", "count_bytes", "calc_diff", "per_token_cast_back",
                           "per_token_cast_to_fp8", "safe_div", "hash_tensor", "hash_tensors"],
}
# ElasticBuffer members V2's test files touch
V2_MEMBERS = ["dispatch", "combine", "capture", "barrier", "destroy", "get_logical_domain_size",
              "get_theoretical_num_sms", "get_theoretical_num_qps", "engram_write", "engram_fetch",
              "pp_set_config", "pp_send", "pp_recv", "agrs_set_config", "agrs_new_session", "agrs_get_inplace_tensor",
              "all_gather", "create_agrs_session", "destroy_agrs_session", "get_engram_storage_size_hint",
              "get_pp_buffer_size_hint", "get_agrs_num_max_session_bytes"]


@pytest.mark.parametrize("module", sorted(V2_IMPORTS))
def test_v2_layout_imports(module):
    m = importlib.import_module(module)
    missing = [n for n in V2_IMPORTS[module] if not hasattr(m, n)]
    assert not missing, f"{module} lacks {missing}"
    assert Path(m.__file__).resolve().is_relative_to(REPO / "deep_ep"), m.__file__


def test_v2_buffer_members():
    import deep_ep
    missing = [n for n in V2_MEMBERS if not hasattr(deep_ep.ElasticBuffer, n)]
    assert not missing, missing


@pytest.mark.skipif(not STAGED.is_dir(), reason="DeepEP V2's tests not staged (scripts/stage_deepep_v2_tests.sh)")
def test_staged_files_import_only_the_layout():
    """Every `from deep_ep... import name` in the staged test files names a module and a name commlib
    provides (V2_IMPORTS) or one of V2's own test-support modules staged beside them."""
    import ast
    support = {f"deep_ep.utils.{p.stem}" for p in (STAGED / "support" / "deep_ep" / "utils").glob("*.py")}
    for f in sorted((STAGED / "tests").rglob("test_*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("deep_ep"):
                if node.module in support:
                    continue
                assert node.module in V2_IMPORTS, (f.name, node.module)
                for a in node.names:
                    assert a.name in V2_IMPORTS[node.module], (f.name, node.module, a.name)


def test_v2_math_helpers():
    from deep_ep.utils import math as m
    assert (m.align(5, 4), m.align(8, 4), m.ceil_div(9, 4)) == (8, 8, 3)
    assert m.safe_div(0, 0) == 0 and m.safe_div(3, 2) == 1.5
    with pytest.raises(ZeroDivisionError):
        m.safe_div(1, 0)
    x = torch.randn(6, 200)
    assert m.calc_diff(x, x) == pytest.approx(0, abs=1e-12)
    a, b = x.double() + 1, (x * 1.1).double() + 1   # the metric, written out
    assert m.calc_diff(x, x * 1.1) == pytest.approx(float(((a - b) ** 2).sum() / (a * a + b * b).sum()), rel=1e-9)
    q, s = m.per_token_cast_to_fp8(x)               # 200 channels: the second block is zero-padded
    assert q.shape == (6, 200) and q.dtype == torch.float8_e4m3fn and s.shape == (6, 2)
    assert torch.allclose(s[:, 0], x[:, :128].abs().amax(1) / 448) and torch.allclose(s[:, 1], x[:, 128:].abs().amax(1) / 448)
    back = m.per_token_cast_back(q, s)
    assert back.dtype == torch.bfloat16 and back.shape == (6, 200)
    assert ((back.float() - x).abs() <= x.abs() / 16 + s.repeat_interleave(128, 1)[:, :200] * 448 / 512 + 1e-2).all()
    # packed UE8M0: each byte an exponent, scale 2 ** (byte - 127); and column-major scales
    e = torch.randint(120, 130, (6, 4), dtype=torch.uint8)
    packed = e.view(torch.int32)                    # [6, 1]: four scales per int
    q4 = torch.randn(6, 512).to(torch.float8_e4m3fn)
    want = (q4.float().view(6, 4, 128) * torch.pow(2.0, e.float() - 127).unsqueeze(2)).view(6, 512).to(torch.bfloat16)
    assert torch.equal(m.per_token_cast_back(q4, packed), want)
    col = torch.empty_strided((6, 2), (1, 8))
    col.copy_(s)
    assert torch.equal(m.per_token_cast_back(q, col), back)
    assert m.per_token_cast_back(q[:0], s[:0]).shape == (0, 200)
    assert m.count_bytes(x, (q, None), [s]) == 6 * 200 * 4 + 6 * 200 + 6 * 2 * 4
    i = torch.arange(4, dtype=torch.int32)
    assert m.hash_tensor(i) == 6 and m.hash_tensors(i, (i * 2, None)) == 6 ^ 12


_ENVS_WORLD = textwrap.dedent("""
    import os, sys, torch
    import torch.distributed as dist
    from deep_ep.utils import envs
    import deep_ep

    def run(local_rank, n):
        rank, world, group = envs.init_dist(local_rank, n, seed=3)
        assert (rank, world) == (local_rank, n) and group.size() == n
        assert envs.get_global_seed() == 3 and envs.get_local_seed() == 3 + rank
        assert torch.get_default_dtype() == torch.bfloat16
        torch.set_default_dtype(torch.float32)
        per_node = int(os.environ.get("COMMLIB_RANKS_PER_NODE", n))
        phys = (n // per_node, per_node)
        assert envs.get_physical_domain_size(group) == phys, envs.get_physical_domain_size(group)
        assert deep_ep.get_logical_domain_size(group) == phys
        assert envs.get_logical_domain_size(group, allow_hybrid_mode=False) == (1, n)
        envs.dist_print(f"once {rank}", once_in_node=True)
        envs.dist_print(f"each {rank}")
        buf = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=8, hidden=128, explicitly_destroy=True)
        assert buf.get_physical_domain_size() == phys and buf.get_logical_domain_size() == phys
        buf.destroy()
        dist.destroy_process_group()

    if __name__ == "__main__":
        torch.multiprocessing.spawn(run, args=(2,), nprocs=2)
""")


@pytest.mark.parametrize("ranks_per_node", [None, 1])
def test_v2_envs_world(tmp_path, ranks_per_node):
    """init_dist / seeds / dist_print / domain sizes on 2 spawned CPU ranks (gloo), as V2's tests call them."""
    script = tmp_path / "world.py"
    script.write_text(_ENVS_WORLD)
    env = dict(os.environ, PYTHONPATH=str(REPO), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29800 + (ranks_per_node or 0)),
               COMMLIB_DEEP_EP_QUIET="1", CUDA_VISIBLE_DEVICES="")
    env.pop("COMMLIB_RANKS_PER_NODE", None)
    if ranks_per_node:
        env["COMMLIB_RANKS_PER_NODE"] = str(ranks_per_node)
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.split()
    assert lines.count("once") == 1, r.stdout   # local rank 0 (the launch's process index) only
    assert lines.count("each") == 2, r.stdout


@pytest.mark.skipif(not STAGED.is_dir(), reason="DeepEP V2's tests not staged (scripts/stage_deepep_v2_tests.sh)")
@pytest.mark.parametrize("run", ["v2ep", "v2ep_nosync", "v2ep_nomr"])
def test_v2_test_ep_on_cpu_ranks(tmp_path, run):
    """V2's test_ep.py, unchanged, on 2 CPU ranks: its first mode (fp8, expert_alignment=128, handle
    copy) at a small shape, against V2's own reference (refs.py). The whole file at this shape (144
    modes) takes about 2 minutes: DEEPEP_V2_ARGS without --test-first-only."""
    env = dict(os.environ, DEEPEP_V2_CPU="1", COMMLIB_DEEP_EP_QUIET="1", PYTHON=sys.executable,
               DEEPEP_TIMEOUT_S="200", CUDA_VISIBLE_DEVICES="",
               DEEPEP_V2_ARGS="--num-tokens 32 --hidden 256 --num-experts 8 --num-topk 4 --test-first-only")
    r = subprocess.run(["bash", str(REPO / "scripts" / "deepep_tests.sh"), str(tmp_path), str(REPO / "tests" / "deepep_v2_cpu"),
                        str(STAGED), run], env=env, capture_output=True, text=True, timeout=300)
    log = (tmp_path / f"{run}.log").read_text() if (tmp_path / f"{run}.log").exists() else ""
    assert r.returncode == 0, r.stdout + log[-4000:]
    assert "Testing with do_handle_copy=1, expert_alignment=128, use_fp8_dispatch=1" in log
