"""Fault injection on CPU (gloo) ranks: every surviving rank raises within COMMLIB_TIMEOUT_S,
never hangs; a Buffer that timed out refuses further calls. Plus long runs, property-based
routing, and the "nothing lost" invariant."""
import os
import time

import pytest
import torch

import commlib
from commlib.utils.launch import parallel_launch

TIMEOUT_S = 3.0
E, H, K, T = 16, 128, 4, 12


def _setup(ctx, hidden=H):
    os.environ["COMMLIB_TIMEOUT_S"] = str(TIMEOUT_S)
    cfg = commlib.Buffer.get_dispatch_config(ctx.world_size)
    buf = commlib.Buffer(ctx.group, cfg.get_nvl_buffer_size_hint(1024 * 2, ctx.world_size), backend="reference")
    g = torch.Generator().manual_seed(ctx.rank)
    x = torch.randn(T, hidden, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return buf, x, idx


def _dispatch(buf, x, idx, num_experts=E, **kw):
    ntr, nrr, nte, tir, _ = buf.get_dispatch_layout(idx, num_experts)
    return buf.dispatch(x, num_tokens_per_rank=ntr, is_token_in_rank=tir, num_tokens_per_expert=nte, topk_idx=idx, **kw)


def _outcome(fn):
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the outcome is what the test inspects
        return type(e).__name__, str(e), time.monotonic() - t0
    return None, "", time.monotonic() - t0


def _fault_worker(ctx, fault):
    buf, x, idx = _setup(ctx)
    if fault == "exit_before_dispatch":
        if ctx.rank == 1:
            os._exit(0)
        return _outcome(lambda: _dispatch(buf, x, idx))
    if fault == "skip_combine":
        rx, _, _, _, h, _ = _dispatch(buf, x, idx)
        if ctx.rank == 1:
            time.sleep(TIMEOUT_S + 3)  # never calls combine
            return None
        first = _outcome(lambda: buf.combine(rx, h))
        second = _outcome(lambda: _dispatch(buf, x, idx))
        return first, second
    if fault == "skip_combine_then_dispatch":
        rx, _, _, _, h, _ = _dispatch(buf, x, idx)
        if ctx.rank == 1:
            return _outcome(lambda: _dispatch(buf, x, idx))
        return _outcome(lambda: buf.combine(rx, h))
    if fault == "dispatch_twice":
        rx, _, _, _, h, _ = _dispatch(buf, x, idx)
        if ctx.rank == 0:
            return _outcome(lambda: _dispatch(buf, x, idx))
        return _outcome(lambda: buf.combine(rx, h))
    if fault.startswith("disagree_"):
        what = fault[len("disagree_"):]
        odd = ctx.rank == 1
        if what == "num_experts":
            return _outcome(lambda: _dispatch(buf, x, idx, num_experts=2 * E if odd else E))
        if what == "hidden":
            if odd:
                x = torch.randn(T, 2 * H).to(torch.bfloat16)
            return _outcome(lambda: _dispatch(buf, x, idx))
        if what == "dtype":
            xin = commlib.per_token_cast_to_fp8(x.float()) if odd else x
            return _outcome(lambda: _dispatch(buf, xin, idx))
        if what == "config":
            cfg = commlib.Config(10 if odd else 20, 32, 256)
            return _outcome(lambda: _dispatch(buf, x, idx, config=cfg))
        if what == "bad_input_on_one_rank":
            bad = idx.clone()
            if odd:
                bad = bad.int()  # wrong dtype on one rank only
            return _outcome(lambda: buf.dispatch(x, num_tokens_per_rank=torch.zeros(2, dtype=torch.int32),
                                                 is_token_in_rank=torch.zeros(T, 2, dtype=torch.bool),
                                                 num_tokens_per_expert=torch.zeros(E, dtype=torch.int32),
                                                 topk_idx=bad))
    raise AssertionError(fault)


def _run_fault(fault):
    return parallel_launch(2, _fault_worker, fault, timeout_s=120, allow_exit=True)


def test_rank_exits_before_dispatch():
    name, msg, took = _run_fault("exit_before_dispatch")
    assert name == "CommlibError" and "rank 0" in msg, msg
    assert took < TIMEOUT_S + 5


def test_rank_skips_combine_times_out_and_poisons_buffer():
    (name, msg, took), (name2, msg2, _) = _run_fault("skip_combine")
    assert name == "CommlibError" and "timed out" in msg and "combine" in msg and "COMMLIB_TIMEOUT_S" in msg, msg
    assert TIMEOUT_S - 0.5 < took < TIMEOUT_S + 5
    assert name2 == "CommlibError" and "unusable" in msg2, msg2


def test_rank_skips_combine_and_dispatches():
    name, msg, took = _run_fault("skip_combine_then_dispatch")
    assert name == "ValueError" and "disagree" in msg and "op" in msg, msg
    assert took < TIMEOUT_S


def test_rank_dispatches_twice():
    name, msg, _ = _run_fault("dispatch_twice")
    assert name == "ValueError" and "combine" in msg and "dispatch" in msg, msg


@pytest.mark.parametrize("what,word", [("num_experts", "num_experts"), ("hidden", "hidden"), ("dtype", "fp8"),
                                       ("config", "num_sms"), ("bad_input_on_one_rank", "rejected")])
def test_ranks_disagree(what, word):
    name, msg, took = _run_fault(f"disagree_{what}")
    assert name == "ValueError" and word in msg, msg
    assert took < TIMEOUT_S
