"""Config: the SM budget and chunk sizes of one dispatch or combine call, plus tuned defaults.

Field order follows DeepEP's ``Config`` so positional construction is compatible:
``Config(num_sms, num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens,
num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens)``.

What the fields mean in commlib:
  num_sms                            CTAs a communication kernel launches (even); channels = num_sms / 2.
                                     Each channel owns a contiguous range of tokens.
  num_max_nvl_chunked_send_tokens    tokens a sender copies before it publishes progress to the receiver.
  num_max_nvl_chunked_recv_tokens    rows the NVLink buffer holds per (source rank, channel): a call may
                                     send at most this many tokens per channel, i.e.
                                     ceil(num_tokens / channels) <= this.
  num_max_rdma_chunked_send_tokens   tokens per network chunk (hierarchical path).
  num_max_rdma_chunked_recv_tokens   rows the network staging buffer holds per (source node, channel).
"""
from __future__ import annotations

import dataclasses
import math

from commlib.utils.math import align_up

# Per-row metadata that travels next to a token's hidden bytes (bounds used to size buffers).
MAX_TOPK = 32
CONTROL_BYTES = 1 << 20  # flags, counters and count-exchange slots at the start of every buffer


def row_slot_bytes(hidden_bytes: int) -> int:
    """Bytes one buffered token needs: hidden bytes, FP8 scales (one float per 128 bytes), metadata."""
    scale_bytes = math.ceil(hidden_bytes / 128) * 4
    return align_up(hidden_bytes) + align_up(scale_bytes) + 16 + align_up(MAX_TOPK * 12)


@dataclasses.dataclass
class Config:
    num_sms: int = 20
    num_max_nvl_chunked_send_tokens: int = 32
    num_max_nvl_chunked_recv_tokens: int = 1024
    num_max_rdma_chunked_send_tokens: int = 64
    num_max_rdma_chunked_recv_tokens: int = 1024

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"Config.{f.name} must be an int, got {type(value).__name__}")
            if value <= 0:
                raise ValueError(f"Config.{f.name} must be positive, got {value}")
        if self.num_sms % 2 != 0:
            raise ValueError(f"Config.num_sms must be even (two CTAs per channel), got {self.num_sms}")
        if self.num_max_nvl_chunked_send_tokens > self.num_max_nvl_chunked_recv_tokens:
            raise ValueError(
                "Config.num_max_nvl_chunked_send_tokens "
                f"({self.num_max_nvl_chunked_send_tokens}) must not exceed "
                f"num_max_nvl_chunked_recv_tokens ({self.num_max_nvl_chunked_recv_tokens})")
        if self.num_max_rdma_chunked_send_tokens > self.num_max_rdma_chunked_recv_tokens:
            raise ValueError(
                "Config.num_max_rdma_chunked_send_tokens "
                f"({self.num_max_rdma_chunked_send_tokens}) must not exceed "
                f"num_max_rdma_chunked_recv_tokens ({self.num_max_rdma_chunked_recv_tokens})")

    @property
    def num_channels(self) -> int:
        return self.num_sms // 2

    def max_tokens_per_call(self) -> int:
        """Largest num_tokens a dispatch with this config accepts (the NVLink buffer's capacity)."""
        return self.num_channels * self.num_max_nvl_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of NVLink buffer (``num_nvl_bytes``) this config needs for rows of ``hidden_bytes``.

        Two regions (dispatch, combine), each with one slot array per (source rank, channel).
        ``hidden_bytes`` is hidden * element size of the largest row moved (BF16: 2 * hidden).
        """
        if hidden_bytes <= 0 or num_ranks <= 0:
            raise ValueError(f"hidden_bytes ({hidden_bytes}) and num_ranks ({num_ranks}) must be positive")
        region = num_ranks * self.num_channels * self.num_max_nvl_chunked_recv_tokens * row_slot_bytes(hidden_bytes)
        return CONTROL_BYTES + 2 * region

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes of network staging buffer (``num_rdma_bytes``) for the hierarchical path.

        ``num_ranks`` is the whole world; the buffer holds one slot array per (source node, channel)
        for dispatch and for combine. Returns 0 is never returned: a single node still gets a hint.
        """
        if hidden_bytes <= 0 or num_ranks <= 0:
            raise ValueError(f"hidden_bytes ({hidden_bytes}) and num_ranks ({num_ranks}) must be positive")
        region = num_ranks * self.num_channels * self.num_max_rdma_chunked_recv_tokens * row_slot_bytes(hidden_bytes)
        return CONTROL_BYTES + 2 * region


# Defaults per EP size (num_sms is filled in from Buffer.num_sms). Tuned on 2 x H200; the tuner
# (commlib.tuning.autotune) may override them per machine and shape.
_DISPATCH_DEFAULTS = {
    # num_ranks: (send chunk, recv capacity, rdma send chunk, rdma recv capacity)
    1: (32, 1024, 64, 1024),
    2: (32, 1024, 64, 1024),
    4: (32, 1024, 64, 1024),
    8: (32, 1024, 64, 1024),
}
_COMBINE_DEFAULTS = {
    1: (32, 1024, 64, 1024),
    2: (32, 1024, 64, 1024),
    4: (32, 1024, 64, 1024),
    8: (32, 1024, 64, 1024),
}


def _default(table: dict, num_ranks: int, num_sms: int) -> Config:
    if num_ranks <= 0:
        raise ValueError(f"num_ranks must be positive, got {num_ranks}")
    fields = table.get(num_ranks, table[8])
    return Config(num_sms, *fields)


def default_dispatch_config(num_ranks: int, num_sms: int) -> Config:
    return _default(_DISPATCH_DEFAULTS, num_ranks, num_sms)


def default_combine_config(num_ranks: int, num_sms: int) -> Config:
    return _default(_COMBINE_DEFAULTS, num_ranks, num_sms)
