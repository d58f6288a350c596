"""Low-latency mode (reference transport) against an independent oracle, inside CPU worlds.

The FP8 cast, the power-of-two scales and the UE8M0 unpacking are the oracle's (oracle.py) or
written here, not imported from commlib."""
from __future__ import annotations

import math

import oracle as O
import torch

import commlib

E_PER_RANK, H, K, M = 4, 512, 4, 24


def _inputs(rank, R, seed):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    T = [M, 0, 7, 19][rank % 4] if seed % 2 else 5 + 3 * rank
    x = (torch.randn(T, H, generator=g) * (rank + 1)).to(torch.bfloat16)
    E = E_PER_RANK * R
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.empty(0, K, dtype=torch.int64)
    if T:
        idx[torch.rand(T, K, generator=g) < 0.2] = -1
    w = torch.rand(T, K, generator=g)
    return x, idx.contiguous(), w


def _buffer(ctx):
    R = ctx.world_size
    return commlib.Buffer(ctx.group, 0, commlib.Buffer.get_low_latency_rdma_size_hint(M, H, R, E_PER_RANK * R),
                          low_latency_mode=True, backend="reference")


def unpack_ue8m0(packed):
    """[..., H / 512] int32, four biased 8-bit exponents per word (lowest byte first) -> [..., H / 128]
    float32 scales 2^(e - 127)."""
    shifts = torch.tensor([0, 8, 16, 24], dtype=torch.int64)
    exps = (packed.to(torch.int64).unsqueeze(-1) >> shifts) & 0xFF
    return torch.pow(2.0, (exps - 127).double()).float().flatten(-2)


def _round_pow2_scale(amax):
    s = max(amax, 1e-4) / 448.0
    return 2.0 ** math.ceil(math.log2(s))


def _as_received(xrow, fp8, round_scale):
    """What the expert sees of a token row (dequantised for FP8), computed independently."""
    if not fp8:
        return xrow.float()
    if not round_scale:
        q, s = O.cast_fp8(xrow.unsqueeze(0))
        return (q.float().view(-1, 128) * s.view(-1, 1)).view(-1)
    blocks = xrow.float().view(-1, 128)
    out = []
    for b in blocks:
        sc = _round_pow2_scale(float(b.abs().max()))
        out.append(O.e4m3_round(b / sc).float() * sc)
    return torch.cat(out)


def _check(ctx, buf, seed, fp8, round_scale=False, ue8m0=False, zero_copy=False, hook=False):
    R, me = ctx.world_size, ctx.rank
    E, L = E_PER_RANK * R, E_PER_RANK
    ins = [_inputs(r, R, seed) for r in range(R)]
    x, idx, w = ins[me]
    recv_x, recv_count, handle, event, recv_hook = buf.low_latency_dispatch(
        x, idx, M, E, use_fp8=fp8, round_scale=round_scale, use_ue8m0=ue8m0, return_recv_hook=hook)
    if hook:
        recv_hook()
    event.current_stream_wait()
    # oracle: rows per local expert, sources in rank order, (token, slot) order within a source
    for e in range(L):
        g = me * L + e
        want = [(s, t) for s in range(R) for t in range(ins[s][0].shape[0]) for k in range(K)
                if int(ins[s][1][t, k]) == g]
        assert int(recv_count[e]) == len(want), (e, int(recv_count[e]), len(want))
        assert handle.src_info[e, :len(want)].tolist() == [t for _, t in want]
        assert bool((handle.src_info[e, len(want):] == -1).all())
        for s in range(R):
            n = sum(1 for ss, _ in want if ss == s)
            start = sum(1 for ss, _ in want if ss < s)
            assert int(handle.layout_range[e, s]) == (start << 32) | n
        for i, (s, t) in enumerate(want):
            xs = ins[s][0][t]
            if not fp8:
                assert torch.equal(recv_x[e, i].view(torch.int16), xs.view(torch.int16)), (e, i)
            else:
                q, sc = recv_x[0][e, i], recv_x[1][e, i]
                scales = unpack_ue8m0(sc) if ue8m0 else sc
                got = (q.float().view(-1, 128) * scales.view(-1, 1)).view(-1)
                assert torch.equal(got, _as_received(xs, True, round_scale)), (e, i)
                if round_scale:
                    assert bool((torch.log2(scales) == torch.round(torch.log2(scales))).all())
        assert bool((recv_x[0] if fp8 else recv_x)[e, len(want):].float().eq(0).all())
    # combine: expert e's output = received row (dequantised) x (1 + g / 16), in bf16
    factors = torch.tensor([1 + (me * L + e) / 16 for e in range(L)]).view(L, 1, 1)
    base = (recv_x[0].float().view(L, R * M, -1, 128) * (unpack_ue8m0(recv_x[1]) if ue8m0 else recv_x[1]).unsqueeze(-1)
            ).view(L, R * M, H) if fp8 else recv_x.float()
    y = (base * factors).to(torch.bfloat16)
    if zero_copy:
        target = buf.get_next_low_latency_combine_buffer(handle)
        target.copy_(y)
        y = target
    out = torch.empty(x.shape[0], H, dtype=torch.bfloat16)
    combined, event, chook = buf.low_latency_combine(y, idx, w, handle, zero_copy=zero_copy, return_recv_hook=hook,
                                                     out=out)
    if hook:
        chook()
    assert combined is out
    # partial per expert rank (fp32, slots in top-k order, then bf16), then the partials in rank order
    exp = torch.zeros(x.shape[0], H)
    for t in range(x.shape[0]):
        acc = torch.zeros(H)
        for d in range(R):
            part, any_here = torch.zeros(H), False
            for k in range(K):
                g = int(idx[t, k])
                if g < 0 or g // L != d:
                    continue
                row = (_as_received(x[t], fp8, round_scale) * (1 + g / 16)).to(torch.bfloat16).float()
                part, any_here = part + w[t, k] * row, True
            if any_here:
                acc = acc + part.to(torch.bfloat16).float()
        exp[t] = acc
    assert torch.equal(combined.view(torch.int16), exp.to(torch.bfloat16).view(torch.int16)), "combine"


def case_bf16(ctx):
    buf = _buffer(ctx)
    for seed in (1, 2):
        _check(ctx, buf, seed, fp8=False, hook=seed == 2)
    buf.destroy()


def case_fp8(ctx):
    buf = _buffer(ctx)
    _check(ctx, buf, 3, fp8=True)
    _check(ctx, buf, 4, fp8=True, round_scale=True, zero_copy=True)
    _check(ctx, buf, 5, fp8=True, round_scale=True, ue8m0=True, hook=True)
    buf.destroy()


def case_errors(ctx):
    R = ctx.world_size
    buf = _buffer(ctx)
    x, idx, w = _inputs(ctx.rank, R, 1)
    for fn, word in ((lambda: buf.low_latency_dispatch(torch.zeros(M + 1, H, dtype=torch.bfloat16),
                                                       torch.zeros(M + 1, K, dtype=torch.int64), M, 4 * R),
                      "num_max_dispatch_tokens_per_rank"),
                     (lambda: buf.low_latency_dispatch(x, idx, M, 4 * R, use_fp8=True, use_ue8m0=True), "use_ue8m0"),
                     (lambda: buf.low_latency_dispatch(x.float(), idx, M, 4 * R), "bfloat16")):
        try:
            fn()
        except (ValueError, TypeError) as e:
            assert word in str(e), e
        else:
            raise AssertionError(word)
    _, _, h, _, hook = buf.low_latency_dispatch(x, idx, M, 4 * R, use_fp8=False, return_recv_hook=True)
    y = torch.zeros(4, R * M, H, dtype=torch.bfloat16)
    try:
        buf.low_latency_combine(y, idx, w, h)
    except ValueError as e:
        assert "hook" in str(e)
    else:
        raise AssertionError("combine before the receive hook")
    hook()
    buf.low_latency_combine(y, idx, w, h)
    small = commlib.Buffer(ctx.group, 0, 1024, low_latency_mode=True, backend="reference")
    try:
        small.low_latency_dispatch(x, idx, M, 4 * R)
    except ValueError as e:
        assert "get_low_latency_rdma_size_hint" in str(e), e
    else:
        raise AssertionError("small rdma buffer accepted")
    small.destroy()
    buf.destroy()


def case_hook_halves(ctx):
    """return_recv_hook=True: the call does the send half (the exchange) and its hook the receive half
    (the rows into the outputs, zeros until then), once; without a hook the call does both. The
    outputs after the hook are the plain call's, bit for bit (dispatch BF16 and FP8, combine)."""
    R = ctx.world_size
    buf = _buffer(ctx)
    eng, log = buf._low_latency, []
    for name in ("_dispatch_receive", "_combine_receive"):
        inner = getattr(eng, name)
        setattr(eng, name, lambda *a, _f=inner, _n=name: (log.append(_n.split("_")[1] + " receive"), _f(*a))[1])
    a2a = buf.backend._a2a_rows
    buf.backend._a2a_rows = lambda *a, **k: (log.append("exchange"), a2a(*a, **k))[1]
    x, idx, w = _inputs(ctx.rank, R, 3)
    E = E_PER_RANK * R
    for fp8 in (False, True):
        log.clear()
        plain = buf.low_latency_dispatch(x, idx, M, E, use_fp8=fp8)
        assert log == ["exchange", "dispatch receive"], log
        log.clear()
        rx, cnt, handle, _, hook = buf.low_latency_dispatch(x, idx, M, E, use_fp8=fp8, return_recv_hook=True)
        assert log == ["exchange"], log
        assert not bool(cnt.any()) and bool((handle.src_info == -1).all()), "outputs filled before the hook"
        log.clear()
        hook()
        assert log == ["dispatch receive"], log
        got = [*(rx if fp8 else [rx]), cnt, handle.src_info, handle.layout_range]
        want = [*(plain[0] if fp8 else [plain[0]]), plain[1], plain[2].src_info, plain[2].layout_range]
        for i, (g, p) in enumerate(zip(got, want)):
            assert torch.equal(g.contiguous().view(torch.uint8), p.contiguous().view(torch.uint8)), (fp8, i)
        try:
            hook()
        except ValueError as e:
            assert "once" in str(e), e
        else:
            raise AssertionError("a receive hook ran twice")
    rx, _, handle, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    log.clear()
    want, _, _ = buf.low_latency_combine(rx, idx, w, handle)
    assert log == ["exchange", "combine receive"], log
    log.clear()
    got, _, hook = buf.low_latency_combine(rx, idx, w, handle, return_recv_hook=True)
    assert log == ["exchange"] and not bool(got.float().any()), log
    hook()
    assert log == ["exchange", "combine receive"], log
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    buf.destroy()


def case_roll_call(ctx):
    """Shrink mode's roll call: all ranks answer (nothing masked); rank R - 1 stops: every other rank
    masks it after one timeout, and later rounds among the rest are quick; a rank that has itself
    masked takes no part."""
    import time

    from commlib.backends.low_latency.reference import RollCall
    R, me = ctx.world_size, ctx.rank
    rc = RollCall(ctx.group, me, R, 4242, timeout_s=2.0, what="test")
    mask = torch.zeros(R, dtype=torch.int32)
    assert rc.round(mask) == [] and not mask.any()
    gone = R - 1
    if me != gone:
        t0 = time.monotonic()
        assert rc.round(mask) == [gone], mask
        assert 1.5 < time.monotonic() - t0 < 30
        assert mask.tolist() == [0] * (R - 1) + [1]
        t0 = time.monotonic()
        for _ in range(3):
            assert rc.round(mask) == []
        assert time.monotonic() - t0 < 1.5, "rounds among the live ranks waited for the masked one"
    mine = torch.zeros(R, dtype=torch.int32)
    mine[me] = 1
    assert rc.round(mine) == [] and mine.tolist() == [int(r == me) for r in range(R)]
    torch.distributed.barrier()
