"""Cases for test_default_device.py: commlib's key calls with torch's default device set elsewhere.

Each scenario builds its own Buffer, runs the calls and returns {name: output tensor}. A case runs
the scenario twice on every rank: with torch's default device CPU, then under
``torch.set_default_device("meta")``, where a tensor commlib makes without naming its device lands
on meta and fails (meta has no data; copying it to a real device raises). The two runs must agree
bit for bit. The test's own inputs name their device; the oracle is the CPU-default run.
"""
from __future__ import annotations

import torch

from commlib import Buffer
from commlib.fp8 import per_token_cast_to_fp8

CPU = torch.device("cpu")
E, H, K = 16, 256, 4
LL_E_PER_RANK, LL_H, LL_MAX = 2, 512, 16


def _inputs(ctx, T: int, num_experts: int, hidden: int, seed: int):
    """x [T, hidden] bf16, topk_idx [T, K] int64, topk_weights [T, K] float32 on ctx.device."""
    g = torch.Generator(device="cpu").manual_seed(seed * 1000 + ctx.rank)
    x = torch.randn(T, hidden, generator=g, device=CPU, dtype=torch.float32).to(torch.bfloat16)
    scores = torch.rand(T, num_experts, generator=g, device=CPU, dtype=torch.float32)
    idx = scores.topk(K, dim=1).indices
    idx[torch.rand(T, K, generator=g, device=CPU, dtype=torch.float32) < 0.2] = -1
    w = torch.rand(T, K, generator=g, device=CPU, dtype=torch.float32)
    return x.to(ctx.device), idx.to(torch.int64).contiguous().to(ctx.device), w.to(ctx.device)


def _normal_buffer(ctx, backend: str) -> Buffer:
    cfg = Buffer.get_dispatch_config(ctx.world_size)
    return Buffer(ctx.group, cfg.get_nvl_buffer_size_hint(H * 2, ctx.ranks_per_node),
                  cfg.get_rdma_buffer_size_hint(H * 2, ctx.world_size), backend=backend,
                  ranks_per_node=ctx.ranks_per_node)


def scenario_normal(ctx, backend: str = "reference") -> dict:
    """Layout, BF16 and FP8 dispatch, cached dispatch, combine (weights, bias), num_worst_tokens."""
    out = {}
    x, idx, w = _inputs(ctx, 10 + 3 * ctx.rank, E, H, seed=1)
    buf = _normal_buffer(ctx, backend)
    ntr, nrr, nte, tir, _ = buf.get_dispatch_layout(idx, E)
    out.update(ntr=ntr, nte=nte, tir=tir)
    if nrr is not None:
        out["nrr"] = nrr
    layout = dict(num_tokens_per_rank=ntr, num_tokens_per_rdma_rank=nrr, is_token_in_rank=tir,
                  num_tokens_per_expert=nte)
    rx, ri, rw, per_expert, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, **layout)
    out.update(rx=rx, ri=ri, rw=rw, per_expert=torch.tensor(per_expert, device=ctx.device),
               rank_prefix=handle.rank_prefix_matrix, src_idx=handle.recv_src_idx)
    rx2, *_ = buf.dispatch(x, handle=handle)
    out["rx_cached"] = rx2
    y = (rx.float() * (1 + ctx.rank / 8)).to(torch.bfloat16)
    bias = torch.full((x.shape[0], H), 0.5, dtype=torch.bfloat16, device=ctx.device)
    cx, cw, _ = buf.combine(y, handle, rw, bias=bias)
    out.update(cx=cx, cw=cw)
    (q, s), *_ = buf.dispatch(per_token_cast_to_fp8(x), topk_idx=idx, topk_weights=w, **layout)
    out.update(fp8_q=q.view(torch.uint8), fp8_s=s)
    worst = x.shape[0] * ctx.world_size + 8
    wx, wi, ww, wl, wh, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_worst_tokens=worst, **layout)
    n = rx.shape[0]  # rows past the received ones are padding (left as they are by the GPU engines)
    out.update(worst_x=wx[:n], worst_i=wi[:n], worst_w=ww[:n])
    wcx, _, _ = buf.combine(wx, wh)
    out["worst_cx"] = wcx
    buf.destroy()
    return out


def _received(rows_ESX: torch.Tensor, count_E: torch.Tensor) -> torch.Tensor:
    """rows_ESX [experts, slots, ...] with the slots past each expert's count zeroed (the GPU kernels
    leave those as they are)."""
    slot_S = torch.arange(rows_ESX.shape[1], device=rows_ESX.device)
    keep = (slot_S.view(1, -1) < count_E.view(-1, 1)).view(*rows_ESX.shape[:2], *[1] * (rows_ESX.dim() - 2))
    return torch.where(keep, rows_ESX, torch.zeros_like(rows_ESX))


def scenario_low_latency(ctx, backend: str = "reference") -> dict:
    """Low-latency dispatch (BF16, FP8 with a hook) and combine (plain, zero-copy, hooked)."""
    out = {}
    R = ctx.world_size
    num_experts = LL_E_PER_RANK * R
    x, idx, w = _inputs(ctx, 5 + 2 * ctx.rank, num_experts, LL_H, seed=2)
    buf = Buffer(ctx.group, 0, Buffer.get_low_latency_rdma_size_hint(LL_MAX, LL_H, R, num_experts),
                 low_latency_mode=True, backend=backend)
    rx, cnt, handle, _, _ = buf.low_latency_dispatch(x, idx, LL_MAX, num_experts, use_fp8=False)
    out.update(rx=_received(rx, cnt), cnt=cnt, src_info=handle.src_info, layout_range=handle.layout_range)
    comb, _, _ = buf.low_latency_combine(rx, idx, w, handle)
    out["comb"] = comb
    (q, s), cnt8, h8, _, hook = buf.low_latency_dispatch(x, idx, LL_MAX, num_experts, use_fp8=True,
                                                        return_recv_hook=True)
    hook()
    out.update(q=_received(q.view(torch.uint8), cnt8), s=_received(s, cnt8), cnt8=cnt8)
    target = buf.get_next_low_latency_combine_buffer(handle)
    target.copy_(rx)
    zc, _, hook = buf.low_latency_combine(target, idx, w, handle, zero_copy=True, return_recv_hook=True)
    hook()
    out["comb_zero_copy"] = zc
    buf.destroy()
    return out


def scenario_autograd(ctx, backend: str = "reference") -> dict:
    """training.autograd's dispatch and combine, forward and backward."""
    from commlib.training import autograd as ops
    x, idx, w = _inputs(ctx, 8 + ctx.rank, E, H, seed=3)
    buf = _normal_buffer(ctx, backend)
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    d = ops.dispatch(buf, x, idx, w, E)
    y = (d.recv_x.float() * 1.5).to(torch.bfloat16)
    combined, _ = ops.combine(buf, y, d.handle, topk_weights=d.recv_topk_weights)
    g = torch.Generator(device="cpu").manual_seed(7 + ctx.rank)
    loss = (combined.float() * torch.randn(combined.shape, generator=g, device=CPU, dtype=torch.float32).to(ctx.device)).sum() + d.recv_topk_weights.sum()
    loss.backward()
    out = dict(recv_x=d.recv_x.detach(), combined=combined.detach(), x_grad=x.grad, w_grad=w.grad)
    buf.destroy()
    return out


def _compare(name: str, want: dict, got: dict, rank: int) -> None:
    assert sorted(want) == sorted(got), f"rank {rank} {name}: outputs {sorted(got)} != {sorted(want)}"
    for k, a in want.items():
        b = got[k]
        if b is None or a is None:
            assert a is None and b is None, f"rank {rank} {name}.{k}: {a!r} vs {b!r}"
            continue
        assert b.device == a.device, f"rank {rank} {name}.{k} is on {b.device}, not {a.device}, under another default device"
        assert a.dtype == b.dtype and a.shape == b.shape, f"rank {rank} {name}.{k}: {b.dtype}{tuple(b.shape)}"
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), \
            f"rank {rank} {name}.{k} differs under another default device"


def run_both(ctx, scenario, default: str = "meta", backend: str = "reference") -> None:
    """``scenario`` with torch's defaults left alone, then under ``torch.set_default_device(default)`` and
    ``torch.set_default_dtype(torch.bfloat16)`` (DeepEP's test harness sets both): the outputs must be
    the same bytes on the same device (a float tensor commlib makes without its dtype would be bf16)."""
    want = scenario(ctx, backend)
    torch.set_default_device(default)
    torch.set_default_dtype(torch.bfloat16)
    try:
        got = scenario(ctx, backend)
    finally:
        torch.set_default_device(None)
        torch.set_default_dtype(torch.float32)
    assert torch.empty(0).device == CPU and torch.empty(0).dtype == torch.float32
    _compare(scenario.__name__, want, got, ctx.rank)


def run_with_device_context(ctx, scenario, default: str = "meta", backend: str = "reference") -> None:
    """The same under ``with torch.device(default)`` (a context, not the global setting)."""
    want = scenario(ctx, backend)
    with torch.device(default):
        got = scenario(ctx, backend)
    _compare(scenario.__name__, want, got, ctx.rank)


def case_normal(ctx):
    run_both(ctx, scenario_normal)


def case_normal_context(ctx):
    run_with_device_context(ctx, scenario_normal)


def case_low_latency(ctx):
    run_both(ctx, scenario_low_latency)


def case_autograd(ctx):
    run_both(ctx, scenario_autograd)
