"""Fault injection on CPU (gloo) ranks: each rank's outcome is checked (every surviving rank raises
the expected error, naming itself and what differs, within COMMLIB_TIMEOUT_S; the rank that made
the fault did what it was told); a Buffer that timed out refuses further calls. And the test worlds
themselves: a case that fails on one rank only is reported with that rank's text within a minute."""
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
            return "skipped combine"
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
    """Every rank's outcome, in rank order (None for a rank that left on purpose)."""
    return parallel_launch(2, _fault_worker, fault, timeout_s=120, allow_exit=True, return_all=True)


def _raised(outcome, exc_name, *words, within=None):
    name, msg, took = outcome
    assert name == exc_name, f"expected {exc_name}, got {name}: {msg}"
    for word in words:
        assert word in msg, f"{word!r} not in: {msg}"
    if within is not None:
        assert took < within, f"raised after {took:.1f} s: {msg}"


def test_rank_exits_before_dispatch():
    rank0, rank1 = _run_fault("exit_before_dispatch")
    _raised(rank0, "CommlibError", "rank 0", "dispatch", "a peer exited", within=TIMEOUT_S + 5)
    assert rank1 is None  # it left before the call


def test_rank_skips_combine_times_out_and_poisons_buffer():
    (first, second), rank1 = _run_fault("skip_combine")
    _raised(first, "CommlibError", "timed out", "combine", "COMMLIB_TIMEOUT_S", within=TIMEOUT_S + 5)
    assert first[2] > TIMEOUT_S - 0.5, first
    _raised(second, "CommlibError", "unusable", within=1.0)
    assert rank1 == "skipped combine"


def test_rank_skips_combine_and_dispatches():
    rank0, rank1 = _run_fault("skip_combine_then_dispatch")
    _raised(rank0, "ValueError", "rank 0", "disagree", "op: rank 1 has dispatch, rank 0 has combine", within=TIMEOUT_S)
    _raised(rank1, "ValueError", "rank 1", "disagree", "op: rank 0 has combine, rank 1 has dispatch", within=TIMEOUT_S)


def test_rank_dispatches_twice():
    rank0, rank1 = _run_fault("dispatch_twice")
    _raised(rank0, "ValueError", "rank 0", "op: rank 1 has combine, rank 0 has dispatch", within=TIMEOUT_S)
    _raised(rank1, "ValueError", "rank 1", "op: rank 0 has dispatch, rank 1 has combine", within=TIMEOUT_S)


@pytest.mark.parametrize("what,word", [("num_experts", "num_experts"), ("hidden", "hidden"), ("dtype", "fp8"),
                                       ("config", "num_sms")])
def test_ranks_disagree(what, word):
    """Every rank raises, naming the field and both ranks' values, before anything is sent."""
    for rank, outcome in enumerate(_run_fault(f"disagree_{what}")):
        _raised(outcome, "ValueError", f"[commlib rank {rank}] ranks disagree", f"{word}: rank {1 - rank} has",
                f"rank {rank} has", within=TIMEOUT_S)


def test_bad_input_on_one_rank():
    """The rank with the bad input raises its own error by name; the other says which rank refused."""
    rank0, rank1 = _run_fault("disagree_bad_input_on_one_rank")
    _raised(rank0, "ValueError", "rank 0", "rank(s) [1] rejected", "nothing was sent", within=TIMEOUT_S)
    _raised(rank1, "TypeError", "topk_idx", "int64", within=TIMEOUT_S)


def test_world_reports_a_case_failing_on_one_rank_within_a_minute():
    """Rank 1 fails a case while rank 0 waits in a collective rank 1 never enters: the world stops
    and raises with rank 1's assertion text well before any collective or run timeout."""
    from worlds import run_world
    t0 = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        run_world(2, "cases_worlds", ["passes", "fails_on_rank_1_only", "passes"], timeout_s=600, failed_wait_s=4.0)
    took = time.monotonic() - t0
    msg = str(info.value)
    assert "planted failure on rank 1 only" in msg and "rank 1" in msg and "fails_on_rank_1_only" in msg, msg
    assert "ranks [0] did not finish" in msg, msg
    assert took < 60, f"took {took:.0f} s"


def test_world_collects_failures_of_every_rank_and_moves_on():
    """A case that fails on every rank is reported with each rank's text; the next case still runs."""
    from worlds import run_world
    res = run_world(2, "cases_worlds", ["fails_on_every_rank", "passes"], timeout_s=120)
    assert res["passes"] is None
    assert all(f"planted failure on rank {r}" in res["fails_on_every_rank"] for r in range(2)), res
