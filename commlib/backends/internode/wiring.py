"""What the internode data paths share of the engine: the topology, the two seams (network step,
node step), the probe, the row counters, the count exchange's collective and its one host read, and
where a call's outputs are allocated.
The engine builds one ``Wiring`` in __init__; the paths (counted.py, device.py, padded.py) take it.

Legend: R ranks, M nodes, P ranks per node, Kc the most chunks a call may use, E experts.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Optional

import torch

from commlib.backends.base import alloc_outputs
from commlib.backends.common import HOST
from commlib.backends.internode.exchange import check_exchange, parse_digest
from commlib.backends.internode.geometry import Plan
from commlib.backends.internode.network import NetworkStep
from commlib.backends.internode.node import NodeStep
from commlib.backends.internode.rows import output_views
from commlib.backends.probe import Probe
from commlib.topology import Topology


@dataclasses.dataclass
class Wiring:
    topology: Topology
    device: torch.device            # where the engine's tensors live (CPU on gloo)
    nccl: bool
    network: NetworkStep
    node: NodeStep
    probe: Probe
    counters: dict                  # the Backend's row counters
    max_chunks: int                 # Kc
    max_nodes: int                  # max_nodes_per_token
    gather: Callable                # gather(row, out=None) -> [R, n]: the count exchange on the Buffer's group
    gather_into: Callable           # gather_into(row, out): the same into out (contiguous [R * n]), nothing made
    phase: Callable                 # phase(what): names the step a timeout reports
    reads: list = dataclasses.field(default_factory=lambda: [0])   # host reads (tests: one per dispatch)
    ctx: Any = None                 # the Backend's BackendContext (out_stream, comm_stream); None: current stream
    blocks: list = dataclasses.field(default_factory=list)         # this call's ``alloc`` tensors
    kept: dict = dataclasses.field(default_factory=dict)           # kept.Launches per kind and shape
    stage: Optional[torch.Tensor] = None   # the network staging rows (``staging``), uint8 [bytes]
    stage_told: bool = False
    # the topology's ints the calls read (its properties cost a Python call each), and the device's
    # (torch.device.type builds a string per read): whether it is a GPU, its index (-1: the current)
    my_node: int = dataclasses.field(init=False)
    my_local_rank: int = dataclasses.field(init=False)
    cuda: bool = dataclasses.field(init=False)
    dev_index: int = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.my_node, self.my_local_rank = self.topology.node, self.topology.local_rank
        self.cuda = self.device.type == "cuda"
        self.dev_index = self.device.index if self.cuda and self.device.index is not None else -1

    def alloc(self, *specs, outputs=()) -> list:
        """A call's tensors ((shape, dtype) per spec, None for none) on its output stream: the caller's,
        where the Buffer says so (base.alloc_outputs: freed blocks go back to the caller's pool, in its
        stream order), else the current one; kept in ``blocks`` for the result. ``outputs`` (an
        rows.output_layout): the call's outputs, views of one more allocation, after them."""
        ctx = self.ctx
        out, back = (ctx.out_stream, ctx.comm_stream) if ctx is not None else (None, None)
        if not outputs:
            return alloc_outputs(out, back, specs, self.device, self.blocks)
        made = alloc_outputs(out, back, (*specs, ((outputs[0],), torch.uint8)), self.device, self.blocks)
        return made[:-1] + output_views(made[-1], outputs)

    def staging(self, rows: int, width: int) -> torch.Tensor:
        """uint8 [rows, width] of the engine's network staging rows (what a kept call sends and lands on
        the rail; the Buffer's num_rdma_bytes stands for them), kept between calls instead of allocated
        per call. Every call that uses them runs on the comm stream and waits there for its collectives,
        so one call's use follows the last one's. Grown (a new buffer, a quarter of headroom, made on the
        comm stream) where too small; a view holds its buffer, so calls kept before keep the old one. A
        call captured in a CUDA graph allocates its own instead (kept.py)."""
        n = rows * width
        st = self.stage
        if st is None or st.numel() < n:
            ctx = self.ctx
            comm = ctx.comm_stream if ctx is not None and self.cuda else None
            back = torch.cuda.current_stream(self.device) if comm is not None else None
            st = self.stage = alloc_outputs(comm, back, (((n + (n >> 2),), torch.uint8),), self.device, [])[0]
            budget = getattr(ctx, "num_rdma_bytes", 0) if ctx is not None else 0
            if budget and st.numel() > budget and not self.stage_told:
                self.stage_told = True
                warnings.warn(f"commlib rank {self.topology.rank}: the internode engine's staging rows "
                              f"({st.numel() / 2**20:.0f} MiB) exceed the Buffer's num_rdma_bytes "
                              f"({budget / 2**20:.0f} MiB), which they stand for")
        return st[:n].view(rows, width)

    def take_blocks(self, keep: bool = True) -> Optional[tuple]:
        """The result's ``blocks`` (what ``alloc`` made since the last call), and a fresh list; None
        where ``keep`` is false (outputs moved elsewhere: the Buffer then records what it finds)."""
        made, self.blocks = self.blocks, []
        return tuple(made) if keep else None

    def read(self, t: torch.Tensor) -> torch.Tensor:
        """A device -> host read (the probe makes and may time the copy)."""
        self.reads[0] += 1
        return self.probe.read(t)

    def h2d(self, values: list, dtype=torch.int64) -> torch.Tensor:
        """A small host list on the engine's device without a stream sync (pinned, non-blocking)."""
        t = torch.tensor(values, dtype=dtype, device=HOST)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def read_counts(self, g: torch.Tensor, digest: torch.Tensor, sig: list, E: int) -> dict:
        """The one host read of a non-cached dispatch: the digest of the gathered rows ``g`` as plain
        lists (exchange.parse_digest). When it flags an error, the whole ``g`` is read too (a second
        read, on the error path only) and the checks raise alike on every rank."""
        topo = self.topology
        P = topo.ranks_per_node
        counts = parse_digest(self.read(digest).tolist(), topo.num_ranks // P, P, self.max_chunks, E // topo.num_ranks)
        if counts["error"]:
            self.exchange_failed(g, sig, E=E)
        return counts

    def exchange_failed(self, g: torch.Tensor, sig: list, E: int) -> None:
        """The digest flagged an error: the whole gathered rows ``g`` read (a second read, on the error path
        only) and the checks raise alike on every rank (the C++ call path's dispatch calls it too)."""
        self.check(self.read(g), sig, E)
        raise RuntimeError(f"[commlib rank {self.topology.rank}] the count exchange flagged an error that its "
                           "checks did not find (a commlib bug: please report it)")

    def check(self, gh, sig: list, E: int) -> None:
        topo = self.topology
        check_exchange(gh, sig, me=topo.rank, R=topo.num_ranks, E=E, max_nodes=self.max_nodes)

    def count_rows(self, plan: Plan) -> None:
        """Rows moved by a counted call (``plan``'s geometry): over the network, inside the node."""
        c = self.counters
        if plan.row_counts is None:   # the geometry is the plan's for good: sum it once
            moved = {"local_rows": 0, "internode_rows": 0, "intranode_rows": 0}
            node, loc = self.my_node, self.my_local_rank
            for m, n in enumerate(plan.home_lens):
                moved["local_rows" if m == node else "internode_rows"] += n
            for k in range(plan.num_chunks):
                for p, n in enumerate(plan.fan_send[k]):
                    moved["local_rows" if p == loc else "intranode_rows"] += n
            plan.row_counts = tuple(moved.items())
        for key, n in plan.row_counts:
            c[key] += n

    def count_padded(self, plan: Plan) -> None:
        """Rows moved by a padded call, padding included (what crossed the links)."""
        topo, c = self.topology, self.counters
        sent = plan.num_chunks * plan.crows
        c["local_rows"] += sent
        c["internode_rows"] += sent * (topo.num_nodes - 1)
        if not self.node.in_area:   # the node all-gather; the kernel's rows are known on the device only
            c["intranode_rows"] += sent * topo.num_nodes * (topo.ranks_per_node - 1)


__all__ = ["Wiring"]
