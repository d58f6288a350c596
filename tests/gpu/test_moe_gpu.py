"""commlib.moe's expert stage on one GPU: routed_experts through torch._grouped_mm (bf16), both its
paths (one local slot per row: the permutation; several: the float32 index_add), against the
float64 per-row loop of tests/test_pipeline.py, values and gradients. Skipped without a GPU.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # tests/test_pipeline.py's helpers

pytestmark = pytest.mark.gpu

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available() or not hasattr(torch, "_grouped_mm"),
                               reason="needs a GPU and torch._grouped_mm")


@needs_gpu
@pytest.mark.parametrize("kind", ["one_slot", "several"])
def test_routed_experts_grouped_mm_matches_reference(kind):
    from commlib.moe import _use_grouped_mm, routed_experts
    from test_pipeline import _counts, _expert_params, _reference, _rel_err, _routing

    dev = torch.device("cuda", 0)
    w_gate_up, w_down = _expert_params(torch.bfloat16)
    idx, weights = _routing(kind)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(idx.shape[0], w_gate_up.shape[1], generator=g).to(torch.bfloat16)
    g_out = torch.randn(x.shape, generator=g)
    leaves64 = [t.double().requires_grad_() for t in (x, w_gate_up, w_down, weights)]
    ref = _reference(leaves64[0], idx, leaves64[3], leaves64[1], leaves64[2])
    ref_grads = torch.autograd.grad(ref, leaves64, g_out.double())

    results = {}
    # every row of both routings has a local slot, so the dispatch flag is valid for both: it takes
    # the permutation path for one_slot (M == N) and the general one for several
    for name, kw in (("counts", dict(counts=_counts(idx))),
                     ("flag", dict(counts=_counts(idx), rows_have_local_expert=True))):
        leaves = [t.to(dev).detach().clone().requires_grad_() for t in (x, w_gate_up, w_down, weights)]
        assert _use_grouped_mm(leaves[0], "auto")
        y = routed_experts(leaves[0], idx.to(dev), leaves[3], leaves[1], leaves[2], impl="auto", **kw)
        permuted = "PermuteRows" in type(y.grad_fn).__name__
        assert permuted == (kind == "one_slot" and name == "flag"), (name, type(y.grad_fn))
        grads = torch.autograd.grad(y, leaves, g_out.to(dev, y.dtype))
        # bf16 experts against float64: the CPU test's tolerance (2e-2 relative L2 per tensor)
        for what, got, want in zip(("y", "x", "w_gate_up", "w_down", "topk_weights"), (y,) + grads,
                                   (ref,) + ref_grads):
            err = _rel_err(got.cpu(), want)
            assert err <= 2e-2, (kind, name, what, err)
        results[name] = [t.cpu() for t in (y,) + grads]
    if kind == "one_slot":   # one term per row: the float32 sum is exact, both paths give the same bits
        for a, b in zip(results["counts"], results["flag"]):
            assert torch.equal(a, b)
