"""What a profiler calls commlib's kernels, inside a spawned GPU world (tests/gpu/test_kernel_names_gpu.py).

DeepEP's tests time kernels with the PyTorch profiler (``bench_kineto``): each name they ask for
must be in exactly one line of the profile table, and with ``num_kernels_per_period`` they keep the
trace events whose name contains ``::dispatch`` / ``::combine``. These cases run a normal and a
low-latency dispatch + combine on the nvlink backend under the profiler and check the names it
records against those rules.
"""
from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from commlib.buffer import Buffer
from commlib.config import Config
from low_latency_cases import SMALL, make_inputs
from nvlink_cases import make_routing, make_x

_BUFFERS: dict = {}


def _profiled(fn):
    """(CUDA kernel names of every event, the profile table's lines) of one fn() after a warm-up."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    table = prof.key_averages().table(sort_by="cuda_time_total", max_name_column_width=100).split("\n")
    return names, table


def _check(names, table, op: str, want: str, launches: int) -> None:
    hits = [n for n in names if f"::{op}" in n]
    assert len(hits) == launches and all(n.startswith(want) for n in hits), \
        f"kernel events with '::{op}': {hits}, expected {launches} of {want}; all kernels: {sorted(set(names))}"
    lines = [line for line in table if op in line]
    assert len(lines) == 1, f"profile table lines with {op!r} (DeepEP's bench_kineto wants one): {lines}"


def case_normal_names(ctx):
    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    cfg = Config(20, 32, 256, 64, 1024)
    T, H, E, K = 64, 256, 8 * R, 4
    if "normal" not in _BUFFERS:
        _BUFFERS["normal"] = Buffer(ctx.group, cfg.get_nvl_buffer_size_hint(H * 2, R), backend="nvlink",
                                    explicitly_destroy=True)
    buf = _BUFFERS["normal"]
    g = torch.Generator().manual_seed(17 + me)
    idx, w = make_routing("random", T, E, K, me, R, g)
    idx, w = idx.to(dev), w.to(dev)
    x, _ = make_x(T, H, False, g, dev)

    def dispatch():
        ntpr, nrr, ntpe, tir, _ = buf.get_dispatch_layout(idx, E)
        return buf.dispatch(x, num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=nrr, is_token_in_rank=tir,
                            num_tokens_per_expert=ntpe, topk_idx=idx, topk_weights=w, config=cfg)

    names, table = _profiled(dispatch)
    _check(names, table, "dispatch", "commlib::intranode::dispatch", 1)
    rx, _ridx, rw, _, handle, _ = dispatch()
    names, table = _profiled(lambda: buf.combine(rx, handle, topk_weights=rw, config=cfg))
    _check(names, table, "combine", "commlib::intranode::combine", 1)
    torch.cuda.synchronize()


def case_low_latency_names(ctx):
    R = ctx.world_size
    M, H, E, K = SMALL["M"], SMALL["H"], SMALL["E_PER_RANK"] * R, SMALL["K"]
    if "ll" not in _BUFFERS:
        _BUFFERS["ll"] = Buffer(ctx.group, 0, Buffer.get_low_latency_rdma_size_hint(M, H, R, E),
                                low_latency_mode=True, backend="nvlink", explicitly_destroy=True)
    buf = _BUFFERS["ll"]
    x, idx, w = make_inputs(ctx, 3, M, H, E, K)

    names, table = _profiled(lambda: buf.low_latency_dispatch(x, idx, M, E, use_fp8=False))
    _check(names, table, "dispatch", "commlib::low_latency::dispatch", 1)
    rx, _count, handle, _, _ = buf.low_latency_dispatch(x, idx, M, E, use_fp8=False)
    names, table = _profiled(lambda: buf.low_latency_combine(rx, idx, w, handle))
    _check(names, table, "combine", "commlib::low_latency::combine", 1)
    torch.cuda.synchronize()


def case_teardown(ctx):
    for buf in _BUFFERS.values():
        buf.destroy()
    _BUFFERS.clear()
