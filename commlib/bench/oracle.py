"""The benchmarks' oracle: what every rank must receive and get back, from the inputs alone.

Written from the contract (DeepEP's dispatch / combine), in plain torch, importing nothing of
commlib: not the layout, routing, FP8 or backend code the benchmarks check. A bug there cannot
hide here by being shared. The routing functions take every rank's inputs (each rank rebuilds its
peers' from their seeds) and answer for one rank.

The contract, as this module states it:
  * experts are split in contiguous blocks, E / R per rank: rank r owns [r E/R, (r + 1) E/R);
  * a token goes to a rank once if any of its top-k slots names an expert there (-1 = empty slot);
  * rank r receives rows grouped by source rank in rank order, token order within a source;
  * a received row carries the slots of experts on r as local ids (global - r E/R) with their
    weights; other slots read -1 with weight 0;
  * tokens per local expert count the (row, slot) pairs naming it;
  * channels: a rank's T tokens are cut into C contiguous ranges of ceil(T / C) tokens;
  * combine: the home rank gets, per token, the float32 sum in rank order of the rows every
    rank returned for it, cast once to the rows' dtype; weights come back as sent (0 in -1 slots);
  * FP8: E4M3 (finite, max 448), one float32 scale per 128 channels of a token, scale = amax / 448
    with amax floored at 1e-4, value = x / scale (float32) rounded to nearest, ties to even,
    saturating at 448.

Legend: T tokens of a rank, H hidden, K top-k slots, E experts, R ranks, L = E / R local
experts, C channels, N rows a rank receives.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

E4M3_MAX = 448.0
FP8_BLOCK = 128
AMAX_FLOOR = 1e-4


# ------------------------------------------------------------------------------ routing
def owner_table(num_experts: int, num_ranks: int, device=None) -> torch.Tensor:
    """[E] int64: the rank that holds each expert (a lookup table, E / R entries per rank)."""
    if num_ranks <= 0 or num_experts % num_ranks:
        raise ValueError(f"oracle: experts ({num_experts}) must split evenly over ranks ({num_ranks})")
    per = num_experts // num_ranks
    return torch.arange(num_ranks, device=device).repeat_interleave(per)


def destinations(topk_idx_TK: torch.Tensor, num_experts: int, num_ranks: int) -> torch.Tensor:
    """[T, R] bool: token t has at least one slot naming an expert on rank r."""
    owner = owner_table(num_experts, num_ranks, topk_idx_TK.device)
    valid_TK = topk_idx_TK >= 0
    rank_TK = owner[topk_idx_TK.clamp(min=0)]
    ranks_R = torch.arange(num_ranks, device=topk_idx_TK.device)
    hit_TKR = (rank_TK.unsqueeze(-1) == ranks_R) & valid_TK.unsqueeze(-1)
    return hit_TKR.any(dim=1)


def tokens_to(topk_idxs: Sequence[torch.Tensor], num_experts: int, rank: int) -> list[torch.Tensor]:
    """Per source rank s: [n_s] int64 token indices of s whose rows ``rank`` receives, in order."""
    R = len(topk_idxs)
    return [destinations(idx, num_experts, R)[:, rank].nonzero().flatten() for idx in topk_idxs]


def gather(per_rank: Sequence[torch.Tensor], tokens: Sequence[torch.Tensor]) -> torch.Tensor:
    """Rows ``per_rank[s][tokens[s]]`` for every source s, concatenated in rank order."""
    fp8 = per_rank[0].is_floating_point() and per_rank[0].element_size() == 1
    parts = [(t.view(torch.uint8) if fp8 else t)[i.to(t.device)] for t, i in zip(per_rank, tokens)]
    out = torch.cat(parts, dim=0)
    return out.view(per_rank[0].dtype) if fp8 else out  # FP8: indexed and joined as bytes


def local_expert_ids(topk_idx_NK: torch.Tensor, rank: int, num_experts: int, num_ranks: int) -> torch.Tensor:
    """[N, K] int64: local id of each slot naming an expert on ``rank``, else -1."""
    owner = owner_table(num_experts, num_ranks, topk_idx_NK.device)
    first = int((owner == rank).nonzero()[0])
    valid = topk_idx_NK >= 0
    mine = valid & (owner[topk_idx_NK.clamp(min=0)] == rank)
    return torch.where(mine, topk_idx_NK - first, torch.full_like(topk_idx_NK, -1))


def tokens_per_local_expert(local_ids_NK: torch.Tensor, num_local: int) -> list[int]:
    """(row, slot) pairs naming each local expert."""
    ids = local_ids_NK.reshape(-1).tolist()
    counts = [0] * num_local
    for e in ids:
        if e >= 0:
            counts[e] += 1
    return counts


def rank_prefix_matrix(topk_idxs: Sequence[torch.Tensor], num_experts: int) -> torch.Tensor:
    """[R, R] int32: [i][j] = rows ranks 0..i send to rank j (inclusive over sources)."""
    R = len(topk_idxs)
    out = torch.zeros(R, R, dtype=torch.int64, device="cpu")
    run = [0] * R
    for i, idx in enumerate(topk_idxs):
        sent = destinations(idx, num_experts, R).sum(dim=0).tolist()
        for j in range(R):
            run[j] += int(sent[j])
            out[i, j] = run[j]
    return out.to(torch.int32)


def channel_prefix_matrix(topk_idx_TK: torch.Tensor, num_experts: int, num_ranks: int,
                          num_channels: int) -> torch.Tensor:
    """[R, C] int32: rows this rank sends to rank r from the channels before c."""
    dest = destinations(topk_idx_TK, num_experts, num_ranks).cpu()
    T = dest.shape[0]
    per = -(-T // num_channels) if num_channels else 0
    out = torch.zeros(num_ranks, num_channels, dtype=torch.int32, device="cpu")
    for c in range(num_channels):
        lo = min(c * per, T)
        out[:, c] = dest[:lo].sum(dim=0).to(torch.int32)
    return out


# ------------------------------------------------------------------------------ combine
def combine(rows_by_rank: Sequence[torch.Tensor], tokens_by_rank: Sequence[Sequence[torch.Tensor]], rank: int,
            num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``rank`` gets back when every rank r returns rows ``rows_by_rank[r]`` (in the order r
    received them; ``tokens_by_rank[r][s]`` = source-s tokens behind r's rows from s).

    Returns (combined [T, H] in the rows' dtype: float32 sum in rank order, cast once; sum_abs
    [T, H] float32 of the summed terms' magnitudes, for bounds where partial sums are rounded).
    """
    H = rows_by_rank[0].shape[1]
    dev = rows_by_rank[0].device
    acc = torch.zeros(num_tokens, H, dtype=torch.float32, device=dev)
    mag = torch.zeros(num_tokens, H, dtype=torch.float32, device=dev)
    for r, rows in enumerate(rows_by_rank):
        before = sum(int(t.numel()) for t in tokens_by_rank[r][:rank])
        mine = tokens_by_rank[r][rank].to(dev)
        block = rows[before:before + mine.numel()].float().to(dev)
        acc[mine] += block      # one rank at a time: each token at most once per rank
        mag[mine] += block.abs()
    return acc.to(rows_by_rank[0].dtype), mag


# ------------------------------------------------------------------------------ FP8
def _e4m3_bits(v: torch.Tensor) -> torch.Tensor:
    """float32 -> uint8 E4M3 (fn) codes: round to nearest, ties to even; past 448 in magnitude
    saturates to 448 (0x7e). NaN inputs are out of scope (the cast never makes one)."""
    a = v.abs()
    _, e = torch.frexp(a)                     # a = m 2^e, m in [0.5, 1): a in [2^(e-1), 2^e)
    e = (e - 1).clamp(min=-6)                 # binade exponent; below 2^-6 the subnormal step 2^-9
    step = torch.ldexp(torch.ones_like(a), e - 3)
    q = torch.round(a / step) * step          # 3 mantissa bits; torch.round ties to even
    _, e2 = torch.frexp(q)
    e2 = e2 - 1
    normal = q >= 2.0 ** -6
    exp_field = torch.where(normal, e2 + 7, torch.zeros_like(e2))
    mant = torch.where(normal, q / torch.ldexp(torch.ones_like(q), e2) * 8 - 8, q / 2.0 ** -9)
    code = exp_field.to(torch.int32) * 8 + mant.to(torch.int32)
    code = torch.where(q > E4M3_MAX, torch.full_like(code, 0x7E), code)
    code = code + torch.signbit(v).to(torch.int32) * 0x80
    return code.to(torch.uint8)


def cast_fp8(x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] (H % 128 == 0) -> (E4M3 [T, H] float8_e4m3fn, float32 scales [T, H / 128])."""
    T, H = x_TH.shape
    if H % FP8_BLOCK:
        raise ValueError(f"oracle.cast_fp8: hidden ({H}) must be a multiple of {FP8_BLOCK}")
    blocks = x_TH.float().reshape(T, H // FP8_BLOCK, FP8_BLOCK)
    amax = torch.maximum(blocks.abs().amax(dim=2), torch.tensor(AMAX_FLOOR, dtype=torch.float32,
                                                                device=x_TH.device))
    scales = amax / E4M3_MAX
    bits = _e4m3_bits(blocks / scales.unsqueeze(2))
    return bits.reshape(T, H).view(torch.float8_e4m3fn), scales


# ------------------------------------------------------------------------------ one rank's expectation
def expected_dispatch(xs: Sequence, topk_idxs: Sequence[torch.Tensor], topk_weights: Sequence[torch.Tensor],
                      num_experts: int, rank: int, num_channels: Optional[int] = None) -> dict:
    """What ``rank`` receives from dispatch. xs[s]: [T_s, H] of any dtype, or (x_fp8, scales).

    Returns recv_x (or recv_x_fp8 + recv_scales), recv_src_idx [N] int32, recv_topk_idx [N, K],
    recv_topk_weights [N, K], tokens_per_expert (list of L ints), rank_prefix_matrix [R, R], and
    with ``num_channels``: channel_prefix_matrix (this rank's) and recv_channel_prefix_matrix
    (row s = source s's channel prefix towards ``rank``); tokens (per source, for ``combine``).
    """
    R = len(topk_idxs)
    toks = tokens_to(topk_idxs, num_experts, rank)
    out: dict = {"tokens": toks}
    if isinstance(xs[0], (tuple, list)):
        out["recv_x_fp8"] = gather([x[0] for x in xs], toks)
        out["recv_scales"] = gather([x[1] for x in xs], toks)
    else:
        out["recv_x"] = gather(xs, toks)
    out["recv_src_idx"] = torch.cat([t.cpu() for t in toks]).to(torch.int32)
    glob = gather(topk_idxs, toks)
    local = local_expert_ids(glob, rank, num_experts, R)
    out["recv_topk_idx"] = local
    w = gather(topk_weights, toks)
    out["recv_topk_weights"] = torch.where(local >= 0, w, torch.zeros_like(w))
    out["tokens_per_expert"] = tokens_per_local_expert(local, num_experts // R)
    out["rank_prefix_matrix"] = rank_prefix_matrix(topk_idxs, num_experts)
    if num_channels is not None:
        out["channel_prefix_matrix"] = channel_prefix_matrix(topk_idxs[rank], num_experts, R, num_channels)
        out["recv_channel_prefix_matrix"] = torch.stack(
            [channel_prefix_matrix(topk_idxs[s], num_experts, R, num_channels)[rank] for s in range(R)])
    return out
