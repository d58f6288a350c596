"""DeepEP v1 compatibility: cases run inside spawned CPU worlds (worlds.py), through ``import deep_ep``.

Written from DeepEP's documented API and semantics (its docstrings: names, positions, shapes,
dtypes; what dispatch / combine / the low-latency calls return), not from its tests. Every rank
regenerates every rank's inputs from (seed, rank), so expected values need no communication.
"""
from __future__ import annotations

import inspect
import math
import os

import torch

import deep_ep
import deep_ep.buffer as deep_ep_buffer
from commlib.backends.low_latency.reference import logfmt_roundtrip, unpack_ue8m0
from commlib.fp8 import per_token_cast_to_fp8
from deep_ep.utils import EventHandle, EventOverlap
from worlds import expect_raises as _expect

E, H, K = 16, 512, 4
LL_E_PER_RANK, LL_M = 4, 16


def _inputs(seed: int, rank: int, R: int, T: int | None = None):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    T = 12 + 3 * rank if T is None else T
    x = (torch.randn(T, H, generator=g) * (1 + rank)).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.empty(0, K, dtype=torch.int64)
    if T:
        idx[torch.rand(T, K, generator=g) < 0.2] = -1
    w = torch.rand(T, K, generator=g)
    return x, idx.contiguous(), w.contiguous()


def _layout(idx: torch.Tensor, R: int):
    """DeepEP's layout tensors computed by hand (not by get_dispatch_layout)."""
    T = idx.shape[0]
    owner = torch.where(idx >= 0, idx // (E // R), torch.full_like(idx, -1))
    tir = torch.zeros(T, R, dtype=torch.bool)
    for r in range(R):
        tir[:, r] = (owner == r).any(dim=1)
    per_rank = tir.sum(0).to(torch.int32)
    per_expert = torch.bincount(idx[idx >= 0], minlength=E).to(torch.int32)
    return per_rank, per_expert, tir


def _buffer(ctx, **kw):
    R = ctx.world_size
    cfg = deep_ep.Buffer.get_dispatch_config(R)
    nvl = cfg.get_nvl_buffer_size_hint(H * 2, R)
    return deep_ep.Buffer(ctx.group, nvl, 0, explicitly_destroy=True, backend="reference", **kw)


# ------------------------------------------------------------------ API surface
def case_surface(ctx):
    R, me = ctx.world_size, ctx.rank
    assert deep_ep.__implementation__ == "commlib"
    assert deep_ep.topk_idx_t == torch.int64
    assert deep_ep.Buffer is deep_ep_buffer.Buffer
    # the constructor's positions are DeepEP v1's
    names = list(inspect.signature(deep_ep.Buffer.__init__).parameters)[1:12]
    assert names == ["group", "num_nvl_bytes", "num_rdma_bytes", "low_latency_mode", "num_qps_per_rank",
                     "allow_nvlink_for_low_latency_mode", "allow_mnnvl", "use_fabric", "explicitly_destroy",
                     "enable_shrink", "comm"], names
    lld = list(inspect.signature(deep_ep.Buffer.low_latency_dispatch).parameters)[1:]
    assert lld == ["x", "topk_idx", "num_max_dispatch_tokens_per_rank", "num_experts",
                   "cumulative_local_expert_recv_stats", "dispatch_wait_recv_cost_stats", "use_fp8", "round_scale",
                   "use_ue8m0", "async_finish", "return_recv_hook"], lld
    llc = list(inspect.signature(deep_ep.Buffer.low_latency_combine).parameters)[1:]
    assert llc == ["x", "topk_idx", "topk_weights", "handle", "use_logfmt", "zero_copy", "async_finish",
                   "return_recv_hook", "out", "combine_wait_recv_cost_stats"], llc
    for name in ("dispatch", "internode_dispatch"):
        p = list(inspect.signature(getattr(deep_ep.Buffer, name)).parameters)[1:15]
        assert p == ["x", "handle", "num_tokens_per_rank", "num_tokens_per_rdma_rank", "is_token_in_rank",
                     "num_tokens_per_expert", "topk_idx", "topk_weights", "expert_alignment", "num_worst_tokens",
                     "config", "previous_event", "async_finish", "allocate_on_comm_stream"], (name, p)
    # every positional argument, in DeepEP's order
    cfg = deep_ep.Buffer.get_dispatch_config(R)
    nvl = cfg.get_nvl_buffer_size_hint(H * 2, R)
    buf = deep_ep.Buffer(ctx.group, nvl, 1 << 16, False, 8, True, False, False, True, False, None)
    assert buf.group_size == R and buf.rank == me and buf.group is ctx.group
    assert buf.num_nvl_bytes == nvl and buf.num_rdma_bytes == 1 << 16 and buf.explicitly_destroy
    assert buf.enable_shrink is False and buf.low_latency_mode is False
    assert buf.runtime.get_num_rdma_ranks() == 1 and buf.runtime.is_available()
    assert buf.runtime.get_rdma_rank() == 0 and buf.runtime.get_local_device_id() == -1
    # capture() is static (SGLang calls it on the class), and EventOverlap(EventHandle()) works
    for ev in (deep_ep.Buffer.capture(), buf.capture(), EventOverlap(EventHandle())):
        assert isinstance(ev, EventOverlap)
        ev.current_stream_wait()
        with ev:
            pass
    assert buf.get_comm_stream() is None  # CPU ranks have no stream
    t = buf.get_local_buffer_tensor(torch.int32, use_rdma_buffer=True)
    assert t.dtype == torch.int32 and t.numel() == (1 << 16) // 4
    t[:4] = 7
    again = buf.get_local_buffer_tensor(torch.int32, torch.Size([2, 2]), 0, True)
    assert again.shape == (2, 2) and bool((again == 7).all())
    assert buf.get_local_buffer_tensor(torch.uint8, offset=8).numel() == nvl - 8
    _expect(ValueError, ["size"], lambda: buf.get_local_buffer_tensor(torch.uint8, torch.Size([nvl + 1])))
    # shrink-mode calls need enable_shrink
    _expect(RuntimeError, ["enable_shrink"], lambda: buf.low_latency_clean_mask_buffer())
    # Config: DeepEP's positional form, and keywords (SGLang's Config(**json))
    c = deep_ep.Config(20, 6, 256, 6, 128)
    assert c.num_max_nvl_chunked_recv_tokens == 256
    as_json = {"num_sms": 20, "num_max_nvl_chunked_send_tokens": 6, "num_max_nvl_chunked_recv_tokens": 256}
    assert deep_ep.Config(**as_json).num_sms == 20
    # a Config DeepEP builds but cannot launch (0 or an odd num_sms): built here too, refused by the call
    x, idx, w = _inputs(5, me, R)
    ntr, nte, tir = _layout(idx, R)
    lay = {"num_tokens_per_rank": ntr, "is_token_in_rank": tir, "num_tokens_per_expert": nte, "topk_idx": idx,
           "topk_weights": w}
    for sms in (0, 3):
        odd = deep_ep.Config(sms, 6, 256, 6, 128)
        _expect(ValueError, ["num_sms", "even", str(sms)], lambda c=odd: buf.dispatch(x, config=c, **lay))
    rx, _, rw, _, h, _ = buf.dispatch(x, config=deep_ep.Config(2, 6, 256, 6, 128), **lay)
    _expect(ValueError, ["num_sms", "even"], lambda: buf.combine(rx, h, rw, config=deep_ep.Config(1, 6, 256)))
    buf.combine(rx, h, rw, config=deep_ep.Config(2, 6, 256))
    buf.destroy()


# ------------------------------------------------------------------ high-throughput dispatch / combine
def _fp8_variants(x: torch.Tensor):
    """DeepEP accepts FP8 scales of any stride and width: DeepGEMM's column-major [T, H/128], per-token
    [T, 1], packed UE8M0 int32 [T, H/512]."""
    q, s = per_token_cast_to_fp8(x)
    T = x.shape[0]
    per_token = x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-4) / 448.0
    q_tok = (x.float() / per_token).to(torch.float8_e4m3fn)
    exps = (torch.arange(T * (H // 512) * 4) % 50 + 100).to(torch.uint8)
    ue8m0 = exps.view(T, H // 512, 4).contiguous().view(torch.int32).view(T, H // 512)
    return {"fp8_colmajor": (q, s.T.contiguous().T), "fp8_per_token": (q_tok, per_token.contiguous()),
            "fp8_ue8m0": (q, ue8m0)}


def _expected_rows(tensors: list, tirs: list, me: int) -> torch.Tensor:
    """Rows rank ``me`` receives: grouped by source rank in rank order, token order within a source."""
    parts = [t[tir[:, me]] for t, tir in zip(tensors, tirs)]
    return torch.cat(parts) if parts else tensors[0][:0]


def case_intranode(ctx):
    R, me = ctx.world_size, ctx.rank
    buf = _buffer(ctx)
    ins = [_inputs(7, r, R) for r in range(R)]
    lays = [_layout(i[1], R) for i in ins]
    x, idx, w = ins[me]
    per_rank, per_expert, tir = lays[me]
    # get_dispatch_layout agrees with the layout computed by hand
    ntr, nrr, nte, tir2, _ = buf.get_dispatch_layout(idx, E)
    assert torch.equal(ntr, per_rank) and torch.equal(nte, per_expert) and torch.equal(tir2, tir) and nrr is None
    gbl_per_rank = sum(lay[0] for lay in lays)
    gbl_per_expert = sum(lay[1] for lay in lays)
    ones = [torch.ones(i[0].shape[0], H, dtype=torch.bfloat16) * r for r, i in enumerate(ins)]
    xs = {"ones": ones, "random": [i[0] for i in ins]}
    fp8 = [_fp8_variants(i[0]) for i in ins]
    for name in fp8[0]:
        xs[name] = [f[name] for f in fp8]
    tirs = [lay[2] for lay in lays]
    for name, per_src in xs.items():
        cur = per_src[me]
        for with_topk in (False, True):
            for previous in (False, True):
                args = dict(x=cur, num_tokens_per_rank=per_rank, is_token_in_rank=tir, num_tokens_per_expert=per_expert,
                            async_finish=previous)
                if with_topk:
                    args.update(topk_idx=idx, topk_weights=w)
                if previous:
                    args["previous_event"] = deep_ep.Buffer.capture()
                recv_x, recv_idx, recv_w, per_expert_list, handle, event = buf.dispatch(**args)
                event.current_stream_wait()
                tag = f"{name} topk={with_topk} previous={previous}"
                assert per_expert_list == gbl_per_expert.view(R, -1)[me].tolist(), tag
                if isinstance(cur, tuple):
                    data, scales = recv_x
                    assert torch.equal(data.view(torch.uint8),
                                       _expected_rows([p[0].view(torch.uint8) for p in per_src], tirs, me)), tag
                    want_s = _expected_rows([p[1].contiguous() for p in per_src], tirs, me)
                    assert scales.dtype == cur[1].dtype and scales.shape == want_s.shape, tag
                    assert torch.equal(scales.view(torch.int32), want_s.view(torch.int32)), tag
                    n = data.shape[0]
                else:
                    assert torch.equal(recv_x.view(torch.int16), _expected_rows(
                        [p.view(torch.int16) for p in per_src], tirs, me)), tag
                    n = recv_x.shape[0]
                assert n == int(gbl_per_rank[me]), tag
                rpm = handle[0]
                assert rpm.shape == (R, R) and int(rpm[R - 1, me]) == n, tag
                if with_topk:
                    assert recv_idx.shape == (n, K) and bool(((recv_idx >= -1) & (recv_idx < E // R)).all())
                    for i, c in enumerate(per_expert_list):
                        assert int((recv_idx == i).sum()) == c, tag
                    worst = sum(i[0].shape[0] for i in ins)
                    wx, widx, ww, empty, _, _ = buf.dispatch(**args, num_worst_tokens=worst)
                    assert empty == [] and widx.shape[0] == worst and bool((widx[n:] == -1).all()), tag
                    assert torch.equal(widx[:n], recv_idx) and torch.equal(ww[:n], recv_w), tag
                else:
                    assert recv_idx is None and recv_w is None, tag
                    # cached dispatch reuses the handle
                    cx, *_ = buf.dispatch(cur, handle=handle)
                    if isinstance(cur, tuple):
                        assert torch.equal(cx[1].view(torch.int32), recv_x[1].view(torch.int32)), tag
                    else:
                        assert torch.equal(cx, recv_x), tag
                if isinstance(cur, tuple):
                    continue
                combined, combined_w, event = buf.combine(recv_x, handle, topk_weights=recv_w if with_topk else None,
                                                          async_finish=previous,
                                                          previous_event=deep_ep.Buffer.capture() if previous else None)
                hits = tir.sum(dim=1, keepdim=True).float()
                if name == "ones":
                    assert torch.equal(combined.float(), cur.float() * hits), tag
                else:
                    assert torch.allclose(combined.float(), cur.float() * hits, rtol=1e-2, atol=1e-2), tag
                if with_topk:
                    want = torch.where(idx >= 0, w, torch.zeros_like(w))
                    assert torch.allclose(combined_w, want, atol=1e-6), tag
                else:
                    assert combined_w is None
    # bad input keeps clear errors
    q, s = _fp8_variants(x)["fp8_colmajor"]
    lay = dict(num_tokens_per_rank=per_rank, is_token_in_rank=tir, num_tokens_per_expert=per_expert)
    _expect(ValueError, ["scales", "shape"], lambda: buf.dispatch((q, s[:-1]), **lay))
    _expect(TypeError, ["scales", "float32"], lambda: buf.dispatch((q, s.double()), **lay))
    _expect(ValueError, ["scales", "shape"], lambda: buf.dispatch((q, torch.ones(q.shape[0], H // 64)), **lay))
    _expect(ValueError, ["num_tokens_per_expert"], lambda: buf.dispatch(x, num_tokens_per_rank=per_rank,
                                                                        is_token_in_rank=tir))
    _expect(ValueError, ["num_worst_tokens"], lambda: buf.dispatch(x, num_worst_tokens=100, **lay))
    buf.destroy()


def case_internode_handle(ctx):
    """Two emulated nodes: DeepEP's 10-field internode handle order; dispatch without top-k across nodes."""
    R, me = ctx.world_size, ctx.rank
    P = R // 2
    cfg = deep_ep.Buffer.get_dispatch_config(R)
    buf = deep_ep.Buffer(ctx.group, cfg.get_nvl_buffer_size_hint(H * 2, P), cfg.get_rdma_buffer_size_hint(H * 2, R),
                         backend="reference", ranks_per_node=P)
    assert buf.runtime.get_num_rdma_ranks() == 2
    ins = [_inputs(11, r, R) for r in range(R)]
    lays = [_layout(i[1], R) for i in ins]
    x, idx, w = ins[me]
    per_rank, per_expert, tir = lays[me]
    ntr, nrr, nte, tir2, _ = buf.get_dispatch_layout(idx, E)
    assert nrr is not None and nrr.shape == (2,)
    for with_topk in (True, False):
        args = dict(num_tokens_per_rank=ntr, num_tokens_per_rdma_rank=nrr, is_token_in_rank=tir2,
                    num_tokens_per_expert=nte)
        if with_topk:
            args.update(topk_idx=idx, topk_weights=w)
        recv_x, _, _, lst, handle, _ = buf.internode_dispatch(x, **args)
        assert torch.equal(recv_x.view(torch.int16), _expected_rows([i[0].view(torch.int16) for i in ins],
                                                                    [lay[2] for lay in lays], me))
        assert lst == sum(lay[1] for lay in lays).view(R, -1)[me].tolist()
        assert len(handle) == 10 and handle[0] is handle.is_token_in_rank
        fields = list(handle)
        assert torch.equal(fields[6], handle.rank_prefix_matrix[:, me])  # recv_gbl_rank_prefix_sum
        assert fields[2].shape == handle.channel_prefix_matrix.shape and fields[1].shape[0] == 2
        assert fields[7].shape == (recv_x.shape[0], 2)
        combined, _, _ = buf.internode_combine(recv_x, handle)
        assert torch.allclose(combined.float(), x.float() * tir.sum(1, keepdim=True).float(), rtol=1e-2, atol=1e-2)


# ------------------------------------------------------------------ low-latency mode
def _ll_inputs(seed, rank, R):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    T = 5 + 2 * rank
    Ell = LL_E_PER_RANK * R
    x = (torch.randn(T, H, generator=g) * 0.3).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(Ell, generator=g)[:K] for _ in range(T)])
    idx[torch.rand(T, K, generator=g) < 0.2] = -1
    w = torch.rand(T, K, generator=g)
    return x, idx.contiguous(), w


def _ll_buffer(ctx, group=None, **kw):
    R = ctx.world_size
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(LL_M, H, R, LL_E_PER_RANK * R)
    return deep_ep.Buffer(group or ctx.group, 0, rdma, low_latency_mode=True, num_qps_per_rank=LL_E_PER_RANK,
                          explicitly_destroy=True, backend="reference", **kw)


def _ll_expected_combine(x, idx, w, R, masked=(), logfmt=False):
    """The low-latency combine's documented sum with BF16 dispatch and identity experts: per rank d
    (unmasked), P_d = sum of w * row over slots on d (fp32, top-k order), cast to bf16 (then LogFMT);
    then the partials in rank order."""
    L = LL_E_PER_RANK
    out = torch.zeros(x.shape[0], H)
    for t in range(x.shape[0]):
        acc = torch.zeros(H)
        for d in range(R):
            if d in masked:
                continue
            part, hit = torch.zeros(H), False
            for k in range(K):
                e = int(idx[t, k])
                if e >= 0 and e // L == d:
                    part, hit = part + w[t, k] * x[t].float(), True
            if hit:
                p = part.to(torch.bfloat16)
                acc = acc + (logfmt_roundtrip(p.view(1, H)).view(H) if logfmt else p.float())
        out[t] = acc
    return out.to(torch.bfloat16)


def case_low_latency(ctx):
    R, me = ctx.world_size, ctx.rank
    L, Ell = LL_E_PER_RANK, LL_E_PER_RANK * R
    buf = _ll_buffer(ctx)
    ins = [_ll_inputs(3, r, R) for r in range(R)]
    x, idx, w = ins[me]
    want_counts = torch.tensor([sum(int((i[1] == me * L + e).sum()) for i in ins) for e in range(L)], dtype=torch.int32)
    # stats: counts added per local expert over calls, wait time per source rank
    cum = torch.zeros(L, dtype=torch.int32)
    wait = torch.zeros(R, dtype=torch.int64)
    for use_fp8, round_scale, ue8m0, hook in ((False, False, False, False), (True, False, False, True),
                                              (True, True, True, False)):
        recv_x, recv_count, handle, event, recv_hook = deep_ep.Buffer.low_latency_dispatch(
            buf, x, idx, LL_M, Ell, cum, wait, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=ue8m0,
            async_finish=not hook, return_recv_hook=hook)
        recv_hook() if hook else event.current_stream_wait()
        assert torch.equal(recv_count, want_counts)
        if use_fp8:
            data, scales = recv_x
            S = H // 512 if ue8m0 else H // 128
            assert scales.shape == (L, R * LL_M, S) and scales.stride() == (S * R * LL_M, 1, R * LL_M), scales.stride()
            assert scales.dtype == (torch.int32 if ue8m0 else torch.float32)
            sc = unpack_ue8m0(scales) if ue8m0 else scales
            deq = (data.float().view(L, R * LL_M, -1, 128) * sc.unsqueeze(-1)).view(L, R * LL_M, H)
        else:
            deq = recv_x.float()
        # expert e's rows: sources in rank order, tokens in order; check against the senders' rows
        for e in range(L):
            rows = [ins[s][0][t].float() for s in range(R) for t in range(ins[s][0].shape[0]) for k in range(K)
                    if int(ins[s][1][t, k]) == me * L + e]
            if rows:
                got = deq[e, :len(rows)]
                assert torch.allclose(got, torch.stack(rows), rtol=0.13, atol=1e-3), (use_fp8, e)
    assert torch.equal(cum, want_counts * 3)
    assert bool((wait >= 0).all()) and int(wait.sum()) > 0
    # combine with identity experts: zero copy (DeepEP's way: write the buffer, pass any tensor), LogFMT, stats
    recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, LL_M, Ell, use_fp8=False)
    cwait = torch.zeros(R, dtype=torch.int64)
    plain, _, _ = buf.low_latency_combine(recv_x, idx, w, handle)
    want = _ll_expected_combine(x, idx, w, R)
    assert torch.equal(plain.view(torch.int16), want.view(torch.int16))
    buf.get_next_low_latency_combine_buffer(handle)[:] = recv_x
    out = torch.empty(x.shape[0], H, dtype=torch.bfloat16)
    zc, _, _ = buf.low_latency_combine(torch.zeros_like(recv_x), idx, w, handle, zero_copy=True, out=out,
                                       combine_wait_recv_cost_stats=cwait)
    assert zc is out and torch.equal(zc.view(torch.int16), want.view(torch.int16))
    assert int(cwait.sum()) > 0
    _expect(ValueError, ["get_next_low_latency_combine_buffer"],
            lambda: buf.low_latency_combine(recv_x, idx, w, handle, zero_copy=True))
    lf, _, _ = buf.low_latency_combine(recv_x, idx, w, handle, use_logfmt=True)
    want_lf = _ll_expected_combine(x, idx, w, R, logfmt=True)
    assert torch.equal(lf.view(torch.int16), want_lf.view(torch.int16))
    assert (lf.float() - plain.float()).abs().max() <= 0.05 * plain.float().abs().max() + 1e-3
    # bad stats keep clear errors
    _expect(TypeError, ["cumulative_local_expert_recv_stats", "int32"],
            lambda: buf.low_latency_dispatch(x, idx, LL_M, Ell, torch.zeros(L, dtype=torch.int64)))
    _expect(ValueError, ["dispatch_wait_recv_cost_stats", f"[{R}]"],
            lambda: buf.low_latency_dispatch(x, idx, LL_M, Ell, None, torch.zeros(R + 1, dtype=torch.int64)))
    buf.destroy()


def case_shrink(ctx):
    """Shrink mode: a masked rank is skipped; a rank that stops calling is masked after the timeout."""
    R, me = ctx.world_size, ctx.rank
    L, Ell = LL_E_PER_RANK, LL_E_PER_RANK * R
    old = os.environ.get("COMMLIB_TIMEOUT_S")
    os.environ["COMMLIB_TIMEOUT_S"] = "4"
    try:
        buf = _ll_buffer(ctx, enable_shrink=True)
    finally:
        if old is None:
            del os.environ["COMMLIB_TIMEOUT_S"]
        else:
            os.environ["COMMLIB_TIMEOUT_S"] = old
    status = torch.zeros(R, dtype=torch.int32)
    buf.low_latency_query_mask_buffer(status)
    assert status.tolist() == [0] * R
    ins = [_ll_inputs(5, r, R) for r in range(R)]
    x, idx, w = ins[me]
    gone = R - 1                      # masked by everyone up front; it makes no call
    failing = 1 if R > 2 else None    # stops calling; the others find out through the timeout
    if me != gone:
        buf.low_latency_update_mask_buffer(gone, True)
        rounds = [(frozenset({gone}), None)]
        if failing is not None:
            rounds.append((frozenset({gone, failing}), failing))
        for masked, fails in rounds:
            if me == fails:
                break
            recv_x, recv_count, handle, _, _ = buf.low_latency_dispatch(x, idx, LL_M, Ell, use_fp8=False)
            buf.low_latency_query_mask_buffer(status)
            assert set(status.nonzero().flatten().tolist()) == set(masked), (status, masked)
            want = [sum(int((ins[s][1] == me * L + e).sum()) for s in range(R) if s not in masked) for e in range(L)]
            assert recv_count.tolist() == want, (recv_count, want)
            combined, _, _ = buf.low_latency_combine(recv_x, idx, w, handle)
            exp = _ll_expected_combine(x, idx, w, R, masked=masked)
            assert torch.equal(combined.view(torch.int16), exp.view(torch.int16))
            buf.clean_low_latency_buffer(LL_M, H, Ell)
        buf.low_latency_clean_mask_buffer()
        buf.low_latency_query_mask_buffer(status)
        assert status.tolist() == [0] * R
    _expect(ValueError, ["rank_to_mask"], lambda: buf.low_latency_update_mask_buffer(R, True))
    buf.destroy()


# ------------------------------------------------------------------ clients, the way each calls commlib
def case_megatron(ctx):
    """Megatron-LM's fused_a2a: the real module when megatron-core is importable, else its call sequence."""
    R, me = ctx.world_size, ctx.rank
    x, idx, w = _inputs(13, me, R)
    try:
        from megatron.core.transformer.moe import fused_a2a
    except ImportError:
        fused_a2a = None
    if fused_a2a is not None and fused_a2a.HAVE_DEEP_EP:
        fused_a2a._buffer = None
        xg = x.clone().requires_grad_(True)
        wg = w.clone().requires_grad_(True)
        recv_x, recv_idx, recv_w, tokens_per_expert, handle = fused_a2a.fused_dispatch(xg, idx, wg, E, ctx.group)
        out, _ = fused_a2a.fused_combine(recv_x, ctx.group, handle)
        (out.float().sum() + recv_w.pow(2).sum()).backward()
        hits = _layout(idx, R)[2].sum(1, keepdim=True).float()
        assert torch.allclose(out.float(), x.float() * hits, rtol=1e-2, atol=1e-2)
        assert torch.allclose(xg.grad.float(), hits.expand(-1, H), rtol=1e-2)
        assert tokens_per_expert.sum() == sum(_inputs(13, r, R)[1].ge(0).logical_and(
            _inputs(13, r, R)[1] // (E // R) == me).sum() for r in range(R))
        fused_a2a._buffer = None
        return
    # the same sequence, reduced: Buffer(group, nvl, rdma); EventOverlap(EventHandle()) as previous_event
    cfgs = (deep_ep.Buffer.get_dispatch_config(R), deep_ep.Buffer.get_combine_config(R))
    nvl = max(c.get_nvl_buffer_size_hint(H * 2, R) for c in cfgs)
    rdma = max(c.get_rdma_buffer_size_hint(H * 2, R) for c in cfgs)
    buf = deep_ep.Buffer(ctx.group, nvl, rdma)
    assert buf.group == ctx.group and buf.num_nvl_bytes >= nvl
    prev = EventOverlap(EventHandle())
    ntr, nrr, nte, tir, ev = buf.get_dispatch_layout(idx, E, previous_event=prev, async_finish=True,
                                                     allocate_on_comm_stream=True)
    recv_x, recv_idx, recv_w, lst, handle, after = buf.dispatch(
        x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=ntr, num_tokens_per_rdma_rank=nrr, is_token_in_rank=tir,
        num_tokens_per_expert=nte, previous_event=ev, async_finish=True, allocate_on_comm_stream=True)
    after.current_stream_wait()
    torch.tensor(lst)
    grad_x, grad_w, after = buf.combine(recv_x.contiguous(), handle, topk_weights=recv_w.float(),
                                        previous_event=EventOverlap(EventHandle()), async_finish=True)
    after.current_stream_wait()
    back, _, _, _, _, after = buf.dispatch(grad_x.contiguous(), handle=handle, previous_event=EventOverlap(EventHandle()),
                                           async_finish=True)
    assert back.shape == recv_x.shape and grad_w.shape == w.shape
    deep_ep.Buffer.set_num_sms(deep_ep.Buffer.num_sms)


def case_sglang(ctx):
    """SGLang's DeepEP dispatcher (auto mode): one Buffer for normal and low-latency calls."""
    R, me = ctx.world_size, ctx.rank
    Ell = LL_E_PER_RANK * R
    deepep_config = {  # SGLang's --deepep-config JSON, built with Config(**entry)
        "normal_dispatch": {"num_sms": deep_ep.Buffer.num_sms, "num_max_nvl_chunked_send_tokens": 8,
                            "num_max_nvl_chunked_recv_tokens": 256},
        "normal_combine": {"num_sms": deep_ep.Buffer.num_sms, "num_max_nvl_chunked_send_tokens": 4,
                           "num_max_nvl_chunked_recv_tokens": 256}}
    cfg_d = deep_ep.Config(**deepep_config["normal_dispatch"])
    cfg_c = deep_ep.Config(**deepep_config["normal_combine"])
    nvl = max(c.get_nvl_buffer_size_hint(H * 2, R) for c in (cfg_d, cfg_c))
    rdma = max(cfg_d.get_rdma_buffer_size_hint(H * 2, R),
               deep_ep.Buffer.get_low_latency_rdma_size_hint(LL_M, H, R, Ell))
    buf = deep_ep.Buffer(ctx.group, nvl, rdma, low_latency_mode=True, num_qps_per_rank=LL_E_PER_RANK,
                         allow_mnnvl=True, backend="reference")
    # normal mode
    x, idx, w = _inputs(17, me, R)
    prev = deep_ep.Buffer.capture()
    ntr, nrr, nte, tir, prev = buf.get_dispatch_layout(idx, E, previous_event=prev, async_finish=True,
                                                       allocate_on_comm_stream=True)
    recv_x, recv_idx, recv_w, lst, handle, event = buf.dispatch(
        x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=ntr, num_tokens_per_rdma_rank=nrr, is_token_in_rank=tir,
        num_tokens_per_expert=nte, previous_event=prev, async_finish=True, allocate_on_comm_stream=True,
        expert_alignment=128, config=cfg_d)
    event.current_stream_wait()
    assert all(c % 128 == 0 for c in lst)
    combined, _, event = buf.combine(recv_x, handle, async_finish=True, previous_event=deep_ep.Buffer.capture(),
                                     allocate_on_comm_stream=True, config=cfg_c)
    event.current_stream_wait()
    # switching to low-latency mode cleans the buffer; the dispatcher reads group_size per call
    buf.clean_low_latency_buffer(LL_M, H, Ell)
    lx, lidx, lw = _ll_inputs(19, me, R)
    expected_m = (lx.shape[0] * buf.group_size * lidx.shape[1] + Ell) // Ell
    assert expected_m > 0
    hidden, count, ll_handle, event, hook = buf.low_latency_dispatch(lx, lidx, LL_M, Ell, use_fp8=True,
                                                                     async_finish=True, return_recv_hook=False)
    event.current_stream_wait()
    out, event, hook = buf.low_latency_combine(x=hidden[0].float().mul(0).to(torch.bfloat16), topk_idx=lidx,
                                               topk_weights=lw, handle=ll_handle, async_finish=True,
                                               return_recv_hook=False)
    event.current_stream_wait()
    assert out.shape == lx.shape and int(out.float().abs().sum()) == 0


def case_vllm(ctx):
    """vLLM's DeepEP managers: a fixed-size high-throughput Buffer; the low-latency Buffer with
    enable_shrink, its mask queries, and the raw RDMA buffer as a tensor."""
    R, me = ctx.world_size, ctx.rank
    Ell = LL_E_PER_RANK * R
    ht = deep_ep.Buffer(group=ctx.group, num_nvl_bytes=1 << 30, num_rdma_bytes=0, low_latency_mode=False,
                        num_qps_per_rank=1, backend="reference")
    x, idx, w = _inputs(23, me, R)
    ntr, nrr, nte, tir, _ = ht.get_dispatch_layout(idx, E)
    recv_x, *_ , handle, _ = ht.dispatch(x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=ntr,
                                         is_token_in_rank=tir, num_tokens_per_expert=nte)
    ht.combine(recv_x, handle)
    rdma = deep_ep.Buffer.get_low_latency_rdma_size_hint(LL_M, H, R, Ell)
    ll = deep_ep.Buffer(group=ctx.group, num_nvl_bytes=0, num_rdma_bytes=rdma, low_latency_mode=True,
                        num_qps_per_rank=LL_E_PER_RANK, allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False,
                        enable_shrink=True, backend="reference")
    status = torch.zeros(R, dtype=torch.int32)
    ll.low_latency_query_mask_buffer(status)
    assert status.sum() == 0
    ll.low_latency_clean_mask_buffer()
    raw = ll.get_local_buffer_tensor(torch.int32, use_rdma_buffer=True)
    assert raw.numel() == rdma // 4
    lx, lidx, lw = _ll_inputs(29, me, R)
    recv, count, h, _, hook = ll.low_latency_dispatch(lx, lidx, LL_M, Ell, use_fp8=True, async_finish=False,
                                                      return_recv_hook=True)
    hook()
    y = (recv[0].float().view(recv[0].shape[0], recv[0].shape[1], -1, 128)
         * recv[1].unsqueeze(-1)).view(recv[0].shape).to(torch.bfloat16)
    out, _, hook = ll.low_latency_combine(y, lidx, lw, h, async_finish=False, return_recv_hook=True)
    hook()
    assert out.shape == lx.shape and not torch.isnan(out.float()).any()
    assert math.isfinite(float(out.float().sum()))
