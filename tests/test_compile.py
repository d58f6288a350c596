"""commlib.training.ops (dispatch / combine as torch.library custom ops) and torch.compile of the MoE
block on CPU ranks: one spawned world of 2 gloo ranks runs every case.

* The ops on every CPU backend (reference on one node, reference and internode on 2 emulated nodes),
  eager and compiled (``fullgraph=True``, aot_eager), against expectations computed on every rank
  from the global inputs (all ranks draw them from one seed): received rows, x and weight
  gradients, combine and its gradient, cached dispatch; num_worst_tokens; FP8.
* The fake kernels: dtypes and devices equal the real outputs'; shapes and strides too where static
  (num_worst_tokens, cached, combine, low-latency), an unbacked row count otherwise.
* MoEBlock compiled with ``fullgraph=True``: no graph break (torch._dynamo.explain), one graph
  holding both ops; outputs and gradients equal the eager block's bit for bit under aot_eager (the
  eager kernels; float32 experts and bf16 ones through torch._grouped_mm), no recompile for new
  routings, no handle state left after the backward; within float32 rounding under inductor.
* The low-latency ops (bf16, FP8, UE8M0) against the Buffer's own calls, eager and compiled.
* Errors: bf16 expected, an unregistered Buffer id, an unknown handle token.
"""
from __future__ import annotations

import gc

import pytest
import torch

from worlds import expect_raises, run_world

WORLD = 2
T, H, K, E = 10, 64, 2, 8
CASES = ["ops_reference", "ops_hierarchical", "ops_internode", "worst_tokens", "fp8", "fake_shapes",
         "block_graph_breaks", "block_compiled_exact", "block_inductor", "low_latency", "errors"]


# ------------------------------------------------------------------ helpers (run on every rank)

def _buffer(ctx, backend="reference", ranks_per_node=None, low_latency=False, M=0, hidden=H):
    from commlib import Buffer
    R = ctx.world_size
    cfg = Buffer.get_dispatch_config(R)
    rdma = Buffer.get_low_latency_rdma_size_hint(M, hidden, R, E) if low_latency else 0
    return Buffer(ctx.group, num_nvl_bytes=cfg.get_nvl_buffer_size_hint(hidden * 2, R), num_rdma_bytes=rdma,
                  low_latency_mode=low_latency, backend=backend, ranks_per_node=ranks_per_node)


def _global_inputs(R, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, T, H, generator=g).to(torch.bfloat16)
    idx = torch.rand(R, T, E, generator=g).topk(K, dim=2).indices
    idx[:, 1, 1] = -1                                     # an empty slot
    w = torch.rand(R, T, K, generator=g)
    g_rows = torch.randn(R, R * T, H, generator=g).to(torch.bfloat16)   # [dest rank, global token]
    g_w = torch.randn(R, R * T, K, generator=g)
    g_home = torch.randn(R, T, H, generator=g).to(torch.bfloat16)
    return x, idx, w, g_rows, g_w, g_home


def _global_ids(handle, me):
    """Global token id (source * T + index) of every received row, from the handle's tensors (on CPU)."""
    counts = torch.diff(handle.rank_prefix_matrix[:, me].cpu().long(), prepend=torch.zeros(1, dtype=torch.long))
    src = torch.repeat_interleave(torch.arange(len(counts)), counts)
    n = src.numel()
    return src * T + handle.recv_src_idx[:n].cpu().long()


def _holders(idx_all, R):
    """[R * T, R] bool: global token t has an expert on rank d."""
    owner = torch.where(idx_all >= 0, idx_all // (E // R), -1).view(R * T, K)
    return torch.stack([(owner == d).any(1) for d in range(R)], dim=1)


def _expected_sum(rows_by_rank, hold):
    """bf16 of the float32 sum, in rank order, of the rows of the ranks holding each token."""
    acc = torch.zeros(rows_by_rank[0].shape, dtype=torch.float32)
    for d, rows in enumerate(rows_by_rank):
        acc += torch.where(hold[:, d:d + 1], rows.float(), torch.zeros_like(acc))
    return acc.to(torch.bfloat16)


def _check_ops(ctx, buf, compiled: bool, seed: int, backend: str = "aot_eager"):
    """dispatch, its gradients, combine, its gradient, cached dispatch: eager or compiled, on the
    Buffer's device, against the expectations from the global inputs (tests/gpu runs it too)."""
    from commlib.training import ops
    r, R, dev = ctx.rank, ctx.world_size, buf.device
    x_all, idx_all, w_all, g_rows, g_w, g_home = _global_inputs(R, seed)
    hold = _holders(idx_all, R)
    mine = slice(r * T, (r + 1) * T)
    idx = idx_all[r].to(dev)

    def run_dispatch(x, w):
        return ops.dispatch(buf, x, idx, w, E)

    def run_combine(y, handle):
        return ops.combine(buf, y, handle)[0]

    def run_cached(z, handle):
        return ops.dispatch_cached(buf, z, handle)

    if compiled:
        torch._dynamo.reset()
        run_dispatch, run_combine, run_cached = (torch.compile(f, fullgraph=True, backend=backend)
                                                 for f in (run_dispatch, run_combine, run_cached))
    x = x_all[r].to(dev, copy=True).requires_grad_()
    w = w_all[r].to(dev, copy=True).requires_grad_()
    with ops.compile_config():
        out = run_dispatch(x, w)
    gid = _global_ids(out.handle, r)
    assert sorted(gid.tolist()) == hold[:, r].nonzero().flatten().tolist(), "rows received"
    assert torch.equal(out.recv_x.cpu(), x_all.view(R * T, H)[gid])
    loss = ((out.recv_x.float() * g_rows[r][gid].to(dev).float()).sum()
            + (out.recv_topk_weights * g_w[r][gid].to(dev)).sum())
    loss.backward()
    assert torch.equal(x.grad.cpu(), _expected_sum([g_rows[d] for d in range(R)], hold)[mine]), "x.grad"
    owner = torch.where(idx_all[r] >= 0, idx_all[r] // (E // R), -1)
    exp_w = torch.zeros(T, K)
    for t in range(T):
        for k in range(K):
            if owner[t, k] >= 0:
                exp_w[t, k] = g_w[owner[t, k], r * T + t, k]
    assert torch.equal(w.grad.cpu(), exp_w), "topk_weights.grad from the rank owning each slot"

    # combine of y_d = bf16(x * (d + 1)) on rank d; its gradient is a cached dispatch of g_home
    y = (out.recv_x.detach().float() * (r + 1)).to(torch.bfloat16).requires_grad_()
    with ops.compile_config():
        combined = run_combine(y, out.handle)
    scaled = [(x_all.view(R * T, H).float() * (d + 1)).to(torch.bfloat16) for d in range(R)]
    assert torch.equal(combined.cpu(), _expected_sum(scaled, hold)[mine]), "combine"
    (combined.float() * g_home[r].to(dev).float()).sum().backward()
    assert torch.equal(y.grad.cpu(), g_home.view(R * T, H)[gid]), "combine's gradient (cached dispatch)"
    with ops.compile_config():
        rows = run_cached(g_home[r].to(dev), out.handle)
    assert torch.equal(rows.cpu(), g_home.view(R * T, H)[gid]), "cached dispatch"


def _run_both(ctx, buf):
    _check_ops(ctx, buf, compiled=False, seed=1)
    _check_ops(ctx, buf, compiled=True, seed=2)


# ------------------------------------------------------------------ cases

def case_ops_reference(ctx):
    _run_both(ctx, _buffer(ctx, "reference"))


def case_ops_hierarchical(ctx):
    buf = _buffer(ctx, "reference", ranks_per_node=1)
    assert buf.topology.num_nodes == 2
    _run_both(ctx, buf)


def case_ops_internode(ctx):
    buf = _buffer(ctx, "internode", ranks_per_node=1)
    assert buf.backend_name == "internode"
    _run_both(ctx, buf)


def case_worst_tokens(ctx):
    """num_worst_tokens: static row count, rows as a plain dispatch's then padding; the same gradients."""
    from commlib.training import ops
    buf, r, R = _buffer(ctx), ctx.rank, ctx.world_size
    x_all, idx_all, w_all, g_rows, _, _ = _global_inputs(R, 3)
    W = R * T
    grads = []
    for worst, compiled in ((0, False), (W, False), (W, True)):
        def f(x, w, worst=worst):
            return ops.dispatch(buf, x, idx_all[r], w, E, num_worst_tokens=worst)
        if compiled:
            torch._dynamo.reset()
            f = torch.compile(f, fullgraph=True, backend="aot_eager")
        x = x_all[r].clone().requires_grad_()
        w = w_all[r].clone().requires_grad_()
        with ops.compile_config():
            out = f(x, w)
        n = _global_ids(out.handle, r).numel()
        if worst:
            assert out.recv_x.shape == (W, H) and out.handle.recv_src_idx.shape == (W,)
            assert (out.recv_topk_idx[n:] == -1).all(), "padding rows have no expert"
            assert torch.equal(out.num_recv_tokens_per_expert.cpu(), counts0), "per-expert counts on the device"
            assert torch.equal(out.recv_x[:n], rows0)
        else:
            rows0, counts0 = out.recv_x.detach(), out.num_recv_tokens_per_expert
        g = torch.zeros(out.recv_x.shape[0], H, dtype=torch.bfloat16)
        g[:n] = g_rows[r][:n]
        (out.recv_x.float() * g.float()).sum().backward()
        grads.append((x.grad, w.grad))
    for gx, gw in grads[1:]:
        assert torch.equal(gx, grads[0][0]) and torch.equal(gw if gw is not None else torch.zeros(T, K),
                                                             grads[0][1] if grads[0][1] is not None
                                                             else torch.zeros(T, K))


def case_fp8(ctx):
    """fp8=True: the rows are the E4M3 round trip of x (commlib.fp8's casts); the gradient passes straight
    through, in bf16: the bf16 dispatch's expectations. Eager and compiled."""
    from commlib.fp8 import per_token_cast_back, per_token_cast_to_fp8
    from commlib.training import ops
    Hf = 128
    buf, r, R = _buffer(ctx, hidden=Hf), ctx.rank, ctx.world_size
    g = torch.Generator().manual_seed(8)
    x_all = torch.randn(R * T, Hf, generator=g).to(torch.bfloat16)
    _, idx_all, w_all, _, _, _ = _global_inputs(R, 8)
    g_rows = torch.randn(R, R * T, Hf, generator=g).to(torch.bfloat16)
    hold = _holders(idx_all, R)
    want_rows = per_token_cast_back(*per_token_cast_to_fp8(x_all), torch.bfloat16)

    def f(x, w):
        return ops.dispatch(buf, x, idx_all[r], w, E, fp8=True)

    torch._dynamo.reset()
    for fn in (f, torch.compile(f, fullgraph=True, backend="aot_eager")):
        x = x_all[r * T:(r + 1) * T].clone().requires_grad_()
        with ops.compile_config():
            out = fn(x, w_all[r])
        gid = _global_ids(out.handle, r)
        assert out.recv_x.dtype == torch.bfloat16 and torch.equal(out.recv_x, want_rows[gid]), "FP8 rows"
        (out.recv_x.float() * g_rows[r][gid].float()).sum().backward()
        assert torch.equal(x.grad, _expected_sum([g_rows[d] for d in range(R)], hold)[r * T:(r + 1) * T])


def case_fake_shapes(ctx):
    """Each op's fake kernel: the real outputs' dtypes, devices and ranks; sizes static where known."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv, free_unbacked_symbols

    from commlib.training import ops
    buf, r, R = _buffer(ctx), ctx.rank, ctx.world_size
    x_all, idx_all, w_all, _, _, _ = _global_inputs(R, 4)
    x, idx, w = x_all[r], idx_all[r], w_all[r]
    bid = ops.register_buffer(buf)
    real = {}
    real["dispatch"] = torch.ops.commlib.dispatch(x, idx, w, bid, E, 0, 1, False)
    real["worst"] = torch.ops.commlib.dispatch(x, idx, w, bid, E, R * T, 1, False)
    handle = real["dispatch"][4]
    real["cached"] = torch.ops.commlib.dispatch_cached(x, handle, bid)
    real["combine"] = torch.ops.commlib.combine(real["dispatch"][0], real["dispatch"][2], handle, bid)

    mode = FakeTensorMode(shape_env=ShapeEnv())
    fx, fidx, fw = (mode.from_tensor(t) for t in (x, idx, w))
    fhandle = [mode.from_tensor(t) for t in handle]
    with mode:
        fake = {"dispatch": torch.ops.commlib.dispatch(fx, fidx, fw, bid, E, 0, 1, False),
                "worst": torch.ops.commlib.dispatch(fx, fidx, fw, bid, E, R * T, 1, False),
                "cached": torch.ops.commlib.dispatch_cached(fx, fhandle, bid)}
        fake["combine"] = torch.ops.commlib.combine(fake["dispatch"][0], fake["dispatch"][2], fhandle, bid)

    def flat(v):
        out = []
        for item in (v if isinstance(v, (tuple, list)) else [v]):
            out.extend(flat(item) if isinstance(item, (tuple, list)) else [item])
        return out

    # the low-latency dispatch (bf16, FP8): static shapes, the scales' column-major strides
    M, H8 = T, 128
    ll = _buffer(ctx, low_latency=True, M=M, hidden=H8)
    x8 = torch.randn(T, H8, generator=torch.Generator().manual_seed(40 + r)).to(torch.bfloat16)
    lid = ops.register_buffer(ll)
    for fp8 in (False, True):
        real[f"ll{fp8}"] = torch.ops.commlib.low_latency_dispatch(x8, idx, lid, M, E, fp8, False, False)
        with mode:
            fake[f"ll{fp8}"] = torch.ops.commlib.low_latency_dispatch(mode.from_tensor(x8), fidx, lid, M, E, fp8,
                                                                      False, False)
    for name in real:
        for i, (a, b) in enumerate(zip(flat(real[name]), flat(fake[name]), strict=True)):
            assert (a.dtype, a.device, a.dim()) == (b.dtype, b.device, b.dim()), (name, i, a.dtype, b.dtype)
            if name.startswith("ll") or not free_unbacked_symbols(b.shape):
                assert (tuple(a.shape), a.stride()) == (tuple(b.shape), b.stride()), (name, i, a.shape, b.shape)
    assert free_unbacked_symbols(fake["dispatch"][0].shape[0]), "non-cached rows: an unbacked size"
    assert fake["worst"][0].shape[0] == R * T and not free_unbacked_symbols(fake["worst"][0].shape)
    assert fake["cached"].shape == (handle[4].shape[0], H) and fake["combine"][0].shape == (T, H)


def _block(ctx, buf, **choices):
    from commlib.training.moe import MoEBlock, MoEConfig
    cfg = MoEConfig(hidden=H, num_experts=E, topk=K, expert_hidden=16, num_groups=2, topk_groups=2,
                    num_shared_experts=1, **choices)
    torch.manual_seed(0)
    return MoEBlock(cfg, num_heads=2, buffer=buf)


def _step(block, fn, h, g):
    block.zero_grad(set_to_none=True)
    h = h.clone().requires_grad_()
    out = fn(h)
    (out * g).sum().backward()
    return [out.detach(), h.grad] + [p.grad for p in block.parameters()]


def _inputs(r, seed):
    gen = torch.Generator().manual_seed(seed * 10 + r)
    return torch.randn(2, 4, H, generator=gen), torch.randn(2, 4, H, generator=gen)


def case_block_graph_breaks(ctx):
    """MoEBlock (attention + MoE layer) traces as one graph holding the commlib ops: 0 graph breaks."""
    from commlib.training import ops
    block = _block(ctx, _buffer(ctx))
    h, _ = _inputs(ctx.rank, 0)
    torch._dynamo.reset()
    with ops.compile_config():
        explained = torch._dynamo.explain(block)(h)
    assert explained.graph_break_count == 0, [str(b.reason)[:400] for b in explained.break_reasons]
    assert explained.graph_count == 1
    targets = {str(n.target) for gm in explained.graphs for n in gm.graph.nodes}
    assert {"commlib.dispatch", "commlib.combine"} <= targets, sorted(targets)


def case_block_compiled_exact(ctx):
    """torch.compile(fullgraph=True, backend=aot_eager) of MoEBlock: outputs and every gradient equal the
    eager block's, over calls with new tokens (and routings) without recompiling; float32 experts
    (the per-expert loop) and bf16 experts through torch._grouped_mm (the GPU's path)."""
    from torch._dynamo.backends.common import aot_autograd

    from commlib.training import ops
    buf = _buffer(ctx)
    for choices in ({}, {"expert_dtype": torch.bfloat16, "expert_impl": "grouped_mm"}):
        block = _block(ctx, buf, **choices)
        frames = []

        def counting(gm, example_inputs):
            frames.append(gm)
            return gm.forward

        torch._dynamo.reset()
        compiled = torch.compile(block, fullgraph=True,
                                 backend=aot_autograd(fw_compiler=counting,
                                                      bw_compiler=lambda gm, example_inputs: gm.forward))
        for seed in range(3):
            h, g = _inputs(ctx.rank, seed)
            want = _step(block, block, h, g)
            with ops.compile_config():
                got = _step(block, compiled, h, g)
            for i, (a, b) in enumerate(zip(want, got, strict=True)):
                assert torch.equal(a, b), f"{choices} call {seed}: output/gradient {i} differs by {(a - b).abs().max()}"
        assert len(frames) == 1, f"{choices}: compiled {len(frames)} times (new routings must not recompile)"
        del want, got
        gc.collect()
        assert ops.live_handles() == 0, "handles outlived their backward"


def case_block_inductor(ctx):
    """The default backend (inductor): one graph, the eager values within float32 rounding."""
    from commlib.training import ops
    block = _block(ctx, _buffer(ctx))
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True)
    h, g = _inputs(ctx.rank, 5)
    want = _step(block, block, h, g)
    with ops.compile_config():
        got = _step(block, compiled, h, g)
    for i, (a, b) in enumerate(zip(want, got, strict=True)):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=lambda m: f"output/gradient {i}: {m}")


def _raw(t):
    return torch.empty(t.shape, dtype=t.dtype).copy_(t).view(torch.uint8)   # bytes, whatever the strides


def case_low_latency(ctx):
    """The decode ops equal the Buffer's low-latency calls (bf16; FP8; FP8 with UE8M0 scales), eager and
    compiled (fullgraph); the scales keep the Buffer's column-major strides."""
    from commlib.training import ops
    M, r, R = T, ctx.rank, ctx.world_size
    _, idx_all, w_all, _, _, _ = _global_inputs(R, 6)
    idx, w = idx_all[r], w_all[r]
    for hidden, kw in ((H, {}), (128, {"use_fp8": True}),
                       (512, {"use_fp8": True, "round_scale": True, "use_ue8m0": True})):
        buf = _buffer(ctx, low_latency=True, M=M, hidden=hidden)
        x = torch.randn(T, hidden, generator=torch.Generator().manual_seed(60 + r)).to(torch.bfloat16)
        want_x, want_count, handle, _, _ = buf.low_latency_dispatch(x, idx, M, E, **dict({"use_fp8": False}, **kw))
        data = want_x[0] if kw else want_x
        want, _, _ = buf.low_latency_combine((data.float() * 0.5).to(torch.bfloat16), idx, w, handle)

        def decode(x):
            recv_x, count, h = ops.low_latency_dispatch(buf, x, idx, M, E, **kw)
            rows = recv_x[0] if kw else recv_x
            return recv_x, count, ops.low_latency_combine(buf, (rows.float() * 0.5).to(torch.bfloat16), idx, w, h)

        torch._dynamo.reset()
        for fn in (decode, torch.compile(decode, fullgraph=True, backend="aot_eager")):
            recv_x, count, combined = fn(x)
            got_parts = recv_x if kw else (recv_x,)
            want_parts = want_x if kw else (want_x,)
            for e in range(E // R):   # rows past an expert's count are unspecified
                n = int(want_count[e])
                for a, b in zip(got_parts, want_parts):
                    assert torch.equal(_raw(a[e, :n]), _raw(b[e, :n])), f"{kw} expert {e}"
            for a, b in zip(got_parts, want_parts):
                assert (a.dtype, a.shape, a.stride()) == (b.dtype, b.shape, b.stride()), kw
            assert torch.equal(count, want_count.to(torch.int32)) and torch.equal(combined, want), kw


def case_errors(ctx):
    from commlib.training import ops
    buf, r = _buffer(ctx), ctx.rank
    x_all, idx_all, w_all, _, _, _ = _global_inputs(ctx.world_size, 7)
    x, idx, w = x_all[r], idx_all[r], w_all[r]
    expect_raises(TypeError, [f"rank {r}", "dispatch x", "bfloat16"], lambda: ops.dispatch(buf, x.float(), idx, w, E))
    expect_raises(RuntimeError, ["no live Buffer", "register_buffer"],
                  lambda: torch.ops.commlib.dispatch(x, idx, w, -5, E, 0, 1, False))
    out = ops.dispatch(buf, x, idx, w, E)
    stale = out.handle._replace(token=torch.empty(1, dtype=torch.uint8))
    expect_raises(RuntimeError, [f"rank {r}", "combine", "token is unknown"],
                  lambda: ops.combine(buf, out.recv_x, stale))
    ops.combine(buf, out.recv_x, out.handle)   # the peers' combine (the stale one raised before any collective)


# ------------------------------------------------------------------ pytest entry

@pytest.fixture(scope="module")
def results():
    return run_world(WORLD, "test_compile", CASES, case_timeout_s=300)


@pytest.mark.parametrize("name", CASES)
def test_compile(results, name):
    assert results[name] is None, results[name]
