"""The chunk geometry of an internode call: how the rows of every (rank, node) stream are cut into
network chunks, and the typed plan a dispatch hands its cached dispatch and combine.

Engine-free: host ints in, host ints and index tensors out; every tensor names its device.

Legend: T tokens here, M nodes, P ranks per node, Kc the most chunks a call may use, J rows of one
landed chunk, S rows this rank sends over the network (one per (token, destination node)).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch


def chunk_rows(count: int, ring_rows: int, max_chunks: int) -> int:
    """Rows per network chunk of a stream of ``count`` rows: the config's ring half, raised so that
    at most ``max_chunks`` chunks carry it."""
    return max(1, ring_rows, -(-count // max_chunks))


def clip(count: int, k: int, rows: int) -> int:
    """Rows of chunk k of a stream of ``count`` rows cut into chunks of ``rows``."""
    return max(0, min(rows, count - k * rows))


def ring_rows(config) -> int:
    """Rows of one network chunk slot: half of a (node, channel) ring of the Config, over its channels
    (the size hint's ring: Config.rdma_ring_bytes)."""
    return max(1, config.num_channels * config.num_max_rdma_chunked_recv_tokens // 2)


def compact(mask: torch.Tensor, total: int) -> torch.Tensor:
    """Flat indices g * n + i of the True entries of ``mask`` [n, G], group by group, row order
    within a group. ``total`` (the number of True entries) comes from the host, so nothing syncs."""
    n, G = mask.shape
    if total == 0 or n == 0:
        return torch.empty(0, dtype=torch.int64, device=mask.device)
    keys = torch.arange(n * G, dtype=torch.int64, device=mask.device).view(G, n)
    keys = torch.where(mask.t(), keys, torch.full_like(keys, n * G))
    return keys.flatten().sort().values[:total]


@dataclasses.dataclass
class Plan:
    """What a dispatch leaves in its handle for the calls that reuse it (``handle.extra["plan"]``).

    ``path``: "counted" (torch steps), "device" (the kernels) or "padded" (num_worst_tokens). Per
    chunk k: rows to and from every rail peer (``send_splits[k]`` / ``recv_splits[k]`` [M]), their
    first row in the send / landed rows (``send_starts`` / ``recv_starts`` [num_chunks + 1]) and, in
    the node, rows this forwarder passes to each local rank (``fan_send[k]`` [P]) and rows each
    forwarder passes here (``fan_recv[k]`` [P]). The lists of tensors are filled by the dispatch's
    chunk loop, per chunk, for its later calls."""

    path: str
    num_chunks: int
    num_recv: int                         # rows this rank receives (num_worst_tokens on the padded path)
    area_row: int = 0                     # bytes per row of the forwarder's areas for this handle's calls
    node_rows: int = 0                    # the most rows a rank of this node receives
    send_splits: list = dataclasses.field(default_factory=list)
    recv_splits: list = dataclasses.field(default_factory=list)
    send_starts: list = dataclasses.field(default_factory=lambda: [0])
    recv_starts: list = dataclasses.field(default_factory=lambda: [0])
    fan_send: list = dataclasses.field(default_factory=list)
    fan_recv: list = dataclasses.field(default_factory=list)
    home_lens: list = dataclasses.field(default_factory=list)   # rows this rank sends each node [M]
    # counted path: send row -> (token, node), the send rows in node order (the home sum's order)
    send_tok: Optional[torch.Tensor] = None
    send_node: Optional[torch.Tensor] = None
    home: Optional[torch.Tensor] = None
    # per chunk, filled by the dispatch: landed rows passed on (node group), where rows landed here,
    # the landed rows' positions on every local rank (the forwarder's combine sources)
    fan_rows: list = dataclasses.field(default_factory=list)
    land_pos: list = dataclasses.field(default_factory=list)
    landed_pos: list = dataclasses.field(default_factory=list)
    # device path: each (token, node) pair's send row [T, M]; padded path: its fixed slot [T, M]
    slot: Optional[torch.Tensor] = None
    land_all: Optional[torch.Tensor] = None   # device path, one rank per node: output row per landed row
    # padded path: rows per chunk and (rank, node) stream, send slots in all, rows received (device),
    # whether its calls run on the kernels (then ``slot`` is int32, -1 for pairs not sent)
    crows: int = 0
    slots: int = 0
    num_recv_dev: Optional[torch.Tensor] = None
    kernels: bool = False
    row_counts: Optional[tuple] = None        # ((counter, rows), ...) one call adds (Wiring.count_rows)
    # device path: the kept cached dispatches and combines of this handle, by the Buffer's replay key
    # (("dispatch", x dtype) / ("combine", K): internode/kept.py)
    kept: dict = dataclasses.field(default_factory=dict)


def geometry(path: str, counts: dict, ring: int, max_chunks: int) -> Plan:
    """The chunk geometry every rank derives alike from the exchange digest's ``counts``
    (``exchange.read_counts``): rows per chunk to and from every rail peer and, in the node, to and
    from every forwarder, with each chunk's first row in the send rows and in the landed rows."""
    if counts["num_chunks"] == 1:   # every stream fits one chunk (the digest's count is the most any needs)
        mine, rail_in = counts["mine"], counts["rail_in"]
        S, J = sum(mine), sum(rail_in)
        return Plan(path=path, num_chunks=1, num_recv=counts["num_recv"], node_rows=counts["node_rows"],
                    send_splits=[list(mine)], recv_splits=[list(rail_in)], send_starts=[0, S], recv_starts=[0, J],
                    fan_send=counts["fan_send"][:1], fan_recv=counts["fan_recv"][:1], home_lens=list(mine))
    return chunked(path, counts, ring, max_chunks)


def chunked(path: str, counts: dict, ring: int, max_chunks: int) -> Plan:
    """``geometry`` for any number of chunks (each stream cut into chunks of ``chunk_rows``)."""
    num_chunks, mine = counts["num_chunks"], counts["mine"]
    M = len(mine)
    rows_of = [chunk_rows(c, ring, max_chunks) for c in mine]
    send_splits = [[clip(mine[m], k, rows_of[m]) for m in range(M)] for k in range(num_chunks)]
    recv_splits = [[clip(c, k, chunk_rows(c, ring, max_chunks)) for c in counts["rail_in"]] for k in range(num_chunks)]
    send_starts, recv_starts = [0], [0]
    for k in range(num_chunks):
        send_starts.append(send_starts[-1] + sum(send_splits[k]))
        recv_starts.append(recv_starts[-1] + sum(recv_splits[k]))
    return Plan(path=path, num_chunks=num_chunks, num_recv=counts["num_recv"], node_rows=counts["node_rows"],
                send_splits=send_splits, recv_splits=recv_splits, send_starts=send_starts, recv_starts=recv_starts,
                fan_send=counts["fan_send"][:num_chunks], fan_recv=counts["fan_recv"][:num_chunks],
                home_lens=list(mine))


def send_order(plan: Plan, in_node: torch.Tensor, chunk: torch.Tensor) -> None:
    """The order of this rank's send rows (device), into ``plan``: chunk-major, then node, then token
    (``send_tok``, ``send_node`` [S]), and the same rows node-major (``home``, the home sum's order).
    ``in_node`` [T, M] bool, ``chunk`` [T, M] the chunk of each (token, node) pair."""
    T, M = in_node.shape
    S = sum(plan.home_lens)
    dev = in_node.device
    keys = (chunk * M + torch.arange(M, device=dev).view(1, M)) * T + torch.arange(T, device=dev).view(T, 1)
    keys = torch.where(in_node, keys, torch.full_like(keys, plan.num_chunks * M * T + 1)).flatten()
    order = keys.sort().values[:S] if S else keys[:0]
    plan.send_tok = order % T
    plan.send_node = (order // T) % M
    plan.home = compact(torch.nn.functional.one_hot(plan.send_node, M).bool(), S) % max(S, 1) if S else order


def padded_plan(in_node: torch.Tensor, spos: torch.Tensor, worst: int, num_ranks: int, ring: int,
                max_chunks: int) -> Plan:
    """Geometry of a num_worst_tokens call (the same on every rank: cap = worst // R, the ring and
    the chunk cap are agreed) and each (token, node) pair's slot in the send rows: chunk-major, then
    node, then the pair's row among its node's (pairs not sent: the dump slot past the end)."""
    M = in_node.shape[1]
    cap = worst // num_ranks
    crows = chunk_rows(cap, ring, max_chunks)
    nch = -(-cap // crows)
    slots = nch * M * crows
    nodes = torch.arange(M, device=in_node.device).view(1, M)
    slot = ((spos // crows) * M + nodes) * crows + spos % crows
    slot = torch.where(in_node, slot, torch.full_like(slot, slots))            # [T, M]
    return Plan(path="padded", num_chunks=nch, num_recv=worst, crows=crows, slots=slots, slot=slot)


__all__ = ["chunk_rows", "clip", "ring_rows", "compact", "Plan", "geometry", "chunked", "send_order", "padded_plan"]
