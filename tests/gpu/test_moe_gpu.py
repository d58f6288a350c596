"""commlib.training.moe's expert stage on one GPU: routed_experts through torch._grouped_mm (bf16), both its
paths (one local slot per row: the permutation; several: the slot sum of csrc/moe_rows.cu), against
the float64 per-row loop of tests/test_pipeline.py, values and gradients; the slot-sum kernel against
a float32 sum in slot order, bit for bit, and against torch's index_add path. Skipped without a GPU.
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
    from commlib.training.moe import routed_experts
    from commlib.training.moe.experts import use_grouped_mm
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
        assert use_grouped_mm(leaves[0], "auto")
        y = routed_experts(leaves[0], idx.to(dev), leaves[3], leaves[1], leaves[2], impl="auto", **kw)
        permuted = "GatherRows" in type(y.grad_fn).__name__
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


@needs_gpu
def test_sm_carveout_gemms_on_gpu():
    """commlib.training.pipeline.sm_carveout on a GPU: inside it torch's carveout is set; a plain matmul
    (cuBLAS) and a grouped GEMM (CUTLASS), both sized for fewer SMs, give the same values as outside
    it (within bf16 rounding of a different tiling); the setting and the BLAS library are as before
    afterwards. Prints the GEMM times in and out of the carveout (information only)."""
    from commlib.training.pipeline import sm_carveout
    from commlib.utils.timing import loop_ms

    dev = torch.device("cuda", 0)
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(8192, 7168, generator=g).to(dev, torch.bfloat16)
    w = torch.randn(7168, 512, generator=g).to(dev, torch.bfloat16) / 64
    wg = torch.randn(2, 7168, 1024, generator=g).to(dev, torch.bfloat16) / 64
    offs = torch.tensor([4096, 8192], device=dev, dtype=torch.int32)

    def gemms():
        return a @ w, torch._grouped_mm(a, wg, offs=offs)

    def timed(fn, reps=20):
        fn()
        return loop_ms(fn, reps)

    before_carveout = torch._C._get_sm_carveout_experimental()
    before_blas = torch.backends.cuda.preferred_blas_library()
    ref = gemms()
    t_out = timed(gemms)
    with sm_carveout(8, dev) as n:
        assert n == 8 and torch._C._get_sm_carveout_experimental() == 8
        assert torch.backends.cuda.preferred_blas_library() == before_blas
        got = gemms()
        t_in = timed(gemms)
    assert torch._C._get_sm_carveout_experimental() == before_carveout
    assert torch.backends.cuda.preferred_blas_library() == before_blas
    for r, x in zip(ref, got):
        err = ((x.float() - r.float()).norm() / r.float().norm()).item()
        assert err < 1e-2, err
    print(f"[carveout] matmul + grouped GEMM: {t_out * 1e3:.0f} us on all SMs, {t_in * 1e3:.0f} us with 8 SMs carved out")


@needs_gpu
def test_deferred_weight_grads_grouped_mm():
    """commlib.training.wgrad through torch._grouped_mm: deferred expert weight gradients equal the immediate
    ones bit for bit (x^T g per group as a K-grouped _grouped_mm), accumulate like autograd, and a
    view's gradient is never deferred (tests/test_pipeline.py's check, on the GPU path)."""
    from test_pipeline import deferred_equals_immediate
    deferred_equals_immediate(torch.device("cuda", 0), torch.bfloat16, "grouped_mm")


def _slot_case(N, K, H, seed):
    """Random rows of a slot sum: [N, K] positions (0 .. K valid slots per row, each src row used once,
    rows without a slot included) and [M, H] bf16 src rows with wide exponents, signed zeros and
    subnormals."""
    g = torch.Generator().manual_seed(seed)
    valid = torch.rand(N, K, generator=g) < torch.rand(N, 1, generator=g)
    M = int(valid.sum())
    pos = torch.full((N, K), -1, dtype=torch.int32)
    pos[valid] = torch.randperm(M, generator=g).to(torch.int32)
    src = (torch.randn(M, H, generator=g) * torch.exp2(torch.randint(-20, 20, (M, 1), generator=g).float()))
    src = src.to(torch.bfloat16)
    if M and H >= 4:
        src[0, :2] = -0.0
        src[-1, 2:4] = torch.tensor([1e-40, -1e-40]).to(torch.bfloat16)   # bf16 subnormals
    return src, pos


def _slot_sum_reference(src, pos):
    """float32 sum in slot order from +0.0, one rounding to bf16 (CPU)."""
    acc = torch.zeros(pos.shape[0], src.shape[1], dtype=torch.float32)
    for k in range(pos.shape[1]):
        p = pos[:, k].long()
        ok = p >= 0
        acc[ok] = acc[ok] + src[p[ok]].float()
    return acc.to(torch.bfloat16)


@needs_gpu
def test_slot_sum_kernel_matches_float32_sum():
    """csrc/moe_rows.cu slot_sum_bf16: bit for bit the float32 sum in slot order rounded once, for
    K = 1 .. 32 slots, rows that are not a multiple of the kernel's 4 x 32 vectors, rows without a
    slot (zeros), no rows at all; with <= 2 slots per row also bit for bit torch's index_add path."""
    from commlib.training.moe.rows import row_kernel_ok, slot_sum_kernel

    dev = torch.device("cuda", 0)
    for N, K, H, seed in ((4096, 2, 7168, 0), (1000, 8, 7168, 1), (777, 32, 136, 2), (300, 3, 8, 3),
                          (513, 1, 1032, 4), (0, 4, 64, 5)):
        src, pos = _slot_case(N, K, H, seed)
        assert row_kernel_ok(src.to(dev), K)
        got = slot_sum_kernel(src.to(dev), pos.to(dev)).cpu()
        want = _slot_sum_reference(src, pos)
        assert got.shape == (N, H) and torch.equal(got.view(torch.int16), want.view(torch.int16)), (N, K, H)
        if K <= 2 and N:   # two terms commute: torch's float32 zeros + index_add (atomics) gives the same bits,
            # except that float32 atomic adds flush subnormals (PTX atom.add.f32): without them here
            src = torch.where(src.float().abs() < 2.0 ** -126, torch.zeros_like(src), src)
            got = slot_sum_kernel(src.to(dev), pos.to(dev)).cpu()
            m, n = torch.nonzero(pos.long() >= 0, as_tuple=True)
            rows = torch.empty(int(pos.ge(0).sum()), dtype=torch.int64)
            rows[pos[m, n].long()] = m
            old = torch.zeros(N, H, device=dev).index_add_(0, rows.to(dev), src.to(dev).float()).to(torch.bfloat16)
            assert torch.equal(got.view(torch.int16), old.cpu().view(torch.int16))


@needs_gpu
def test_routed_experts_row_kernel_against_index_add(monkeypatch):
    """routed_experts with several local slots per row: the slot-sum kernel (forward sum and the
    gather's backward) against COMMLIB_MOE_ROW_KERNEL=0 (torch's index_add): the kernel runs twice per
    forward + backward, and values and gradients agree (bit for bit where a row has <= 2 slots; the
    routing's 3-slot rows may round differently, torch's atomics add in any order)."""
    from commlib.training.moe import routed_experts, rows
    from test_pipeline import _counts, _expert_params, _routing

    dev = torch.device("cuda", 0)
    w_gate_up, w_down = _expert_params(torch.bfloat16)
    idx, weights = _routing("several")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(idx.shape[0], w_gate_up.shape[1], generator=g).to(torch.bfloat16)
    g_out = torch.randn(x.shape, generator=g).to(dev, torch.bfloat16)
    calls = []
    real = rows.slot_sum_kernel
    monkeypatch.setattr(rows, "slot_sum_kernel", lambda *a: calls.append(1) or real(*a))
    results = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("COMMLIB_MOE_ROW_KERNEL", flag)
        calls.clear()
        leaves = [t.to(dev).detach().clone().requires_grad_() for t in (x, w_gate_up, w_down, weights)]
        y = routed_experts(leaves[0], idx.to(dev), leaves[3], leaves[1], leaves[2], counts=_counts(idx))
        assert "SlotSum" in type(y.grad_fn).__name__
        grads = torch.autograd.grad(y, leaves, g_out)
        assert len(calls) == (2 if flag == "1" else 0), (flag, len(calls))
        results[flag] = [t.float().cpu() for t in (y,) + grads]
    two = (idx >= 0).sum(1) <= 2
    for what, a, b in zip(("y", "x", "w_gate_up", "w_down", "topk_weights"), results["1"], results["0"]):
        if what in ("y", "x"):
            assert torch.equal(a[two], b[two]), what
        err = ((a - b).norm() / b.norm().clamp_min(1e-30)).item()
        assert err < 1e-2, (what, err)
