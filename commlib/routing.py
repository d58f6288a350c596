"""Gates that produce the routing dispatch consumes.

``group_limited_topk`` is DeepSeek-V3's node-limited gate: experts are split into groups (one
group per node when num_groups = nodes), the top ``topk_groups`` groups are chosen per token by
the sum of their two best scores, and the top-k experts are picked among those groups only, so a
token never reaches more than ``topk_groups`` groups.
"""
from __future__ import annotations

import torch


def group_limited_topk(scores: torch.Tensor, num_groups: int, topk_groups: int, topk: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """scores: [T, E] float -> (topk_idx [T, K] int64, topk_weights [T, K] float32).

    Weights are the chosen scores normalised to sum to 1 per token.
    """
    if scores.dim() != 2:
        raise ValueError(f"group_limited_topk: scores must be [tokens, experts], got {tuple(scores.shape)}")
    T, E = scores.shape
    if num_groups <= 0 or E % num_groups != 0:
        raise ValueError(f"group_limited_topk: num_groups ({num_groups}) must divide num_experts ({E})")
    if not 0 < topk_groups <= num_groups:
        raise ValueError(f"group_limited_topk: topk_groups ({topk_groups}) must be in [1, {num_groups}]")
    per_group = E // num_groups
    if not 0 < topk <= topk_groups * per_group:
        raise ValueError(f"group_limited_topk: topk ({topk}) must be in [1, {topk_groups * per_group}]")
    scores = scores.float()
    grouped = scores.view(T, num_groups, per_group)
    group_score = grouped.topk(min(2, per_group), dim=2).values.sum(dim=2)     # [T, G]
    top_groups = group_score.topk(topk_groups, dim=1).indices                  # [T, topk_groups]
    group_mask = torch.zeros(T, num_groups, dtype=torch.bool, device=scores.device)
    group_mask.scatter_(1, top_groups, True)
    masked = scores.masked_fill(~group_mask.repeat_interleave(per_group, dim=1), float("-inf"))
    weights, idx = masked.topk(topk, dim=1)
    weights = weights / weights.sum(dim=1, keepdim=True)
    return idx.to(torch.int64), weights.to(torch.float32)


def random_scores(num_tokens: int, num_experts: int, generator: torch.Generator | None = None,
                  device: str | torch.device = "cpu") -> torch.Tensor:
    """Positive gate scores (sigmoid of normals), as V3's gate produces."""
    s = torch.randn(num_tokens, num_experts, generator=generator, device="cpu", dtype=torch.float32)
    return torch.sigmoid(s).to(device)
