"""Rings on spawned CPU worlds (see worlds.py): any token count flows through a Config's rings.

Each case builds a reference Buffer sized by the size hints only, dispatches and combines token
counts from 0 to 8x the rings (0, 1, ring boundaries k * ring * channels and +-1, DeepEP-style
configs), and compares every output with an expectation written here with plain masks over every
rank's inputs (regenerated from (seed, rank)): no commlib layout helper is used.

Legend: T tokens of a rank, H hidden, K top-k, E experts, R ranks, C channels.
"""
from __future__ import annotations

import random

import torch
import torch.distributed as dist

import commlib
from commlib.config import Config
from commlib.fp8 import per_token_cast_to_fp8

H = 128          # bf16 rows of 256 bytes; FP8 rows of 128 bytes + one scale
E_PER_RANK = 4

# DeepEP's test configuration, SGLang-style tiny chunks, tiny rings (1 channel of 4, 10 channels of 8)
TINY = Config(2, 1, 4)
CONFIGS = {"deepep": Config(24, 6, 256), "tiny": Config(20, 1, 8), "one_channel": TINY}


def _buffer(ctx, configs, ranks_per_node=None):
    """A reference Buffer with just the bytes the configs' size hints ask for (bf16 rows)."""
    R = ctx.world_size
    nvl = max(c.get_nvl_buffer_size_hint(H * 2, R) for c in configs)
    rdma = max(c.get_rdma_buffer_size_hint(H * 2, R, ranks_per_node=ranks_per_node or R) for c in configs)
    return commlib.Buffer(ctx.group, nvl, rdma, backend="reference", ranks_per_node=ranks_per_node,
                          max_nodes_per_token=8)


def _inputs(seed: int, rank: int, T: int, R: int, routing: str):
    """x [T, H] bf16, topk_idx [T, K] int64, topk_weights [T, K] float32 of ``rank``."""
    g = torch.Generator().manual_seed(seed * 7919 + rank)
    E = E_PER_RANK * R
    x = (torch.randn(T, H, generator=g) * (1 + rank)).to(torch.bfloat16)
    if routing == "all":  # every token to every rank: each (source, channel) ring gets the channel's tokens
        K = max(R, 2)
        idx = torch.tensor([[r * E_PER_RANK + (t + r) % E_PER_RANK if r < R else -1 for r in range(K)]
                            for t in range(T)], dtype=torch.int64).view(T, K)
    else:
        K = 4
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else \
            torch.empty(0, K, dtype=torch.int64)
        idx[torch.rand(T, K, generator=g) < 0.2] = -1
    w = torch.rand(T, K, generator=g)
    return x, idx.contiguous(), w.contiguous()


def _expected_dispatch(xs, idxs, ws, R: int, me: int):
    """What rank ``me`` must receive: rows grouped by source rank, token order inside a source."""
    rows, srcs, ids, wts = [], [], [], []
    for s in range(R):
        mine = (idxs[s] >= 0) & (idxs[s] // E_PER_RANK == me)
        hit = mine.any(1)
        rows.append(xs[s][hit])
        srcs.append(torch.nonzero(hit).flatten().to(torch.int32))
        ids.append(torch.where(mine, idxs[s] - me * E_PER_RANK, torch.full_like(idxs[s], -1))[hit])
        wts.append(torch.where(mine, ws[s], torch.zeros_like(ws[s]))[hit])
    return torch.cat(rows), torch.cat(srcs), torch.cat(ids), torch.cat(wts)


def _expected_combine(ys, recv_srcs, idxs, R: int, me: int, ranks_per_node: int):
    """The sum at home of the rows every rank returns: float32 in rank order, on several nodes per
    node first (rounded to bf16), then the node partials in node order."""
    T = idxs[me].shape[0]
    src_rank = [torch.cat([torch.full((int(((idxs[s] >= 0) & (idxs[s] // E_PER_RANK == r)).any(1).sum()),), s)
                           for s in range(R)]) for r in range(R)]
    acc = torch.zeros(T, H, dtype=torch.float32)
    for n in range(R // ranks_per_node):
        part = torch.zeros(T, H, dtype=torch.float32)
        hit = torch.zeros(T, dtype=torch.bool)
        for r in range(n * ranks_per_node, (n + 1) * ranks_per_node):
            from_me = src_rank[r] == me
            tok = recv_srcs[r][from_me].long()
            part[tok] += ys[r][from_me].float()
            hit[tok] = True
        if ranks_per_node == R:
            acc = part
        else:
            acc[hit] += part[hit].to(torch.bfloat16).float()
    return acc.to(torch.bfloat16)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def round_trip(ctx, buf, config: Config, Ts, seed: int, routing: str = "random", fp8: bool = False,
               worst: int = 0, ranks_per_node=None) -> None:
    """Dispatch (fresh and cached) and combine ``Ts[r]`` tokens per rank with ``config``; checks all."""
    R, me = ctx.world_size, ctx.rank
    P = ranks_per_node or R
    ins = [_inputs(seed, r, Ts[r], R, routing) for r in range(R)]
    xs, idxs, ws = [i[0] for i in ins], [i[1] for i in ins], [i[2] for i in ins]
    x, idx, w = ins[me]
    tag = f"[{config} T={Ts} {routing} fp8={fp8} worst={worst} rpn={P}]"
    ntr, nrr, nte, tir, _ = buf.get_dispatch_layout(idx, E_PER_RANK * R)
    x_in = x
    if fp8:
        q = [per_token_cast_to_fp8(xx) if xx.shape[0] else (torch.empty(0, H, dtype=torch.float8_e4m3fn),
                                                              torch.empty(0, H // 128)) for xx in xs]
        x_in, datas, scales = q[me], [a for a, _ in q], [b for _, b in q]
    recv_x, recv_idx, recv_w, per_expert, handle, _ = buf.dispatch(
        x_in, num_tokens_per_rank=ntr, num_tokens_per_rdma_rank=nrr, is_token_in_rank=tir,
        num_tokens_per_expert=nte, topk_idx=idx, topk_weights=w, config=config, num_worst_tokens=worst)
    exp_x, exp_src, exp_ids, exp_w = _expected_dispatch(datas if fp8 else xs, idxs, ws, R, me)
    N = exp_x.shape[0]
    got_x = recv_x[0] if fp8 else recv_x
    if worst:
        assert got_x.shape[0] == worst, f"{tag} padded rows {got_x.shape[0]}"
        assert bool((recv_idx[N:] == -1).all()) and bool((recv_w[N:] == 0).all()), f"{tag} padding"
        got_x, recv_idx, recv_w = got_x[:N], recv_idx[:N], recv_w[:N]
        if fp8:
            recv_x = (recv_x[0][:N], recv_x[1][:N])
    assert _same(got_x, exp_x), f"{tag} recv_x"
    if fp8:
        assert _same(recv_x[1], _expected_dispatch(scales, idxs, ws, R, me)[0]), f"{tag} recv scales"
    assert torch.equal(recv_idx, exp_ids), f"{tag} recv_topk_idx"
    assert torch.equal(recv_w, exp_w), f"{tag} recv_topk_weights"
    assert torch.equal(handle.recv_src_idx[:N], exp_src), f"{tag} recv_src_idx"
    if not worst:
        counts = torch.bincount(exp_ids[exp_ids >= 0], minlength=E_PER_RANK).tolist()
        assert per_expert == counts, f"{tag} per-expert {per_expert} != {counts}"
    # cached dispatch moves the same rows
    again = buf.dispatch(x_in, handle=handle, config=config, num_worst_tokens=worst)[0]
    if fp8:
        assert _same(again[0][:N], got_x) and _same(again[1][:N], recv_x[1]), f"{tag} cached"
    else:
        assert _same(again[:N], got_x), f"{tag} cached"
    if fp8 or worst:
        return
    # combine: every rank returns its rows scaled by (1 + rank / 8), so the summation order shows
    exp_all = [_expected_dispatch(xs, idxs, ws, R, r) for r in range(R)]
    ys = [(e[0].float() * (1 + r / 8)).to(torch.bfloat16) for r, e in enumerate(exp_all)]
    cx, cw, _ = buf.combine(ys[me], handle, recv_w, config=config)
    assert _same(cx, _expected_combine(ys, [e[1] for e in exp_all], idxs, R, me, P)), f"{tag} combine"
    assert torch.equal(cw, torch.where(idx >= 0, w, torch.zeros_like(w))), f"{tag} combined weights"


def _boundaries(config: Config) -> list[int]:
    """0, 1, and k rings per channel (k = 1, 2, 8) with one token less and one more."""
    unit = config.num_channels * config.num_max_nvl_chunked_recv_tokens
    return [0, 1] + [n for k in (1, 2, 8) for n in (k * unit - 1, k * unit, k * unit + 1)]


def case_boundaries(ctx):
    """Token counts at and around the ring boundaries, every token to every rank (each ring fills)."""
    R = ctx.world_size
    buf = _buffer(ctx, [TINY, CONFIGS["tiny"]])
    for config in (TINY, CONFIGS["tiny"]):
        for i, T in enumerate(_boundaries(config)):
            round_trip(ctx, buf, config, [T] * R, seed=10 + i, routing="all")
    buf.destroy()


def case_uneven(ctx):
    """Ranks with different token counts (one with none), random routing, bf16 and FP8, padding."""
    R, me = ctx.world_size, ctx.rank
    config = CONFIGS["tiny"]
    buf = _buffer(ctx, [config])
    ring = config.num_channels * config.num_max_nvl_chunked_recv_tokens
    Ts = [(0 if r == 1 else 3 * ring + 7 * r) for r in range(R)]
    round_trip(ctx, buf, config, Ts, seed=30)
    round_trip(ctx, buf, config, Ts, seed=31, fp8=True)
    worst = sum(Ts)
    round_trip(ctx, buf, config, Ts, seed=32, worst=worst)
    round_trip(ctx, buf, config, Ts, seed=33, fp8=True, worst=worst)
    buf.destroy()
    assert me < R


def case_deepep_config(ctx):
    """DeepEP's test configuration Config(24, 6, 256) with 4,096 tokens (once refused), and 3 * 1024 + 1."""
    R = ctx.world_size
    config = CONFIGS["deepep"]
    buf = _buffer(ctx, [config])
    round_trip(ctx, buf, config, [4096] * R, seed=40)
    round_trip(ctx, buf, config, [3073] * R, seed=41, routing="all")
    default = commlib.Buffer.get_dispatch_config(R)
    if default.get_nvl_buffer_size_hint(H * 2, R) <= buf.num_nvl_bytes:
        round_trip(ctx, buf, default, [4096 + R] * R, seed=42)
    buf.destroy()


def case_nodes(ctx):
    """Emulated nodes (2 ranks each) on the reference backend: the network rings too."""
    R = ctx.world_size
    if R < 4:
        return
    config = CONFIGS["tiny"]
    buf = _buffer(ctx, [config], ranks_per_node=2)
    ring = config.num_channels * config.num_max_nvl_chunked_recv_tokens
    round_trip(ctx, buf, config, [2 * ring + 3] * R, seed=50, ranks_per_node=2)
    buf.destroy()


def case_random_rounds(ctx):
    """Random rounds: random tiny configs, token counts from 0 to 8x the rings, every output checked."""
    R = ctx.world_size
    rng = random.Random(60)  # the same draws on every rank
    configs = [TINY, CONFIGS["tiny"], Config(6, 2, 3), Config(8, 3, 16)]
    buf = _buffer(ctx, configs)
    for i in range(12 if R <= 2 else 6):
        config = rng.choice(configs)
        most = 8 * config.num_channels * config.num_max_nvl_chunked_recv_tokens
        Ts = [rng.randint(0, most) for _ in range(R)]
        round_trip(ctx, buf, config, Ts, seed=100 + i, routing=rng.choice(["random", "all"]))
    buf.destroy()


def case_sizes(ctx):
    """A call checks the rings it uses: a Buffer too small for a config's rings refuses it by name
    (every rank alike, before anything moves), a big ring on a small buffer too; fitting calls run."""
    R = ctx.world_size
    config = CONFIGS["tiny"]
    slot = 384  # 256-byte row + source token + 4 x (id, weight), rounded to 128 bytes
    need = R * config.num_channels * config.num_max_nvl_chunked_recv_tokens * slot
    small = commlib.Buffer(ctx.group, need - 1, backend="reference")
    x, idx, w = _inputs(70, ctx.rank, 5, R, "random")
    lay = dict(zip(("num_tokens_per_rank", "num_tokens_per_rdma_rank", "num_tokens_per_expert", "is_token_in_rank"),
                   small.get_dispatch_layout(idx, E_PER_RANK * R)[:4]))
    try:
        small.dispatch(x, topk_idx=idx, topk_weights=w, config=config, **lay)
    except ValueError as e:
        for word in ("num_nvl_bytes", "get_nvl_buffer_size_hint", "num_max_nvl_chunked_recv_tokens", str(need)):
            assert word in str(e), f"{e!r} does not mention {word!r}"
    else:
        raise AssertionError("a Buffer one byte short of the rings took the call")
    small.destroy()
    exact = commlib.Buffer(ctx.group, need, backend="reference")
    round_trip(ctx, exact, config, [3 * config.num_channels * 8 + r for r in range(R)], seed=71)
    exact.destroy()
    dist.barrier(ctx.group)
