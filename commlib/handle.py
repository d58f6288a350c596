"""The routing handle that dispatch returns and combine (or a cached dispatch) reuses.

Legend: T = tokens on this rank, R = ranks, C = channels of the dispatch config, N = rows this
rank received. Positional order follows DeepEP's intranode handle, so code that reads
``handle[0]`` (the rank prefix matrix) keeps working; every field also has a name.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from commlib.topology import Topology


@dataclasses.dataclass
class DispatchHandle:
    # --- positional part (DeepEP order) ---
    rank_prefix_matrix: torch.Tensor          # [R, R] int32: [i][j] = tokens ranks 0..i send to rank j
    channel_prefix_matrix: torch.Tensor       # [R, C] int32: tokens this rank sends to rank r from channels < c
    recv_channel_prefix_matrix: torch.Tensor  # [R, C] int32: rows this rank got from source s from channels < c
    recv_src_idx: torch.Tensor                # [N] int32: index of each received row's token on its source rank
    is_token_in_rank: torch.Tensor            # [T, R] bool
    send_head: torch.Tensor                   # [T, R] int32: row of token t in rank r's recv_x, -1 if not sent
    # --- named-only part ---
    topology: Topology = None                 # type: ignore[assignment]
    num_tokens: int = 0                       # T
    hidden: int = 0
    num_experts: int = 0
    num_channels: int = 0                     # C
    num_recv_tokens: Optional[int] = None     # N, None when dispatched with num_worst_tokens (no host sync)
    num_worst_tokens: int = 0
    buffer_id: int = 0                        # id of the Buffer that made it
    backend: str = ""                         # name of the backend that made it
    extra: dict = dataclasses.field(default_factory=dict)  # backend-private state (hierarchical plan, ...)

    _POSITIONAL = ("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix",
                   "recv_src_idx", "is_token_in_rank", "send_head")

    def __getitem__(self, index: int) -> Any:
        return tuple(getattr(self, name) for name in self._POSITIONAL)[index]

    def __len__(self) -> int:
        return len(self._POSITIONAL)

    def __iter__(self):
        return iter(getattr(self, name) for name in self._POSITIONAL)

    @property
    def recv_src_rank(self) -> torch.Tensor:
        """[N] int32: source rank of every received row (rows are grouped by source in rank order)."""
        me = self.topology.rank
        counts = torch.diff(self.rank_prefix_matrix[:, me].to(torch.int64),
                            prepend=torch.zeros(1, dtype=torch.int64, device=self.rank_prefix_matrix.device))
        ranks = torch.arange(self.topology.num_ranks, device=counts.device)
        return torch.repeat_interleave(ranks, counts).to(torch.int32)
