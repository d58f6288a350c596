"""Single-process unit tests: config, topology, layout helpers, FP8, routing, handle."""
import dataclasses

import pytest
import torch

import commlib
from commlib import routing
from commlib.utils import env
from commlib.backends.base import DispatchResult
from commlib.buffer import Buffer, _tensors_of
from commlib.handle import DispatchHandle
from commlib.config import Config, row_slot_bytes
from commlib.fp8 import per_token_cast_back, per_token_cast_to_fp8, roundtrip_bound
from commlib.layout import (channel_prefix_matrix, channel_starts, dispatch_layout, recv_channel_prefix, rows_before,
                            send_head)
from commlib.topology import Topology

import oracle as O


def test_config_validation_and_hints():
    c = Config(20, 32, 512)
    assert c.num_channels == 10
    assert c.get_nvl_buffer_size_hint(7168 * 2, 2) > 2 * 10 * 512 * 7168 * 2
    assert row_slot_bytes(14336) >= 14336 + 14336 // 32
    with pytest.raises(ValueError, match="even"):  # accepted as DeepEP's is; a call refuses it
        Config(21, 8, 16).check_runnable()
    for bad, word in (((20, 32, 16), "less than"), ((20, 16, 16), "less than"),
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


# (value, its E4M3 code's value) with the block's amax 448, so scale = 1 and x / scale = x
FP8_HAND_SCALE_1 = [
    (448.0, 448.0), (1.0, 1.0), (-5.0, -5.0), (0.0, 0.0),
    (0.3, 0.3125),                  # step 2^-5 in [0.25, 0.5): 9.6 steps -> 10
    (1.0625, 1.0), (1.1875, 1.25),  # ties go to the even mantissa
    (17.0, 16.0), (19.0, 20.0),     # step 2 in [16, 32): ties 8.5 -> 8, 9.5 -> 10
    (300.0, 288.0),                 # step 32 in [256, 448]: 9.375 -> 9
    (2.0 ** -9, 2.0 ** -9),         # the smallest subnormal
    (2.0 ** -10, 0.0), (3 * 2.0 ** -10, 2.0 ** -8), (5 * 2.0 ** -10, 2.0 ** -8),  # subnormal ties to even
    (1.3 * 2.0 ** -7, 5 * 2.0 ** -9),  # subnormal: 5.2 steps of 2^-9 -> 5
]
# amax 7: scale = 7 / 448 = 2^-6 exactly; (x, x after the round trip)
FP8_HAND_SCALE_2M6 = [
    (7.0, 7.0), (7.0 / 1024, 7.0 / 1024), (7.0 / 2048, 7.0 / 2048),  # below amax / 1024: exact, not flushed
    (0.001, 0.0625 / 64),           # 0.064 after scaling: step 2^-7 in [2^-4, 2^-3), 8.19 -> 8
    (1e-4, 3 * 2.0 ** -15),         # 0.0064 after scaling: subnormal, 3.28 steps of 2^-9 -> 3
]


def _hand_block(pairs, amax):
    x = torch.zeros(128)
    x[0] = amax
    for i, (v, _) in enumerate(pairs):
        x[i + 1] = v
    return x


def test_fp8_cast_hand_computed():
    """E4M3 with one float32 scale per 128 channels, on values whose rounding is worked out by hand:
    ties to even, subnormals, values below amax / 1024 kept (not flushed), an all-zero block."""
    x = torch.stack([torch.cat([_hand_block(FP8_HAND_SCALE_1, 448.0), _hand_block(FP8_HAND_SCALE_2M6, 7.0),
                                torch.zeros(128)])])
    for name, cast in (("commlib", per_token_cast_to_fp8), ("oracle", O.cast_fp8)):
        q, s = cast(x)
        assert s[0, 0] == 1.0 and s[0, 1] == 2.0 ** -6, (name, s)
        assert s[0, 2] == torch.tensor(1e-4, dtype=torch.float32) / 448, (name, s)  # all-zero block
        assert q[0, 0].float() == 448 and q[0, 128].float() == 448, name
        for i, (v, want) in enumerate(FP8_HAND_SCALE_1):
            assert float(q[0, i + 1].float()) == want, (name, v, float(q[0, i + 1].float()), want)
        back = per_token_cast_back(q, s, torch.float32) if name == "commlib" else O.dequant(q, s, torch.float32)
        for i, (v, want) in enumerate(FP8_HAND_SCALE_2M6):
            assert float(back[0, 129 + i]) == want, (name, v, float(back[0, 129 + i]), want)
        assert bool((q[0, 256:].float() == 0).all()) and bool((back[0, 256:] == 0).all()), name


def test_fp8_cast_matches_oracle_and_tight_bound():
    """The cast equals the independent oracle's bit for bit, and the round trip stays within the tight
    bound: relative 2^-4 where x / scale is an E4M3 normal (|x| >= amax * 2^-6 / 448), absolute
    scale * 2^-10 (half a subnormal step) below. Every block spans 7 decades, so most values sit far
    below amax / 1024."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(48, 512, generator=g) * 10 ** (-7 * torch.rand(48, 512, generator=g))
    x[:, ::128] = 1.0  # a 1.0 in every block
    x[5] = 0
    x[6, 128:256] = 1e-9  # a block whose amax is below the 1e-4 floor
    q, s = per_token_cast_to_fp8(x)
    q_ref, s_ref = O.cast_fp8(x)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    back = per_token_cast_back(q, s, torch.float32)
    err = (back - x).abs()
    bound = O.fp8_roundtrip_bound(x)
    assert bool((err <= bound).all()), float((err - bound).max())
    amax = x.abs().view(48, 4, 128).amax(2, keepdim=True).expand(48, 4, 128).reshape(48, 512)
    small = (x.abs() < amax / 1024) & (x.abs() >= amax * 2.0 ** -6 / 448)  # below amax / 1024, E4M3 normals
    assert int(small.sum()) > 1000 and bool((err[small] <= x.abs()[small] * 2.0 ** -4 * (1 + 2.0 ** -20)).all())
    assert bool((back[small] != 0).all())


def test_group_limited_topk_ranks_groups_by_two_best_scores():
    """Hand case: by the sum of their two best scores the groups rank 2, 1, 0, 3 and the token takes
    experts 4 and 2; ranking by the best score alone would pick groups 0 and 2 (experts 0 and 4)."""
    scores = torch.tensor([[0.9, 0.0, 0.6, 0.5, 0.7, 0.45, 0.1, 0.1]])
    for gate in (routing.group_limited_topk, O.gate):
        idx, w = gate(scores, num_groups=4, topk_groups=2, topk=2)
        assert idx.tolist() == [[4, 2]], (gate, idx)
        assert torch.allclose(w, torch.tensor([[0.7 / 1.3, 0.6 / 1.3]])), w
    # one expert per group: the best score is the group's score
    idx, _ = routing.group_limited_topk(torch.tensor([[0.1, 0.9, 0.5, 0.7]]), 4, 2, 2)
    assert idx.tolist() == [[1, 3]]


@pytest.mark.parametrize("E,G,TG,K", [(32, 4, 2, 4), (64, 8, 3, 6), (8, 8, 4, 3), (16, 2, 1, 8), (12, 3, 3, 5)])
def test_group_limited_topk_matches_oracle(E, G, TG, K):
    g = torch.Generator().manual_seed(E * G + K)
    scores = routing.random_scores(300, E, g)
    idx, w = routing.group_limited_topk(scores, num_groups=G, topk_groups=TG, topk=K)
    idx_ref, w_ref = O.gate(scores, G, TG, K)
    assert torch.equal(idx, idx_ref)
    assert torch.allclose(w, w_ref, rtol=1e-6, atol=0)


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


@pytest.mark.parametrize("T,R,P,E,C", [(0, 4, 2, 16, 3), (1, 2, 1, 8, 4), (37, 4, 2, 16, 10), (40, 4, 2, 16, 8),
                                       (64, 8, 4, 32, 10), (5, 8, 8, 64, 1), (100, 3, 3, 12, 7)])
def test_layout_and_channel_prefix_match_oracle(T, R, P, E, C):
    """Counts, is_token_in_rank and the channel prefix matrix against the oracle's loops."""
    g = torch.Generator().manual_seed(T * 7 + R)
    idx = torch.stack([torch.randperm(E, generator=g)[:4] for _ in range(T)]) if T else torch.empty(0, 4, dtype=torch.int64)
    if T:
        idx[torch.rand(T, 4, generator=g) < 0.25] = -1
    lay = dispatch_layout(idx, E, Topology(0, R, P))
    ntr, nrr, nte, tir = O.layout(idx, E, R, P)
    assert torch.equal(lay.is_token_in_rank, tir) and torch.equal(lay.num_tokens_per_rank, ntr)
    assert torch.equal(lay.num_tokens_per_expert, nte)
    assert (lay.num_tokens_per_rdma_rank is None) == (nrr is None)
    if nrr is not None:
        assert torch.equal(lay.num_tokens_per_rdma_rank, nrr)
    cp = channel_prefix_matrix(tir, C)
    assert torch.equal(cp, O.channel_prefix(tir, C))
    assert cp.shape == (R, C) and cp.stride() == (C, 1)  # standard strides, also for [R, 1]


@pytest.mark.parametrize("R,C,pad", [(1, 1, 0), (2, 4, 3), (4, 10, 0), (5, 3, 7), (8, 20, 2)])
def test_recv_channel_prefix_from_landed_rows(R, C, pad):
    """The receiver's channel prefixes worked out from its rows equal every source's own
    channel_prefix_matrix row for it (the oracle's loop), with token counts 0..40 per source,
    silent sources and padding rows past the received count."""
    g = torch.Generator().manual_seed(R * 31 + C)
    me = R // 2
    tokens = [0 if s == 1 else int(torch.randint(0, 41, (1,), generator=g)) for s in range(R)]
    rows, want = [], []
    for s, T in enumerate(tokens):
        tir = torch.rand(T, R, generator=g) < 0.4
        rows.append(torch.nonzero(tir[:, me]).flatten().to(torch.int32))
        want.append(O.channel_prefix(tir, C)[me])
    src_idx = torch.cat(rows + [torch.full((pad,), -1, dtype=torch.int32)])
    prefix_col = torch.cumsum(torch.tensor([r.numel() for r in rows]), 0)
    got = recv_channel_prefix(src_idx, prefix_col, torch.tensor(tokens), C)
    assert got.dtype == torch.int32 and torch.equal(got, torch.stack(want))


def test_handle_positional_access():
    t = lambda *s: torch.zeros(*s)  # noqa: E731
    h = commlib.DispatchHandle(t(2, 2), t(2, 1), t(2, 1), t(3), t(4, 2), t(4, 2))
    assert len(h) == 6 and h[0] is h.rank_prefix_matrix and list(h)[5] is h.send_head
    rpm, *_ = h
    assert rpm is h.rank_prefix_matrix


def test_backend_names_and_module_paths_are_only_the_current_ones(monkeypatch):
    """The engine's earlier name ``hierarchical`` and the old module paths (commlib.tune, .overlap,
    .moe, .pipeline) are gone: each is refused with an error naming what is known."""
    import importlib

    from commlib import backends

    for good in ("auto", "reference", "nvlink", "internode"):
        monkeypatch.setenv("COMMLIB_BACKEND", good.upper())
        assert env.backend() == good
    monkeypatch.setenv("COMMLIB_BACKEND", "hierarchical")
    with pytest.raises(ValueError, match="COMMLIB_BACKEND='hierarchical'.*internode"):
        env.backend()
    assert sorted(backends.BACKENDS) == ["internode", "nvlink", "reference"]
    with pytest.raises(ValueError, match="unknown backend 'hierarchical'"):
        backends.make_backend("hierarchical", None)
    for old in ("commlib.tune", "commlib.overlap", "commlib.moe", "commlib.pipeline"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)


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


def test_shared_gpu_fits_its_ranks_ctas():
    """Ranks sharing a GPU (CUDA MPS) must all have their spinning CTAs resident: the world counts the
    most ranks on one GPU, the NVLink build turns to half-SM CTAs when one CTA per SM cannot hold
    them, and a chosen variant is left alone."""
    from commlib.cuda import loader as K
    from commlib.topology import RankFacts, gpu_share
    a = RankFacts("h", "b", "GPU-a", ("GPU-a",), ("GPU-a",))
    b = RankFacts("h", "b", "GPU-b", ("GPU-b",), ("GPU-b",))
    assert gpu_share([a, b]) == 1 and gpu_share([a] * 8) == 8 and gpu_share([a, a, a, b]) == 3
    assert gpu_share([RankFacts("h"), RankFacts("h")]) == 1                       # CPU ranks
    assert gpu_share([a, RankFacts("other", "b", "GPU-a")]) == 1                  # same id, other host
    try:
        assert not K.fit_shared_gpu(2, 24, 132) and K.ctas_per_sm() == 1          # 48 CTAs: one per SM
        assert not K.fit_shared_gpu(1, 200, 132)                                  # one rank: its own launch
        assert K.fit_shared_gpu(8, 24, 132)                                       # 192 > 132: half-SM CTAs
        assert K.ctas_per_sm() == 2 and K.threads("dispatch") == 512 and K.threads("combine") == 512
        K.set_variant({"DISPATCH_UNROLL": 2})                                     # a chosen build stays
        assert not K.fit_shared_gpu(8, 24, 132) and K.threads("dispatch") == K.DEFAULT_VARIANT["DISPATCH_THREADS"]
    finally:
        K.set_variant(None)
    assert K.variant() == K.DEFAULT_VARIANT


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


@pytest.mark.parametrize("R,P,E", [(4, 4, 16), (4, 2, 16), (4, 1, 8), (2, 1, 8)])
def test_vectorised_oracle_matches_loop_oracle(R, P, E):
    """The long runs' vectorised oracle (dispatch and scaled combine) equals the loop oracle."""
    g = torch.Generator().manual_seed(R * 10 + P)
    H, K = 128, 3
    xs = [torch.randn(T, H, generator=g).to(torch.bfloat16) for T in (5, 0, 9, 3)[:R]]
    idxs = []
    for x in xs:
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(x.shape[0])]) if x.shape[0] else \
            torch.empty(0, K, dtype=torch.int64)
        if x.shape[0]:
            idx[torch.rand(idx.shape, generator=g) < 0.3] = -1
        idxs.append(idx)
    ws = [torch.rand(i.shape, generator=g) for i in idxs]
    loops = [O.dispatch_oracle(xs, idxs, ws, E, R, me) for me in range(R)]
    for me in range(R):
        fast = O.dispatch_expected(xs, idxs, ws, E, R, me)
        for key in ("recv_x", "recv_src_idx", "recv_src_rank", "recv_topk_idx", "recv_topk_weights", "per_expert",
                    "rank_prefix_matrix"):
            a, b = fast[key], loops[me][key]
            assert (a == b if isinstance(a, list) else torch.equal(a, b)), (me, key)
    factors = [1 + r / 8 for r in range(R)]
    ys = [(o["recv_x"].float() * factors[r]).to(torch.bfloat16) for r, o in enumerate(loops)]
    srcs = [list(zip(o["recv_src_rank"].tolist(), o["recv_src_idx"].tolist())) for o in loops]
    for me in range(R):
        tir = O.layout(idxs[me], E, R, P)[3]
        want = O.combine_oracle(ys, srcs, xs[me].shape[0], H, me, P, R)
        assert torch.equal(O.combine_scaled_expected(xs[me], tir, P, factors).view(torch.int16), want.view(torch.int16))


def test_rdma_channel_prefix_matrix():
    """DeepEP's internode name: tokens sent to node m from channels before c, counted by hand."""
    g = torch.Generator().manual_seed(3)
    for T, C in ((0, 3), (1, 1), (10, 4), (37, 5)):
        tir = torch.rand(T, 8, generator=g) < 0.3
        h = DispatchHandle(None, None, None, None, tir, None, topology=Topology(0, 8, 4), num_channels=C)
        per = -(-T // C)
        want = [[sum(1 for t in range(min(c * per, T)) if bool(tir[t, 4 * m:4 * m + 4].any())) for c in range(C)]
                for m in range(2)]
        got = h.rdma_channel_prefix_matrix
        assert got.dtype == torch.int32 and got.tolist() == want, (T, C, got.tolist(), want)


def test_result_tensors_and_stream_records_per_allocation():
    """The Buffer records each output's allocation once for the caller's stream: _tensors_of finds the
    tensors of a result and its handle (not the inputs it is told to skip, not per-expert count lists)."""
    from commlib.handle import DispatchHandle
    arena = torch.zeros(20, dtype=torch.int32)
    a, b = arena[:10].view(2, 5), arena[10:].view(10)
    x_in, recv = torch.zeros(3, 4), torch.zeros(5, 4)
    h = DispatchHandle(a, b, torch.zeros(2, 2, dtype=torch.int32), torch.zeros(5, dtype=torch.int32), x_in,
                       torch.zeros(3, 2, dtype=torch.int32), extra={"plan": {"t": torch.zeros(1)}})
    res = DispatchResult(recv, None, None, None, [4, 0, 7], h)
    found = _tensors_of(res, skip=[x_in])
    assert [id(t) for t in found] == [id(recv), id(a), id(b), id(h.recv_channel_prefix_matrix),
                                      id(h.recv_src_idx), id(h.send_head)]
    nested = _tensors_of((recv, [a, (b,)], [1, 2]))
    assert [id(t) for t in nested] == [id(recv), id(a), id(b)]


def test_buffer_config_objects_are_made_once():
    """A Buffer's default configs and combine's per-channel config are built once per key (a Config
    validates every field when built), and stay right: channels from the handle, a new key anew."""
    buf = Buffer.__new__(Buffer)
    buf._tuned, buf._configs, buf._rings, buf.num_ranks, buf.rank = {}, {}, {}, 8, 0
    buf.topology = Topology(0, 8, 8)
    buf.device, buf.num_nvl_bytes, buf.num_rdma_bytes = torch.device("cpu"), 0, 0
    first = buf._resolve_config(None, "dispatch", 4096, 7168)
    assert buf._resolve_config(None, "dispatch", 4096, 7168) is first
    assert first == Buffer.get_dispatch_config(8)
    combine = buf._resolve_config(None, "combine", 4096, 7168)
    assert combine == Buffer.get_combine_config(8) and combine is not first
    rings = buf._combine_rings(combine, 5)
    assert rings.num_sms == 10 and rings == dataclasses.replace(combine, num_sms=10)
    assert buf._combine_rings(combine, 5) is rings
    assert buf._combine_rings(combine, 6).num_sms == 12
    assert buf._combine_rings(combine, 0) is combine
    other = dataclasses.replace(combine)   # an equal config, another object: its own entry
    assert buf._combine_rings(other, 5) is not rings and buf._combine_rings(other, 5).num_sms == 10


def test_dispatch_checks_pass_again_only_for_the_same_signature():
    """A non-cached dispatch whose arguments show every property the checks read as an earlier call's
    skips them (the GPU engines read no values on the host); any property that differs takes the
    checks again, so a bad argument still raises its own error."""
    from commlib.fp8 import BLOCK
    buf = Buffer.__new__(Buffer)
    buf._tuned, buf._configs, buf._rings, buf._prepared = {}, {}, {}, {}
    buf.num_ranks, buf.rank, buf.topology = 2, 0, Topology(0, 2, 2)
    buf.device, buf.num_nvl_bytes, buf.num_rdma_bytes = torch.device("cpu"), 1 << 30, 0
    buf.backend_name, buf._memo_checks = "nvlink", True
    T, H, E, Kk = 16, 2 * BLOCK, 8, 2
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(0, E, (T, Kk), generator=g)
    w = torch.rand(T, Kk, generator=g)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ntr, nte = torch.zeros(2, dtype=torch.int32), torch.zeros(E, dtype=torch.int32)
    tir = torch.zeros(T, 2, dtype=torch.bool)
    checked = []
    real = buf._check_dispatch
    buf._check_dispatch = lambda *a: (checked.append(1), real(*a))[1]

    def prep(x=x, ntr=ntr, tir=tir, nte=nte, idx=idx, w=w, al=1, worst=0, cfg=None):
        return buf._prepare_dispatch(x, None, ntr, None, tir, nte, idx, w, al, worst, cfg)

    first, again = prep(), prep()
    assert len(checked) == 1 and again.config is first.config and again.num_experts == E
    assert again.x is x and again.topk_idx is idx and again.layout.is_token_in_rank is tir
    prep(x=x.clone(), idx=idx.clone(), w=w.clone())                 # new tensors, same signature
    assert len(checked) == 1
    budget = Buffer.num_sms
    try:
        Buffer.set_num_sms(budget + 2)                              # a default Config follows the SM budget
        assert prep().config.num_sms == budget + 2 and len(checked) == 2
    finally:
        Buffer.set_num_sms(budget)
    assert prep().config is first.config and len(checked) == 2
    cfg = Config(4, 6, 64)
    prep(cfg=cfg), prep(cfg=cfg)
    assert len(checked) == 3
    cfg.num_sms = 3                                                  # changed in place: checked again
    bad = [(dict(cfg=cfg), ValueError, "num_sms"),
           (dict(w=w.double()), TypeError, "topk_weights"),
           (dict(idx=idx.t().contiguous().t()), ValueError, "contiguous"),
           (dict(tir=torch.zeros(T, 3, dtype=torch.bool)), ValueError, "is_token_in_rank"),
           (dict(x=x.float()), TypeError, "x"),
           (dict(nte=torch.zeros(E, dtype=torch.int64)), TypeError, "num_tokens_per_expert"),
           (dict(al=True), ValueError, "expert_alignment"),
           (dict(worst=-1), ValueError, "num_worst_tokens"),
           (dict(x=(x.to(torch.float8_e4m3fn), torch.ones(T, 5))), ValueError, "scales")]
    for kw, err, what in bad:
        n = len(checked)
        with pytest.raises(err, match=what):
            prep(**kw)
        assert len(checked) == n + 1, what
    fp8 = (x.to(torch.float8_e4m3fn), torch.ones(T, 2))
    prep(x=fp8), prep(x=(fp8[0], torch.ones(T, 2)))
    n = len(checked)
    with pytest.raises(TypeError, match="scales"):                   # scales of another dtype, same shape
        prep(x=(fp8[0], torch.ones(T, 2, dtype=torch.float64)))
    assert len(checked) == n + 1
