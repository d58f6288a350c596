"""Megatron-Core's MoELayer on CPU ranks: the flex dispatcher on the DeepEP backend (``deep_ep`` =
commlib's reference path) against Megatron's alltoall dispatcher, and both against an oracle.

Run by tests/test_megatron_moe.py in one spawned 2-rank gloo world. The layers, weights and inputs
come from benchmarks.megatron_moe (what the GPU benchmark runs). The oracle below is written from
Megatron's documented semantics and shares no code with either dispatcher: top-k of the FP32 router
logits, softmax over the k chosen, SwiGLU experts, the weighted sum, in FP32 with autograd, from the
same BF16-rounded weights and inputs; every rank recomputes every rank's tokens (the inputs are
drawn per rank from one seed), so it needs no communication.
"""
from __future__ import annotations

import dataclasses

import torch

from benchmarks import megatron_moe as mm

SEED = 7
SHAPES = {
    "top4": mm.CPU_SHAPE,                                        # uneven tokens per rank (48 / 40)
    "top1": dataclasses.replace(mm.CPU_SHAPE, topk=1, tokens=(33, 17), pre_softmax=True),
    "dropped": dataclasses.replace(mm.CPU_SHAPE, topk=2, capacity_factor=0.5),   # index -1 for dropped tokens
}
# Oracle tolerance: Megatron computes in BF16 (its GEMM outputs and activations rounded), the oracle
# in FP32: relative L2 error of each tensor.
ORACLE_REL = 2e-2


def _moe_fp32(x, w, K, pre_softmax):
    """The MoE layer's output for tokens x [T, H] (FP32) with weights w (router [E, H], fc1 [E, 2F, H],
    fc2 [E, H, F]): top-k of the logits, softmax over those k (pre_softmax: top-k of the softmax)."""
    logits = x @ w["router"].T
    if pre_softmax:
        p, idx = logits.softmax(dim=1).topk(K, dim=1)
    else:
        top, idx = logits.topk(K, dim=1)
        p = top.softmax(dim=1)
    out = torch.zeros_like(x)
    for e in range(w["router"].shape[0]):
        t, k = torch.nonzero(idx == e, as_tuple=True)
        if t.numel():
            gate, up = (x[t] @ w["fc1"][e].T).chunk(2, dim=1)
            y = (torch.nn.functional.silu(gate) * up) @ w["fc2"][e].T
            out = out.index_add(0, t, p[t, k, None] * y)
    return out


def oracle(shape, weights, me, R):
    """This rank's out, dx and router gradient (from its own tokens), and the gradients of its local
    experts' fc1 / fc2 (from every rank's tokens), FP32."""
    w = {k: v.bfloat16().float().requires_grad_(True) for k, v in weights.items()}
    xs = [mm.rank_inputs(shape, SEED, r) for r in range(R)]
    x_me = xs[me][0].float().flatten(0, 1).requires_grad_(True)
    out_me = _moe_fp32(x_me, w, shape.topk, shape.pre_softmax)
    dy_me = xs[me][1].float().flatten(0, 1)
    dx, d_router = torch.autograd.grad((out_me * dy_me).sum(), [x_me, w["router"]])
    total = sum((_moe_fp32(xr.float().flatten(0, 1), w, shape.topk, shape.pre_softmax) * dyr.float().flatten(0, 1)).sum()
                for xr, dyr in xs)
    d_fc1, d_fc2 = torch.autograd.grad(total, [w["fc1"], w["fc2"]])
    L = shape.experts // R
    sl = slice(me * L, (me + 1) * L)
    return {"out": out_me.detach(), "dx": dx, "router": d_router, "fc1": d_fc1[sl], "fc2": d_fc2[sl]}


def _rel(got, want) -> float:
    got, want = got.float().flatten(), want.float().flatten()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def _run(ctx, shape):
    """Both layers, one forward and backward each; returns ({dispatcher: step outputs}, weights, the
    token indices the flex layer dispatched [T, K] (-1: dropped))."""
    mm.prepare_megatron()
    mm.init_expert_parallel(ctx.world_size)
    weights = mm.global_weights(shape, SEED)
    x, dy = mm.rank_inputs(shape, SEED, ctx.rank)
    got = {}
    for d in mm.DISPATCHERS:
        layer = mm.load_weights(mm.build_layer(d, shape, ctx.device), weights, ctx.rank, ctx.device)
        got[d] = mm.step(layer, x, dy)
        if d == "flex":
            sent_idx = layer.token_dispatcher._comm_manager.token_indices
    return got, weights, sent_idx


def _check(ctx, name, with_oracle=True):
    shape = SHAPES[name]
    got, weights, sent_idx = _run(ctx, shape)
    flex, a2a = got["flex"], got["alltoall"]
    problems, rel = [], {}
    for k in a2a:
        c = mm.close(flex[k], a2a[k])
        if c["wrong"]:
            problems.append(f"flex vs alltoall {k}: {c}")
    if with_oracle:
        want = oracle(shape, weights, ctx.rank, ctx.world_size)
        for d in mm.DISPATCHERS:
            for k, v in want.items():
                if v.abs().max() > 0:
                    rel[d, k] = _rel(got[d][k].reshape(v.shape), v)
                    if rel[d, k] > ORACLE_REL:
                        problems.append(f"{d} vs oracle {k}: relative error {rel[d, k]:.3g}")
    # the test must be able to see something: outputs and every gradient not all zero
    for k, v in flex.items():
        if k != "router" and v.numel() and not v.abs().max() > 0:
            problems.append(f"flex {k} is all zeros")
    if shape.capacity_factor is not None and not bool((sent_idx < 0).any()):
        problems.append("no token was dropped: the case does not test index -1")
    assert not problems, f"rank {ctx.rank} ({name}):\n" + "\n".join(problems)
    exact = {k: bool(torch.equal(flex[k], a2a[k])) for k in a2a}
    print(f"[megatron {name}] rank {ctx.rank}: flex == alltoall bit for bit: {exact}; "
          f"max |flex - alltoall| {({k: float((flex[k].float() - a2a[k].float()).abs().max()) for k in a2a})}; "
          f"worst relative error to the oracle {max(rel.values(), default=None)}; "
          f"dropped {int((sent_idx < 0).sum())} of {sent_idx.numel()}", flush=True)


def case_top4(ctx):
    """Top-4 of 8 experts, 48 and 40 tokens: flex == alltoall within BF16 tolerance, both near the oracle."""
    _check(ctx, "top4")


def case_top1(ctx):
    """Top-1 (with the softmax before it, as Megatron requires), 33 and 17 tokens."""
    _check(ctx, "top1")


def case_dropped(ctx):
    """Top-2 with capacity factor 0.5: the router drops tokens (flex passes index -1 for them); flex
    against alltoall only (the oracle does not model Megatron's capacity rule)."""
    _check(ctx, "dropped", with_oracle=False)


def case_uses_commlib(ctx):
    """The flex layer's Buffer is commlib's (deep_ep is commlib's package), on the reference backend."""
    mm.prepare_megatron()
    from megatron.core.transformer.moe import fused_a2a

    import deep_ep
    assert deep_ep.__implementation__ == "commlib"
    assert fused_a2a.HAVE_DEEP_EP and fused_a2a.Buffer is deep_ep.Buffer
    buf = fused_a2a._buffer
    assert buf is not None and type(buf) is deep_ep.Buffer and buf.backend_name == "reference", buf


def case_bench_worker(ctx):
    """The benchmark's rank body (what the GPU stage runs) on CPU ranks: its checks pass, every row
    is there, and rank 0's table and JSON are written."""
    import json
    import tempfile

    from commlib.bench import results

    spec = {"shape": dataclasses.asdict(mm.CPU_SHAPE), "seed": SEED, "iters": 2, "warmup": 1, "num_sms": None}
    out = mm.worker(ctx, spec)
    ops = [r["op"] for r in out["rows"]]
    assert ops == [f"check_{k}" for k in ("out", "dx", "router", "fc1", "fc2")] + [
        f"{d}_{m}" for m in ("fwd", "fwd_bwd") for d in mm.DISPATCHERS], ops
    assert results.exit_status(out["rows"]) == 0 and all(r["time_us"] > 0 for r in out["rows"] if "time_us" in r)
    assert out["engine"] == "reference" and "splits_as_numpy" in out["shims"], out
    import importlib.metadata
    if importlib.metadata.version("megatron-core").startswith("0.16."):
        assert "router_gemm_without_te" in out["shims"], out["shims"]
    if ctx.rank == 0:
        mm.print_table(out, mm.CPU_SHAPE, "CPU ranks")
        doc = results.result_document("megatron_moe", "test", out["rows"], world_size=ctx.world_size)
        path = results.write_result(doc, tempfile.mkdtemp(prefix="megatron-moe-"))
        assert path.name.startswith("megatron_moe_CPUx2_") and json.loads(path.read_text())["rows"] == out["rows"]
