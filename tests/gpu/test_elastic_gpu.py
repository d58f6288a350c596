"""DeepEP V2's ElasticBuffer on the GPU (2 ranks; one H200 under MPS is enough): the CPU suite's cases
(tests/cases_elastic.py: oracle of V2's semantics, vLLM / SGLang / Megatron-Core call sequences) on the
NVLink engine, CUDA-graph capture of the cached and the sync-free paths, no host sync where V2 has
none, no kernel build per token count, and the error for a buffer built inside a capture. The ranks'
cases are the case_* functions of this module. Skipped without a GPU and CuPy."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))          # this module, imported by the spawned ranks
sys.path.insert(0, str(HERE.parent))   # tests/worlds.py, tests/cases_elastic.py

pytestmark = pytest.mark.gpu

from commlib.buffer import _cupy_available as _have_cupy  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or not _have_cupy(), reason="needs a GPU and CuPy")

SUITE = ["surface", "errors", "modes", "sum_order", "nomr", "handle_copy", "layouts", "vllm", "sglang", "megatron"]
CASES = ["suite", "graph_cached", "graph_no_sync", "graph_nomr", "no_host_sync", "no_recompile", "capture_error"]


def _suite_on_gpu():
    import cases_elastic as c
    c.DEVICE = torch.device("cuda", torch.cuda.current_device())
    c.BACKEND = None  # auto: the NVLink engine on one node
    return c


def _buffer(ctx, **kw):
    import deep_ep
    c = _suite_on_gpu()
    buf = deep_ep.ElasticBuffer(ctx.group, num_max_tokens_per_rank=c.MAXT, hidden=c.H, num_topk=c.K,
                                explicitly_destroy=True, **kw)
    assert buf.buffer.backend_name == "nvlink", buf.buffer.backend_name
    return buf


def _inputs(seed, rank, T=None):
    c = _suite_on_gpu()
    return tuple(t.to(c.DEVICE) for t in c._inputs(seed, rank, T=T))


def _run_suite(ctx, engine: str):
    import deep_ep
    c = _suite_on_gpu()
    probe = deep_ep.ElasticBuffer(ctx.group, num_max_tokens_per_rank=c.MAXT, hidden=c.H, explicitly_destroy=True)
    assert probe.buffer.backend_name == engine, (probe.buffer.backend_name, engine)
    probe.destroy()
    for name in SUITE:
        try:
            getattr(c, f"case_{name}")(ctx)
        except Exception as e:
            raise AssertionError(f"cases_elastic.case_{name} failed on the {engine} engine") from e


def case_suite(ctx):
    _run_suite(ctx, "nvlink")


def case_internode_suite(ctx):
    """Every rank its own emulated node: the internode engine (NCCL between the ranks)."""
    _run_suite(ctx, "internode")


def _valid(h, t):
    """The rows of a dispatch output that hold tokens (padding rows are unspecified, as in V2)."""
    if h.do_expand:
        slots = h.expanded_slots.to(torch.int64)
        return t[slots[slots >= 0]]
    return t[:int(h.psum_num_recv_tokens_per_scaleup_rank[-1])]


def case_graph_cached(ctx):
    """A cached dispatch + combine captured once, replayed with new x: equal to the eager calls."""
    from commlib.utils.timing import capture_graph
    c = _suite_on_gpu()
    buf = _buffer(ctx)
    x, idx, w = _inputs(3, ctx.rank)
    for expand in (False, True):
        h = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=c.E, do_expand=expand)[3]
        x_s = x.clone()

        def step():
            rx = buf.dispatch(x_s, handle=h, do_expand=expand)[0]
            return rx, buf.combine(rx, h)[0]

        graph, (rx_g, cx_g) = capture_graph(step, capture_error_mode="thread_local")
        for it in range(3):
            x_s.copy_((x.float() * (it + 2)).to(torch.bfloat16))
            graph.replay()
            torch.cuda.synchronize()
            rx_e, cx_e = step()
            torch.cuda.synchronize()
            assert torch.equal(_valid(h, rx_g), _valid(h, rx_e)), (expand, it)
            assert torch.equal(cx_g, cx_e), (expand, it)
    buf.destroy()


def case_graph_no_sync(ctx):
    """The non-cached dispatch without a CPU sync (vLLM's decode: no expand; SGLang's: expand) and its
    combine captured once, replayed with new routing and x: equal to the eager calls."""
    from commlib.utils.timing import capture_graph
    c = _suite_on_gpu()
    buf = _buffer(ctx)
    x, idx, w = _inputs(4, ctx.rank)
    for expand in (False, True):
        x_s, idx_s, w_s = x.clone(), idx.clone(), w.clone()

        def step():
            rx, _, rw, h, _ = buf.dispatch(x_s, topk_idx=idx_s, topk_weights=w_s, num_experts=c.E,
                                           do_cpu_sync=False, do_expand=expand)
            y = rx if not expand else (rx.float() * 2).to(torch.bfloat16)
            cx, cw, _ = buf.combine(y, h, topk_weights=rw)
            return rx, rw, h, cx, cw

        graph, (rx_g, rw_g, h_g, cx_g, cw_g) = capture_graph(step, capture_error_mode="thread_local")
        for it in range(3):
            nx, nidx, nw = _inputs(10 + it, ctx.rank)
            x_s.copy_(nx)
            idx_s.copy_(nidx)
            w_s.copy_(nw)
            graph.replay()
            torch.cuda.synchronize()
            rx_e, rw_e, h_e, cx_e, cw_e = step()
            torch.cuda.synchronize()
            for name in ("psum_num_recv_tokens_per_scaleup_rank", "psum_num_recv_tokens_per_expert", "recv_src_metadata"):
                assert torch.equal(getattr(h_g, name), getattr(h_e, name)), (expand, it, name)
            assert torch.equal(_valid(h_e, rx_g), _valid(h_e, rx_e)), (expand, it)
            assert torch.equal(_valid(h_e, rw_g), _valid(h_e, rw_e)), (expand, it)
            assert torch.equal(cx_g, cx_e) and torch.equal(cw_g, cw_e), (expand, it)
    buf.destroy()


def case_graph_nomr(ctx):
    """allow_multiple_reduction=False: the sync-free expanded dispatch and its combine (one transport
    combine per top-k slot, the sum at home) captured once, replayed with new routing and x: equal to
    the eager calls; and that combine makes no host sync."""
    from commlib.utils.timing import capture_graph
    c = _suite_on_gpu()
    buf = _buffer(ctx, allow_multiple_reduction=False)
    x, idx, _ = _inputs(7, ctx.rank)
    bias = torch.randn(x.shape[0], c.H, device=c.DEVICE).to(torch.bfloat16)
    x_s, idx_s = x.clone(), idx.clone()

    def step():
        rx, _, _, h, _ = buf.dispatch(x_s, topk_idx=idx_s, num_experts=c.E, do_cpu_sync=False, do_expand=True)
        return buf.combine((rx.float() * 2).to(torch.bfloat16), h, bias=bias)[0]

    graph, cx_g = capture_graph(step, capture_error_mode="thread_local")
    for it in range(2):
        nx, nidx, _ = _inputs(20 + it, ctx.rank)  # a rank's token count depends on the rank only
        x_s.copy_(nx)
        idx_s.copy_(nidx)
        graph.replay()
        torch.cuda.synchronize()
        cx_e = step()
        torch.cuda.synchronize()
        assert torch.equal(cx_g, cx_e), it
    h = buf.dispatch(x, topk_idx=idx, num_experts=c.E, do_expand=True)[3]
    y = torch.randn(h.num_expanded_tokens, c.H, device=c.DEVICE).to(torch.bfloat16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        buf.combine(y, h, bias=bias)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    buf.destroy()


def case_no_host_sync(ctx):
    """No host sync in the calls V2 makes without one: dispatch with do_cpu_sync=False (both layouts),
    a cached dispatch, and combine."""
    c = _suite_on_gpu()
    buf = _buffer(ctx)
    x, idx, w = _inputs(5, ctx.rank)
    buf.get_theoretical_num_sms(c.E, c.K)  # remembered before the sync check (pure host work)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for expand in (False, True):
            rx, _, rw, h, ev = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=c.E, do_cpu_sync=False,
                                            do_expand=expand, async_with_compute_stream=True)
            ev.current_stream_wait()
            rx2 = buf.dispatch(x, handle=h, do_expand=expand)[0]
            buf.combine(rx2, h, topk_weights=rw)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    buf.destroy()


def case_no_recompile(ctx):
    """Calls with new token counts and new num_max_tokens_per_rank build no kernel."""
    from commlib.cuda import loader
    c = _suite_on_gpu()
    buf = _buffer(ctx)
    x, idx, w = _inputs(6, ctx.rank)
    for expand in (False, True):  # warm: every build these calls use
        h = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=c.E, do_expand=expand)[3]
        buf.combine(buf.dispatch(x, handle=h, do_expand=expand)[0], h)
        h = buf.dispatch(x, topk_idx=idx, num_experts=c.E, do_cpu_sync=False, do_expand=expand)[3]
    torch.cuda.synchronize()
    builds = len(loader._modules)
    for T, bound in ((1, 1), (5, 8), (17, 32), (c.MAXT, 256), (3, 1024)):
        x, idx, w = _inputs(60 + T, ctx.rank, T=T)
        for expand in (False, True):
            for sync in (True, False):
                h = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=c.E, num_max_tokens_per_rank=bound,
                                 do_cpu_sync=sync, do_expand=expand)[3]
                rx = buf.dispatch(x, handle=h, do_expand=expand)[0]
                buf.combine(rx, h)
    torch.cuda.synchronize()
    assert len(loader._modules) == builds, f"kernel builds grew from {builds} to {len(loader._modules)}"
    buf.destroy()


def case_capture_error(ctx):
    """An ElasticBuffer or a v1 Buffer built inside a CUDA graph capture raises at once (no collective,
    no hang)."""
    import deep_ep
    from worlds import expect_raises
    c = _suite_on_gpu()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        expect_raises(RuntimeError, ["CUDA graph capture", f"rank {ctx.rank}] ElasticBuffer"],
                      lambda: deep_ep.ElasticBuffer(ctx.group, num_max_tokens_per_rank=c.MAXT, hidden=c.H))
        expect_raises(RuntimeError, ["CUDA graph capture", f"rank {ctx.rank}] Buffer"],
                      lambda: deep_ep.Buffer(ctx.group, 1 << 20, 0))
    _buffer(ctx).destroy()  # the world is still in step


@needs_cuda
def test_elastic_on_nvlink():
    from worlds import run_world

    os.environ.setdefault("COMMLIB_TIMEOUT_S", "60")
    results = run_world(2, "test_elastic_gpu", CASES, use_gpu=True, timeout_s=900, case_timeout_s=600)
    failed = {k: v for k, v in results.items() if v}
    assert not failed, "\n\n".join(f"--- {k} ---\n{v}" for k, v in failed.items())


@needs_cuda
def test_elastic_on_internode():
    """2 emulated nodes of 1 rank (own NCCL_HOSTID each): V2's hybrid domain on the internode engine."""
    from worlds import run_world

    os.environ.setdefault("COMMLIB_TIMEOUT_S", "60")
    results = run_world(2, "test_elastic_gpu", ["internode_suite"], use_gpu=True, group_backend="nccl",
                        emulate_hosts=True, ranks_per_node=1, timeout_s=900, case_timeout_s=600)
    failed = {k: v for k, v in results.items() if v}
    assert not failed, "\n\n".join(f"--- {k} ---\n{v}" for k, v in failed.items())
