"""The hierarchical engine on GPUs (NVLink fan-out inside emulated nodes) against the reference backend."""
from __future__ import annotations

import torch

import commlib
from commlib.fp8 import per_token_cast_to_fp8


def _same(a, b, what):
    if isinstance(a, tuple):
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{what}[{i}]")
        return
    if a is None or b is None:
        assert a is None and b is None, what
        return
    assert a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)), what


def _run(ctx, rpn: int):
    R, dev = ctx.world_size, ctx.device
    E, H, K, T = 16 * R, 1024, 8, 96
    cfg = commlib.Buffer.get_dispatch_config(R)
    nvl = cfg.get_nvl_buffer_size_hint(H * 2, rpn)
    rdma = cfg.get_rdma_buffer_size_hint(H * 2, R)
    bufs = {name: commlib.Buffer(ctx.group, nvl, rdma, ranks_per_node=rpn, backend=name)
            for name in ("hierarchical", "reference")}
    for seed in range(4):
        g = torch.Generator().manual_seed(seed * 100 + ctx.rank)
        x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev)
        scores = torch.rand(T, E, generator=g)
        idx, w = commlib.routing.group_limited_topk(scores, R // rpn, min(2, R // rpn), K)
        idx, w = idx.to(dev), w.to(dev)
        xin = per_token_cast_to_fp8(x) if seed % 2 else x
        outs = {}
        for name, buf in bufs.items():
            ntr, nrr, nte, tir, _ = buf.get_dispatch_layout(idx, E)
            rx, ri, rw, lst, h, _ = buf.dispatch(xin, num_tokens_per_rank=ntr, num_tokens_per_rdma_rank=nrr,
                                                 is_token_in_rank=tir, num_tokens_per_expert=nte, topk_idx=idx,
                                                 topk_weights=w)
            y = (rx[0].float() if seed % 2 else rx.float()).mul(1.5).to(torch.bfloat16)
            cx, cw, _ = buf.combine(y, h, rw)
            cached = buf.dispatch(xin, handle=h)[0]
            outs[name] = (rx, ri, rw, lst, h.rank_prefix_matrix, h.send_head, cx, cw, cached)
        a, b = outs["hierarchical"], outs["reference"]
        for i, what in enumerate(("recv_x", "recv_topk_idx", "recv_topk_weights", "per_expert", "rank_prefix",
                                  "send_head", "combined_x", "combined_w", "cached recv_x")):
            if what == "per_expert":
                assert a[i] == b[i], what
            else:
                _same(a[i], b[i], f"seed {seed} {what}")
    for buf in bufs.values():
        buf.destroy()


def case_two_nodes_of_one(ctx):
    _run(ctx, 1)


def case_two_nodes_of_two(ctx):
    if ctx.world_size >= 4:
        _run(ctx, 2)
