"""Config: the SM budget and ring sizes of one dispatch or combine call, plus tuned defaults.

Field order follows DeepEP's ``Config`` so positional construction is compatible:
``Config(num_sms, num_max_nvl_chunked_send_tokens, num_max_nvl_chunked_recv_tokens,
num_max_rdma_chunked_send_tokens, num_max_rdma_chunked_recv_tokens)``.

What the fields mean (as in DeepEP):
  num_sms                            CTAs a communication kernel launches; channels = num_sms / 2. A call
                                     needs it positive and even (a Config may hold 0 or an odd count, as
                                     DeepEP's may; check_runnable). Each channel owns a contiguous range
                                     of every rank's tokens.
  num_max_nvl_chunked_send_tokens    tokens a sender moves before it publishes progress (its tail).
  num_max_nvl_chunked_recv_tokens    slots of the NVLink ring per (source rank, channel): rows stream
                                     through it, the receiver hands slots back (its head), so a call may
                                     have any number of tokens.
  num_max_rdma_chunked_send_tokens   tokens per network chunk (several nodes).
  num_max_rdma_chunked_recv_tokens   slots of the network ring per (source node, channel); rounded up to a
                                     multiple of the send chunk, which must be at most half of it.

Defaults and validation are DeepEP v1's (``Config()`` is ``Config(20, 6, 256, 6, 256)``); the
deliberate differences are listed in docs/deep_ep.md. Staging is a ring per (source, channel): its size depends on the Config and the row, never on
the call's token count. The size hints are at most DeepEP's for the same Config, hidden and ranks.
"""
from __future__ import annotations

import dataclasses
import math
import operator

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


INT32_MAX = 2 ** 31 - 1


def as_int(name: str, value) -> int:
    """``value`` as a plain int, converted the way DeepEP's C++ ``Config`` takes its ``int`` arguments
    (pybind11): anything with ``__index__`` (int, bool, numpy and 0-d torch integers) within int32;
    floats, strings and None are a TypeError."""
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None
    if not -INT32_MAX - 1 <= v <= INT32_MAX:
        raise TypeError(f"{name} must fit a 32-bit int (as DeepEP's Config), got {v}")
    return int(v)


def _check_hint_args(hidden_bytes: int, num_ranks: int, ranks_per_node: int | None) -> tuple:
    hidden_bytes, num_ranks = as_int("hidden_bytes", hidden_bytes), as_int("num_ranks", num_ranks)
    for name, v in (("hidden_bytes", hidden_bytes), ("num_ranks", num_ranks)):
        if v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    P = NUM_MAX_NVL_PEERS if ranks_per_node is None else as_int("ranks_per_node", ranks_per_node)
    if P <= 0:
        raise ValueError(f"ranks_per_node must be a positive int, got {ranks_per_node!r}")
    return hidden_bytes, num_ranks, P


@dataclasses.dataclass
class Config:
    num_sms: int = 20
    num_max_nvl_chunked_send_tokens: int = 6
    num_max_nvl_chunked_recv_tokens: int = 256
    num_max_rdma_chunked_send_tokens: int = 6
    num_max_rdma_chunked_recv_tokens: int = 256

    def __post_init__(self) -> None:
        # What DeepEP's Config accepts, commlib's accepts, and it refuses what DeepEP's refuses (with
        # a ValueError naming the field instead of an assertion). num_sms may be 0 or odd here, as
        # in DeepEP: a dispatch or combine refuses such a Config (check_runnable), a size hint does not.
        for f in dataclasses.fields(self):
            setattr(self, f.name, as_int(f"Config.{f.name}", getattr(self, f.name)))
        if self.num_sms < 0:
            raise ValueError(f"Config.num_sms must be >= 0, got {self.num_sms}")
        for f in dataclasses.fields(self)[1:]:
            if getattr(self, f.name) <= 0:
                raise ValueError(f"Config.{f.name} must be positive, got {getattr(self, f.name)}")
        if self.num_max_nvl_chunked_send_tokens >= self.num_max_nvl_chunked_recv_tokens:
            raise ValueError(
                "Config.num_max_nvl_chunked_send_tokens "
                f"({self.num_max_nvl_chunked_send_tokens}) must be less than "
                f"num_max_nvl_chunked_recv_tokens ({self.num_max_nvl_chunked_recv_tokens}), the ring it streams through")
        # As DeepEP: the network ring holds whole send chunks, and a sender always finds half of it free.
        send = self.num_max_rdma_chunked_send_tokens
        recv = align_up(self.num_max_rdma_chunked_recv_tokens, send)
        if recv > INT32_MAX:
            raise ValueError(f"Config.num_max_rdma_chunked_recv_tokens rounded up to a multiple of the send chunk "
                             f"({recv}) does not fit a 32-bit int")
        self.num_max_rdma_chunked_recv_tokens = recv
        if send > recv // 2:
            raise ValueError(
                f"Config.num_max_rdma_chunked_send_tokens ({send}) must be at most half of "
                f"num_max_rdma_chunked_recv_tokens ({recv}, rounded up to a multiple of the send chunk)")

    def check_runnable(self, rank: int | None = None) -> Config:
        """This Config, if a dispatch or combine can run with it: num_sms positive and even (two CTAs
        per channel; DeepEP asserts the same when it launches). Else a ValueError."""
        if self.num_sms <= 0 or self.num_sms % 2:
            who = f"[commlib rank {rank}] " if rank is not None else ""
            raise ValueError(f"{who}Config.num_sms must be a positive even number to run a dispatch or combine "
                             f"(two CTAs per channel), got {self.num_sms}")
        return self

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
        hidden_bytes, num_ranks, P = _check_hint_args(hidden_bytes, num_ranks, ranks_per_node)
        return align_up(self.nvl_ring_bytes(min(num_ranks, P), row_slot_bytes(hidden_bytes)), HINT_ALIGN)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int, *,
                                  ranks_per_node: int | None = None) -> int:
        """Bytes of network staging (``num_rdma_bytes``) for rows of ``hidden_bytes``; 0 on one node.

        ``num_ranks`` is the whole group; nodes = ceil(num_ranks / ranks_per_node) (8 by default, as
        in DeepEP). Several nodes: a send and a receive ring per (node, channel) of
        ``num_max_rdma_chunked_recv_tokens`` slots.
        """
        hidden_bytes, num_ranks, P = _check_hint_args(hidden_bytes, num_ranks, ranks_per_node)
        return align_up(self.rdma_ring_bytes(ceil_div(num_ranks, P), row_slot_bytes(hidden_bytes)), HINT_ALIGN)


# Defaults per EP size (num_sms is filled in from Buffer.num_sms): the values of DeepEP v1's
# get_dispatch_config / get_combine_config (its last v1 code, before EPv2), plus 1 rank (DeepEP has no
# entry; the 2-rank one). DeepEP asserts num_ranks is in its table; commlib takes the entry of the
# nearest size at or above num_ranks (the largest past the table). The tuner (commlib.tuning.autotune)
# may override them per machine and shape.
# num_ranks: (nvl send chunk, nvl ring, rdma send chunk, rdma ring)
_DISPATCH_DEFAULTS = {
    1: (24, 256, 6, 128),
    2: (24, 256, 6, 128),
    4: (6, 256, 6, 128),
    8: (6, 256, 6, 128),
    16: (36, 288, 20, 128),
    24: (32, 288, 8, 128),
    32: (32, 288, 8, 128),
    48: (32, 288, 8, 128),
    64: (32, 288, 8, 128),
    96: (20, 480, 12, 128),
    128: (20, 560, 12, 128),
    144: (32, 720, 12, 128),
    160: (28, 720, 12, 128),
}
_COMBINE_DEFAULTS = {
    1: (10, 256, 6, 128),
    2: (10, 256, 6, 128),
    4: (9, 256, 6, 128),
    8: (4, 256, 6, 128),
    16: (4, 288, 12, 128),
    24: (1, 288, 8, 128),
    32: (1, 288, 8, 128),
    48: (1, 288, 8, 128),
    64: (1, 288, 8, 128),
    96: (1, 480, 8, 128),
    128: (1, 560, 8, 128),
    144: (2, 720, 8, 128),
    160: (2, 720, 8, 128),
}


def _default(table: dict, num_ranks: int, num_sms: int) -> Config:
    num_ranks = as_int("num_ranks", num_ranks)
    if num_ranks <= 0:
        raise ValueError(f"num_ranks must be a positive int, got {num_ranks!r}")
    # the entry of the nearest EP size at or above num_ranks (the largest past the table)
    fields = table[min((r for r in table if r >= num_ranks), default=max(table))]
    return Config(num_sms, *fields)


def default_dispatch_config(num_ranks: int, num_sms: int) -> Config:
    return _default(_DISPATCH_DEFAULTS, num_ranks, num_sms)


def default_combine_config(num_ranks: int, num_sms: int) -> Config:
    return _default(_COMBINE_DEFAULTS, num_ranks, num_sms)
