"""Config: the SM budget and ring sizes of one dispatch or combine call, plus tuned defaults.

Field order follows DeepEP's ``Config`` so positional construction is compatible:
``Config(num_sms, num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens,
num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens)``.

What the fields mean (as in DeepEP):
  num_sms                            CTAs a communication kernel launches (even); channels = num_sms / 2.
                                     Each channel owns a contiguous range of every rank's tokens.
  num_max_nvl_chunked_send_tokens    tokens a sender moves before it publishes progress (its tail).
  num_max_nvl_chunked_recv_tokens    slots of the NVLink ring per (source rank, channel): rows stream
                                     through it, the receiver hands slots back (its head), so a call may
                                     have any number of tokens.
  num_max_rdma_chunked_send_tokens   tokens per network chunk (several nodes).
  num_max_rdma_chunked_recv_tokens   slots of the network ring per (source node, channel); rounded up to a
                                     multiple of the send chunk, which must be at most half of it.

Staging is a ring per (source, channel): its size depends on the Config and the row, never on
the call's token count. The size hints are at most DeepEP's for the same Config, hidden and ranks.
"""
from __future__ import annotations

import dataclasses
import math

from commlib.utils.math import align_up, ceil_div

# Per-row metadata that travels next to a token's hidden bytes (bounds used to size buffers).
MAX_TOPK = 32
# Flags, counters and count-exchange slots of the NVLink engine: allocated beside num_nvl_bytes,
# not counted in the size hint (DeepEP keeps its barrier and pointer words outside it too).
CONTROL_BYTES = 1 << 20
NUM_MAX_NVL_PEERS = 8  # ranks per node the size hints assume (DeepEP's), unless told otherwise
SLOT_ALIGN = 128       # ring slots never share a cache line (a line read early could be stale)
HINT_ALIGN = 128


def slot_bytes(hidden_bytes: int, num_scales: int = 0, num_topk: int = 0) -> int:
    """Bytes of one ring slot: the row, its FP8 scales, then the source token and per top-k slot a
    local expert id and a weight, rounded up to SLOT_ALIGN. Combine rows (no scales, no source
    token, weights only) fit the same slot."""
    meta = 4 * (1 + 2 * num_topk)
    return align_up(align_up(hidden_bytes) + align_up(4 * num_scales) + meta, SLOT_ALIGN)


def row_slot_bytes(hidden_bytes: int) -> int:
    """The largest slot a row of ``hidden_bytes`` can need: FP8 scales (one float per 128 bytes)
    and MAX_TOPK top-k entries."""
    return slot_bytes(hidden_bytes, math.ceil(hidden_bytes / 128), MAX_TOPK)


def _check_hint_args(hidden_bytes: int, num_ranks: int, ranks_per_node: int | None) -> int:
    for name, v in (("hidden_bytes", hidden_bytes), ("num_ranks", num_ranks)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    P = NUM_MAX_NVL_PEERS if ranks_per_node is None else ranks_per_node
    if isinstance(P, bool) or not isinstance(P, int) or P <= 0:
        raise ValueError(f"ranks_per_node must be a positive int, got {ranks_per_node!r}")
    return P


@dataclasses.dataclass
class Config:
    num_sms: int = 20
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 128

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"Config.{f.name} must be an int, got {type(value).__name__}")
            if value <= 0:
                raise ValueError(f"Config.{f.name} must be positive, got {value}")
        if self.num_sms % 2 != 0:
            raise ValueError(f"Config.num_sms must be even (two CTAs per channel), got {self.num_sms}")
        if self.num_max_nvl_chunked_send_tokens >= self.num_max_nvl_chunked_recv_tokens:
            raise ValueError(
                "Config.num_max_nvl_chunked_send_tokens "
                f"({self.num_max_nvl_chunked_send_tokens}) must be less than "
                f"num_max_nvl_chunked_recv_tokens ({self.num_max_nvl_chunked_recv_tokens}), the ring it streams through")
        # As DeepEP: the network ring holds whole send chunks, and a sender always finds half of it free.
        send = self.num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = align_up(self.num_max_rdma_chunked_recv_tokens, send)
        if send > self.num_max_rdma_chunked_recv_tokens // 2:
            raise ValueError(
                f"Config.num_max_rdma_chunked_send_tokens ({send}) must be at most half of "
                f"num_max_rdma_chunked_recv_tokens ({self.num_max_rdma_chunked_recv_tokens}, rounded up to a "
                "multiple of the send chunk)")

    @property
    def num_channels(self) -> int:
        return self.num_sms // 2

    def nvl_ring_bytes(self, num_ranks: int, row_bytes: int) -> int:
        """Bytes of the NVLink rings of ``num_ranks`` sources with slots of ``row_bytes``."""
        return num_ranks * self.num_channels * self.num_max_nvl_chunked_recv_tokens * row_bytes

    def rdma_ring_bytes(self, num_nodes: int, row_bytes: int) -> int:
        """Bytes of the network rings (send and receive side) of ``num_nodes`` nodes."""
        if num_nodes <= 1:
            return 0
        return 2 * num_nodes * self.num_channels * self.num_max_rdma_chunked_recv_tokens * row_bytes

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int, *,
                                 ranks_per_node: int | None = None) -> int:
        """Bytes of NVLink buffer (``num_nvl_bytes``) for rows of ``hidden_bytes``, any token count.

        One ring per (source rank of the node, channel) of ``num_max_nvl_chunked_recv_tokens`` slots,
        shared by dispatch and combine. ``hidden_bytes``: hidden * element size of the largest row
        moved (BF16: 2 * hidden). ``num_ranks``: ranks of the group; the node holds
        min(num_ranks, ranks_per_node) of them (ranks_per_node defaults to 8, as in DeepEP).
        """
        P = _check_hint_args(hidden_bytes, num_ranks, ranks_per_node)
        return align_up(self.nvl_ring_bytes(min(num_ranks, P), row_slot_bytes(hidden_bytes)), HINT_ALIGN)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int, *,
                                  ranks_per_node: int | None = None) -> int:
        """Bytes of network staging (``num_rdma_bytes``) for rows of ``hidden_bytes``; 0 on one node.

        ``num_ranks`` is the whole group; nodes = ceil(num_ranks / ranks_per_node) (8 by default, as
        in DeepEP). Several nodes: a send and a receive ring per (node, channel) of
        ``num_max_rdma_chunked_recv_tokens`` slots.
        """
        P = _check_hint_args(hidden_bytes, num_ranks, ranks_per_node)
        return align_up(self.rdma_ring_bytes(ceil_div(num_ranks, P), row_slot_bytes(hidden_bytes)), HINT_ALIGN)


# Defaults per EP size (num_sms is filled in from Buffer.num_sms): DeepEP's per-rank-count table
# as the starting point; the tuner (commlib.tuning.autotune) may override them per machine and shape.
# num_ranks: (nvl send chunk, nvl ring, rdma send chunk, rdma ring)
_DISPATCH_DEFAULTS = {
    1: (24, 256, 6, 128),
    2: (24, 256, 6, 128),
    4: (6, 256, 6, 128),
    8: (6, 256, 6, 128),
    16: (16, 288, 20, 128),
    24: (8, 288, 32, 128),
    32: (8, 288, 32, 128),
    64: (20, 288, 28, 128),
    128: (20, 560, 32, 128),
    144: (32, 720, 12, 128),
    160: (28, 720, 12, 128),
}
_COMBINE_DEFAULTS = {
    1: (10, 256, 6, 128),
    2: (10, 256, 6, 128),
    4: (9, 256, 6, 128),
    8: (4, 256, 6, 128),
    16: (2, 288, 28, 128),
    24: (1, 288, 20, 128),
    32: (1, 288, 20, 128),
    64: (1, 288, 20, 128),
    128: (1, 560, 12, 128),
    144: (2, 720, 8, 128),
    160: (2, 720, 8, 128),
}


def _default(table: dict, num_ranks: int, num_sms: int) -> Config:
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks <= 0:
        raise ValueError(f"num_ranks must be a positive int, got {num_ranks!r}")
    # the entry of the nearest EP size at or above num_ranks (the largest past the table)
    fields = table[min((r for r in table if r >= num_ranks), default=max(table))]
    return Config(num_sms, *fields)


def default_dispatch_config(num_ranks: int, num_sms: int) -> Config:
    return _default(_DISPATCH_DEFAULTS, num_ranks, num_sms)


def default_combine_config(num_ranks: int, num_sms: int) -> Config:
    return _default(_COMBINE_DEFAULTS, num_ranks, num_sms)
