"""The deep_ep compatibility package and the pieces behind it that need no process group: the import
(which implementation, the real-DeepEP warning), topology from hostnames, FP8 scales of any layout,
the LogFMT codec, events, and the internode handle order."""
import importlib
import logging
import subprocess
import sys
import textwrap

import pytest
import torch

import deep_ep
from commlib.backends.low_latency.reference import logfmt_roundtrip
from commlib.handle import DispatchHandle
from commlib.topology import Topology, ranks_per_node_from_hosts
from commlib.utils.event import EventHandle, EventOverlap
from commlib.validate import scales_carrier, scales_from_carrier, split_x


def test_deep_ep_is_commlib():
    import commlib
    assert deep_ep.__implementation__ == "commlib" and deep_ep.__version__ == commlib.__version__
    assert deep_ep.Buffer is commlib.Buffer and deep_ep.Config is commlib.Config
    assert deep_ep.topk_idx_t is torch.int64
    from deep_ep.utils import EventHandle as EH
    from deep_ep.utils import EventOverlap as EO
    from deep_ep.utils import check_nvlink_connections
    assert EH is EventHandle and EO is EventOverlap
    check_nvlink_connections(None)
    from deep_ep.buffer import Buffer
    assert Buffer is commlib.Buffer


def _run(code: str, env_extra: dict, path_extra: str = "") -> subprocess.CompletedProcess:
    import os
    env = dict(os.environ, **env_extra)
    root = str(__import__("pathlib").Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (path_extra, root, env.get("PYTHONPATH", "")) if p)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=120)


def test_import_says_which_and_warns_on_a_real_deep_ep(tmp_path):
    code = """
        import logging, warnings
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
        warnings.simplefilter("always")
        import deep_ep
        print("impl", deep_ep.__implementation__, deep_ep.find_real_deep_ep())
    """
    r = _run(code, {"COMMLIB_DEEP_EP_QUIET": "0"})
    assert r.returncode == 0, r.stderr
    assert "deep_ep: deep_ep -> commlib" in r.stderr and "compatibility layer" in r.stderr
    assert "impl commlib []" in r.stdout and "RuntimeWarning" not in r.stderr
    quiet = _run(code, {"COMMLIB_DEEP_EP_QUIET": "1"})
    assert "deep_ep -> commlib" not in quiet.stderr
    # a real DeepEP's extension on the path: the import warns, naming it
    (tmp_path / "deep_ep_cpp.py").write_text("")
    r = _run(code, {"COMMLIB_DEEP_EP_QUIET": "1"}, str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "RuntimeWarning" in r.stderr and "deep_ep_cpp at" in r.stderr and "Uninstall one" in r.stderr
    r = _run("import runpy; runpy.run_module('deep_ep', run_name='__main__')", {"COMMLIB_DEEP_EP_QUIET": "1"},
             str(tmp_path))
    assert "deep_ep -> commlib" in r.stdout and "real DeepEP visible: deep_ep_cpp at" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("hosts, want", [
    (["a"] * 4, 4),
    (["a", "a", "b", "b"], 2),
    (["a", "b", "c", "d"], 1),
    (["a", "a", "a", "b"], None),       # unequal: one node, with a warning
    (["a", "b", "a", "b"], None),       # not node-major
])
def test_ranks_per_node_from_hostnames(hosts, want):
    if want is None:
        with pytest.warns(RuntimeWarning, match="node-major"):
            assert ranks_per_node_from_hosts(hosts) is None
    else:
        assert ranks_per_node_from_hosts(hosts) == want


def test_topology_without_launcher_variables(monkeypatch):
    for name in ("COMMLIB_RANKS_PER_NODE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS",
                 "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(name, raising=False)
    t = Topology.detect(5, 8, hostnames=["n0"] * 4 + ["n1"] * 4)
    assert (t.num_nodes, t.node, t.local_rank) == (2, 1, 1)
    assert Topology.detect(0, 8).num_nodes == 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # a launcher's word wins over the hostnames
    assert Topology.detect(5, 8, hostnames=["n0"] * 4 + ["n1"] * 4).num_nodes == 1


def test_fp8_scales_of_any_layout_round_trip():
    T, H = 5, 1024
    q = torch.randn(T, H).to(torch.float8_e4m3fn)
    cases = [torch.rand(T, H // 128).T.contiguous().T,                      # DeepGEMM's column-major
             torch.rand(T, 1),                                              # per token
             torch.randint(0, 2 ** 31 - 1, (T, H // 512), dtype=torch.int32),  # packed UE8M0
             torch.rand(T, H // 128)]                                       # plain
    for s in cases:
        data, scales = split_x((q, s), 0, torch.device("cpu"))
        c = scales_carrier(scales, H)
        assert c.dtype == torch.float32 and c.shape == (T, H // 128) and c.is_contiguous()
        back = scales_from_carrier(c, s.shape[1], s.dtype)
        assert back.dtype == s.dtype and back.shape == s.shape and torch.equal(back.view(torch.int32),
                                                                                s.contiguous().view(torch.int32))
    with pytest.raises(ValueError, match="scales"):
        split_x((q, torch.rand(T, H // 64)), 0, torch.device("cpu"))
    with pytest.raises(TypeError, match="int32"):
        split_x((q, torch.rand(T, 8, dtype=torch.float64)), 0, torch.device("cpu"))


def test_logfmt_codec():
    g = torch.Generator().manual_seed(0)
    small = (torch.randn(6, 256, generator=g) * 0.1).to(torch.bfloat16)
    small[0, :128] = 0  # an all-zero block stays zero
    big = (torch.randn(2, 256, generator=g) * 4).to(torch.bfloat16)
    dec = logfmt_roundtrip(small)
    assert torch.equal(dec[0, :128], torch.zeros(128))
    # nonzero values keep their sign and land within half a level (log2 step <= 32 / 510) of the truth
    v = small.float()
    nz = v != 0
    assert torch.equal(torch.sign(dec[nz]), torch.sign(v[nz]))
    rel = (dec[nz] / v[nz]).abs()
    assert float(rel.max()) <= 2 ** (32 / 510 / 2) + 1e-6 and float(rel.min()) >= 2 ** (-32 / 510 / 2) - 1e-6
    # a block with a value of magnitude >= 1 travels as bf16, unchanged
    assert torch.equal(logfmt_roundtrip(big), big.float())
    # the block maximum and minimum are levels: exact
    blk = small[1, :128].float()
    i, j = blk.abs().argmax(), blk.abs().argmin()
    assert torch.allclose(dec[1, i], blk[i], rtol=1e-5) and torch.allclose(dec[1, j], blk[j], rtol=1e-5)


def test_events_on_cpu():
    h = EventHandle()
    assert h.event is None
    h.current_stream_wait()
    ev = EventOverlap(EventHandle())
    assert ev.event is None
    ev.current_stream_wait()
    with ev:
        pass
    assert deep_ep.Buffer.capture().event is None  # static, callable on the class


def test_internode_handle_order():
    T, R, C = 6, 4, 2
    tir = torch.rand(T, R) > 0.5
    rpm = torch.cumsum(torch.randint(0, 3, (R, R), dtype=torch.int32), 0).to(torch.int32)
    n = int(rpm[-1, 1])
    common = dict(rank_prefix_matrix=rpm, channel_prefix_matrix=torch.zeros(R, C, dtype=torch.int32),
                  recv_channel_prefix_matrix=torch.zeros(R, C, dtype=torch.int32),
                  recv_src_idx=torch.arange(n, dtype=torch.int32), is_token_in_rank=tir,
                  send_head=torch.zeros(T, R, dtype=torch.int32), num_tokens=T, num_channels=C)
    one = DispatchHandle(topology=Topology(1, R, R), **common)
    assert len(one) == 6 and one[0] is rpm and one[4] is tir
    two = DispatchHandle(topology=Topology(1, R, 2), **common)
    f = list(two)
    assert len(two) == 10 and f[0] is tir
    assert f[1].shape == (2, C) and f[2] is two.channel_prefix_matrix and f[5] is two.recv_channel_prefix_matrix
    assert torch.equal(f[6], rpm[:, 1]) and f[7].shape == (n, 2)
    assert f[3] is None and f[4] is None and f[8] is None and f[9] is None


def test_megatron_sees_deep_ep():
    fused_a2a = pytest.importorskip("megatron.core.transformer.moe.fused_a2a")
    assert fused_a2a.HAVE_DEEP_EP and fused_a2a.Buffer is deep_ep.Buffer
    assert fused_a2a.EventOverlap is EventOverlap and fused_a2a.EventHandle is EventHandle


def test_quiet_import_logs_nothing(caplog, monkeypatch):
    monkeypatch.setenv("COMMLIB_DEEP_EP_QUIET", "1")
    with caplog.at_level(logging.INFO, logger="deep_ep"):
        importlib.reload(deep_ep)
    assert not [r for r in caplog.records if r.name == "deep_ep"]
