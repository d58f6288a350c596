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
from commlib.config import row_slot_bytes as commlib_row_slot_bytes
from commlib.handle import DispatchHandle
from commlib import topology as topo
from commlib.topology import RankFacts, Topology, local_facts, node_groups, ranks_per_node_from_facts, ranks_per_node_from_hosts
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


# ------------------------------------------------------------------ topology from the ranks' facts
def _gpu_host(host, gpus, pairs=None, boot="b0", ranks=None):
    """RankFacts of ranks on one host, rank i on GPU ranks[i] (default: one rank per GPU). ``pairs``:
    groups of GPUs with peer access among themselves (default: all of them)."""
    visible = tuple(f"{host}-g{i}" for i in range(gpus))
    pairs = pairs or [list(range(gpus))]
    reach = {g: tuple(visible[j] for p in pairs if g in p for j in p) for g in range(gpus)}
    return [RankFacts(host, boot, visible[g], visible, reach[g]) for g in (ranks if ranks is not None else range(gpus))]


def test_ranks_per_node_from_gpu_facts():
    cpu = [RankFacts("n0", "b0")] * 4 + [RankFacts("n1", "b1")] * 4
    assert ranks_per_node_from_facts(cpu) == 4
    # the same hostname on two machines (e.g. containers named alike): the boot ids tell them apart
    assert ranks_per_node_from_facts([RankFacts("pod", "b0")] * 2 + [RankFacts("pod", "b1")] * 2) == 2
    # 8 GPUs of one host with full peer access; two such hosts
    assert ranks_per_node_from_facts(_gpu_host("a", 8)) == 8
    assert ranks_per_node_from_facts(_gpu_host("a", 8) + _gpu_host("b", 8, boot="b1")) == 8
    # NVLink pairs (A100 PCIe): peer access only inside each pair -> nodes of 2 on one host
    pairs = _gpu_host("a", 4, pairs=[[0, 1], [2, 3]])
    assert node_groups(pairs) == [[0, 1], [2, 3]] and ranks_per_node_from_facts(pairs) == 2
    # no peer access at all: every GPU its own node
    assert ranks_per_node_from_facts(_gpu_host("a", 3, pairs=[[0], [1], [2]])) == 1
    # ranks sharing a GPU are one node; a process that does not see a peer's GPU (CUDA_VISIBLE_DEVICES
    # per process) has no evidence against it: the host decides
    assert ranks_per_node_from_facts(_gpu_host("a", 2, ranks=[0, 0, 1, 1])) == 4
    hidden = [RankFacts("a", "b0", f"a-g{i}", (f"a-g{i}",), (f"a-g{i}",)) for i in range(4)]
    assert ranks_per_node_from_facts(hidden) == 4
    # Topology.detect uses the facts when no launcher variable says more
    t = Topology.detect(3, 4, facts=pairs)
    assert (t.num_nodes, t.node, t.local_rank) == (2, 1, 1)


def test_inconsistent_gpu_layouts_are_refused():
    # a host's ranks not consecutive: GPU ranks raise (one node would pair ranks of two hosts), naming the layout
    interleaved = [_gpu_host("a", 2)[0], _gpu_host("b", 2, boot="b1")[0], _gpu_host("a", 2)[1],
                   _gpu_host("b", 2, boot="b1")[1]]
    with pytest.raises(ValueError, match=r"node-major.*\('a', \[0, 2\]\)"):
        ranks_per_node_from_facts(interleaved)
    with pytest.raises(ValueError, match="node-major"):  # NVLink pairs interleaved in rank order
        ranks_per_node_from_facts(_gpu_host("a", 4, pairs=[[0, 2], [1, 3]]))
    with pytest.raises(ValueError, match="node-major"):  # unequal nodes
        ranks_per_node_from_facts(_gpu_host("a", 3) + _gpu_host("b", 1, boot="b1"))
    # peer access that does not partition the host: 0-1 and 1-2 reach each other, 0-2 do not
    chain = _gpu_host("a", 3)
    chain = [RankFacts("a", "b0", f.gpu, f.visible, p) for f, p in
             zip(chain, [("a-g0", "a-g1"), ("a-g0", "a-g1", "a-g2"), ("a-g1", "a-g2")])]
    with pytest.raises(ValueError, match="ranks 0 and 2"):
        node_groups(chain)
    # CPU ranks keep the documented fallback: a warning and one node
    with pytest.warns(RuntimeWarning, match="node-major"):
        assert ranks_per_node_from_facts([RankFacts("a"), RankFacts("b"), RankFacts("a"), RankFacts("b")]) is None


def test_local_facts(monkeypatch, tmp_path):
    import socket
    import types
    cpu = local_facts(torch.device("cpu"))
    assert cpu.hostname == socket.gethostname() and cpu.gpu == "" and cpu.visible == () and cpu.peers == ()
    if topo.os.path.exists("/proc/sys/kernel/random/boot_id"):
        assert len(cpu.boot_id) == 36
    # a CUDA rank on GPU 1 of 3, with peer access to GPU 2 only (mocked: no GPU here)
    uuids = ["aaa", "bbb", "ccc"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(uuid=uuids[i]))
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: {a, b} == {1, 2})
    f = local_facts()
    assert f.gpu == "GPU-bbb" and f.visible == ("GPU-aaa", "GPU-bbb", "GPU-ccc") and f.peers == ("GPU-bbb", "GPU-ccc")
    # without a UUID (older torch): the PCI address
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(pci_domain_id=0, pci_bus_id=0x1b + i, pci_device_id=0))
    assert local_facts(torch.device("cuda", 0)).gpu == "0000:1b:00"


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


# ------------------------------------------------------------------ Config as DeepEP's
def _deepep_config(sms, nvl_send, nvl_recv, rdma_send, rdma_recv):
    """What DeepEP v1's C++ Config constructor does with five ints (csrc/config.hpp, read and restated):
    None where one of its assertions fails, else the fields it keeps (the network ring rounded up to
    whole send chunks)."""
    if sms < 0 or nvl_send <= 0 or nvl_recv <= 0 or nvl_send >= nvl_recv or rdma_send <= 0 or rdma_recv <= 0:
        return None
    rdma_recv = -(-rdma_recv // rdma_send) * rdma_send
    if not rdma_send < rdma_recv or rdma_send > rdma_recv // 2:
        return None
    return (sms, nvl_send, nvl_recv, rdma_send, rdma_recv)


def _commlib_config(*fields):
    try:
        c = deep_ep.Config(*fields)
    except ValueError:
        return None
    return (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens,
            c.num_max_rdma_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens)


def test_config_accepts_and_refuses_what_deepep_does():
    import itertools
    sms = (-2, -1, 0, 1, 2, 3, 20, 24)
    small = (-1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 12, 13)
    n = 0
    for fields in itertools.product(sms, small, small, small, small):
        assert _commlib_config(*fields) == _deepep_config(*fields), fields
        n += _deepep_config(*fields) is not None
    assert n > 1000  # both answers occur often
    # DeepEP's recommended configs (its table's values) and the defaults are accepted
    for f in [(24, 256, 6, 128), (36, 288, 20, 128), (32, 288, 8, 128), (20, 480, 12, 128), (28, 720, 12, 128),
              (1, 288, 8, 128), (2, 720, 8, 128), (6, 256, 6, 256)]:
        assert _commlib_config(20, *f) == _deepep_config(20, *f) is not None


def test_config_defaults_and_argument_types_as_deepep():
    import numpy as np
    c = deep_ep.Config()
    assert (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens,
            c.num_max_rdma_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens) == (20, 6, 256, 6, 258)
    assert _deepep_config(20, 6, 256, 6, 256) == (20, 6, 256, 6, 258)  # DeepEP's default ring, rounded up too
    assert deep_ep.Config(num_max_rdma_chunked_recv_tokens=128).num_max_rdma_chunked_recv_tokens == 132
    # pybind11's int conversion: integers of any kind (bool, numpy, 0-d torch) are ints; floats, strings are not
    c = deep_ep.Config(np.int64(24), np.int32(6), torch.tensor(256), True + 5, 128)
    assert c == deep_ep.Config(24, 6, 256, 6, 128) and type(c.num_sms) is int and type(c.num_max_nvl_chunked_recv_tokens) is int
    assert deep_ep.Config(True, 6, 256).num_sms == 1
    for bad in (20.0, "20", None, np.float32(20)):
        with pytest.raises(TypeError, match="num_sms"):
            deep_ep.Config(bad)
    with pytest.raises(TypeError, match="32-bit"):
        deep_ep.Config(20, 6, 2 ** 31)
    with pytest.raises(ValueError, match="32-bit"):
        deep_ep.Config(20, 6, 256, 2 ** 31 - 3, 2 ** 31 - 2)  # rounded up past int32
    # 0 and odd num_sms: built (as DeepEP) and sized, refused by a call (check_runnable; tests/cases_deep_ep.py)
    for sms in (0, 1, 3):
        odd = deep_ep.Config(sms, 6, 256)
        assert odd.get_nvl_buffer_size_hint(7168 * 2, 8) == (sms // 2) * 8 * 256 * commlib_row_slot_bytes(7168 * 2)
        with pytest.raises(ValueError, match="positive even"):
            odd.check_runnable(3)
    assert deep_ep.Config(2, 6, 256).check_runnable() is not None
    # the hints take numpy integers too
    assert deep_ep.Config().get_nvl_buffer_size_hint(np.int64(7168 * 2), np.int32(8)) == \
        deep_ep.Config().get_nvl_buffer_size_hint(7168 * 2, 8)


# DeepEP v1's get_dispatch_config / get_combine_config values (its last v1 code): EP size -> fields 1..4
DEEPEP_DISPATCH = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
                   24: (32, 288, 8, 128), 32: (32, 288, 8, 128), 48: (32, 288, 8, 128), 64: (32, 288, 8, 128),
                   96: (20, 480, 12, 128), 128: (20, 560, 12, 128), 144: (32, 720, 12, 128), 160: (28, 720, 12, 128)}
DEEPEP_COMBINE = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
                  24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 48: (1, 288, 8, 128), 64: (1, 288, 8, 128),
                  96: (1, 480, 8, 128), 128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128)}


def test_default_configs_are_deepeps(monkeypatch):
    monkeypatch.setattr(deep_ep.Buffer, "num_sms", 24)
    for table, get in ((DEEPEP_DISPATCH, deep_ep.Buffer.get_dispatch_config),
                       (DEEPEP_COMBINE, deep_ep.Buffer.get_combine_config)):
        for R, fields in table.items():
            assert get(R) == deep_ep.Config(24, *fields), (get, R)
        # beyond DeepEP (which asserts the size is in its table): the next size up, the largest past the end
        assert get(1) == get(2) and get(3) == get(4) and get(12) == get(16) and get(100) == get(128)
        assert get(1024) == get(160)
        with pytest.raises(ValueError, match="num_ranks"):
            get(0)


def test_share_memory_decides_the_forwarder_kernel():
    """The internode engine's forwarder kernel needs the node's ranks to map each other's memory:
    one host and boot, and peer access (or one GPU shared)."""
    from commlib.topology import share_memory
    assert share_memory(_gpu_host("a", 4))
    assert share_memory(_gpu_host("a", 1, ranks=[0, 0]))                    # processes sharing one GPU
    assert not share_memory(_gpu_host("a", 4, pairs=[[0, 1], [2, 3]]))      # 0 cannot reach 2
    assert share_memory(_gpu_host("a", 4, pairs=[[0, 1], [2, 3]], ranks=[0, 1]))
    assert not share_memory(_gpu_host("a", 2, ranks=[0]) + _gpu_host("b", 2, ranks=[0]))   # two hosts
    assert not share_memory(_gpu_host("a", 2, ranks=[0], boot="b0") + _gpu_host("a", 2, ranks=[1], boot="b1"))
