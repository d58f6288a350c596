"""GPU long run (issue: reliability): 10,000 dispatch/combine rounds with fresh random routing on
the NVLink engine, every round hashed against the reference backend on the same inputs, and the
allocated device memory / host RSS compared between round N/10 and round N (drift reported)."""
from __future__ import annotations

import os
import time

import torch

from nvlink_cases import buffers, default_cfg, dev_hash


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def case_long_run(ctx):
    me, dev = ctx.rank, ctx.device
    rounds = int(os.environ.get("COMMLIB_TEST_LONG_ROUNDS", "10000"))
    cfg = default_cfg(recv=64)
    nv, ref = buffers(ctx, key="long")
    E, K, H = 32, 4, 512
    g = torch.Generator(device=dev).manual_seed(777 + me)
    mismatches = torch.zeros((), dtype=torch.int64, device=dev)
    mem, rss = {}, {}
    t0 = time.perf_counter()
    for it in range(rounds):
        T = 32 + it % 97
        idx = torch.rand(T, E, generator=g, device=dev).topk(K, dim=1).indices
        idx[torch.rand(T, K, generator=g, device=dev) < 0.1] = -1
        w = torch.rand(T, K, generator=g, device=dev)
        x = torch.randn(T, H, generator=g, device=dev).to(torch.bfloat16)
        hashes = []
        for buf in (nv, ref):
            ntpr, _, ntpe, tir, _ = buf.get_dispatch_layout(idx, E)
            rx, ridx, rw, _, h, _ = buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=tir,
                                                 num_tokens_per_expert=ntpe, topk_idx=idx, topk_weights=w,
                                                 config=cfg)
            cx, cw, _ = buf.combine(rx, h, topk_weights=rw, config=cfg)
            hashes.append(torch.stack([dev_hash(t) for t in (rx, ridx, rw, cx, cw)]))
        mismatches += (hashes[0] != hashes[1]).any().to(torch.int64)  # no host sync per round
        if it + 1 in (rounds // 10, rounds):
            torch.cuda.synchronize()
            mem[it + 1] = torch.cuda.memory_allocated(dev) / 2**20
            rss[it + 1] = _rss_mb()
    bad = int(mismatches)
    mem_drift = mem[rounds] - mem[rounds // 10]
    rss_drift = rss[rounds] - rss[rounds // 10]
    print(f"[long-run] rank {me}: {rounds} rounds in {time.perf_counter() - t0:.1f} s, mismatching rounds {bad}, "
          f"device memory {mem} MiB (drift {mem_drift:+.2f}), RSS {rss} MiB (drift {rss_drift:+.1f})", flush=True)
    assert bad == 0, f"{bad} of {rounds} rounds differ from the reference"
    assert mem_drift <= 0.5, f"allocated device memory grew by {mem_drift:.2f} MiB"
    assert rss_drift < 64, f"RSS grew by {rss_drift:.1f} MiB"


# ------------------------------------------------------------------------------------------------
# Fault injection: ranks disagree on a dispatch (count-exchange level, never traps; one world)
# ------------------------------------------------------------------------------------------------

def _disagree(ctx, what: str, word: str, seed: int):
    """Rank 1 calls dispatch with a different num_experts / hidden / dtype / Config: every rank raises
    RankDisagreement (CommlibError + ValueError) naming the field and both ranks' values, within the
    timeout, before any data moves; then both ranks run a normal round (still in step, bit-exact)."""
    from commlib.fp8 import per_token_cast_to_fp8
    from commlib.validate import CommlibError
    from nvlink_cases import run_case

    me, dev = ctx.rank, ctx.device
    nv, _ = buffers(ctx)
    cfg = default_cfg()
    E, K, T, H = 32, 4, 24, 256
    g = torch.Generator(device=dev).manual_seed(1000 * seed + me)
    idx = torch.rand(T, E, generator=g, device=dev).topk(K, dim=1).indices
    w = torch.rand(T, K, generator=g, device=dev)
    x = torch.randn(T, H, generator=g, device=dev).to(torch.bfloat16)
    odd = me == 1
    num_experts, xin, call_cfg = E, x, cfg
    if what == "num_experts" and odd:
        num_experts = 2 * E
    elif what == "hidden" and odd:
        xin = torch.randn(T, 2 * H, generator=g, device=dev).to(torch.bfloat16)
    elif what == "dtype" and odd:
        xin = per_token_cast_to_fp8(x)
    elif what == "config" and odd:
        call_cfg = default_cfg(num_sms=10)
    ntpr, _, ntpe, tir, _ = nv.get_dispatch_layout(idx, num_experts)
    timeout = float(os.environ.get("COMMLIB_TIMEOUT_S", "100"))
    t0 = time.monotonic()
    try:
        nv.dispatch(xin, num_tokens_per_rank=ntpr, is_token_in_rank=tir, num_tokens_per_expert=ntpe, topk_idx=idx,
                    topk_weights=w, config=call_cfg)
    except ValueError as e:
        took = time.monotonic() - t0
        msg = str(e)
        assert isinstance(e, CommlibError), f"{type(e).__name__}: {msg}"
        assert "ranks disagree" in msg and word in msg and f"rank {1 - me} has" in msg and f"rank {me} has" in msg, msg
        assert "nothing was sent" in msg, msg
        assert took < timeout, f"raised after {took:.1f} s"
        print(f"[disagree {what}] rank {me}: {msg}", flush=True)
    else:
        raise AssertionError(f"rank {me}: dispatch with ranks disagreeing on {what} did not raise")
    assert nv.backend.failed is None
    run_case(ctx, cfg=cfg, T=30, H=256, seed=80 + seed)  # still in step: results equal the reference


def case_disagree_num_experts(ctx):
    _disagree(ctx, "num_experts", "num_experts", 1)


def case_disagree_hidden(ctx):
    _disagree(ctx, "hidden", "hidden", 2)


def case_disagree_dtype(ctx):
    _disagree(ctx, "dtype", "dtype", 3)


def case_disagree_config(ctx):
    _disagree(ctx, "config", "num_sms", 4)


def case_disagree_combine_sms_is_fine(ctx):
    """Only the channel split (from the handle) shapes a combine: ranks that combine with different
    num_sms are not a disagreement for the NVLink engine (the reference backend would refuse it), so
    no signature check may fire, and the result equals the same combine with equal num_sms."""
    me, dev = ctx.rank, ctx.device
    nv, _ = buffers(ctx)
    cfg = default_cfg()
    E, K, T, H = 32, 4, 40, 256
    g = torch.Generator(device=dev).manual_seed(4242 + me)
    idx = torch.rand(T, E, generator=g, device=dev).topk(K, dim=1).indices
    w = torch.rand(T, K, generator=g, device=dev)
    x = torch.randn(T, H, generator=g, device=dev).to(torch.bfloat16)
    ntpr, _, ntpe, tir, _ = nv.get_dispatch_layout(idx, E)
    rx, _, rw, _, h, _ = nv.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=tir, num_tokens_per_expert=ntpe,
                                     topk_idx=idx, topk_weights=w, config=cfg)
    same, same_w, _ = nv.combine(rx, h, topk_weights=rw, config=cfg)
    mixed, mixed_w, _ = nv.combine(rx, h, topk_weights=rw, config=default_cfg(num_sms=8 if me else 20))
    assert torch.equal(same.view(torch.int16), mixed.view(torch.int16)), "combine differs with per-rank num_sms"
    assert torch.equal(same_w, mixed_w)
