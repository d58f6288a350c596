"""commlib.training.autograd: gradients of dispatch / combine, FP8, torch.compile, on CPU ranks.

One world of 4 ranks laid out as 2 emulated nodes x 2 (so both the NVLink-style and the
hierarchical reference paths run); every case runs inside it. Expected gradients are computed on
every rank from the global inputs (all ranks draw them from one seed), following the combine
semantics in commlib/backends/base.py exactly, so gradients are compared bit for bit.
"""
from __future__ import annotations

import pytest
import torch

from worlds import run_world

WORLD, RANKS_PER_NODE = 4, 2
T, H, K, E = 12, 128, 3, 8
CASES = ["dispatch_grad", "combine_grad", "fp8_dispatch_grad", "fp8_tuple_input", "no_weights",
         "torch_compile", "bad_dtype"]


# ------------------------------------------------------------------ helpers (run on every rank)

def _buffer(ctx, hidden=H):
    from commlib import Buffer
    cfg = Buffer.get_dispatch_config(ctx.world_size)
    return Buffer(ctx.group, num_nvl_bytes=cfg.get_nvl_buffer_size_hint(hidden * 2, ctx.ranks_per_node),
                  num_rdma_bytes=cfg.get_rdma_buffer_size_hint(hidden * 2, ctx.world_size))


_BUFFERS = {}


def _buf(ctx):
    if "b" not in _BUFFERS:
        _BUFFERS["b"] = _buffer(ctx)
    return _BUFFERS["b"]


def _global_inputs(R, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, T, H, generator=g).to(torch.bfloat16)
    scores = torch.rand(R, T, E, generator=g)
    idx = scores.topk(K, dim=2).indices
    idx[:, 0, 1] = -1                        # an empty slot
    w = torch.rand(R, T, K, generator=g)
    grad_rows = torch.randn(R, R * T, H, generator=g).to(torch.bfloat16)  # [dest rank, global token]
    grad_w = torch.randn(R, R * T, K, generator=g)
    grad_home = torch.randn(R, T, H, generator=g).to(torch.bfloat16)
    return x, idx.to(torch.int64), w, grad_rows, grad_w, grad_home


def _owner(idx, R):
    return torch.where(idx >= 0, idx // (E // R), torch.full_like(idx, -1))


def _expected_combine(rows_of_rank, holds, topo_nodes, ranks_per_node):
    """bf16(sum over nodes of float(bf16(sum over the node's ranks of float(row)))) (base.py semantics)."""
    acc = torch.zeros(H, dtype=torch.float32)
    for m in range(topo_nodes):
        part = torch.zeros(H, dtype=torch.float32)
        any_row = False
        for d in range(m * ranks_per_node, (m + 1) * ranks_per_node):
            if holds[d]:
                part += rows_of_rank[d].float()
                any_row = True
        if any_row:
            acc += part.to(torch.bfloat16).float() if topo_nodes > 1 else part
    return acc.to(torch.bfloat16)


def _expected_x_grad(ctx, idx_all, grad_rows):
    R, r = ctx.world_size, ctx.rank
    owners = _owner(idx_all[r], R)
    out = torch.empty(T, H, dtype=torch.bfloat16)
    nodes = R // ctx.ranks_per_node
    for t in range(T):
        holds = [(owners[t] == d).any().item() for d in range(R)]
        out[t] = _expected_combine([grad_rows[d][r * T + t] for d in range(R)], holds, nodes, ctx.ranks_per_node)
    return out


def _global_ids(handle):
    return handle.recv_src_rank.to(torch.int64) * T + handle.recv_src_idx.to(torch.int64)


# ------------------------------------------------------------------ cases

def case_dispatch_grad(ctx):
    from commlib.training import autograd as ops
    buf, r, R = _buf(ctx), ctx.rank, ctx.world_size
    x_all, idx_all, w_all, grad_rows, grad_w, _ = _global_inputs(R)
    x = x_all[r].clone().requires_grad_()
    w = w_all[r].clone().requires_grad_()
    out = ops.dispatch(buf, x, idx_all[r], w, E)
    gid = _global_ids(out.handle)
    assert torch.equal(out.recv_x, x_all.view(R * T, H)[gid])
    loss = (out.recv_x.float() * grad_rows[r][gid].float()).sum() + (out.recv_topk_weights * grad_w[r][gid]).sum()
    loss.backward()
    assert x.grad.dtype == torch.bfloat16
    assert torch.equal(x.grad, _expected_x_grad(ctx, idx_all, grad_rows)), "x.grad differs from the combine of row grads"
    owners = _owner(idx_all[r], R)
    exp_w = torch.zeros(T, K)
    for t in range(T):
        for k in range(K):
            if owners[t, k] >= 0:
                exp_w[t, k] = grad_w[owners[t, k], r * T + t, k]
    assert torch.equal(w.grad, exp_w), "topk_weights.grad must come from the rank owning each slot"


def case_combine_grad(ctx):
    from commlib.training import autograd as ops
    buf, r, R = _buf(ctx), ctx.rank, ctx.world_size
    x_all, idx_all, w_all, _, _, grad_home = _global_inputs(R, seed=1)
    out = ops.dispatch(buf, x_all[r], idx_all[r], w_all[r], E)
    gid = _global_ids(out.handle)
    y = (out.recv_x.float() * 2).to(torch.bfloat16).detach().requires_grad_()
    bias = torch.zeros(T, H, dtype=torch.bfloat16, requires_grad=True)
    combined, combined_w = ops.combine(buf, y, out.handle, topk_weights=out.recv_topk_weights, bias=bias)
    assert combined.shape == (T, H) and combined.dtype == torch.bfloat16
    assert not combined_w.requires_grad
    (combined.float() * grad_home[r].float()).sum().backward()
    src = gid // T
    assert torch.equal(y.grad, grad_home[src, gid % T]), "combine's gradient must be the cached dispatch of grads"
    assert torch.equal(bias.grad, grad_home[r])


def case_fp8_dispatch_grad(ctx):
    from commlib.training import autograd as ops
    from commlib.fp8 import per_token_cast_back, per_token_cast_to_fp8
    buf, r, R = _buf(ctx), ctx.rank, ctx.world_size
    x_all, idx_all, w_all, grad_rows, _, _ = _global_inputs(R, seed=2)
    x = x_all[r].clone().requires_grad_()
    out = ops.dispatch(buf, x, idx_all[r], w_all[r], E, fp8=True)
    gid = _global_ids(out.handle)
    deq = per_token_cast_back(*per_token_cast_to_fp8(x_all.view(R * T, H)), torch.bfloat16)
    assert out.recv_x.dtype == torch.bfloat16 and torch.equal(out.recv_x, deq[gid])
    (out.recv_x.float() * grad_rows[r][gid].float()).sum().backward()
    assert torch.equal(x.grad, _expected_x_grad(ctx, idx_all, grad_rows)), "FP8 dispatch: gradient is straight-through"


def case_fp8_tuple_input(ctx):
    from commlib.training import autograd as ops
    from commlib.fp8 import per_token_cast_to_fp8
    buf, r, R = _buf(ctx), ctx.rank, ctx.world_size
    x_all, idx_all, w_all, _, grad_w, _ = _global_inputs(R, seed=3)
    w = w_all[r].clone().requires_grad_()
    out = ops.dispatch(buf, per_token_cast_to_fp8(x_all[r]), idx_all[r], w, E)
    assert isinstance(out.recv_x, tuple) and out.recv_x[0].dtype == torch.float8_e4m3fn
    gid = _global_ids(out.handle)
    (out.recv_topk_weights * grad_w[r][gid]).sum().backward()
    assert w.grad is not None and w.grad.abs().sum() > 0


def case_no_weights(ctx):
    from commlib.training import autograd as ops
    buf, r, R = _buf(ctx), ctx.rank, ctx.world_size
    x_all, idx_all, _, grad_rows, _, _ = _global_inputs(R, seed=4)
    x = x_all[r].clone().requires_grad_()
    out = ops.dispatch(buf, x, idx_all[r], None, E)
    assert out.recv_topk_weights is None
    gid = _global_ids(out.handle)
    (out.recv_x.float() * grad_rows[r][gid].float()).sum().backward()
    assert torch.equal(x.grad, _expected_x_grad(ctx, idx_all, grad_rows))


def case_torch_compile(ctx):
    """torch.compile traces around the ops (a graph break at each) and matches eager exactly."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend
    from commlib.training import autograd as ops
    buf, r = _buf(ctx), ctx.rank
    torch._dynamo.reset()

    def step(x, router_w, expert_w):
        scores = torch.sigmoid(x.float() @ router_w.t())
        weights, idx = scores.topk(K, dim=1)
        weights = (weights / weights.sum(1, keepdim=True)).contiguous()
        out = ops.dispatch(buf, x.to(torch.bfloat16), idx, weights, E)
        y = torch.tanh(out.recv_x.float() @ expert_w) * out.recv_topk_weights.sum(1, keepdim=True)
        combined, _ = ops.combine(buf, y.to(torch.bfloat16), out.handle)
        return (combined.float() - x).pow(2).mean()

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter)
    for seed in (5, 6):  # two routings: the received row count changes between calls
        g = torch.Generator().manual_seed(seed * 100 + r)
        x = torch.randn(T, H, generator=g)
        gw = torch.Generator().manual_seed(seed)
        router_w = torch.randn(E, H, generator=gw).requires_grad_()
        expert_w = (torch.randn(H, H, generator=gw) / H ** 0.5).requires_grad_()
        loss_eager = step(x, router_w, expert_w)
        ge = torch.autograd.grad(loss_eager, (router_w, expert_w))
        loss_comp = compiled(x, router_w, expert_w)
        gc = torch.autograd.grad(loss_comp, (router_w, expert_w))
        torch.testing.assert_close(loss_comp, loss_eager, rtol=1e-6, atol=1e-6)
        for a, b in zip(gc, ge):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert counter.frame_count >= 3, f"expected graphs around two graph breaks, got {counter.frame_count}"


def case_bad_dtype(ctx):
    from commlib.training import autograd as ops
    buf, r, R = _buf(ctx), ctx.rank, ctx.world_size
    x_all, idx_all, w_all, _, _, _ = _global_inputs(R)
    with pytest.raises(TypeError, match="bfloat16"):
        ops.dispatch(buf, x_all[r].float(), idx_all[r], w_all[r], E)


# ------------------------------------------------------------------ pytest entry

@pytest.fixture(scope="module")
def results():
    return run_world(WORLD, "test_autograd", CASES, ranks_per_node=RANKS_PER_NODE)


@pytest.mark.parametrize("name", CASES)
def test_autograd(results, name):
    assert results[name] is None, results[name]
