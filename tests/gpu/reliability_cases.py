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
