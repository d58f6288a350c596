"""Single-process unit tests: config, topology, layout helpers, FP8, routing, handle."""
import pytest
import torch

import commlib
from commlib import routing
from commlib.utils import env
from commlib.config import Config, row_slot_bytes
from commlib.fp8 import per_token_cast_back, per_token_cast_to_fp8, roundtrip_bound
from commlib.layout import channel_prefix_matrix, channel_starts, dispatch_layout, rows_before, send_head
from commlib.topology import Topology


def test_config_validation_and_hints():
    c = Config(20, 32, 512)
    assert c.num_channels == 10
    assert c.get_nvl_buffer_size_hint(7168 * 2, 2) > 2 * 10 * 512 * 7168 * 2
    assert row_slot_bytes(14336) >= 14336 + 14336 // 32
    for bad, word in (((21, 8, 16), "even"), ((20, 32, 16), "less than"), ((20, 16, 16), "less than"),
                      ((20, 0, 16), "positive"), ((20, 8, 16, 64, 32), "rdma")):
        with pytest.raises(ValueError, match=word):
            Config(*bad)
    with pytest.raises(TypeError):
        Config(20.0, 8, 16)
    assert commlib.Buffer.get_dispatch_config(8).num_sms == commlib.Buffer.num_sms


def test_topology(monkeypatch):
    t = Topology(rank=5, num_ranks=8, ranks_per_node=4)
    assert (t.num_nodes, t.node, t.local_rank) == (2, 1, 1)
    assert t.node_ranks() == [4, 5, 6, 7] and t.rail_ranks() == [1, 5]
    monkeypatch.setenv("COMMLIB_RANKS_PER_NODE", "2")
    assert Topology.detect(3, 8).ranks_per_node == 2
    monkeypatch.delenv("COMMLIB_RANKS_PER_NODE")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert Topology.detect(3, 8).num_nodes == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="divide"):
        Topology.detect(0, 8)
    monkeypatch.setenv("COMMLIB_RANKS_PER_NODE", "x")
    with pytest.raises(ValueError, match="COMMLIB_RANKS_PER_NODE"):
        env.ranks_per_node()


def test_ce_staging(monkeypatch):
    """COMMLIB_CE_STAGING: device unless set; host; anything else is refused by name."""
    monkeypatch.delenv("COMMLIB_CE_STAGING", raising=False)
    assert env.ce_staging() == "device"
    monkeypatch.setenv("COMMLIB_CE_STAGING", "HOST")
    assert env.ce_staging() == "host"
    monkeypatch.setenv("COMMLIB_CE_STAGING", "nvme")
    with pytest.raises(ValueError, match="COMMLIB_CE_STAGING"):
        env.ce_staging()


def test_ce_bytes(monkeypatch):
    """COMMLIB_CE_BYTES: 0 (SM kernels) unless set; a negative or non-integer value is refused by name."""
    monkeypatch.delenv("COMMLIB_CE_BYTES", raising=False)
    assert env.ce_bytes() == 0
    monkeypatch.setenv("COMMLIB_CE_BYTES", str(600 << 20))
    assert env.ce_bytes() == 600 << 20
    for bad in ("-1", "lots"):
        monkeypatch.setenv("COMMLIB_CE_BYTES", bad)
        with pytest.raises(ValueError, match="COMMLIB_CE_BYTES"):
            env.ce_bytes()
    monkeypatch.delenv("COMMLIB_CE_SMS", raising=False)
    assert env.ce_sms() == 0
    monkeypatch.setenv("COMMLIB_CE_SMS", "16")
    assert env.ce_sms() == 16
    monkeypatch.setenv("COMMLIB_CE_SMS", "-2")
    with pytest.raises(ValueError, match="COMMLIB_CE_SMS"):
        env.ce_sms()


def test_default_on_switches(monkeypatch):
    """COMMLIB_FAST_LAUNCH and COMMLIB_DEFER_WGRAD are on unless set to 0 / false / no / off."""
    for name, read in (("COMMLIB_FAST_LAUNCH", env.fast_launch), ("COMMLIB_DEFER_WGRAD", env.defer_wgrad)):
        monkeypatch.delenv(name, raising=False)
        assert read()
        for off in ("0", "false", "No", "OFF"):
            monkeypatch.setenv(name, off)
            assert not read(), (name, off)
        for on in ("1", "", "yes"):
            monkeypatch.setenv(name, on)
            assert read(), (name, on)


def test_layout_helpers():
    assert channel_starts(10, 4) == [0, 3, 6, 9, 10]
    assert channel_starts(0, 3) == [0, 0, 0, 0]
    topo = Topology(0, 4, 2)
    idx = torch.tensor([[0, 5], [2, -1], [7, 6], [-1, -1]])
    lay = dispatch_layout(idx, 8, topo)
    assert lay.is_token_in_rank.tolist() == [[True, False, True, False], [False, True, False, False],
                                             [False, False, False, True], [False, False, False, False]]
    assert lay.num_tokens_per_rank.tolist() == [1, 1, 1, 1]
    assert lay.num_tokens_per_rdma_rank.tolist() == [2, 2]
    assert lay.num_tokens_per_expert.tolist() == [1, 0, 1, 0, 0, 1, 1, 1]
    cp = channel_prefix_matrix(lay.is_token_in_rank, 2)
    assert cp.tolist() == [[0, 1], [0, 1], [0, 1], [0, 0]]
    rpm = torch.tensor([[1, 1, 1, 1], [3, 2, 2, 2], [4, 4, 4, 4], [5, 5, 5, 5]], dtype=torch.int32)
    sh = send_head(lay.is_token_in_rank, rpm, 1)
    assert sh[:, 0].tolist() == [1, -1, -1, -1] and sh[:, 3].tolist() == [-1, -1, 1, -1]
    assert torch.equal(send_head(lay.is_token_in_rank, rpm, 1, before=rows_before(lay.is_token_in_rank)), sh)


@pytest.mark.parametrize("T,R", [(0, 2), (1, 1), (7, 2), (300, 3), (1000, 8)])
def test_rows_before_counts_earlier_tokens_per_rank(T, R):
    """rows_before (the copy-engine path's row of a token among a rank's rows, and send_head's core):
    int32 [T, R], contiguous, tokens before t with the same rank, checked against a plain loop."""
    tir = torch.rand(T, R, generator=torch.Generator().manual_seed(T + R)) < 0.6
    got = rows_before(tir)
    assert got.dtype == torch.int32 and got.shape == (T, R) and got.is_contiguous()
    seen = [0] * R
    for t in range(T):
        for r in range(R):
            assert int(got[t, r]) == seen[r], (t, r)
            seen[r] += int(tir[t, r])


def test_fp8_roundtrip_within_bound():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 512, generator=g) * torch.logspace(-3, 3, 64).unsqueeze(1)
    x[3] = 0
    q, s = per_token_cast_to_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (64, 4)
    back = per_token_cast_back(q, s, torch.float32)
    assert bool(((back - x).abs() <= roundtrip_bound(x)).all())
    assert bool((back[3] == 0).all())
    with pytest.raises(ValueError, match="multiple of 128"):
        per_token_cast_to_fp8(torch.zeros(2, 100))


def test_group_limited_topk_limits_groups():
    g = torch.Generator().manual_seed(1)
    scores = routing.random_scores(256, 64, g)
    idx, w = routing.group_limited_topk(scores, num_groups=8, topk_groups=3, topk=6)
    assert idx.shape == (256, 6) and idx.dtype == torch.int64
    groups = idx // 8
    assert max(len(set(row)) for row in groups.tolist()) <= 3
    assert torch.allclose(w.sum(1), torch.ones(256))
    assert all(len(set(row)) == 6 for row in idx.tolist())
    with pytest.raises(ValueError, match="divide"):
        routing.group_limited_topk(scores, 7, 2, 4)


def test_handle_positional_access():
    t = lambda *s: torch.zeros(*s)  # noqa: E731
    h = commlib.DispatchHandle(t(2, 2), t(2, 1), t(2, 1), t(3), t(4, 2), t(4, 2))
    assert len(h) == 6 and h[0] is h.rank_prefix_matrix and list(h)[5] is h.send_head
    rpm, *_ = h
    assert rpm is h.rank_prefix_matrix


def test_deepep_api_surface():
    for name in ("Buffer", "Config", "EventOverlap", "topk_idx_t"):
        assert hasattr(commlib, name)
    assert commlib.topk_idx_t is torch.int64
    for name in ("set_num_sms", "get_dispatch_config", "get_combine_config", "is_sm90_compiled",
                 "get_dispatch_layout", "dispatch", "combine", "destroy", "capture"):
        assert hasattr(commlib.Buffer, name)
    ev = commlib.EventOverlap(None)
    with ev:
        ev.current_stream_wait()


def test_kernel_signatures_and_argument_layout():
    """The fast launch path packs arguments from the kernels' C signatures: every family parses,
    the layout kernel's is what nvlink.py passes, and offsets follow native alignment."""
    import struct

    from commlib.cuda import loader as K

    for family, names in K.FAMILIES.items():
        for name in names:
            codes = K.kernel_signature(family, name)
            assert codes and set(codes) <= set("iIqQfd"), (name, codes)
    assert K.kernel_signature("layout", "layout_kernel") == "QiiiiQQQQQ"
    codes = "QiiQiQ"
    offsets = K.param_offsets(codes)
    assert offsets == [0, 8, 12, 16, 24, 32]
    packed = struct.pack("@" + codes, 1, 2, 3, 4, 5, 6)
    assert [struct.unpack_from("@" + c, packed, o)[0] for c, o in zip(codes, offsets)] == [1, 2, 3, 4, 5, 6]
    assert K.ptr(None) == 0 and K.i32(7) == 7


def test_kernel_variant_parse_and_set():
    """Benchmarks' --variant / --kernel-variant text -> set_variant; unknown keys and bad items raise."""
    from commlib.cuda import loader as K
    assert K.parse_variant("") == {} and K.parse_variant(" , ") == {}
    assert K.parse_variant("DISPATCH_THREADS=512, COMBINE_THREADS=512") == {"DISPATCH_THREADS": 512,
                                                                           "COMBINE_THREADS": 512}
    for bad in ("DISPATCH_THREADS", "DISPATCH_THREADS=big"):
        with pytest.raises(ValueError):
            K.parse_variant(bad)
    try:
        assert K.set_variant(K.parse_variant("DISPATCH_UNROLL=2"))["DISPATCH_UNROLL"] == 2
        assert K.threads("dispatch") == K.DEFAULT_VARIANT["DISPATCH_THREADS"]
        with pytest.raises(ValueError):
            K.set_variant({"NO_SUCH_KNOB": 1})
        with pytest.raises(ValueError, match="COMM_CLUSTER"):  # the grid is only known to be even
            K.set_variant({"COMM_CLUSTER": 4})
        for bad in ({"SHARE_WORK": 2}, {"COMM_TRACE": -1}, {"LL_TRACE": 2}, {"LOCAL_IN_RECEIVER": 2},
                    {"DISPATCH_STREAM_SEND": -1}):
            with pytest.raises(ValueError):
                K.set_variant(bad)
        for gone in ("DISPATCH_BULK", "DISPATCH_ASYNC_DEPTH", "DISPATCH_PROBE_NO_REMOTE_COPY", "WAIT_BACKOFF_NS"):
            with pytest.raises(ValueError, match="unknown kernel variant"):  # left the kernels (docs/notes)
                K.set_variant({gone: 1})
        assert K.set_variant({"DISPATCH_STREAM_SEND": 4})["DISPATCH_STREAM_SEND"] == 4  # release every 4 tokens
        # DISPATCH_STREAM_MAX_SMS: dispatch calls of few SMs launch the streaming sender's build
        K.set_variant({"DISPATCH_STREAM_MAX_SMS": 8})
        base_key = tuple(sorted(K.variant().items()))
        streaming_key = K.dispatch_variant_key(8)
        assert dict(streaming_key)["DISPATCH_STREAM_SEND"] == 1
        assert {k: v for k, v in streaming_key if k != "DISPATCH_STREAM_SEND"} == \
            {k: v for k, v in base_key if k != "DISPATCH_STREAM_SEND"}
        assert K.dispatch_variant_key(4) == streaming_key and K.dispatch_variant_key(10) == base_key
        K.set_variant({"DISPATCH_STREAM_MAX_SMS": 8, "DISPATCH_STREAM_SEND": 1})   # streaming everywhere already
        assert K.dispatch_variant_key(4) == tuple(sorted(K.variant().items()))
        K.set_variant({"DISPATCH_STREAM_MAX_SMS": 0})
        assert K.dispatch_variant_key(4) == tuple(sorted(K.variant().items()))    # 0: never
        K.set_variant(None)   # the default: up to 20 SMs
        assert dict(K.dispatch_variant_key(20))["DISPATCH_STREAM_SEND"] == 1
        assert dict(K.dispatch_variant_key(24))["DISPATCH_STREAM_SEND"] == 0
        with pytest.raises(ValueError, match="DISPATCH_STREAM_MAX_SMS"):
            K.set_variant({"DISPATCH_STREAM_MAX_SMS": -1})
        with pytest.raises(ValueError, match="SHARE_WORK=1 needs COMM_CLUSTER=2"):  # the counter is cluster smem
            K.set_variant({"SHARE_WORK": 1, "COMM_CLUSTER": 1})
        assert K.set_variant({"COMM_CLUSTER": 1})["SHARE_WORK"] == 0  # the default follows plain CTAs
        assert K.set_variant({"SHARE_WORK": 1})["SHARE_WORK"] == 1
        assert "-DCL_TRACE_POINTS=3" in K.options(False)
        K.set_variant({"COMM_TRACE": 1})
        assert "-DCL_COMM_TRACE=1" in K.options(False)
        assert not any(o.startswith("-DCOMMLIB_") for o in K.options(False))  # macros and env vars: two prefixes
    finally:
        K.set_variant(None)
    assert K.variant() == K.DEFAULT_VARIANT
    # COMM_CLUSTER=2 turns the data kernels into 2-CTA cluster launches (common.cuh); 1 leaves them plain
    for family in ("dispatch", "combine"):
        assert f"CL_CLUSTER_DIMS __launch_bounds__(k{family.capitalize()}Threads" in K.source(family)
    # every kernel's parameters parse (launch packs its arguments from them), attribute macros or not
    for family, names in K.FAMILIES.items():
        for name in names:
            assert len(K.kernel_signature(family, name)) > 3, (family, name)
    assert "-DCL_COMM_CLUSTER=2" in K.options(False, dict(K.DEFAULT_VARIANT, COMM_CLUSTER=2))
    K.set_variant(None)


def test_cu_function_handle_old_and_new_cupy():
    """The ctypes launch path needs the CUfunction: .ptr on older CuPy's Function, .kernel.ptr on the
    RawKernel CuPy 14's get_function returns; none found means CuPy's own launch (handle 0)."""
    from types import SimpleNamespace

    from commlib.cuda import loader as K
    assert K.cu_function_handle(SimpleNamespace(ptr=5)) == 5
    assert K.cu_function_handle(SimpleNamespace(kernel=SimpleNamespace(ptr=7))) == 7
    assert K.cu_function_handle(SimpleNamespace(kernel=None)) == 0
    assert K.cu_function_handle(object()) == 0


def test_clock_monitor_windows():
    """commlib.bench.clocks: sampler lines are parsed (warnings and [N/A] power survive), stamped as they
    arrive, and summed per window and GPU; the power-cap bit is counted; a missing sampler is False."""
    import sys
    import time

    from commlib.bench import clocks

    assert clocks.parse_line("0, 1980, 123.4, 0x0000000000000004") == (0, 1980.0, 123.4, 4)
    assert clocks.parse_line("1, 1545, [N/A], 0x0000000000000000") == (1, 1545.0, None, 0)
    assert clocks.parse_line("Failed to query power") is None
    # the fake sampler: two samples per GPU, a pause, then two more (GPU 0 power-capped at a lower clock)
    script = ("import sys, time\n"
              "for g in (0, 1): print(f'{g}, 1980, 300.0, 0x0', flush=True)\n"
              "for g in (0, 1): print(f'{g}, 1980, 310.0, 0x1', flush=True)\n"
              "time.sleep(1.0)\n"
              "print('0, 1500, 700.0, 0x4', flush=True); print('1, 1900, [N/A], 0x0', flush=True)\n"
              "print('0, 1600, 690.0, 0x4', flush=True); print('1, 1900, [N/A], 0x0', flush=True)\n"
              "time.sleep(5)\n")
    mon = clocks.ClockMonitor(command=[sys.executable, "-c", script])
    assert mon.start()
    with mon.window("forward.sequential"):
        deadline = time.monotonic() + 20
        while len(mon.samples) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
    with mon.window("forward.dual"):
        while len(mon.samples) < 8 and time.monotonic() < deadline:
            time.sleep(0.01)
    mon.stop()
    s = mon.summary()
    seq, dual = s["forward.sequential"], s["forward.dual"]
    assert seq["0"]["samples"] == 2 and seq["0"]["sm_mhz_mean"] == 1980 and seq["0"]["power_w_mean"] == 305
    assert seq["0"]["power_cap_share"] == 0
    assert dual["0"] == {"samples": 2, "sm_mhz_mean": 1550, "sm_mhz_min": 1500, "power_w_mean": 695,
                         "power_cap_share": 1.0, "thermal_share": 0.0, "hw_slowdown_share": 0.0}
    assert dual["1"]["power_w_mean"] is None and dual["1"]["sm_mhz_mean"] == 1900
    assert clocks.clock_ratio(s, "forward") == pytest.approx((1550 / 1980 + 1900 / 1980) / 2)
    assert clocks.clock_ratio(s, "forward_backward") is None
    assert not clocks.ClockMonitor(command=["/nonexistent/nvidia-smi"]).start()
