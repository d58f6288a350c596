"""Long runs, property-based routing and the "nothing lost" invariant, inside one CPU world."""
from __future__ import annotations

import hashlib
import os

import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

import commlib
import oracle as O

_buffers: dict = {}


def _buffer(ctx, rpn: int, hidden_bytes: int = 512 * 2):
    if rpn not in _buffers:
        cfg = commlib.Buffer.get_dispatch_config(ctx.world_size)
        _buffers[rpn] = commlib.Buffer(ctx.group, cfg.get_nvl_buffer_size_hint(hidden_bytes, rpn),
                                       cfg.get_rdma_buffer_size_hint(hidden_bytes, ctx.world_size),
                                       ranks_per_node=rpn, backend="reference", max_nodes_per_token=8)
    return _buffers[rpn]


def _inputs(seed, rank, T, H, E, K, drop):
    g = torch.Generator().manual_seed(seed * 131 + rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.empty(0, K, dtype=torch.int64)
    if T and drop > 0:
        idx[torch.rand(T, K, generator=g) < drop] = -1
    w = torch.rand(T, K, generator=g)
    return x, idx.contiguous(), w


def round_trip(ctx, buf, seed, Ts, H, E, K, drop, check_oracle=True):
    """One dispatch + combine; returns a hash of this rank's outputs. Checks invariants."""
    R, me = ctx.world_size, ctx.rank
    ins = [_inputs(seed, r, Ts[r], H, E, K, drop) for r in range(R)]
    x, idx, w = ins[me]
    ntr, nrr, nte, tir, _ = buf.get_dispatch_layout(idx, E)
    rx, ri, rw, lst, h, _ = buf.dispatch(x, num_tokens_per_rank=ntr, num_tokens_per_rdma_rank=nrr,
                                         is_token_in_rank=tir, num_tokens_per_expert=nte, topk_idx=idx,
                                         topk_weights=w)
    cx, cw, _ = buf.combine(rx, h, rw)
    # nothing lost: rows received everywhere = (token, destination rank) pairs sent everywhere
    totals = torch.tensor([rx.shape[0], int(tir.sum())], dtype=torch.int64)
    dist.all_reduce(totals)
    assert totals[0] == totals[1], f"rows received {int(totals[0])} != pairs sent {int(totals[1])}"
    # combine returns every token: its rows summed once per rank reached
    k = tir.sum(1, keepdim=True).float()
    assert torch.equal(cx.view(torch.int16), (x.float() * k + 0.0).to(torch.bfloat16).view(torch.int16)) \
        or buf.topology.num_nodes > 1, "combine lost or duplicated a row"
    assert torch.equal(cw, torch.where(idx >= 0, w, torch.zeros_like(w))), "combined weights"
    if check_oracle:
        exp = O.dispatch_oracle([i[0] for i in ins], [i[1] for i in ins], [i[2] for i in ins], E, R, me)
        assert torch.equal(rx.view(torch.int16), exp["recv_x"].view(torch.int16)), "recv_x vs oracle"
        assert torch.equal(ri, exp["recv_topk_idx"]) and torch.equal(rw, exp["recv_topk_weights"])
    digest = hashlib.sha256()
    for t in (rx, ri, rw, cx, cw):
        digest.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def case_long_run(ctx):
    """1,000 rounds with fresh random routing: every round matches the oracle; RSS stays flat."""
    rounds = int(os.environ.get("COMMLIB_TEST_ROUNDS", "1000"))
    buf = _buffer(ctx, 2 if ctx.world_size % 2 == 0 else 1)
    rss = {}
    for i in range(rounds):
        round_trip(ctx, buf, seed=10_000 + i, Ts=[8 + (i + r) % 5 for r in range(ctx.world_size)],
                   H=128, E=16, K=4, drop=0.1, check_oracle=(i % 10 == 0))
        if i + 1 in (rounds // 10, rounds):
            rss[i + 1] = _rss_mb()
    drift = rss[rounds] - rss[rounds // 10]
    if ctx.rank == 0:
        print(f"[stress] {rounds} rounds, RSS {rss} MB, drift {drift:+.1f} MB")
    assert drift < 16, f"RSS grew by {drift:.1f} MB over {rounds} rounds"


@settings(max_examples=int(os.environ.get("COMMLIB_TEST_EXAMPLES", "30")), derandomize=True, database=None,
          phases=[Phase.explicit, Phase.generate], deadline=None, suppress_health_check=list(HealthCheck))
@given(T=st.integers(0, 40), K=st.integers(1, 8), per_rank=st.sampled_from([1, 2, 4, 8]),
       drop=st.sampled_from([0.0, 0.3, 1.0]), H=st.sampled_from([128, 512]), rpn=st.sampled_from([1, 2, 4]),
       seed=st.integers(0, 2**16))
def _property(ctx, T, K, per_rank, drop, H, rpn, seed):
    R = ctx.world_size
    if R % rpn:
        rpn = R
    E = per_rank * R
    K = min(K, E)
    round_trip(ctx, _buffer(ctx, rpn), seed, [(T + 7 * r) % 41 for r in range(R)], H, E, K, drop)


def case_property(ctx):
    """Hypothesis draws the same derandomized examples on every rank (no shrinking: ranks stay in step)."""
    _property(ctx)
