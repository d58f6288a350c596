"""An independent single-process oracle: from every rank's inputs, what each rank must get.

Written with plain Python loops over tokens, from the definitions (DeepEP's call model), and
importing nothing from commlib: the layout (ranks per token, counts), the channel prefixes, the
group-limited gate and the FP8 E4M3 cast are written here again, so a bug in the library's
vectorised code cannot hide in the oracle.
"""
from __future__ import annotations

import torch

FP8_MAX = 448.0           # largest finite E4M3 (e4m3fn) value
FP8_BLOCK = 128           # channels per float32 scale
FP8_MIN_AMAX = 1e-4       # an all-zero block's amax (its scale is MIN_AMAX / 448)
E4M3_MIN_NORMAL = 2.0 ** -6
E4M3_SUBNORMAL_STEP = 2.0 ** -9
BIG = 2.0 ** 26           # exact in bf16; its float32 ulp (8) swallows any |x| < 4 added to it


def spread(t: torch.Tensor, seed: int, share: float = 0.5) -> torch.Tensor:
    """bf16 ``t`` with about ``share`` of its elements replaced by +-BIG. A float32 sum of such rows
    loses the small terms it adds while a BIG is not yet cancelled, so its bf16 value depends on the
    order of the terms (with plain randn rows every order gives the same bits: the sums are exact)."""
    g = torch.Generator().manual_seed(seed)
    pick = torch.rand(t.shape, generator=g) < share
    sign = torch.where(torch.rand(t.shape, generator=g) < 0.5, -1.0, 1.0)
    return torch.where(pick.to(t.device), (sign * BIG).to(t.device), t.float()).to(torch.bfloat16)


def ranks_of_token(topk_row, num_experts: int, num_ranks: int) -> list[int]:
    per = num_experts // num_ranks
    return sorted({int(e) // per for e in topk_row if int(e) >= 0})


def dispatch_oracle(xs, topk_idxs, topk_ws, num_experts: int, num_ranks: int, me: int, alignment: int = 1):
    """xs[r]: [T_r, H] (any dtype); returns dict with recv rows and metadata for rank ``me``."""
    per = num_experts // num_ranks
    rows, src_idx, src_rank, tk, tw = [], [], [], [], []
    counts = [[0] * num_ranks for _ in range(num_ranks)]
    for s in range(num_ranks):
        for t in range(xs[s].shape[0]):
            dests = ranks_of_token(topk_idxs[s][t].tolist(), num_experts, num_ranks)
            for d in dests:
                counts[s][d] += 1
            if me not in dests:
                continue
            rows.append(xs[s][t])
            src_idx.append(t)
            src_rank.append(s)
            ids = []
            ws = []
            for k, e in enumerate(topk_idxs[s][t].tolist()):
                if e >= 0 and e // per == me:
                    ids.append(e - me * per)
                    ws.append(float(topk_ws[s][t][k]) if topk_ws is not None else 0.0)
                else:
                    ids.append(-1)
                    ws.append(0.0)
            tk.append(ids)
            tw.append(ws)
    H = xs[me].shape[1]
    K = topk_idxs[me].shape[1]
    recv_x = torch.stack(rows) if rows else torch.empty(0, H, dtype=xs[me].dtype)
    per_expert = [0] * per
    for ids in tk:
        for e in ids:
            if e >= 0:
                per_expert[e] += 1
    per_expert = [(c + alignment - 1) // alignment * alignment for c in per_expert]
    prefix = [[0] * num_ranks for _ in range(num_ranks)]
    for i in range(num_ranks):
        for j in range(num_ranks):
            prefix[i][j] = counts[i][j] + (prefix[i - 1][j] if i else 0)
    return {
        "recv_x": recv_x,
        "recv_src_idx": torch.tensor(src_idx, dtype=torch.int32),
        "recv_src_rank": torch.tensor(src_rank, dtype=torch.int32),
        "recv_topk_idx": torch.tensor(tk, dtype=torch.int64).view(-1, K),
        "recv_topk_weights": torch.tensor(tw, dtype=torch.float32).view(-1, K),
        "per_expert": per_expert,
        "rank_prefix_matrix": torch.tensor(prefix, dtype=torch.int32),
        "counts": counts,
    }


def combine_oracle(ys_by_rank, srcs_by_rank, num_tokens: int, hidden: int, me: int, ranks_per_node: int,
                   num_ranks: int, biases=(), dtype=torch.bfloat16, sum_orders=None):
    """ys_by_rank[r]: [N_r, H] rows rank r returns; srcs_by_rank[r]: list of (src_rank, src_idx).

    DeepEP's order: acc = 0 + bias0 + bias1 (float32); one node: + the rows in rank order, or in
    sum_orders[t]'s (an int per token, commlib's DispatchHandle.sum_order: its 8 nibbles, first to
    last, name ranks; a named rank holding a row not yet added is added; then the rest in rank
    order). Several nodes: per node, the rows summed from 0 in local order and rounded to bf16; +
    the node partials in node order. Cast.
    """
    num_nodes = num_ranks // ranks_per_node
    start = torch.zeros(num_tokens, hidden, dtype=torch.float32)
    for b in biases:
        start = start + b.float()
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32)
    # rows of each token, by rank
    rows = [dict() for _ in range(num_ranks)]
    for r in range(num_ranks):
        for i, (s, t) in enumerate(srcs_by_rank[r]):
            if s == me:
                rows[r][t] = ys_by_rank[r][i].float()
    for t in range(num_tokens):
        acc = start[t].clone()
        if num_nodes == 1:
            seq = []
            word = (int(sum_orders[t]) & 0xFFFFFFFF) if sum_orders is not None else 0
            for i in range(8):
                r = (word >> (4 * i)) & 15
                if r < num_ranks and t in rows[r] and r not in seq:
                    seq.append(r)
            seq += [r for r in range(num_ranks) if t in rows[r] and r not in seq]
            for r in seq:
                acc = acc + rows[r][t]
        else:
            for n in range(num_nodes):
                part = torch.zeros(hidden, dtype=torch.float32)
                hit = False
                for p in range(ranks_per_node):
                    r = n * ranks_per_node + p
                    if t in rows[r]:
                        part = part + rows[r][t]
                        hit = True
                if hit:
                    acc = acc + part.to(torch.bfloat16).float()
        out[t] = acc
    return out.to(dtype)


def combine_weights_oracle(ws_by_rank, srcs_by_rank, num_tokens: int, K: int, me: int, ranks_per_node: int,
                           num_ranks: int):
    num_nodes = num_ranks // ranks_per_node
    rows = [dict() for _ in range(num_ranks)]
    for r in range(num_ranks):
        for i, (s, t) in enumerate(srcs_by_rank[r]):
            if s == me:
                rows[r][t] = ws_by_rank[r][i]
    out = torch.zeros(num_tokens, K, dtype=torch.float32)
    for t in range(num_tokens):
        acc = torch.zeros(K, dtype=torch.float32)
        for n in range(num_nodes):
            part = torch.zeros(K, dtype=torch.float32)
            for p in range(ranks_per_node):
                r = n * ranks_per_node + p
                if t in rows[r]:
                    part = part + rows[r][t]
            acc = acc + part if num_nodes > 1 else part
        out[t] = acc
    return out


def min_internode_rows(topk_idxs, num_experts: int, num_ranks: int, ranks_per_node: int) -> int:
    """Rows that must cross between nodes: one per (token, other node it needs)."""
    total = 0
    for s in range(num_ranks):
        home = s // ranks_per_node
        for t in range(topk_idxs[s].shape[0]):
            nodes = {r // ranks_per_node for r in ranks_of_token(topk_idxs[s][t].tolist(), num_experts, num_ranks)}
            total += len(nodes - {home})
    return total


# ---------------------------------------------------------------- layout
def layout(topk_idx, num_experts: int, num_ranks: int, ranks_per_node: int):
    """(num_tokens_per_rank [R], num_tokens_per_rdma_rank [M] or None on one node,
    num_tokens_per_expert [E], is_token_in_rank [T, R]), int32 / bool, by loops over tokens."""
    T = topk_idx.shape[0]
    tir = torch.zeros(T, num_ranks, dtype=torch.bool)
    nte = [0] * num_experts
    for t in range(T):
        for r in ranks_of_token(topk_idx[t].tolist(), num_experts, num_ranks):
            tir[t, r] = True
        for e in topk_idx[t].tolist():
            if e >= 0:
                nte[e] += 1
    ntr = [sum(bool(tir[t, r]) for t in range(T)) for r in range(num_ranks)]
    M = num_ranks // ranks_per_node
    nrr = None
    if M > 1:
        nrr = torch.tensor([sum(any(bool(tir[t, n * ranks_per_node + p]) for p in range(ranks_per_node))
                                for t in range(T)) for n in range(M)], dtype=torch.int32)
    return torch.tensor(ntr, dtype=torch.int32), nrr, torch.tensor(nte, dtype=torch.int32), tir


def channel_of_token(t: int, num_tokens: int, num_channels: int) -> int:
    """Channels own contiguous token ranges of ceil(T / C) tokens (DeepEP's split); the last may be empty."""
    per = -(-num_tokens // num_channels)
    return t // per


def channel_prefix(is_token_in_rank, num_channels: int):
    """[R, C] int32: [r][c] = tokens of channels before c that go to rank r."""
    T, R = is_token_in_rank.shape
    per_channel = [[0] * num_channels for _ in range(R)]
    for t in range(T):
        c = channel_of_token(t, T, num_channels)
        for r in range(R):
            per_channel[r][c] += int(bool(is_token_in_rank[t, r]))
    out = [[sum(per_channel[r][:c]) for c in range(num_channels)] for r in range(R)]
    return torch.tensor(out, dtype=torch.int32).view(R, num_channels)


# ---------------------------------------------------------------- the group-limited gate
def gate(scores, num_groups: int, topk_groups: int, topk: int):
    """DeepSeek-V3's node-limited gate, by loops: groups ranked by the sum of their two best scores
    (the best one for groups of one expert), the ``topk_groups`` best groups kept, the ``topk`` best
    experts among them in descending score order; weights = chosen scores / their sum.
    Returns (topk_idx [T, K] int64, topk_weights [T, K] float32)."""
    T, E = scores.shape
    per = E // num_groups
    idx, ws = [], []
    for t in range(T):
        s = [float(v) for v in scores[t].float().tolist()]
        group_score = [sum(sorted(s[g * per:(g + 1) * per], reverse=True)[:2]) for g in range(num_groups)]
        groups = sorted(range(num_groups), key=lambda g: -group_score[g])[:topk_groups]
        candidates = [e for g in groups for e in range(g * per, (g + 1) * per)]
        chosen = sorted(candidates, key=lambda e: -s[e])[:topk]
        total = sum(s[e] for e in chosen)
        idx.append(chosen)
        ws.append([s[e] / total for e in chosen])
    return (torch.tensor(idx, dtype=torch.int64).view(T, topk), torch.tensor(ws, dtype=torch.float32).view(T, topk))


# ---------------------------------------------------------------- FP8 E4M3, one scale per 128 channels
def e4m3_round(v):
    """Round float values to the nearest E4M3 (e4m3fn) value, ties to even; |v| <= 448 expected.

    Normals (|v| >= 2^-6) keep 3 mantissa bits: the step in [2^e, 2^(e+1)) is 2^(e-3), so the
    rounding error is at most 2^-4 |v|. Subnormals are multiples of 2^-9: error at most 2^-10."""
    v = v.double()
    a = v.abs()
    _, exp = torch.frexp(a.clamp(min=E4M3_MIN_NORMAL))     # a = m * 2^exp, m in [0.5, 1)
    step = torch.ldexp(torch.ones_like(a), (exp - 1 - 3).to(torch.int32))
    rounded = torch.round(a / step) * step                   # torch.round: half to even
    assert bool((rounded <= FP8_MAX).all()), "value beyond E4M3's range"
    return torch.sign(v) * rounded


def cast_fp8(x):
    """x [T, H] (H % 128 == 0) -> (E4M3 [T, H], float32 scales [T, H / 128]).

    scale = max(amax of the 128-channel block, 1e-4) / 448 in float32; each value is x / scale
    (float32) rounded to E4M3 by ``e4m3_round`` (the final dtype conversion is exact)."""
    T, H = x.shape
    blocks = x.float().reshape(T, H // FP8_BLOCK, FP8_BLOCK)
    amax = torch.zeros(T, H // FP8_BLOCK, dtype=torch.float32)
    for t in range(T):
        for b in range(H // FP8_BLOCK):
            amax[t, b] = max(float(blocks[t, b].abs().max()), float(torch.tensor(FP8_MIN_AMAX, dtype=torch.float32)))
    scales = amax / FP8_MAX
    q = e4m3_round(blocks / scales.unsqueeze(2)).float()
    return q.reshape(T, H).to(torch.float8_e4m3fn), scales


def dequant(q, scales, dtype=torch.bfloat16):
    """(E4M3 [T, H], float32 scales [T, H / 128]) -> q * scale (float32), cast to ``dtype``."""
    T, H = q.shape
    return (q.float().reshape(T, -1, FP8_BLOCK) * scales.float().unsqueeze(2)).reshape(T, H).to(dtype)


def fp8_roundtrip_bound(x):
    """Elementwise bound on |x - dequant(cast_fp8(x))| (float32 back): 2^-4 |x| where x / scale is in
    E4M3's normal range, 2^-10 * scale (half the subnormal step) below it; 2^-20 relative slack for
    the float32 divide and multiply around the rounding."""
    T, H = x.shape
    blocks = x.float().reshape(T, H // FP8_BLOCK, FP8_BLOCK)
    scale = blocks.abs().amax(dim=2, keepdim=True).clamp(min=FP8_MIN_AMAX) / FP8_MAX
    normal = blocks.abs() >= E4M3_MIN_NORMAL * scale
    bound = torch.where(normal, blocks.abs() * 2.0 ** -4, scale * 2.0 ** -10 + 0 * blocks)
    return (bound * (1 + 2.0 ** -20)).reshape(T, H)


# ---------------------------------------------------------------- vectorised twins (long runs)
def dispatch_expected(xs, topk_idxs, topk_ws, num_experts: int, num_ranks: int, me: int):
    """``dispatch_oracle`` with tensor ops per source rank instead of loops per token, for runs of
    thousands of rounds (tests/test_units.py pins it to the loop version). Same keys, less "counts"."""
    per = num_experts // num_ranks
    lo, hi = me * per, (me + 1) * per
    rows, src_idx, src_rank, tk, tw, prefix = [], [], [], [], [], []
    for s in range(num_ranks):
        ids = topk_idxs[s]
        owner = torch.where(ids >= 0, ids // per, torch.full_like(ids, -1))
        to_rank = torch.stack([(owner == d).any(1) for d in range(num_ranks)], 1) if ids.shape[0] else \
            torch.zeros(0, num_ranks, dtype=torch.bool)
        prefix.append(to_rank.sum(0) + (prefix[-1] if prefix else 0))
        mine = (ids >= lo) & (ids < hi)
        keep = mine.any(1)
        rows.append(xs[s][keep])
        src_idx.append(torch.nonzero(keep).flatten())
        src_rank.append(torch.full((int(keep.sum()),), s))
        tk.append(torch.where(mine, ids - lo, torch.full_like(ids, -1))[keep])
        if topk_ws is not None:
            tw.append(torch.where(mine, topk_ws[s].float(), torch.zeros_like(topk_ws[s].float()))[keep])
    recv_topk_idx = torch.cat(tk)
    valid = recv_topk_idx[recv_topk_idx >= 0]
    return {
        "recv_x": torch.cat(rows),
        "recv_src_idx": torch.cat(src_idx).to(torch.int32),
        "recv_src_rank": torch.cat(src_rank).to(torch.int32),
        "recv_topk_idx": recv_topk_idx,
        "recv_topk_weights": torch.cat(tw) if tw else None,
        "per_expert": [int((valid == e).sum()) for e in range(per)],
        "rank_prefix_matrix": torch.stack(prefix).to(torch.int32),
    }


def combine_scaled_expected(x, is_token_in_rank, ranks_per_node: int, factors):
    """The combine of rows that every rank r returns as bf16(row * factors[r]) (row = the token's x
    as dispatched), at the token's home rank: float32 sums in rank order on one node; on several,
    per node in local-rank order, rounded to bf16, then the node partials in node order."""
    T, R = is_token_in_rank.shape
    M = R // ranks_per_node
    reached = is_token_in_rank.float()
    acc = torch.zeros(T, x.shape[1])
    for n in range(M):
        part = torch.zeros(T, x.shape[1])
        for p in range(ranks_per_node):
            r = n * ranks_per_node + p
            part = part + reached[:, r:r + 1] * (x.float() * factors[r]).to(torch.bfloat16).float()
        acc = acc + (part.to(torch.bfloat16).float() if M > 1 else part)
    return acc.to(torch.bfloat16)
