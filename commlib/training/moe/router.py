"""The router: DeepSeek-V3's sigmoid gate with group-limited top-k.

Legend: T tokens, H hidden, E experts, K top-k.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from commlib.routing import group_limited_topk
from commlib.training.moe.config import MoEConfig


class Router(nn.Module):
    """Sigmoid gate with group-limited top-k (DeepSeek-V3), float32."""

    def __init__(self, cfg: MoEConfig, device=None) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.randn(cfg.num_experts, cfg.hidden, device=device) / math.sqrt(cfg.hidden))

    def forward(self, x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Args: x_TH [T, H], any float dtype (scored in float32).
        Returns: (topk_idx [T, K] int64 global expert ids, topk_weights [T, K] float32, scaled by
        ``routed_scaling``)."""
        scores_TE = torch.sigmoid(F.linear(x_TH.float(), self.weight.float()))
        topk_idx_TK, topk_weights_TK = group_limited_topk(scores_TE, self.cfg.num_groups, self.cfg.topk_groups,
                                                          self.cfg.topk)
        if self.cfg.routed_scaling != 1.0:
            topk_weights_TK = topk_weights_TK * self.cfg.routed_scaling
        return topk_idx_TK, topk_weights_TK.contiguous()
