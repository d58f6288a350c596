"""Routing -> counts: the layout every backend agrees on, written with plain torch ops.

Legend: T tokens on this rank, K top-k slots, E experts, R ranks, C channels, M nodes.
These functions are the specification the GPU layout kernel is tested against.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from commlib.topology import Topology
from commlib.utils.math import align_up

topk_idx_t = torch.int64


@dataclasses.dataclass
class Layout:
    num_tokens_per_rank: torch.Tensor        # [R] int32
    num_tokens_per_rdma_rank: Optional[torch.Tensor]  # [M] int32, None on one node
    num_tokens_per_expert: torch.Tensor      # [E] int32
    is_token_in_rank: torch.Tensor           # [T, R] bool


def expert_ranks(topk_idx_TK: torch.Tensor, num_experts: int, num_ranks: int) -> torch.Tensor:
    """[T, K] int64: rank owning each selected expert, -1 for empty (-1) slots."""
    experts_per_rank = num_experts // num_ranks
    ranks = torch.div(topk_idx_TK, experts_per_rank, rounding_mode="floor")
    return torch.where(topk_idx_TK >= 0, ranks, torch.full_like(ranks, -1))


def token_in_rank(topk_idx_TK: torch.Tensor, num_experts: int, num_ranks: int) -> torch.Tensor:
    """[T, R] bool: does token t have at least one expert on rank r."""
    ranks_TK = expert_ranks(topk_idx_TK, num_experts, num_ranks)
    valid_TK = ranks_TK >= 0
    hits_TR = torch.zeros(topk_idx_TK.shape[0], num_ranks, dtype=torch.int32, device=topk_idx_TK.device)
    hits_TR.scatter_add_(1, ranks_TK.clamp(min=0), valid_TK.to(torch.int32))
    return hits_TR > 0


def token_in_node(is_token_in_rank_TR: torch.Tensor, topo: Topology) -> torch.Tensor:
    """[T, M] bool: does token t have at least one expert on node m."""
    T = is_token_in_rank_TR.shape[0]
    return is_token_in_rank_TR.view(T, topo.num_nodes, topo.ranks_per_node).any(dim=2)


def dispatch_layout(topk_idx_TK: torch.Tensor, num_experts: int, topo: Topology) -> Layout:
    is_token_in_rank_TR = token_in_rank(topk_idx_TK, num_experts, topo.num_ranks)
    num_tokens_per_rank = is_token_in_rank_TR.sum(dim=0, dtype=torch.int32)
    valid = topk_idx_TK[topk_idx_TK >= 0]
    num_tokens_per_expert = torch.bincount(valid, minlength=num_experts).to(torch.int32)
    num_tokens_per_rdma_rank = None
    if topo.num_nodes > 1:
        num_tokens_per_rdma_rank = token_in_node(is_token_in_rank_TR, topo).sum(dim=0, dtype=torch.int32)
    return Layout(num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank_TR)


def channel_starts(num_tokens: int, num_channels: int) -> list[int]:
    """Start token of each channel, plus the end: channel c owns [starts[c], starts[c+1]).

    Tokens are split into contiguous ranges of ceil(T / C) tokens (the last ranges may be empty).
    """
    per = channel_size(num_tokens, num_channels)
    return [min(c * per, num_tokens) for c in range(num_channels)] + [num_tokens]


def channel_size(num_tokens: int, num_channels: int) -> int:
    """Tokens per channel range: ceil(T / C), 0 without channels."""
    return (num_tokens + num_channels - 1) // num_channels if num_channels > 0 else 0


def channel_prefix_matrix(is_token_in_rank_TR: torch.Tensor, num_channels: int) -> torch.Tensor:
    """[R, C] int32: tokens this rank sends to rank r from channels before c (exclusive prefix)."""
    T, R = is_token_in_rank_TR.shape
    cum = torch.zeros(T + 1, R, dtype=torch.int32, device=is_token_in_rank_TR.device)
    cum[1:] = torch.cumsum(is_token_in_rank_TR.to(torch.int32), dim=0)
    # channel_starts(T, C)[:-1], made on the device (no host -> device copy, so no stream sync)
    per = channel_size(T, num_channels)
    starts = torch.clamp(torch.arange(num_channels, dtype=torch.int64, device=cum.device) * per, max=T)
    # Not .contiguous(): with one channel the transpose is [R, 1] with strides (1, R), which PyTorch
    # already calls contiguous (size-1 dims are ignored), so it would stay as is and a dtype view
    # (stride(-1) must be 1) fails. An explicit contiguous_format clone always gets strides (C, 1).
    return cum.index_select(0, starts).t().clone(memory_format=torch.contiguous_format)


def recv_channel_prefix(recv_src_idx: torch.Tensor, rank_prefix_col: torch.Tensor, num_tokens_of: torch.Tensor,
                        num_channels: int) -> torch.Tensor:
    """[R, C] int32: what ``channel_prefix_matrix`` gives source s for this rank (row s: rows from s out
    of its channels before c), worked out where the rows landed instead of sent along.

    ``recv_src_idx`` [N]: the received rows, grouped by source and in token order within one (rows
    past the received count: any value); ``rank_prefix_col`` [R]: rows received from sources <= s
    (the rank prefix matrix's column of this rank); ``num_tokens_of`` [R]: every source's token count.
    A row from s counts for channel c when its token is below s's channel start c: ceil(T_s / C) * c.
    """
    R, dev = rank_prefix_col.shape[0], recv_src_idx.device
    N = recv_src_idx.shape[0]
    ends = rank_prefix_col.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    src = torch.searchsorted(ends, torch.arange(N, dtype=torch.int64, device=dev), right=True)   # R past the rows
    T = num_tokens_of.to(torch.int64)
    span = T.max().clamp(min=0) + 2 if R else T.new_ones(())
    keys = src * span + recv_src_idx.to(torch.int64).clamp(min=-1) + 1          # sorted: (source, token)
    per = (T + num_channels - 1) // num_channels                                # channel_size per source
    c = torch.arange(num_channels, dtype=torch.int64, device=dev)
    bounds = torch.minimum(per.view(R, 1) * c.view(1, num_channels), T.view(R, 1))
    queries = torch.arange(R, dtype=torch.int64, device=dev).view(R, 1) * span + bounds + 1
    return (torch.searchsorted(keys, queries.flatten()).view(R, num_channels) - starts.view(R, 1)).to(torch.int32)


def rows_before(is_token_in_rank_TR: torch.Tensor) -> torch.Tensor:
    """[T, R] int32: tokens before t that also go to rank r (t's row among this rank's rows for r).

    The scan runs along the contiguous dim of the [R, T] transpose: torch's CUDA scan over the outer
    dim of a [T, R] tensor gives each of the R columns one thread (~0.9 ms at T = 16384, R = 2 on an
    H200, measured in bench_overlap's kernel profile), the inner-dim scan is parallel."""
    in_rank = is_token_in_rank_TR.t().to(torch.int32).contiguous()
    before = torch.cumsum(in_rank, dim=1, dtype=torch.int32) - in_rank
    return before.t().contiguous()


def send_head(is_token_in_rank_TR: torch.Tensor, rank_prefix_matrix_RR: torch.Tensor, rank: int,
              before: torch.Tensor | None = None) -> torch.Tensor:
    """[T, R] int32: row of token t in rank r's recv_x (-1 if not sent there).

    Rows on rank r are grouped by source rank, so token t of rank `rank` lands after all rows
    from lower ranks (rank_prefix_matrix[rank-1][r]) plus the tokens before t that also go to r.
    """
    before = rows_before(is_token_in_rank_TR) if before is None else before  # rows_before, if computed
    base = rank_prefix_matrix_RR[rank - 1] if rank > 0 else torch.zeros_like(rank_prefix_matrix_RR[0])
    head = before + base.to(torch.int32).unsqueeze(0)
    return torch.where(is_token_in_rank_TR, head, torch.full_like(head, -1)).to(torch.int32)


def local_expert_ids(topk_idx_NK: torch.Tensor, rank: int, num_local_experts: int) -> torch.Tensor:
    """Global expert ids -> this rank's local ids; -1 for experts elsewhere (and for -1 slots)."""
    local = topk_idx_NK - rank * num_local_experts
    keep = (topk_idx_NK >= 0) & (local >= 0) & (local < num_local_experts)
    return torch.where(keep, local, torch.full_like(local, -1))


def tokens_per_expert_list(recv_topk_idx_NK: torch.Tensor, num_local_experts: int, expert_alignment: int) -> list[int]:
    """Received tokens per local expert, each rounded up to a multiple of expert_alignment."""
    valid = recv_topk_idx_NK[recv_topk_idx_NK >= 0]
    counts = torch.bincount(valid.cpu(), minlength=num_local_experts).tolist()
    return [align_up(c, expert_alignment) for c in counts]
