"""The routing handle that dispatch returns and combine (or a cached dispatch) reuses.

Legend: T = tokens on this rank, R = ranks, C = channels of the dispatch config, N = rows this
rank received, M = nodes. Positional order follows DeepEP's handle: on one node its intranode
6-tuple, so code that reads ``handle[0]`` (the rank prefix matrix) keeps working; on several nodes
its internode 10-tuple (is_token_in_rank first). Every field also has a name.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from commlib.layout import channel_prefix_matrix
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
    # [T] int32 or None (rank order): the order combine sums each token's rows in, on one node (several
    # nodes: node, then rail order). Nibble i (bits 4i .. 4i+3) names the rank summed i-th; a rank's
    # place is its first nibble; ranks holding the token that no nibble names follow, in rank order
    # (so 0 is rank order). ElasticBuffer sets it (DeepEP V2's order); DeepEP v1 has none.
    sum_order: Optional[torch.Tensor] = None

    _POSITIONAL = ("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix",
                   "recv_src_idx", "is_token_in_rank", "send_head")
    # DeepEP's internode handle order; fields commlib's transports do not keep are None
    _POSITIONAL_INTERNODE = ("is_token_in_rank", "rdma_channel_prefix_matrix", "gbl_channel_prefix_matrix",
                             "recv_rdma_channel_prefix_matrix", "recv_rdma_rank_prefix_sum",
                             "recv_gbl_channel_prefix_matrix", "recv_gbl_rank_prefix_sum", "recv_src_meta",
                             "send_rdma_head", "send_nvl_head")

    def _names(self) -> tuple:
        internode = self.topology is not None and self.topology.num_nodes > 1
        return self._POSITIONAL_INTERNODE if internode else self._POSITIONAL

    def __getitem__(self, index: int) -> Any:
        return tuple(getattr(self, name) for name in self._names())[index]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self):
        return iter(getattr(self, name) for name in self._names())

    # --- DeepEP's internode names, from what every transport keeps ---
    @property
    def gbl_channel_prefix_matrix(self) -> torch.Tensor:
        """[R, C] int32: the channel prefix matrix over all ranks (= channel_prefix_matrix)."""
        return self.channel_prefix_matrix

    @property
    def recv_gbl_channel_prefix_matrix(self) -> torch.Tensor:
        """[R, C] int32 (= recv_channel_prefix_matrix)."""
        return self.recv_channel_prefix_matrix

    @property
    def recv_gbl_rank_prefix_sum(self) -> torch.Tensor:
        """[R] int32: rows received from sources 0..r (inclusive prefix sum; rank_prefix_matrix's column)."""
        return self.rank_prefix_matrix[:, self.topology.rank].contiguous()

    @property
    def rdma_channel_prefix_matrix(self) -> torch.Tensor:
        """[M, C] int32: tokens this rank sends to node m from channels before c (exclusive prefix)."""
        t = self.topology
        T, C = self.is_token_in_rank.shape[0], max(self.num_channels, 1)
        # the channel prefix matrix of the token-in-node mask
        return channel_prefix_matrix(self.is_token_in_rank.view(T, t.num_nodes, t.ranks_per_node).any(dim=2), C)

    @property
    def recv_src_meta(self) -> torch.Tensor:
        """[N, 2] int32: (source rank, token index on the source) of every received row (commlib's form of
        DeepEP's per-row source metadata)."""
        src = self.recv_src_rank
        n = self.recv_src_idx.shape[0]
        if src.shape[0] < n:  # num_worst_tokens: padding rows have no source
            src = torch.cat([src, torch.full((n - src.shape[0],), -1, dtype=torch.int32, device=src.device)])
        return torch.stack([src, self.recv_src_idx.to(torch.int32)], dim=1)

    recv_rdma_channel_prefix_matrix = None
    recv_rdma_rank_prefix_sum = None
    send_rdma_head = None
    send_nvl_head = None

    @property
    def recv_src_rank(self) -> torch.Tensor:
        """[N] int32: source rank of every received row (rows are grouped by source in rank order)."""
        me = self.topology.rank
        counts = torch.diff(self.rank_prefix_matrix[:, me].to(torch.int64),
                            prepend=torch.zeros(1, dtype=torch.int64, device=self.rank_prefix_matrix.device))
        ranks = torch.arange(self.topology.num_ranks, device=counts.device)
        return torch.repeat_interleave(ranks, counts).to(torch.int32)
