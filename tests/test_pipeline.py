"""commlib.training.pipeline and commlib.training.moe on CPU ranks: the staged MoE model equals the plain one and the
single-process equivalent; the dual schedules (two forwards, two backwards, DualPipe's
forward-with-backward hook) give the same outputs and gradients as running the micro-batches one
after the other, bit for bit, in every issue order; the schedule pairs every comm step with a
compute step and follows the issue-order rule (comm first unless it waits on the host); the
overlap benchmark runs at tiny shapes (also its calibrated balanced_fb preset, and --comm-sms / the
calibrated balanced_sms preset, whose configs reach every dispatch and combine).

One world of 2 ranks runs every case (spawning ranks is the expensive part on CPU). The tests at
the end run in this process: the expert stage (routed_experts' permutation and general paths
against a per-row loop, RMSNorm, MoELayer.finish).
"""
from __future__ import annotations

import pytest
import torch

from worlds import run_world

WORLD = 2
CASES = ["staged_equals_plain_and_single_process", "dual_forward_backward", "deferred_weight_grads",
         "overlapped_forward_backward", "joint_forward_backward",
         "schedule_pairs_comm_with_compute", "issue_orders_same_results", "fp8_dispatch_stage", "inference_no_grad",
         "moe_layer_without_attention", "bench_overlap_smoke", "bench_overlap_balanced_fb_smoke",
         "bench_overlap_comm_sms"]

H, E, K, HEADS, LAYERS, SEQ, VOCAB = 64, 8, 2, 4, 2, 8, 40


def _cfg(hidden=H, **kw):
    from commlib.training.moe import MoEConfig
    return MoEConfig(hidden=hidden, num_experts=E, topk=K, expert_hidden=32, num_groups=2, topk_groups=2,
                     num_shared_experts=1, **kw)


_BUFFERS = {}


def _buf(ctx, hidden=H):
    from commlib import Buffer
    if hidden not in _BUFFERS:
        cfg = Buffer.get_dispatch_config(ctx.world_size)
        _BUFFERS[hidden] = Buffer(ctx.group, num_nvl_bytes=cfg.get_nvl_buffer_size_hint(hidden * 2, ctx.world_size))
    return _BUFFERS[hidden]


def _model(ctx, buffer, vocab=VOCAB, seed=0, hidden=H, **cfg_kw):
    from commlib.training.moe import MoEModel
    torch.manual_seed(seed)
    return MoEModel(_cfg(hidden, **cfg_kw), LAYERS, HEADS, buffer=buffer, num_ranks=ctx.world_size,
                    vocab_size=vocab, max_seq_len=SEQ)


def _tokens(ctx, batch_per_rank=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, VOCAB, (ctx.world_size * batch_per_rank, SEQ), generator=g)
    return toks, toks[ctx.rank * batch_per_rank:(ctx.rank + 1) * batch_per_rank]


def _loss(out):
    return out.float().pow(2).mean()


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_grads(a, b, what):
    assert a.keys() == b.keys(), f"{what}: different parameters got gradients"
    for n in a:
        assert torch.equal(a[n], b[n]), f"{what}: gradient of {n} differs (max {(a[n] - b[n]).abs().max()})"


# ------------------------------------------------------------------ cases

def case_staged_equals_plain_and_single_process(ctx):
    import torch.distributed as dist
    model = _model(ctx, _buf(ctx))
    single = _model(ctx, None)
    everything, mine = _tokens(ctx)
    out = model(mine)
    model.staged = False
    out_plain = model(mine)
    model.staged = True
    assert torch.equal(out, out_plain), "staged and plain EP forwards differ"
    B = mine.shape[0]
    out_single = single(everything)[ctx.rank * B:(ctx.rank + 1) * B]
    # Same rows reach the same experts in the same order and the emulated wire rounds like the
    # real one, so the forward is bit-identical.
    assert torch.equal(out, out_single), f"EP and single-process forwards differ: {(out - out_single).abs().max()}"

    n_global = everything.numel()
    (out.float().pow(2).sum() / n_global).backward()
    g_staged = _grads(model)
    model.zero_grad(set_to_none=True)
    model.staged = False
    (model(mine).float().pow(2).sum() / n_global).backward()
    model.staged = True
    _assert_same_grads(g_staged, _grads(model), "staged vs plain")

    (single(everything).float().pow(2).sum() / n_global).backward()
    L = E // ctx.world_size
    for (name, p), (name_s, p_s) in zip(model.named_parameters(), single.named_parameters()):
        assert name == name_s
        grad = g_staged[name]
        if "experts" in name:
            ref = p_s.grad[ctx.rank * L:(ctx.rank + 1) * L]
        else:
            grad = grad.clone()
            dist.all_reduce(grad)  # replicated parameters: sum the ranks' contributions
            ref = p_s.grad
        torch.testing.assert_close(grad, ref, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def _sequential_run(ctx, seed: int):
    """A model and two one-sequence micro-batches run one after the other: (model, mb0, mb1, out0,
    out1, gradients); the model's gradients are cleared afterwards."""
    model = _model(ctx, _buf(ctx))
    _, mine = _tokens(ctx, batch_per_rank=2, seed=seed)
    mb0, mb1 = mine[:1], mine[1:]
    s0, s1 = model(mb0), model(mb1)
    _loss(s0).backward()
    _loss(s1).backward()
    g_seq = _grads(model)
    model.zero_grad(set_to_none=True)
    return model, mb0, mb1, s0, s1, g_seq


def case_dual_forward_backward(ctx):
    from commlib.training import pipeline as P
    model, mb0, mb1, s0, s1, g_seq = _sequential_run(ctx, seed=2)

    o0, o1 = P.dual_forward(model, (mb0,), (mb1,))
    assert torch.equal(o0, s0) and torch.equal(o1, s1)
    P.dual_backward(_loss(o0), None, _loss(o1), None)
    _assert_same_grads(g_seq, _grads(model), "dual vs sequential")

    # Outputs + gradients form (as a pipeline stage that is not last would call it).
    model.zero_grad(set_to_none=True)
    o0, o1 = P.dual_forward(model, (mb0,), (mb1,))
    g0 = torch.autograd.grad(_loss(o0), o0)[0]
    g1 = torch.autograd.grad(_loss(o1), o1)[0]
    P.dual_backward(o0, g0, o1, g1)
    _assert_same_grads(g_seq, _grads(model), "dual (outputs, grads) vs sequential")

    # The shared expert in the experts stage instead of the attention stage (the default): the same
    # parameters (same seed), so the same outputs and gradients bit for bit; the carry differs.
    other = _model(ctx, _buf(ctx), shared_stage="experts")
    stage_keys = {}
    with torch.no_grad():
        for stage_model in (model, other):
            h = stage_model._prologue(mb0)
            stage_keys[stage_model.cfg.shared_stage] = set(stage_model.blocks[0].stage_attn({"h": h}))
    assert stage_keys == {"attn": {"h", "x_wire", "topk_idx", "topk_weights", "shared"},
                          "experts": {"h", "x_wire", "topk_idx", "topk_weights", "x_norm"}}, stage_keys
    o0, o1 = P.dual_forward(other, (mb0,), (mb1,))
    assert torch.equal(o0, s0) and torch.equal(o1, s1), "shared_stage=experts changed the outputs"
    P.dual_backward(_loss(o0), None, _loss(o1), None)
    _assert_same_grads(g_seq, _grads(other), "dual, shared_stage=experts, vs sequential (shared_stage=attn)")


def case_deferred_weight_grads(ctx):
    """defer_weight_grads (DualPipe's B / W split): the expert GEMMs' weight gradients are queued by
    one backward compute step and run after the chain's next one (or at its end), the attention
    projections' after the next compute step of either micro-batch (or at the schedule's end);
    dual_backward and overlapped_forward_backward give the sequential gradients bit for bit, and
    the deferral did happen: 2 expert GEMMs + 2 projections per layer and micro-batch went through
    the queue."""
    from commlib.training import pipeline as P
    from commlib.training import wgrad
    model, mb0, mb1, s0, s1, g_seq = _sequential_run(ctx, seed=2)
    ran = []
    real_run = wgrad.run

    def counting_run(queue):
        ran.append(len(queue))
        return real_run(queue)

    wgrad.run = counting_run
    try:
        o0, o1 = P.dual_forward(model, (mb0,), (mb1,))
        P.dual_backward(_loss(o0), None, _loss(o1), None, defer_weight_grads=True)
        _assert_same_grads(g_seq, _grads(model), "dual, deferred weight gradients, vs sequential")
        assert sum(ran) == 4 * LAYERS * 2, ran
        # sequential (overlap=False) never defers, whatever the flag says
        ran.clear()
        model.zero_grad(set_to_none=True)
        o0, o1 = P.dual_forward(model, (mb0,), (mb1,), overlap=False)
        P.dual_backward(_loss(o0), None, _loss(o1), None, overlap=False, defer_weight_grads=True)
        _assert_same_grads(g_seq, _grads(model), "sequential with the flag")
        assert sum(ran) == 0, ran
        # DualPipe's hook: micro-batch 1's backward defers, micro-batch 0's forward is unaffected
        ran.clear()
        model.zero_grad(set_to_none=True)
        out1 = model(mb1)
        outs0, _ = P.overlapped_forward_backward(model, [mb0], None, None, model, _loss(out1), None, None,
                                                 defer_weight_grads=True)
        assert torch.equal(outs0[0], s0)
        _loss(outs0[0]).backward()
        _assert_same_grads(g_seq, _grads(model), "overlapped F/B, deferred, then B(0)")
        assert sum(ran) == 4 * LAYERS, ran
    finally:
        wgrad.run = real_run
    model.zero_grad(set_to_none=True)


def case_overlapped_forward_backward(ctx):
    """DualPipe's contract on a hidden-state chunk: inputs are leaves, input grads land in .grad."""
    from commlib.training import pipeline as P
    chunk = _model(ctx, _buf(ctx), vocab=None, seed=3)
    g = torch.Generator().manual_seed(10 + ctx.rank)
    h0 = torch.randn(1, SEQ, H, generator=g)
    h1 = torch.randn(1, SEQ, H, generator=g)
    target = torch.randn(1, SEQ, H, generator=g)

    def criterion(out, tgt):
        return (out.float() - tgt).pow(2).mean()

    # Reference: micro-batch 1 forward + backward, micro-batch 0 forward, one after the other.
    x1 = h1.clone().requires_grad_()
    criterion(chunk(x1), target).backward()
    ref_grads, ref_x1_grad = _grads(chunk), x1.grad.clone()
    chunk.zero_grad(set_to_none=True)
    x0 = h0.clone().requires_grad_()
    ref_out0 = chunk(x0)

    for mode in ("loss", "outputs"):
        chunk.zero_grad(set_to_none=True)
        x1 = h1.clone().requires_grad_()
        out1 = chunk(x1)
        x0 = h0.clone().requires_grad_()
        if mode == "loss":       # last pipeline stage: DualPipe passes loss1 and no outputs
            loss1 = criterion(out1, target)
            outs0, loss0 = type(chunk).overlapped_forward_backward(chunk, [x0], criterion, [target],
                                                                   chunk, loss1, [], [])
            assert loss1.grad_fn is None  # detached, as DualPipe expects
        else:                    # middle stage: outputs and their gradients
            grad1 = torch.autograd.grad(criterion(out1, target), out1)[0]
            outs0, loss0 = P.overlapped_forward_backward(chunk, [x0], None, None, chunk, None, [out1], [grad1])
            assert loss0 is None
        assert isinstance(outs0, list) and torch.equal(outs0[0], ref_out0)
        assert outs0[0]._base is None  # DualPipe frees outputs and refuses views
        _assert_same_grads(ref_grads, _grads(chunk), f"overlapped F/B ({mode}) vs sequential")
        assert torch.equal(x1.grad, ref_x1_grad), f"input gradient of micro-batch 1 ({mode})"
        # micro-batch 0's outputs stay attached: its backward later works as usual.
        criterion(outs0[0], target).backward()
        assert x0.grad is not None


def case_joint_forward_backward(ctx):
    """dual_forward_backward (two forwards then two backwards as one schedule) gives the sequential
    losses / outputs and gradients bit for bit (criterion or given gradients, deferred weight
    gradients or not, a (forward, backward) carveout pair), and its turn from forward to backward
    is the joint one: micro-batch 0's combine' right after its last combine, before micro-batch 1's,
    with micro-batch 0's expert backward paired with micro-batch 1's last combine."""
    from commlib.training import pipeline as P
    model, mb0, mb1, s0, s1, g_seq = _sequential_run(ctx, seed=2)
    for defer in (False, True):
        for schedule in ("split", "joint"):
            model.zero_grad(set_to_none=True)
            l0, l1 = P.dual_forward_backward(model, (mb0,), (mb1,), criterion=_loss, defer_weight_grads=defer,
                                             sm_carveout=("auto", "off"), schedule=schedule)
            assert torch.equal(l0, _loss(s0)) and torch.equal(l1, _loss(s1)) and l0.grad_fn is None
            _assert_same_grads(g_seq, _grads(model), f"{schedule} (criterion, defer={defer}) vs sequential")
    leaf0, leaf1 = s0.detach().requires_grad_(), s1.detach().requires_grad_()
    g0 = torch.autograd.grad(_loss(leaf0), leaf0)[0]
    g1 = torch.autograd.grad(_loss(leaf1), leaf1)[0]
    for overlap, schedule in ((True, "joint"), (True, "split"), (False, "joint")):
        model.zero_grad(set_to_none=True)
        o0, o1 = P.dual_forward_backward(model, (mb0,), (mb1,), grads0=g0, grads1=g1, overlap=overlap,
                                         schedule=schedule)
        assert torch.equal(o0, s0) and torch.equal(o1, s1) and o0.grad_fn is None
        _assert_same_grads(g_seq, _grads(model), f"{schedule} (gradients, overlap={overlap}) vs sequential")
    model.zero_grad(set_to_none=True)
    for bad, err in (({}, ValueError), ({"grads0": g0}, ValueError), ({"criterion": (_loss,)}, ValueError),
                     ({"criterion": _loss, "grads0": g0, "grads1": g1}, ValueError)):
        with pytest.raises(err, match="criterion"):
            P.dual_forward_backward(model, (mb0,), (mb1,), **bad)
    with pytest.raises(ValueError, match="sm_carveout"):
        P.dual_forward_backward(model, (mb0,), (mb1,), criterion=_loss, sm_carveout=("auto", "off", 4))
    with pytest.raises(ValueError, match="schedule"):
        P.dual_forward_backward(model, (mb0,), (mb1,), criterion=_loss, schedule="bogus")
    with torch.no_grad(), pytest.raises(RuntimeError, match="autograd"):
        P.dual_forward_backward(model, (mb0,), (mb1,), criterion=_loss)

    # The turn, on a hidden-state chunk (its last stage is a residual add: light, never paired).
    chunk = _model(ctx, _buf(ctx), vocab=None, seed=3)
    g = torch.Generator().manual_seed(20 + ctx.rank)
    h0, h1 = torch.randn(1, SEQ, H, generator=g), torch.randn(1, SEQ, H, generator=g)
    r0, r1 = chunk(h0), chunk(h1)
    _loss(r0).backward()
    _loss(r1).backward()
    ref = _grads(chunk)
    chunk.zero_grad(set_to_none=True)
    tl = P.Timeline()
    from commlib.training import wgrad
    ran, real_run = [], wgrad.run

    def counting_run(queue):
        ran.append(len(queue))
        return real_run(queue)

    wgrad.run = counting_run
    try:
        l0, l1 = P.dual_forward_backward(chunk, (h0,), (h1,), criterion=_loss, timeline=tl,
                                         defer_weight_grads=True, schedule="joint")
    finally:
        wgrad.run = real_run
    assert torch.equal(l0, _loss(r0)) and torch.equal(l1, _loss(r1))
    _assert_same_grads(ref, _grads(chunk), "joint, chunk, vs sequential")
    # every expert GEMM's and projection's weight gradient went through the queue (2 + 2 per layer
    # and micro-batch) but micro-batch 0's first expert backward's, after the turn (TURN_KEEPS_WGRAD)
    assert sum(ran) == 4 * LAYERS * 2 - 2, ran
    labels = [s["label"] for s in tl.spans()]
    last = f"combine{LAYERS - 1}"
    comm = [l for l in labels if _is_comm(l)]
    turn = comm.index(f"0.F.{last}")
    assert comm[turn:turn + 5] == [f"0.F.{last}", f"0.B.{last}", f"1.F.{last}", f"1.B.{last}",
                                   f"0.B.dispatch{LAYERS - 1}"], comm
    i = labels.index(f"1.F.{last}")
    assert labels[i + 1] == f"0.B.experts{LAYERS - 1}", labels  # combine issued first, its partner next
    # every other comm step is paired with a compute step of the other micro-batch
    _check_pairs([l for l in labels if l not in (f"0.B.{last}", f"1.B.{last}")
                  and not l.endswith("finish")])


def case_schedule_pairs_comm_with_compute(ctx):
    """Issue order (CPU timeline = host order): every comm step is paired with a compute step of
    the other micro-batch, and the issue-order rule holds: a comm step that does not wait on the
    host goes first (the comm stream is fed before the host issues the compute kernels), a forward
    dispatch (it reads its receive count on the host) goes right after its compute partner."""
    from commlib.training import pipeline as P
    model = _model(ctx, _buf(ctx))
    _, mine = _tokens(ctx, batch_per_rank=2, seed=4)
    tl = P.Timeline()
    o0, o1 = P.dual_forward(model, (mine[:1],), (mine[1:],), timeline=tl)
    fwd = [s["label"] for s in tl.spans()]
    assert fwd[:7] == ["0.F.attn0", "1.F.attn0", "0.F.dispatch0", "0.F.experts0", "1.F.dispatch0",
                       "0.F.combine0", "1.F.experts0"], fwd
    _check_pairs(fwd)
    tl = P.Timeline()
    P.dual_backward(_loss(o0), None, _loss(o1), None, timeline=tl)
    bwd = [s["label"] for s in tl.spans()]
    assert bwd[:5] == ["0.B.finish", "0.B.combine1", "1.B.finish", "1.B.combine1", "0.B.experts1"], bwd
    _check_pairs(bwd)

    def fwd_bwd_labels(order):
        tl = P.Timeline()
        out1 = model(mine[1:])
        P.overlapped_forward_backward(model, [mine[:1]], _loss, [], model, _loss(out1), [], [], timeline=tl,
                                      issue_order=order)
        return [s["label"] for s in tl.spans()]

    fb = fwd_bwd_labels(None)
    # DeepSeek-V3's pairing: attention with combine', dispatch with experts', experts with dispatch',
    # ...; combine' and dispatch' (no host wait) are issued before their partner, dispatch after.
    assert fb[:7] == ["1.B.finish", "1.B.combine1", "0.F.attn0", "1.B.experts1", "0.F.dispatch0",
                      "1.B.dispatch1", "0.F.experts0"], fb
    _check_pairs(fb)
    # The other orders pair the same steps and keep the comm steps in the same order.
    for order in ("comm_first", "compute_first"):
        other = fwd_bwd_labels(order)
        _check_pairs(other, order)
        comm = [l for l in fb if _is_comm(l)]
        assert [l for l in other if _is_comm(l)] == comm, (order, other)
        assert sorted(other) == sorted(fb)
    assert fwd_bwd_labels("compute_first")[:7] == ["1.B.finish", "0.F.attn0", "1.B.combine1", "1.B.experts1",
                                                   "0.F.dispatch0", "0.F.experts0", "1.B.dispatch1"]


def _is_comm(label):
    return any(c in label for c in ("dispatch", "combine"))


def _check_pairs(labels, order="auto"):
    """Every comm step sits next to a compute step of the other micro-batch: after it when the comm
    step goes first (order "comm_first", or "auto" and not a forward dispatch), else before it."""
    for i, label in enumerate(labels):
        if not _is_comm(label):
            continue
        blocks_host = ".F.dispatch" in label
        first = order == "comm_first" or (order == "auto" and not blocks_host)
        partner = labels[i + 1] if first else labels[i - 1]
        assert not _is_comm(partner), f"{label} not paired with compute ({order}): {labels}"
        assert partner.split(".")[0] != label.split(".")[0], f"{label} paired with its own micro-batch: {labels}"


def case_issue_orders_same_results(ctx):
    """Every issue order gives the sequential outputs and gradients bit for bit."""
    from commlib.training import pipeline as P
    model, mb0, mb1, s0, s1, g_seq = _sequential_run(ctx, seed=7)
    for order in P.ISSUE_ORDERS:
        model.zero_grad(set_to_none=True)
        o0, o1 = P.dual_forward(model, (mb0,), (mb1,), issue_order=order)
        assert torch.equal(o0, s0) and torch.equal(o1, s1), order
        P.dual_backward(_loss(o0), None, _loss(o1), None, issue_order=order)
        _assert_same_grads(g_seq, _grads(model), f"dual ({order}) vs sequential")
    try:
        P.dual_forward(model, (mb0,), (mb1,), issue_order="bogus")
    except ValueError as e:
        assert "issue order" in str(e)
    else:
        raise AssertionError("an unknown issue order was accepted")


def case_fp8_dispatch_stage(ctx):
    from commlib.training import pipeline as P
    model = _model(ctx, _buf(ctx, 128), hidden=128, fp8_dispatch=True)
    single = _model(ctx, None, hidden=128, fp8_dispatch=True)
    everything, mine = _tokens(ctx, seed=5)
    out = model(mine)
    model.staged = False
    out_plain = model(mine)
    model.staged = True
    assert torch.equal(out, out_plain)
    B = mine.shape[0]
    assert torch.equal(out, single(everything)[ctx.rank * B:(ctx.rank + 1) * B])
    _loss(out).backward()
    g_staged = _grads(model)
    model.zero_grad(set_to_none=True)
    o0, o1 = P.dual_forward(model, (mine[:1],), (mine[1:],))
    assert torch.equal(o0, model(mine[:1]).detach()) and torch.equal(o1, model(mine[1:]).detach())
    model.zero_grad(set_to_none=True)
    model.staged = False
    _loss(model(mine)).backward()
    model.staged = True
    _assert_same_grads(g_staged, _grads(model), "fp8 staged vs plain")


def case_inference_no_grad(ctx):
    from commlib.training import pipeline as P
    model = _model(ctx, _buf(ctx))
    _, mine = _tokens(ctx, seed=6)
    with torch.no_grad():
        ref0, ref1 = model(mine[:1]), model(mine[1:])
        o0, o1 = P.dual_forward(model, (mine[:1],), (mine[1:],))
    assert not o0.requires_grad
    assert torch.equal(o0, ref0) and torch.equal(o1, ref1)


def case_moe_layer_without_attention(ctx):
    """num_heads=0 (the MoE layer alone, bench_overlap's balanced_fb): EP == single process, dual == sequential."""
    from commlib.training import pipeline as P
    from commlib.training.moe import MoEModel
    torch.manual_seed(0)
    model = MoEModel(_cfg(), 1, 0, buffer=_buf(ctx), num_ranks=ctx.world_size, vocab_size=VOCAB, max_seq_len=SEQ)
    torch.manual_seed(0)
    single = MoEModel(_cfg(), 1, 0, buffer=None, num_ranks=ctx.world_size, vocab_size=VOCAB, max_seq_len=SEQ)
    assert model.blocks[0].attn is None and model.blocks[0].norm1 is None
    everything, mine = _tokens(ctx, seed=8)
    B = mine.shape[0]
    out = model(mine)
    assert torch.equal(out, single(everything)[ctx.rank * B:(ctx.rank + 1) * B])
    _loss(model(mine[:1])).backward()
    _loss(model(mine[1:])).backward()
    g_seq = _grads(model)
    model.zero_grad(set_to_none=True)
    o0, o1 = P.dual_forward(model, (mine[:1],), (mine[1:],))
    P.dual_backward(_loss(o0), None, _loss(o1), None)
    _assert_same_grads(g_seq, _grads(model), "no-attention dual vs sequential")


def case_bench_overlap_smoke(ctx):
    import os
    import tempfile

    from benchmarks import bench_overlap as bench
    with tempfile.TemporaryDirectory() as out_dir:
        args = bench.parse_args(["--tokens", "16", "--hidden", "64", "--experts", "8", "--topk", "2",
                                 "--expert-hidden", "32", "--heads", "4", "--layers", "1", "--warmup", "1",
                                 "--iters", "2", "--out-dir", out_dir])
        result = bench.run(ctx, args)
        if ctx.rank == 0:
            assert result["figures"]["forward"]["sequential_ms"] > 0
            assert os.path.exists(result["json_path"])
            assert result["calibration"] is None and result["issue_order"] == "auto"
            assert result["fb_schedule"] == "split" and result["check"]["max_relative_error"] == 0
            assert result["check"]["ok"] and set(result["check"]["phases"]) == set(result["figures"])
            assert all(c["checked"] and c["compared"] >= 2 for c in result["check"]["phases"].values())
            for f in result["figures"].values():
                assert f["checked"] and f["compute_dense_checked"] is False  # replayed rows: not compared
                assert f["compute_dense_ms"] > 0 and f["dual_over_max_comm_compute_dense"] > 0
                assert set(f["verdict_dense"]) == set(f["verdict"]) and f["comm_over_compute_dense"] > 0
                assert f["comm_over_compute"] > 0 and set(f["verdict"]) == {
                    "dual_over_max_ok", "comm_about_equal_compute", "speedup_target_applies", "speedup_ok"}
        # the joint forward+backward schedule, one phase, a backward carveout of its own
        args = bench.parse_args(["--tokens", "16", "--hidden", "64", "--experts", "8", "--topk", "2",
                                 "--expert-hidden", "32", "--heads", "4", "--layers", "1", "--warmup", "1",
                                 "--iters", "1", "--out-dir", out_dir, "--no-plot", "--no-dense",
                                 "--fb-schedule", "joint", "--phases", "forward_backward",
                                 "--sm-carveout-backward", "off"])
        result = bench.run(ctx, args)
        if ctx.rank == 0:
            assert list(result["figures"]) == ["forward_backward"] and result["fb_schedule"] == "joint"
            assert result["sm_carveout"]["backward_requested"] == "off" and result["check"]["ok"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--phases", "forward,bogus"])


def case_bench_overlap_balanced_fb_smoke(ctx):
    """The balanced_fb preset at tiny shapes: no attention, expert_hidden calibrated (two sizes here)."""
    import os
    import tempfile

    from benchmarks import bench_overlap as bench
    from benchmarks.overlap import calibrate
    sizes, calibrate.CALIBRATION_SIZES = calibrate.CALIBRATION_SIZES, (16, 32)
    try:
        with tempfile.TemporaryDirectory() as out_dir:
            args = bench.parse_args(["--preset", "balanced_fb", "--tokens", "16", "--hidden", "64", "--warmup",
                                     "1", "--iters", "1", "--no-plot", "--issue-order", "comm_first", "--no-dense",
                                     "--out-dir", out_dir])
            result = bench.run(ctx, args)
            if ctx.rank == 0:
                assert result["shapes"]["heads"] == 0 and result["issue_order"] == "comm_first"
                assert not any("compute_dense_ms" in f for f in result["figures"].values())  # --no-dense
                cal = result["calibration"]
                assert cal is not None and cal["chosen"] in (16, 32) and cal["trials"]
                assert result["shapes"]["expert_hidden"] == cal["chosen"]
                assert result["check"]["ok"]
                assert os.path.exists(result["json_path"])
    finally:
        calibrate.CALIBRATION_SIZES = sizes


def case_bench_overlap_comm_sms(ctx):
    """--comm-sms N: every dispatch and combine (forward, backward, cached) gets Config(num_sms=N), and
    Buffer.num_sms stays as it was; balanced_sms calibrates N (two candidates here)."""
    import tempfile

    from benchmarks import bench_overlap as bench
    from benchmarks.overlap import calibrate
    from commlib import Buffer
    candidates, calibrate.COMM_SMS_CALIBRATION = calibrate.COMM_SMS_CALIBRATION, (4, 6)
    seen = []   # (op, cached, num_sms) of every call on this rank
    dispatch, combine = Buffer.dispatch, Buffer.combine

    def spy_dispatch(self, *args, **kw):
        config = kw.get("config")
        seen.append(("dispatch", kw.get("handle") is not None, config.num_sms if config is not None else None))
        return dispatch(self, *args, **kw)

    def spy_combine(self, *args, **kw):
        config = kw.get("config")
        seen.append(("combine", False, config.num_sms if config is not None else None))
        return combine(self, *args, **kw)

    default_sms = Buffer.num_sms
    shapes = ["--tokens", "16", "--hidden", "64", "--expert-hidden", "32", "--warmup", "1", "--iters", "1",
              "--no-plot"]
    Buffer.dispatch, Buffer.combine = spy_dispatch, spy_combine
    try:
        with tempfile.TemporaryDirectory() as out_dir:
            result = bench.run(ctx, bench.parse_args(["--preset", "tiny", "--comm-sms", "4", "--out-dir", out_dir]
                                                     + shapes))
            assert {op for op, _, _ in seen} == {"dispatch", "combine"} and any(c for _, c, _ in seen), seen[:12]
            assert {n for _, _, n in seen} == {4}, seen[:12]
            if ctx.rank == 0:
                assert result["comm_sms"] == 4 and result["comm_sms_source"] == "--comm-sms"
                assert result["comm_configs"]["dispatch"]["num_sms"] == 4
                assert result["comm_configs"]["combine"]["num_sms"] == 4
                assert result["json_path"].endswith("_sms4.json") and result["check"]["ok"]
            seen.clear()
            result = bench.run(ctx, bench.parse_args(["--preset", "balanced_sms", "--out-dir", out_dir] + shapes))
            assert {n for _, _, n in seen} <= {4, 6} and seen, seen[:12]
            if ctx.rank == 0:
                cal = result["calibration"]
                assert cal["knob"] == "comm_sms" and cal["chosen"] in (4, 6) and cal["trials"]
                assert result["comm_sms"] == cal["chosen"] and result["comm_sms_source"] == "calibrated"
                assert seen[-1][2] == cal["chosen"]   # the timed runs come after the calibration
                assert result["shapes"]["heads"] == 0 and result["shapes"]["expert_hidden"] == 32
                assert result["check"]["ok"]
    finally:
        Buffer.dispatch, Buffer.combine = dispatch, combine
        calibrate.COMM_SMS_CALIBRATION = candidates
    assert Buffer.num_sms == default_sms   # per call, nothing class-wide
    with pytest.raises(SystemExit):
        bench.parse_args(["--comm-sms", "3"])


# ------------------------------------------------------------------ pytest entry

@pytest.fixture(scope="module")
def results():
    return run_world(WORLD, "test_pipeline", CASES)


@pytest.mark.parametrize("name", CASES)
def test_pipeline(results, name):
    assert results[name] is None, results[name]


# ------------------------------------------------------------------ the expert stage, one process
# commlib.training.moe.routed_experts against a per-row loop in float64, both its paths (one local slot per
# row: a permutation; several: the float32 index_add), forward and gradients; RMSNorm and
# MoELayer.finish against the formulas they replace.

_N, _H, _I, _L, _K = 24, 16, 8, 4, 3


def _expert_params(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w_gate_up = (torch.randn(_L, _H, 2 * _I, generator=g) / _H ** 0.5).to(dtype)
    w_down = (torch.randn(_L, _I, _H, generator=g) / _I ** 0.5).to(dtype)
    return w_gate_up, w_down


def _routing(kind, seed=1):
    """[N, K] local ids (-1 = elsewhere) and weights (nonzero in -1 slots too: they must be ignored).

    one_slot: every row has exactly one local slot, at a random position (M == N);
    several: rows with 1, 2 or 3 local slots (an expert at most once per row), all >= 1;
    some_empty: like several, and every fourth row has no local slot."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.full((_N, _K), -1, dtype=torch.int64)
    for n in range(_N):
        if kind == "one_slot":
            idx[n, torch.randint(0, _K, (1,), generator=g)] = torch.randint(0, _L, (1,), generator=g)
        else:
            m = 1 + n % 3
            if kind == "some_empty" and n % 4 == 0:
                m = 0
            slots = torch.randperm(_K, generator=g)[:m]
            idx[n, slots] = torch.randperm(_L, generator=g)[:m]
    weights = torch.rand(_N, _K, generator=g) + 0.1
    return idx, weights


def _reference(x, idx, weights, w_gate_up, w_down):
    """y[n] = sum_k w[n, k] * down(silu(gate) * up)(x[n]), one row and one slot at a time, float64."""
    import torch.nn.functional as F
    rows = []
    for n in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=torch.float64)
        for k in range(idx.shape[1]):
            e = int(idx[n, k])
            if e < 0:
                continue
            gate, up = (x[n] @ w_gate_up[e]).chunk(2)
            acc = acc + weights[n, k] * ((F.silu(gate) * up) @ w_down[e])
        rows.append(acc)
    return torch.stack(rows)


def _run_routed(x, idx, weights, w_gate_up, w_down, g_out, **kw):
    from commlib.training.moe import routed_experts
    leaves = [t.detach().clone().requires_grad_() for t in (x, w_gate_up, w_down, weights)]
    xs, w1, w2, tw = leaves
    y = routed_experts(xs, idx, tw, w1, w2, impl="loop", **kw)
    grads = torch.autograd.grad(y, leaves, g_out.to(y.dtype))
    return y, grads


def _counts(idx):
    return torch.bincount(idx[idx >= 0], minlength=_L).tolist()


def _rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


# Tolerances, against float64: float32 experts 1e-5 relative + 1e-6 absolute elementwise (observed
# <= 3e-7 relative L2), their x gradient (bf16, as x) 1e-2 relative L2 (observed 2.1e-3); bf16
# experts (parameters, activations and GEMM outputs rounded to bf16: 8 significant bits, 2^-8 =
# 3.9e-3 per rounding, a few in a row) 2e-2 relative L2 per tensor (observed 3.4e-3 .. 1.2e-2).
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["one_slot", "several", "some_empty"])
def test_routed_experts_matches_per_row_reference(dtype, kind):
    w_gate_up, w_down = _expert_params(dtype)
    idx, weights = _routing(kind)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(_N, _H, generator=g).to(torch.bfloat16)   # rows arrive in bf16 from dispatch
    g_out = torch.randn(_N, _H, generator=g)

    leaves64 = [t.double().requires_grad_() for t in (x, w_gate_up, w_down, weights)]
    ref = _reference(leaves64[0], idx, leaves64[3], leaves64[1], leaves64[2])
    ref_grads = torch.autograd.grad(ref, leaves64, g_out.double())

    has_local = kind != "some_empty"
    variants = {"counts": dict(counts=_counts(idx)), "host_counts": dict(counts=None)}
    if has_local:
        variants["flag"] = dict(counts=_counts(idx), rows_have_local_expert=True)
    results = {}
    for name, kw in variants.items():
        y, grads = _run_routed(x, idx, weights, w_gate_up, w_down, g_out, **kw)
        assert y.dtype == dtype and y.shape == (_N, _H)
        permuted = "GatherRows" in type(y.grad_fn).__name__
        # The permutation path: exactly when one slot per row is known on the host (the flag with
        # M == N, or counts computed here); the general path otherwise.
        assert permuted == (kind == "one_slot" and name in ("flag", "host_counts")), (name, type(y.grad_fn))
        for what, got, want in zip(("y", "x", "w_gate_up", "w_down", "topk_weights"), (y,) + grads,
                                   (ref,) + ref_grads):
            if dtype == torch.float32 and what != "x":
                torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"{kind}/{name}/{what}: {m}")
            else:  # bf16 experts, and x's gradient (bf16 like x)
                tol = 2e-2 if dtype == torch.bfloat16 else 1e-2
                assert _rel_err(got, want) <= tol, (kind, name, what, _rel_err(got, want))
        # -1 slots contribute nothing: their weights get no gradient; rows without a slot are 0
        assert torch.all(grads[3][idx < 0] == 0)
        empty = (idx >= 0).sum(1) == 0
        assert torch.all(y[empty] == 0) and torch.all(grads[0][empty] == 0)
        results[name] = (y, grads)
    # Both paths give the same bits: with one term per row the float32 sum is exact.
    base_y, base_grads = results["counts"]
    for name, (y, grads) in results.items():
        assert torch.equal(y, base_y), name
        for a, b in zip(grads, base_grads):
            assert torch.equal(a, b), name


def test_routed_experts_permutation_backward_is_exact():
    """float64 gradcheck and gradgradcheck of both paths (the permutation's backward is itself)."""
    from commlib.training.moe import routed_experts
    w_gate_up, w_down = _expert_params(torch.float64)
    x = torch.randn(_N, _H, dtype=torch.float64)
    for kind, kw in (("one_slot", dict(rows_have_local_expert=True)), ("several", {})):
        idx, weights = _routing(kind)
        counts = _counts(idx)
        inputs = [t.clone().double().requires_grad_() for t in (x, w_gate_up, w_down, weights)]

        def fn(x, w1, w2, tw):
            return routed_experts(x, idx, tw, w1, w2, counts=counts, impl="loop", **kw)
        assert torch.autograd.gradcheck(fn, inputs), kind
        assert torch.autograd.gradgradcheck(fn, inputs), kind


def test_routed_experts_flag_refuses_rows_without_slots():
    from commlib.training.moe import routed_experts
    w_gate_up, w_down = _expert_params(torch.float32)
    idx, weights = _routing("some_empty")
    idx = idx[: _L]   # rows 0 (no slot), 1 (two), 2 (three), 3 (one): M == 6 > N == 4, fine
    routed_experts(torch.randn(4, _H), idx, weights[:4], w_gate_up, w_down, counts=_counts(idx),
                   impl="loop", rows_have_local_expert=True)
    idx = idx[[0, 3]]  # one empty row, one with one slot: M == 1 < N == 2 contradicts the flag
    with pytest.raises(ValueError, match="rows_have_local_expert"):
        routed_experts(torch.randn(2, _H), idx, weights[:2], w_gate_up, w_down, counts=_counts(idx),
                       impl="loop", rows_have_local_expert=True)


def test_expert_compute_dispatch_flag_same_bits():
    """MoELayer.expert_compute with rows_have_local_expert (its dispatch callers) == without."""
    from commlib.training.moe import MoEConfig, MoELayer
    torch.manual_seed(0)
    cfg = MoEConfig(hidden=_H, num_experts=_L, topk=_K, expert_hidden=_I, expert_impl="loop")
    layer = MoELayer(cfg, buffer=None, num_ranks=1)
    for kind in ("one_slot", "several"):
        idx, weights = _routing(kind)
        x = torch.randn(_N, _H).to(torch.bfloat16)
        outs = []
        for flag in (False, True):
            layer.zero_grad(set_to_none=True)
            xs, tw = x.clone().requires_grad_(), weights.clone().requires_grad_()
            y = layer.expert_compute(xs, idx, tw, _counts(idx), rows_have_local_expert=flag)
            assert y.dtype == torch.bfloat16
            y.float().pow(2).sum().backward()
            outs.append([y, xs.grad, tw.grad] + [p.grad for p in layer.experts.parameters()])
        for a, b in zip(*outs):
            assert torch.equal(a, b), kind


def test_moe_config_rejects_bad_shared_stage():
    from commlib.training.moe import MoEConfig
    with pytest.raises(ValueError, match="shared_stage"):
        MoEConfig(hidden=64, num_experts=8, topk=2, expert_hidden=32, shared_stage="dispatch")


def test_rmsnorm_matches_formula():
    import warnings
    from commlib.training.moe import RMSNorm
    torch.manual_seed(0)
    H = 256
    norm = RMSNorm(H)
    with torch.no_grad():
        norm.weight.add_(0.1 * torch.randn(H))
    assert list(norm.state_dict()) == ["weight"]

    def formula(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * w

    # float32: equal to the formula within float32 rounding, forward and gradients
    x = (3 * torch.randn(2, 16, H)).requires_grad_()
    g = torch.randn(2, 16, H)
    out = norm(x)
    gx, gw = torch.autograd.grad(out, (x, norm.weight), g)
    x2, w2 = x.detach().clone().requires_grad_(), norm.weight.detach().clone().requires_grad_()
    ref = formula(x2, w2)
    rx, rw = torch.autograd.grad(ref, (x2, w2), g)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gx, rx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw, rw, rtol=1e-5, atol=1e-5)

    # bf16 module on bf16 rows: at least as close to the exact value as the bf16 formula
    nb = RMSNorm(H).to(torch.bfloat16)
    with torch.no_grad():
        nb.weight.copy_(norm.weight)
    xb = (3 * torch.randn(64, H)).to(torch.bfloat16)
    exact = formula(xb.double(), nb.weight.double())
    got, old = nb(xb), formula(xb, nb.weight)
    assert got.dtype == old.dtype == torch.bfloat16
    assert (got.double() - exact).abs().max() <= (old.double() - exact).abs().max()

    # mixed dtypes (bf16 rows, float32 weight) keep the formula: float32 result, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mixed = norm(xb)
    assert mixed.dtype == torch.float32 and torch.equal(mixed, formula(xb, norm.weight))


def test_finish_same_bits_as_cast_then_add():
    from commlib.training.moe import MoELayer
    torch.manual_seed(0)
    combined = torch.randn(32, 64).to(torch.bfloat16)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        shared = torch.randn(32, 64, dtype=dtype)
        c, s = combined.clone().requires_grad_(), shared.clone().requires_grad_()
        out = MoELayer.finish(c, s, dtype)
        c2, s2 = combined.clone().requires_grad_(), shared.clone().requires_grad_()
        ref = c2.to(dtype) + s2.to(dtype)
        assert out.dtype == ref.dtype == dtype and torch.equal(out, ref), dtype
        g = torch.randn(32, 64, dtype=dtype)
        for a, b in zip(torch.autograd.grad(out, (c, s), g), torch.autograd.grad(ref, (c2, s2), g)):
            assert a.dtype == b.dtype and torch.equal(a, b), dtype
        assert torch.equal(MoELayer.finish(combined, None, dtype), combined.to(dtype))


def test_sm_carveout_resolves_and_restores(monkeypatch):
    """The overlapped schedules' SM carveout: 'auto' = the comm stages' SMs (their Config's, else
    the Buffer's), 'off'/0 = none, ints pass, bad values raise; the context manager sets torch's
    carveout for its body only (clamped below the SM count) and is a no-op on CPU or for 0."""
    import types
    from commlib import Config
    from commlib.training import pipeline as P

    class FakeBuffer:          # what _buffer_call_sms reads: the class's num_sms, the tuned configs
        num_sms = 4
        _tuned: dict = {}

    buf = FakeBuffer()
    cfg = Config(num_sms=6, num_max_nvl_chunked_send_tokens=8, num_max_nvl_chunked_recv_tokens=256)
    stages = [P.ComputeStage("a", lambda c: c), P.DispatchStage(buf, 8, config=cfg), P.CombineStage(buf)]
    assert P.resolve_sm_carveout("auto", stages) == 6          # the dispatch Config's 6 > the Buffer's 4
    stages[1].config = None
    assert P.resolve_sm_carveout("auto", stages) == 4
    buf._tuned = {"k": cfg}
    assert P.resolve_sm_carveout("auto", stages) == 6          # a tuned config may take more
    assert P.resolve_sm_carveout("auto", []) == 0
    assert P.resolve_sm_carveout("off", stages) == P.resolve_sm_carveout(0, stages) == 0
    assert P.resolve_sm_carveout("12", stages) == P.resolve_sm_carveout(12) == 12
    monkeypatch.setenv("COMMLIB_SM_CARVEOUT", "off")
    assert P.resolve_sm_carveout(None, stages) == 0
    monkeypatch.delenv("COMMLIB_SM_CARVEOUT")
    assert P.resolve_sm_carveout(None, stages) == 6
    for bad in ("most", -1, True, 2.5):
        with pytest.raises(ValueError):
            P.resolve_sm_carveout(bad, stages)

    state = {"value": 3, "calls": []}

    def setter(v):
        state["calls"].append(v)
        state["value"] = v

    monkeypatch.setattr(torch._C, "_set_sm_carveout_experimental", setter, raising=False)
    monkeypatch.setattr(torch._C, "_get_sm_carveout_experimental", lambda: state["value"], raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(multi_processor_count=132))
    cuda = torch.device("cuda", 0)
    with P.sm_carveout(20, cuda) as n:
        assert n == 20 and state["value"] == 20
    assert state["value"] == 3                                   # the previous value is back
    with pytest.raises(RuntimeError):
        with P.sm_carveout(500, cuda) as n:
            assert n == 131 and state["value"] == 131            # clamped below the SM count
            raise RuntimeError("body failed")
    assert state["value"] == 3                                   # restored on error too
    state["calls"].clear()
    for n, dev in ((0, cuda), (8, torch.device("cpu")), (8, None)):
        with P.sm_carveout(n, dev) as got:
            assert got == 0
    assert state["calls"] == []


def test_bench_overlap_transport_flags(monkeypatch):
    """--ce-staging / --ce-sms set the ranks' environment (COMMLIB_CE_BYTES only when unset); the
    network preset's shapes; bad values are refused."""
    from benchmarks.overlap.options import parse_args, resolve_shapes, transport_env
    from commlib.utils import env

    for k in ("COMMLIB_CE_STAGING", "COMMLIB_CE_BYTES", "COMMLIB_CE_SMS"):
        monkeypatch.setenv(k, "")  # recorded, so what _transport_env sets is undone after the test
        monkeypatch.delenv(k)
    args = parse_args(["--preset", "network", "--ce-staging", "host", "--ce-sms", "8"])
    transport_env(args)
    assert (env.ce_staging(), env.ce_bytes(), env.ce_sms()) == ("host", 600 << 20, 8)
    monkeypatch.setenv("COMMLIB_CE_BYTES", str(1 << 30))
    transport_env(parse_args(["--ce-staging", "device"]))
    assert (env.ce_staging(), env.ce_bytes()) == ("device", 1 << 30)
    shapes = resolve_shapes(args, on_gpu=True)
    assert (shapes["tokens"], shapes["heads"], shapes["expert_hidden"], shapes["topk"]) == (16384, 16, 3072, 2)
    with pytest.raises(SystemExit):
        parse_args(["--ce-sms", "0"])
    with pytest.raises(SystemExit):
        parse_args(["--ce-staging", "nvme"])


def test_bench_overlap_halves_floor():
    """Two forwards then two backwards: the floor is max(comm, compute) of each half, summed."""
    from benchmarks.overlap import analysis as bench

    def span(label, stream, ms):
        return {"label": label, "stream": stream, "start_ms": 0.0, "end_ms": ms}

    spans = [span("0.F.attn0", "compute", 2), span("0.F.dispatch0", "comm", 3), span("1.F.attn0", "compute", 2),
             span("1.F.dispatch0", "comm", 3), span("0.B.attn0", "compute", 4), span("0.B.dispatch0", "comm", 3),
             span("1.B.attn0", "compute", 4), span("1.B.dispatch0", "comm", 3)]
    # forward half: comm 6 > compute 4; backward half: compute 8 > comm 6 -> 14, against max(12, 12)
    assert bench.halves_floor_ms(spans) == 14
    assert bench.halves_floor_ms(spans[:4]) == 6  # a forward alone: its own max


def test_bench_overlap_gap_split():
    """bench_overlap's schedule bound replays the dual order at sequential durations: lockstep pairs
    cost their max, a stream waits for its micro-batch's previous step; the split reports busy
    ratios and idle shares from the spans."""
    from benchmarks.overlap import analysis as bench

    def span(label, stream, t0, t1):
        return {"label": label, "stream": stream, "start_ms": t0, "end_ms": t1}

    # sequential durations: A 1, D 3, X 2 (mb 0) and A 1, D 3, X 2 (mb 1)
    seq = [span("0.A", "compute", 0, 1), span("0.D", "comm", 1, 4), span("0.X", "compute", 4, 6),
           span("1.A", "compute", 6, 7), span("1.D", "comm", 7, 10), span("1.X", "compute", 10, 12)]
    # dual order (slower spans: the bound ignores their durations, only their order counts)
    dual = [span("0.A", "compute", 0, 1.5), span("0.D", "comm", 1.5, 5), span("1.A", "compute", 1.6, 3),
            span("1.D", "comm", 5, 9), span("0.X", "compute", 5.1, 7.5), span("1.X", "compute", 9, 11.5)]
    # replay: 0.A 0-1 | 0.D 1-4 and 1.A 1-2 | 1.D 4-7 and 0.X 4-6 | 1.X 7-9
    assert bench.schedule_bound_ms(seq, dual) == 9.0
    split = bench.gap_split(seq, dual, busiest_ms=6.0)
    assert split["schedule_bound_over_max"] == 1.5
    assert abs(split["dual_busy_over_sequential"]["comm"] - 7.5 / 6) < 1e-12
    assert abs(split["dual_busy_over_sequential"]["compute"] - 7.8 / 6) < 1e-12
    assert abs(split["dual_idle_share"]["comm"] - (1 - 7.5 / 11.5)) < 1e-12
    assert split["sequential_stage_ms"] == {"A": 1.0, "D": 3.0, "X": 2.0}
    layered = [span("0.F.attn0", "compute", 0, 1), span("1.F.attn1", "compute", 1, 4),
               span("0.B.experts0", "compute", 4, 6), span("1.B.attn12", "compute", 6, 6.5)]
    assert bench.stage_means_ms(layered) == {"F.attn": 2.0, "B.experts": 2.0, "B.attn": 0.5}


def test_bench_overlap_comm_trace_steps():
    """bench_overlap --comm-trace: comm steps (comm-stream order) take their data kernel's traces in
    launch order per kind (combine' runs the dispatch kernel, dispatch' the combine kernel); each
    step gets the kernel's own time, its CTAs' start spread and its start after the span began
    (the soonest step counting 0); unmatched launches or steps raise."""
    from benchmarks.overlap import analysis as bench

    def span(label, t0, t1):
        return {"label": label, "stream": "comm", "start_ms": t0, "end_ms": t1}

    ms = 1_000_000  # ns per ms
    spans = [span("0.F.dispatch0", 0.0, 3.0), {"label": "0.F.experts0", "stream": "compute", "start_ms": 3.0,
                                               "end_ms": 4.0},
             span("0.B.combine0", 5.0, 6.0), span("0.F.combine0", 4.0, 5.0), span("0.B.dispatch0", 6.0, 8.0)]
    base = 100 * ms  # the GPU clock's own origin
    hist = {"dispatch": [[(base + 1 * ms, 0, base + 3 * ms), (base + 2 * ms, 0, base + 2 * ms + ms // 2)],
                         [(base + 5 * ms + ms // 2, 0, base + 6 * ms)] * 2],
            "combine": [[(base + 4 * ms, 0, base + 5 * ms), (base + 4 * ms, 0, base + 4 * ms + ms // 4)],
                        [(base + 6 * ms, 0, base + 8 * ms)] * 2]}
    steps = bench.comm_trace_steps(spans, hist)
    assert [(s["label"], s["kernel"]) for s in steps] == [
        ("0.F.dispatch0", "dispatch"), ("0.F.combine0", "combine"), ("0.B.combine0", "dispatch"),
        ("0.B.dispatch0", "combine")]
    got = [(s["span_ms"], s["kernel_ms"], s["skew_ms"], s["lead_ms"]) for s in steps]
    assert got == [(3.0, 2.0, 1.0, 1.0), (1.0, 1.0, 0.0, 0.0), (1.0, 0.5, 0.0, 0.5), (2.0, 2.0, 0.0, 0.0)]
    summary = bench.comm_trace_summary({"dual": steps})
    assert summary == {"dual": {"span_ms": 7.0, "kernel_ms": 5.5, "lead_ms": 1.5, "skew_ms": 1.0}}
    with pytest.raises(RuntimeError, match="no combine launch left"):
        bench.comm_trace_steps(spans, {"dispatch": hist["dispatch"], "combine": hist["combine"][:1]})
    with pytest.raises(RuntimeError, match="launches without a comm step"):
        bench.comm_trace_steps(spans[:3], hist)


def deferred_equals_immediate(device=None, dtype=torch.float32, impl="auto"):
    """routed_experts' expert weight gradients through commlib.training.wgrad: inside ``deferring(queue)``
    both expert parameters get no gradient from autograd and two entries are queued; ``run`` then
    gives the same gradients as the immediate backward, bit for bit (same GEMMs), and accumulates
    onto existing ones as AccumulateGrad does; an expert without rows gets a zero gradient. Views (a
    slice of the parameter) are never deferred.
    Shared with tests/gpu/test_moe_gpu.py."""
    from commlib.training import wgrad
    from commlib.training.moe import routed_experts
    device = device or torch.device("cpu")
    w_gate_up, w_down = (p.to(device) for p in _expert_params(dtype))
    idx, weights = _routing("some_empty")
    idx = torch.where(idx == _L - 1, torch.full_like(idx, -1), idx)   # the last expert gets no rows
    idx, weights = idx.to(device), weights.to(device)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(idx.shape[0], _H, generator=g).to(device, dtype)
    g_out = torch.randn(idx.shape[0], _H, generator=g).to(device, dtype)

    def backward(params, queue):
        with wgrad.deferring(queue):
            y = routed_experts(x, idx, weights, params[0], params[1], _counts(idx.cpu()), impl)
            torch.autograd.backward(y, g_out)

    now = [torch.nn.Parameter(w_gate_up.clone()), torch.nn.Parameter(w_down.clone())]
    backward(now, None)
    assert _counts(idx.cpu())[-1] == 0
    assert all(not p.grad[_L - 1].any() for p in now)   # an expert without rows: zero weight gradient
    later = [torch.nn.Parameter(w_gate_up.clone()), torch.nn.Parameter(w_down.clone())]
    queue = []
    backward(later, queue)
    assert len(queue) == 2 and all(p.grad is None for p in later)
    assert wgrad.run(queue) == 2 and queue == []
    for a, b in zip(now, later):
        assert torch.equal(a.grad, b.grad)
    backward(later, queue)                      # a second backward: queued again, then added in place
    first = [p.grad for p in later]
    wgrad.run(queue)
    for a, b, f in zip(now, later, first):
        assert b.grad is f and torch.equal(b.grad, a.grad + a.grad)
    base = torch.nn.Parameter(w_gate_up.clone())
    with wgrad.deferring(queue):
        y = routed_experts(x, idx, weights, base[0:_L], w_down, _counts(idx.cpu()), impl)
        torch.autograd.backward(y, g_out)
    assert queue == [] and torch.equal(base.grad, now[0].grad)   # a view: its gradient came back now


def test_deferred_weight_grads_equal_immediate():
    deferred_equals_immediate()
    deferred_equals_immediate(dtype=torch.bfloat16)


def test_deferred_weight_grads_from_another_thread():
    """Autograd runs CUDA ops' backward on its own device threads while the caller waits: a queue
    activated on the caller's thread must still collect them (it did not when it was thread-local)."""
    import threading
    from commlib.training import wgrad
    from commlib.training.moe import routed_experts
    w_gate_up, w_down = (torch.nn.Parameter(p) for p in _expert_params(torch.float32))
    idx, weights = _routing("one_slot")
    x = torch.randn(idx.shape[0], _H)
    queue = []
    with wgrad.deferring(queue):
        y = routed_experts(x, idx, weights, w_gate_up, w_down, _counts(idx), "loop")
        worker = threading.Thread(target=torch.autograd.backward, args=(y, torch.ones_like(y)))
        worker.start()
        worker.join()
    assert len(queue) == 2 and w_gate_up.grad is None and w_down.grad is None
    wgrad.run(queue)
    assert w_gate_up.grad is not None and w_down.grad is not None


def test_linear_same_bits_and_deferred_next():
    """moe.linear (the attention projections): F.linear's output and gradients bit for bit on CPU,
    and inside wgrad.deferring its weight gradient is queued with placement NEXT (split() sorts the
    queue's entries by placement) and equals the immediate one once run."""
    from commlib.training import wgrad
    from commlib.training.moe import linear
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for shape in ((2, 5, 16), (7, 16)):
            x = torch.randn(*shape, dtype=dtype)
            g = torch.randn(*shape[:-1], 8, dtype=dtype)
            w0 = torch.randn(8, 16, dtype=dtype)
            xa, wa = x.clone().requires_grad_(), torch.nn.Parameter(w0.clone())
            ya = linear(xa, wa)
            ya.backward(g)
            xb, wb = x.clone().requires_grad_(), torch.nn.Parameter(w0.clone())
            yb = torch.nn.functional.linear(xb, wb)
            yb.backward(g)
            assert torch.equal(ya, yb) and torch.equal(xa.grad, xb.grad) and torch.equal(wa.grad, wb.grad)
            wc, queue = torch.nn.Parameter(w0.clone()), []
            with wgrad.deferring(queue):
                linear(x.clone().requires_grad_(), wc).backward(g)
            chain_items, next_items = wgrad.split(queue)
            assert chain_items == [] and len(next_items) == 1 and wc.grad is None
            wgrad.run(next_items)
            assert torch.equal(wc.grad, wb.grad)


def test_bench_overlap_replay_comm():
    """ReplayComm: record passes calls through and keeps index tensors, counts and handles; replay
    returns them in call order with fresh rows of random values (same shapes and dtypes; not zeros,
    which a GEMM runs on at a lower power), moves nothing, and refuses a call sequence that differs
    from the recorded one."""
    import types

    from benchmarks.overlap.replay import ReplayComm

    class Fake:
        comm_stream = None
        rank = 3

        def __init__(self):
            self.calls = 0

        def dispatch(self, x, handle=None, previous_event=None, async_finish=False):
            self.calls += 1
            idx = torch.tensor([[0, -1], [1, 0]])
            return x * 2, idx, torch.ones(2, 2), [2, 1], types.SimpleNamespace(idx=idx), "event"

        def combine(self, x, handle, previous_event=None, async_finish=False):
            self.calls += 1
            return x + 1, None, "event"

    real = Fake()
    r = ReplayComm(real)
    x = torch.full((2, 4), 3.0, dtype=torch.bfloat16)
    rec = r.dispatch(x)
    assert rec[0].eq(6).all() and rec[5] == "event"
    r.combine(rec[0], rec[4])
    assert real.calls == 2 and r.rank == 3  # attributes fall through to the real Buffer
    r.mode = "replay"
    rows = []
    for _ in range(2):
        r.rewind()
        out = r.dispatch(x)
        assert out[0].dtype == torch.bfloat16 and out[0].shape == (2, 4) and out[0].ne(0).all()
        assert out[1] is rec[1] and out[2] is rec[2] and out[3] == [2, 1] and out[4] is rec[4]
        assert out[5].event is None  # an EventOverlap (CPU: no event)
        c = r.combine(out[0], out[4])
        assert c[0].shape == (2, 4) and c[0].ne(0).any() and c[1] is None
        rows.append(out[0])
    # the same values each replay, in a tensor of its own
    assert torch.equal(rows[0], rows[1]) and rows[0].data_ptr() != rows[1].data_ptr()
    r.rewind()
    r.dispatch(x)
    p, none, _ = r.combine(x, None, finish_later=True)  # what the pipeline's stages ask for
    assert none is None and p.finish()[0].shape == (2, 4)
    with pytest.raises(RuntimeError, match="already called"):
        p.finish()
    assert real.calls == 2
    r.rewind()
    r.dispatch(x), r.combine(x, None)
    with pytest.raises(RuntimeError, match="had no more calls"):
        r.combine(x, None)
    r.rewind()
    with pytest.raises(RuntimeError, match="call 0 is a combine"):
        r.combine(x, None)


def test_turn_moves_to_the_comm_stream_only_between_comm_steps():
    """dual_forward_backward issues a chain's turn (light and bookkeeping steps between its last
    forward and first backward comm step) on that comm stream; a heavy step between, or no stream
    (CPU), leaves every step where it was."""
    from commlib.training import pipeline as P

    def noop():
        pass

    stream = object()  # stands for a CUDA stream; the steps are only wrapped here, never run

    def steps(light=True, comm_stream=stream):
        return [P.Step("compute", "F.attn", noop), P.Step("comm", "F.combine", noop, stream=comm_stream),
                P.Step("compute", "F.finish", noop, light=light), P.Step("none", "F.end", noop),
                P.Step("none", "turn", noop), P.Step("compute", "B.finish", noop, light=light),
                P.Step("comm", "B.combine", noop, stream=comm_stream), P.Step("compute", "B.experts", noop)]

    s = steps()
    P.turn_on_comm_stream(s, 4)
    assert [st.run is not noop for st in s] == [False, False, True, True, True, True, False, False]
    for s in (steps(light=False), steps(comm_stream=None)):
        P.turn_on_comm_stream(s, 4)
        assert all(st.run is noop for st in s)


def test_model_schedule_joint_turn_on_comm_stream_is_shorter(tmp_path):
    """experiments.model_schedule: sequential durations replayed in each schedule's order; with a
    compute-bound backward the joint schedule (turn on the comm stream) beats the split one, and
    with the turn on the compute stream it does not."""
    import json

    from experiments import model_schedule as ms
    dur = {"F.attn": 6.0, "F.dispatch": 7.5, "F.experts": 6.0, "F.combine": 7.5, "F.finish": 0.2,
           "B.finish": 0.3, "B.combine": 7.5, "B.experts": 13.0, "B.dispatch": 7.5, "B.attn": 13.0}
    names = [(f"{s}{l}", "comm" if s in ("dispatch", "combine") else "compute")
             for l in range(2) for s in ("attn", "dispatch", "experts", "combine")] + [("finish", "compute")]
    spans, t = [], 0.0
    for tag in ("0", "1"):
        for phase, order in (("F", names), ("B", list(reversed(names)))):
            for name, stream in order:
                d = dur[f"{phase}.{name.rstrip('01')}"]
                spans.append({"label": f"{tag}.{phase}.{name}", "stream": stream, "start_ms": t, "end_ms": t + d})
                t += d
    comm = sum(s["end_ms"] - s["start_ms"] for s in spans if s["stream"] == "comm")
    compute = sum(s["end_ms"] - s["start_ms"] for s in spans if s["stream"] == "compute")
    path = tmp_path / "fb.json"
    path.write_text(json.dumps({"figures": {"forward_backward": {
        "spans_sequential": spans, "comm_ms": comm, "compute_ms": compute, "dual_over_max_comm_compute": 1.2,
        "halves_floor_over_max": 1.05}}}))
    m = ms.model(str(path), {"finish"})
    assert m["joint"] < m["split"] - 0.005, m
    assert m["joint_compute"] >= m["split"] - 1e-9, m
    o = ms.orders(ms.chain_stages(spans), {"finish"})["joint"]
    comm_order = [label for label, stream in o if "combine" in label or "dispatch" in label]
    i = comm_order.index("0.F.combine1")
    assert comm_order[i:i + 4] == ["0.F.combine1", "0.B.combine1", "1.F.combine1", "1.B.combine1"], comm_order
    assert ["0.F.finish", "comm"] in o and ["1.B.finish", "comm"] in o  # the turn, on the comm stream


def test_bench_overlap_check_and_exit_code(monkeypatch):
    """bench_overlap's check: the run is ok only when every compared phase is; a phase not compared
    reads N/A and does not count; a wrong compared result makes main() return 1 (the exit code),
    a right one or none compared 0."""
    from benchmarks import bench_overlap as bench
    from benchmarks.overlap.check import NOT_CHECKED, exit_code, status, summarize

    def phase(err, tol=0.0):
        return {"checked": True, "max_relative_error": err, "worst": "out0", "compared": 3, "tolerance": tol,
                "ok": err <= tol}

    good = summarize({"forward": phase(0.0), "fwd0_bwd1": NOT_CHECKED})
    assert good["ok"] is True and good["checked"] and exit_code({"check": good}) == 0
    assert status(good["phases"]["fwd0_bwd1"]) == "N/A" and status(good) == "ok"
    bad = summarize({"forward": phase(0.0), "forward_backward": phase(0.5, 1e-2)})
    assert bad["ok"] is False and bad["worst"] == "forward_backward: out0" and bad["max_relative_error"] == 0.5
    assert status(bad) == "WRONG" and exit_code({"check": bad}) == 1
    none = summarize({"forward": NOT_CHECKED})
    assert none["ok"] is None and status(none) == "N/A" and exit_code({"check": none}) == 0
    for check, code in ((bad, 1), (good, 0)):
        monkeypatch.setattr(bench, "parallel_launch", lambda *a, check=check, **kw: {"check": check})
        assert bench.main(["--preset", "tiny"]) == code


def test_bench_overlap_compare_finds_a_wrong_schedule(monkeypatch):
    """check.compare against a run whose dual result differs: WRONG (one rank, gloo)."""
    import torch.distributed as dist

    from benchmarks.overlap.check import compare
    from commlib.utils.launch import free_port

    model = torch.nn.Linear(4, 4)
    x = torch.ones(2, 4)

    def run(overlap):
        y = model(x) * (1.5 if overlap else 1.0)   # a "schedule" that gets the numbers wrong
        y.sum().backward()
        return y

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        c = compare(model, run, torch.device("cpu"), "forward")
        assert c["checked"] and not c["ok"] and c["max_relative_error"] > 0.1 and c["compared"] == 3
        same = compare(model, lambda overlap: run(False), torch.device("cpu"), "forward")
        assert same["ok"] and same["max_relative_error"] == 0
    finally:
        dist.destroy_process_group()
