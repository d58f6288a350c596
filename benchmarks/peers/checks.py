"""bench_peers' checks of each engine's outputs against the NCCL all-to-all oracle (commlib.bench.baseline):
received rows bit for bit up to row order, keyed by source rank and token; combined rows within BF16
rounding. Plain tensors: CPU-testable.

Legend: T tokens of a rank, H hidden, N rows a rank received, R ranks.
"""
from __future__ import annotations

import torch

from commlib.bench import baseline



def source_of_rows(rank_prefix_matrix: torch.Tensor, rank: int) -> torch.Tensor:
    """[N] int64 source rank of each received row: rows arrive grouped by source in rank order, and
    ``rank_prefix_matrix[s][rank]`` counts the rows of sources 0..s (DeepEP's handle[0])."""
    upto = rank_prefix_matrix[:, rank].to(torch.int64).cpu()
    counts = torch.diff(upto, prepend=torch.zeros(1, dtype=torch.int64))
    return torch.repeat_interleave(torch.arange(len(counts)), counts)


def wrong_up_to_row_order(got: torch.Tensor | None, src_rank: torch.Tensor, src_idx: torch.Tensor,
                          want: torch.Tensor) -> int:
    """Elements of ``got`` ([N, ...]) that differ bit-wise from ``want``, the oracle's rows ordered by
    (source rank, source token), after ordering ``got``'s rows the same way; every element of
    ``want`` when the row counts differ or two rows claim the same source token."""
    n = want.shape[0]
    if got is None or got.shape[0] != n or src_rank.numel() != n or src_idx.numel() != n:
        return int(want.numel())
    key = src_rank.to(torch.int64).cpu() * (1 << 32) + src_idx.to(torch.int64).cpu()
    order = torch.argsort(key)
    key = key[order]
    if n > 1 and not bool((key[1:] > key[:-1]).all()):
        return int(want.numel())
    return baseline.count_wrong(got[order.to(got.device)], want)


def wrong_rows(got, handle, rank: int, want) -> int:
    """``wrong_up_to_row_order`` for a dispatch output (BF16 rows, or (FP8 rows, scales) against the
    oracle's pair), keyed by the handle's rank prefix matrix and recv_src_idx (DeepEP's handle[0], [3])."""
    src_rank, src_idx = source_of_rows(handle[0], rank), handle[3]
    if isinstance(want, tuple):
        if not isinstance(got, tuple):
            return int(want[0].numel() + want[1].numel())
        return sum(wrong_up_to_row_order(g, src_rank, src_idx, w) for g, w in zip(got, want))
    return wrong_up_to_row_order(got[0] if isinstance(got, tuple) else got, src_rank, src_idx, want)


def wrong_combined(got: torch.Tensor | None, want: torch.Tensor, x: torch.Tensor, is_token_in_rank: torch.Tensor) -> int:
    """Elements of a combined [T, H] output outside BF16 rounding of the oracle's: one rounding of a
    partial sum (2^-8 of the summed magnitudes) plus the final cast (commlib.bench.baseline)."""
    sum_abs = x.float().abs() * is_token_in_rank.sum(dim=1, keepdim=True).to(x.device).float()
    return baseline.count_wrong_close(got, want, sum_abs, partial_roundings=1)
