"""Long runs, property-based routing and the "nothing lost" invariant, inside one CPU world.

Every round, on every topology the world is cut into (one node, and emulated nodes of 2 and 1
ranks), checks dispatch (rows, expert ids, weights, per-expert counts, rank prefix matrix, source
indices) against the oracle and combine against its closed form, with rows scaled per rank so the
summation order and the node-level bf16 rounding matter.
"""
from __future__ import annotations

import os

import oracle as O
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import commlib

_buffers: dict = {}

# The property test's examples: each one runs on every topology of the world (pinned, derandomized).
PROPERTY_EXAMPLES = 30
_examples_run = []


def topologies(world: int) -> list[int]:
    """Ranks per node: one node, then emulated nodes of 2 ranks and of 1 rank (where they divide)."""
    return [p for p in dict.fromkeys((world, 2, 1)) if world % p == 0]


def _buffer(ctx, rpn: int, hidden_bytes: int = 512 * 2):
    if rpn not in _buffers:
        cfg = commlib.Buffer.get_dispatch_config(ctx.world_size)
        _buffers[rpn] = commlib.Buffer(ctx.group, cfg.get_nvl_buffer_size_hint(hidden_bytes, rpn),
                                       cfg.get_rdma_buffer_size_hint(hidden_bytes, ctx.world_size),
                                       ranks_per_node=rpn, backend="reference", max_nodes_per_token=8)
    return _buffers[rpn]


def _inputs(seed, rank, T, H, E, K, drop):
    """Random routing; a token's first slot is never dropped, so every token reaches some rank."""
    g = torch.Generator().manual_seed(seed * 131 + rank)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.empty(0, K, dtype=torch.int64)
    if T and drop > 0:
        dropped = torch.rand(T, K, generator=g) < drop
        dropped[:, 0] = False
        idx[dropped] = -1
    w = torch.rand(T, K, generator=g)
    return x, idx.contiguous(), w


def round_trip(ctx, buf, seed, Ts, H, E, K, drop) -> int:
    """One dispatch + combine, both checked against the oracle; returns the rows this rank received."""
    R, me = ctx.world_size, ctx.rank
    P = buf.topology.ranks_per_node
    tag = f"[seed {seed} rpn {P} Ts {Ts} H {H} E {E} K {K} drop {drop}]"
    ins = [_inputs(seed, r, Ts[r], H, E, K, drop) for r in range(R)]
    x, idx, w = ins[me]
    ntr, nrr, nte, tir, _ = buf.get_dispatch_layout(idx, E)
    rx, ri, rw, lst, h, _ = buf.dispatch(x, num_tokens_per_rank=ntr, num_tokens_per_rdma_rank=nrr,
                                         is_token_in_rank=tir, num_tokens_per_expert=nte, topk_idx=idx,
                                         topk_weights=w)
    exp = O.dispatch_expected([i[0] for i in ins], [i[1] for i in ins], [i[2] for i in ins], E, R, me)
    assert torch.equal(rx.view(torch.int16), exp["recv_x"].view(torch.int16)), f"{tag} recv_x"
    assert torch.equal(ri, exp["recv_topk_idx"]), f"{tag} recv_topk_idx"
    assert torch.equal(rw, exp["recv_topk_weights"]), f"{tag} recv_topk_weights"
    assert lst == exp["per_expert"], f"{tag} per-expert counts {lst} != {exp['per_expert']}"
    assert torch.equal(h.rank_prefix_matrix, exp["rank_prefix_matrix"]), f"{tag} rank_prefix_matrix"
    assert torch.equal(h.recv_src_idx, exp["recv_src_idx"]), f"{tag} recv_src_idx"

    factors = [1 + r / 8 for r in range(R)]
    y = (rx.float() * factors[me]).to(torch.bfloat16)
    cx, cw, _ = buf.combine(y, h, rw)
    exp_cx = O.combine_scaled_expected(x, tir, P, factors)
    assert torch.equal(cx.view(torch.int16), exp_cx.view(torch.int16)), f"{tag} combined x"
    assert torch.equal(cw, torch.where(idx >= 0, w, torch.zeros_like(w))), f"{tag} combined weights"
    # nothing lost: rows received everywhere = (token, destination rank) pairs sent everywhere
    totals = torch.tensor([rx.shape[0], int(tir.sum())], dtype=torch.int64)
    dist.all_reduce(totals)
    assert totals[0] == totals[1], f"{tag} rows received {int(totals[0])} != pairs sent {int(totals[1])}"
    return int(totals[0])


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def case_long_run(ctx):
    """1,000 rounds with fresh random routing, cycling through one node and emulated 2- and 1-rank
    nodes: every round's dispatch and combine match the oracle; RSS stays flat."""
    rounds = int(os.environ.get("COMMLIB_TEST_ROUNDS", "1000"))
    topos = topologies(ctx.world_size)
    bufs = [_buffer(ctx, p) for p in topos]
    rss, rows = {}, 0
    for i in range(rounds):
        rows += round_trip(ctx, bufs[i % len(bufs)], seed=10_000 + i,
                           Ts=[4 + (i + r) % 5 for r in range(ctx.world_size)], H=128, E=16, K=4, drop=0.1)
        if i + 1 in (rounds // 10, rounds):
            rss[i + 1] = _rss_mb()
    drift = rss[rounds] - rss[rounds // 10]
    if ctx.rank == 0:
        print(f"[stress] {rounds} rounds over ranks per node {topos}, {rows} rows, RSS {rss} MB, "
              f"drift {drift:+.1f} MB")
    assert drift < 16, f"RSS grew by {drift:.1f} MB over {rounds} rounds"


@settings(max_examples=PROPERTY_EXAMPLES, derandomize=True, database=None, phases=[Phase.explicit, Phase.generate],
          deadline=None, suppress_health_check=list(HealthCheck))
@given(T=st.integers(1, 40), K=st.integers(1, 8), per_rank=st.sampled_from([1, 2, 4, 8]),
       drop=st.sampled_from([0.0, 0.3, 1.0]), H=st.sampled_from([128, 512]), seed=st.integers(0, 2**16))
def _property(ctx, T, K, per_rank, drop, H, seed):
    R = ctx.world_size
    E = per_rank * R
    K = min(K, E)
    Ts = [T] + [(T + 7 * r) % 41 for r in range(1, R)]  # rank 0 always has tokens; others may have none
    for p in topologies(R):
        assert round_trip(ctx, _buffer(ctx, p), seed, Ts, H, E, K, drop) > 0
    _examples_run.append((T, K, per_rank, drop, H, seed))


def case_property(ctx):
    """PROPERTY_EXAMPLES (30) derandomized hypothesis examples, the same on every rank (no shrinking:
    ranks stay in step), each run on every topology (3 on 4 ranks: 90 checked round trips). Every
    example carries data: rank 0 has at least one token and a token's first top-k slot is never
    dropped."""
    _examples_run.clear()
    _property(ctx)
    assert len(_examples_run) == PROPERTY_EXAMPLES, f"hypothesis ran {len(_examples_run)} examples"
    if ctx.rank == 0:
        print(f"[stress] property: {len(_examples_run)} examples x topologies {topologies(ctx.world_size)}, "
              f"first {_examples_run[0]}, last {_examples_run[-1]}")
