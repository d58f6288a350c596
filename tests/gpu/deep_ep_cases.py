"""DeepEP v1 compatibility on the device: ``import deep_ep`` flows on the nvlink backend, bit for bit
against the reference backend of the same world (tests/cases_deep_ep.py holds the CPU suite)."""
from __future__ import annotations

import torch
from nvlink_cases import check_same

import deep_ep
from deep_ep.utils import EventHandle, EventOverlap
from commlib.topology import local_facts, ranks_per_node_from_facts

E, H, K = 16, 512, 4
M_LL, E_PER_RANK = 16, 4
_BUF: dict = {}


def _inputs(seed, rank, dev):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    T = 40 + 7 * rank
    x = (torch.randn(T, H, generator=g) * (1 + rank)).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    idx[torch.rand(T, K, generator=g) < 0.2] = -1
    w = torch.rand(T, K, generator=g)
    return x.to(dev), idx.to(dev).contiguous(), w.to(dev).contiguous()


def _pair(ctx):
    if "ht" not in _BUF:
        R = ctx.world_size
        nvl = deep_ep.Buffer.get_dispatch_config(R).get_nvl_buffer_size_hint(H * 2, R)
        nv = deep_ep.Buffer(ctx.group, nvl, 0, explicitly_destroy=True)   # auto: nvlink on one node
        ref = deep_ep.Buffer(ctx.group, nvl, 0, explicitly_destroy=True, backend="reference")
        assert nv.backend_name == "nvlink", nv.backend_name
        _BUF["ht"] = (nv, ref)
    return _BUF["ht"]


def _fp8_variants(x):
    from commlib.fp8 import per_token_cast_to_fp8
    q, s = per_token_cast_to_fp8(x)
    T = x.shape[0]
    tok = x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-4) / 448.0
    ue8m0 = (torch.arange(T * (H // 512) * 4, device=x.device) % 50 + 100).to(torch.uint8).view(T, -1).view(torch.int32)
    return {"fp8_colmajor": (q, s.T.contiguous().T), "fp8_per_token": ((x.float() / tok).to(torch.float8_e4m3fn),
                                                                        tok.contiguous()),
            "fp8_ue8m0": (q, ue8m0)}


def case_intranode(ctx):
    nv, ref = _pair(ctx)
    x, idx, w = _inputs(3, ctx.rank, ctx.device)
    ntr, _, nte, tir, _ = nv.get_dispatch_layout(idx, E)
    xs = {"bf16": x, **_fp8_variants(x)}
    for name, cur in xs.items():
        for with_topk in (False, True):
            args = dict(num_tokens_per_rank=ntr, is_token_in_rank=tir, num_tokens_per_expert=nte)
            if with_topk:
                args.update(topk_idx=idx, topk_weights=w)
            prev = EventOverlap(EventHandle())
            got = nv.dispatch(cur, previous_event=prev, async_finish=True, **args)
            got[5].current_stream_wait()
            want = ref.dispatch(cur, **args)
            tag = f"{name} topk={with_topk}"
            if isinstance(cur, tuple):
                check_same(got[0][0], want[0][0], tag + " recv_x")
                check_same(got[0][1], want[0][1], tag + " recv scales")
                assert got[0][1].dtype == cur[1].dtype and got[0][1].shape[1] == cur[1].shape[1], tag
            else:
                check_same(got[0], want[0], tag + " recv_x")
            for i, what in ((1, "recv_topk_idx"), (2, "recv_topk_weights"), (3, "per-expert list")):
                check_same(got[i], want[i], f"{tag} {what}")
            if not with_topk:
                cached = nv.dispatch(cur, handle=got[4])
                check_same(cached[0][1] if isinstance(cur, tuple) else cached[0],
                           got[0][1] if isinstance(cur, tuple) else got[0], tag + " cached")
            if not isinstance(cur, tuple):
                a = nv.combine(got[0], got[4], topk_weights=got[2], previous_event=deep_ep.Buffer.capture(),
                               async_finish=True)
                a[2].current_stream_wait()
                b = ref.combine(want[0], want[4], topk_weights=want[2])
                check_same(a[0], b[0], tag + " combined")
                check_same(a[1], b[1], tag + " combined weights")
    assert isinstance(nv.get_comm_stream(), torch.cuda.Stream)
    assert deep_ep.Buffer.capture().event is not None


def case_low_latency(ctx):
    R = ctx.world_size
    Ell = E_PER_RANK * R
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(M_LL, H, R, Ell)
    nv = deep_ep.Buffer(ctx.group, 0, rdma, low_latency_mode=True, num_qps_per_rank=E_PER_RANK,
                        explicitly_destroy=True, enable_shrink=True, backend="nvlink")
    ref = deep_ep.Buffer(ctx.group, 0, rdma, low_latency_mode=True, explicitly_destroy=True, backend="reference")
    g = torch.Generator().manual_seed(ctx.rank)
    T = 5 + 3 * ctx.rank
    x = (torch.randn(T, H, generator=g) * 0.5).to(torch.bfloat16).to(ctx.device)
    idx = torch.stack([torch.randperm(Ell, generator=g)[:K] for _ in range(T)]).to(ctx.device)
    w = torch.rand(T, K, generator=g).to(ctx.device)
    cum = torch.zeros(E_PER_RANK, dtype=torch.int32, device=ctx.device)
    for fp8, rs, ue in ((False, False, False), (True, False, False), (True, True, True)):
        a = nv.low_latency_dispatch(x, idx, M_LL, Ell, cum, use_fp8=fp8, round_scale=rs, use_ue8m0=ue,
                                    return_recv_hook=True)
        a[4]()
        b = ref.low_latency_dispatch(x, idx, M_LL, Ell, use_fp8=fp8, round_scale=rs, use_ue8m0=ue)
        check_same(a[1], b[1], "recv_count")
        if fp8:
            S = H // 512 if ue else H // 128
            assert a[0][1].stride() == (S * R * M_LL, 1, R * M_LL), a[0][1].stride()
            for e in range(E_PER_RANK):
                n = int(b[1][e])
                check_same(a[0][0][e, :n], b[0][0][e, :n], f"fp8 rows e{e}")
                check_same(a[0][1][e, :n], b[0][1][e, :n], f"scales e{e}")
    torch.cuda.synchronize()
    assert torch.equal(cum, b[1] * 3), (cum, b[1])
    a = nv.low_latency_dispatch(x, idx, M_LL, Ell, use_fp8=False)
    b = ref.low_latency_dispatch(x, idx, M_LL, Ell, use_fp8=False)
    nv.get_next_low_latency_combine_buffer(a[2]).copy_(a[0])
    got, _, _ = nv.low_latency_combine(torch.empty_like(a[0]), idx, w, a[2], zero_copy=True)
    want, _, _ = ref.low_latency_combine(b[0], idx, w, b[2])
    check_same(got, want, "zero-copy combine")
    # LogFMT and wait-time stats through DeepEP's API: the reference's result bit for bit, stats added
    # to every source's entry
    y = (b[0].float() / 64).to(torch.bfloat16)   # mostly below 1: LogFMT encodes most blocks
    waits = [torch.zeros(R, dtype=torch.int64, device=ctx.device) for _ in range(2)]
    a = nv.low_latency_dispatch(x, idx, M_LL, Ell, None, waits[0], use_fp8=False)
    got, _, _ = nv.low_latency_combine(y, idx, w, a[2], use_logfmt=True, combine_wait_recv_cost_stats=waits[1])
    want, _, _ = ref.low_latency_combine(y, idx, w, b[2], use_logfmt=True)
    check_same(got, want, "LogFMT combine")
    for t in waits:
        v = t.cpu()
        assert bool((v > 0).all()) and bool((v == v[0]).all()), v
    # shrink mode: every rank masks R-1 (R-1 too, which then sends and waits for nothing)
    nv.low_latency_update_mask_buffer(R - 1, True)
    nv.low_latency_dispatch(x, idx, M_LL, Ell, use_fp8=False)
    nv.low_latency_clean_mask_buffer()
    status = torch.zeros(R, dtype=torch.int32, device=ctx.device)
    nv.low_latency_query_mask_buffer(status)
    assert int(status.sum()) == 0
    nv.clean_low_latency_buffer(M_LL, H, Ell)
    nv.destroy()
    ref.destroy()


def case_teardown(ctx):
    for pair in _BUF.values():
        for b in pair:
            b.destroy()
    _BUF.clear()


def case_topology_facts(ctx):
    """The facts a Buffer gathers when no launcher variable says how many ranks share a node: this
    rank's GPU among the visible ones and in its own peer set, and every rank of this one host in one
    node (GPUs shared, or reaching each other with peer access on an NVLink machine)."""
    f = local_facts()
    assert f.gpu and f.gpu in f.visible and f.gpu in f.peers, f
    assert f.gpu == f.visible[torch.cuda.current_device()]
    facts = [None] * ctx.world_size
    torch.distributed.all_gather_object(facts, f, group=ctx.group)
    assert len({(x.hostname, x.boot_id) for x in facts}) == 1, facts
    assert ranks_per_node_from_facts(facts) == ctx.world_size, facts
