"""torch.compile over commlib.training.ops on the GPU: one spawned world of 2 ranks (one GPU is enough:
the ranks share it, under MPS on the device machine), the nvlink backend. Skipped without a GPU and CuPy.

* ops_nvlink: the ops eager and compiled (aot_eager, inductor), against the global-input expectations
  of tests/test_compile.py, bit for bit.
* ops_internode (its own world: NCCL between the 2 ranks as emulated hosts, 2 nodes x 1): the
  same checks on the internode engine.
* worst_no_sync: a compiled dispatch + combine with num_worst_tokens issues no host sync
  (``torch.cuda.set_sync_debug_mode("error")``), static shapes, the plain dispatch's rows.
* block_compiled: MoEBlock with bf16 experts (torch._grouped_mm) compiled with fullgraph=True: no graph
  break; inductor's outputs and gradients within bf16 rounding of the eager block's (eager sums rows
  with csrc/moe_rows.cu, the traced block with torch's ops).
* decode_cudagraphs: the low-latency decode step (dispatch in bf16 and in FP8 + dequantization, a
  per-expert GEMM, combine) compiled with ``mode="reduce-overhead"`` (CUDA graphs, no cudagraph skip),
  replayed with fresh inputs, against the eager step.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))          # this module, for the spawned ranks
sys.path.insert(0, str(HERE.parent))   # tests/worlds.py, tests/test_compile.py

pytestmark = pytest.mark.gpu

from commlib.buffer import _cupy_available as _have_cupy  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or not _have_cupy(), reason="needs a GPU and CuPy")

CASES = ["ops_nvlink", "worst_no_sync", "block_compiled", "decode_cudagraphs"]
M_DECODE = 16


def _nvlink(ctx):
    from commlib import Buffer
    from test_compile import H
    R = ctx.world_size
    cfg = Buffer.get_dispatch_config(R)
    buf = Buffer(ctx.group, num_nvl_bytes=cfg.get_nvl_buffer_size_hint(H * 2, R), backend="nvlink",
                 explicitly_destroy=True)
    assert buf.backend_name == "nvlink"
    return buf


def case_ops_nvlink(ctx):
    from test_compile import _check_ops
    buf = _nvlink(ctx)
    try:
        _check_ops(ctx, buf, compiled=False, seed=1)
        _check_ops(ctx, buf, compiled=True, seed=2)
        _check_ops(ctx, buf, compiled=True, seed=3, backend="inductor")
    finally:
        buf.destroy()


def case_ops_internode(ctx):
    from commlib import Buffer
    from test_compile import H, _check_ops
    cfg = Buffer.get_dispatch_config(ctx.world_size)
    buf = Buffer(ctx.group, num_nvl_bytes=cfg.get_nvl_buffer_size_hint(H * 2, ctx.world_size), backend="internode",
                 ranks_per_node=1, explicitly_destroy=True)
    assert buf.backend_name == "internode" and buf.topology.num_nodes == 2
    try:
        _check_ops(ctx, buf, compiled=False, seed=1)
        _check_ops(ctx, buf, compiled=True, seed=2)
    finally:
        buf.destroy()


def case_worst_no_sync(ctx):
    from commlib.training import ops
    from test_compile import E, H, T, _global_ids, _global_inputs
    buf, r, R = _nvlink(ctx), ctx.rank, ctx.world_size
    try:
        x_all, idx_all, w_all, _, _, _ = _global_inputs(R, 11)
        x, idx, w = (t[r].to(ctx.device) for t in (x_all, idx_all, w_all))
        plain = ops.dispatch(buf, x, idx, w, E)
        n = _global_ids(plain.handle, r).numel()

        def step(x, w):
            out = ops.dispatch(buf, x, idx, w, E, num_worst_tokens=R * T)
            return out.recv_x, ops.combine(buf, out.recv_x, out.handle)[0]

        compiled = torch.compile(step, fullgraph=True)
        compiled(x, w)                          # compiles (host work allowed)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            recv_x, combined = compiled(x, w)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert recv_x.shape == (R * T, H)
        assert torch.equal(recv_x[:n], plain.recv_x)
        want, _ = ops.combine(buf, plain.recv_x, plain.handle)
        assert torch.equal(combined, want)
    finally:
        buf.destroy()


def case_block_compiled(ctx):
    from commlib.training import ops
    from commlib.training.moe import MoEBlock, MoEConfig
    from test_compile import E, H, K
    buf, r = _nvlink(ctx), ctx.rank
    try:
        cfg = MoEConfig(hidden=H, num_experts=E, topk=K, expert_hidden=32, num_groups=2, topk_groups=2,
                        num_shared_experts=1, expert_dtype=torch.bfloat16)
        torch.manual_seed(0)
        block = MoEBlock(cfg, num_heads=2, buffer=buf, device=ctx.device)
        torch._dynamo.reset()
        gen = torch.Generator().manual_seed(r)
        h = torch.randn(2, 8, H, generator=gen).to(ctx.device)
        g = torch.randn(2, 8, H, generator=gen).to(ctx.device)
        with ops.compile_config():
            explained = torch._dynamo.explain(block)(h)
        assert explained.graph_break_count == 0, [str(b.reason)[:400] for b in explained.break_reasons]
        def step(fn):
            block.zero_grad(set_to_none=True)
            hi = h.clone().requires_grad_()
            out = fn(hi)
            (out * g).sum().backward()
            return [out.detach(), hi.grad] + [p.grad for p in block.parameters()]

        want = step(block)
        for backend in ("aot_eager", "inductor"):   # graph capture alone, then the default compiler
            torch._dynamo.reset()
            compiled = torch.compile(block, fullgraph=True, backend=backend)
            with ops.compile_config():
                for call in range(2):
                    got = step(compiled)
                    for i, (a, b) in enumerate(zip(want, got, strict=True)):
                        err = (b.float() - a.float()).norm() / a.float().norm().clamp(min=1e-12)
                        assert err <= 2e-2, f"{backend} call {call}: output/gradient {i}: relative error {err}"
    finally:
        buf.destroy()


def case_decode_cudagraphs(ctx):
    from torch._dynamo.utils import counters

    from commlib import Buffer
    from commlib.training import ops
    from test_compile import E, _global_inputs
    r, R, dev = ctx.rank, ctx.world_size, ctx.device
    Hd, L = 128, E // R
    buf = Buffer(ctx.group, 0, Buffer.get_low_latency_rdma_size_hint(M_DECODE, Hd, R, E), low_latency_mode=True,
                 backend="nvlink", explicitly_destroy=True)
    try:
        gen = torch.Generator().manual_seed(100 + r)
        w_LHH = (torch.randn(L, Hd, Hd, generator=gen) / Hd ** 0.5).to(dev, torch.bfloat16)
        for use_fp8 in (False, True):
            def decode(x, idx, w):
                recv_x, count, handle = ops.low_latency_dispatch(buf, x, idx, M_DECODE, E, use_fp8=use_fp8)
                if use_fp8:   # dequantize: every 128 columns times their scale
                    data, scales = recv_x
                    recv_x = (data.float().view(L, -1, Hd // 128, 128) * scales.unsqueeze(-1)).view(L, -1, Hd)
                    recv_x = recv_x.to(torch.bfloat16)
                y = torch.bmm(recv_x, w_LHH)    # every slot row (rows past an expert's count are ignored)
                return count, ops.low_latency_combine(buf, y, idx, w, handle)

            torch._dynamo.reset()
            counters.clear()
            compiled = torch.compile(decode, mode="reduce-overhead", fullgraph=True)
            for step in range(5):               # warm-up, record, then replays
                _, idx_all, w_all, _, _, _ = _global_inputs(R, 20 + step)
                idx, w = idx_all[r].to(dev), w_all[r].to(dev)     # T <= M_DECODE tokens
                x = torch.randn(idx.shape[0], Hd, generator=gen).to(dev, torch.bfloat16)
                want_count, want = decode(x, idx, w)
                count, got = compiled(x, idx, w)
                torch.cuda.synchronize()
                tag = f"fp8={use_fp8} step {step}"
                assert torch.equal(count, want_count), f"{tag}: recv_count"
                torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2, msg=lambda m: f"{tag}: {m}")
            skips = dict(counters["inductor"]).get("cudagraph_skips", 0)
            assert skips == 0, f"fp8={use_fp8}: cudagraphs skipped: {dict(counters['inductor'])}"
    finally:
        buf.destroy()


@needs_cuda
def test_compile_gpu():
    from worlds import run_world

    os.environ.setdefault("COMMLIB_TIMEOUT_S", "60")
    only = os.environ.get("COMMLIB_TEST_CASES")
    names = [n for n in CASES if not only or n in only.split(",")]
    results = run_world(2, "test_compile_gpu", names, use_gpu=True, timeout_s=600, case_timeout_s=300)
    failed = {k: v for k, v in results.items() if v}
    assert not failed, "\n\n".join(f"--- {k} ---\n{v}" for k, v in failed.items())


@needs_cuda
def test_compile_gpu_internode():
    from worlds import run_world

    os.environ.setdefault("COMMLIB_TIMEOUT_S", "60")
    results = run_world(2, "test_compile_gpu", ["ops_internode"], use_gpu=True, group_backend="nccl",
                        emulate_hosts=True, ranks_per_node=1, timeout_s=600, case_timeout_s=300)
    assert results["ops_internode"] is None, results["ops_internode"]
