"""Topology: which node and local rank every rank is, so multi-node logic runs on one machine.

Ranks are laid out node-major: rank = node * ranks_per_node + local_rank. ``ranks_per_node``
comes from COMMLIB_RANKS_PER_NODE or the launcher (torchrun's LOCAL_WORLD_SIZE, Open MPI's
OMPI_COMM_WORLD_LOCAL_SIZE, MPICH's MPI_LOCALNRANKS); without any (vLLM and SGLang start their own
workers), from the group itself: the hostname of every rank, which the Buffer gathers. Ranks that
share a hostname share a node. 8 CPU processes can thus be 2 emulated nodes x 4, and 2 GPUs 2 nodes x 1.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Optional, Sequence

from commlib.utils import env

# A token may target at most this many nodes (DeepSeek-V3's node-limited routing).
DEFAULT_MAX_NODES_PER_TOKEN = 4


@dataclasses.dataclass(frozen=True)
class Topology:
    rank: int
    num_ranks: int
    ranks_per_node: int

    def __post_init__(self) -> None:
        if self.num_ranks <= 0:
            raise ValueError(f"num_ranks must be positive, got {self.num_ranks}")
        if not 0 <= self.rank < self.num_ranks:
            raise ValueError(f"rank {self.rank} is outside [0, {self.num_ranks})")
        if self.ranks_per_node <= 0 or self.num_ranks % self.ranks_per_node != 0:
            raise ValueError(
                f"ranks_per_node={self.ranks_per_node} does not divide the world size {self.num_ranks} "
                "(set COMMLIB_RANKS_PER_NODE to a divisor of the world size)")

    @property
    def num_nodes(self) -> int:
        return self.num_ranks // self.ranks_per_node

    @property
    def node(self) -> int:
        return self.rank // self.ranks_per_node

    @property
    def local_rank(self) -> int:
        return self.rank % self.ranks_per_node

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_rank_of(self, rank: int) -> int:
        return rank % self.ranks_per_node

    def global_rank(self, node: int, local_rank: int) -> int:
        return node * self.ranks_per_node + local_rank

    def node_ranks(self, node: int | None = None) -> list[int]:
        """Ranks of one node (NVLink peers), this rank's node by default."""
        node = self.node if node is None else node
        return list(range(node * self.ranks_per_node, (node + 1) * self.ranks_per_node))

    def rail_ranks(self, local_rank: int | None = None) -> list[int]:
        """Ranks sharing a local rank across nodes (the network group), this rank's by default."""
        local_rank = self.local_rank if local_rank is None else local_rank
        return [n * self.ranks_per_node + local_rank for n in range(self.num_nodes)]

    @classmethod
    def detect(cls, rank: int, num_ranks: int, ranks_per_node: int | None = None,
               hostnames: Optional[Sequence[str]] = None) -> "Topology":
        """Topology from an explicit value, else the environment, else the ranks' hostnames (one per
        rank, in rank order), else a single node."""
        if ranks_per_node is None:
            ranks_per_node = env.ranks_per_node()
        if ranks_per_node is None and hostnames is not None:
            ranks_per_node = ranks_per_node_from_hosts(hostnames)
        if ranks_per_node is None or ranks_per_node > num_ranks:
            ranks_per_node = num_ranks
        return cls(rank=rank, num_ranks=num_ranks, ranks_per_node=ranks_per_node)


def ranks_per_node_from_hosts(hostnames: Sequence[str]) -> Optional[int]:
    """Ranks per node from every rank's hostname: the ranks of a host must be consecutive and every
    host must hold as many (node-major); otherwise a warning and None (one node)."""
    if not hostnames:
        return None
    runs: list = []  # (host, ranks) in rank order
    for h in hostnames:
        if runs and runs[-1][0] == h:
            runs[-1][1] += 1
        else:
            runs.append([h, 1])
    hosts = [h for h, _ in runs]
    sizes = {n for _, n in runs}
    if len(set(hosts)) == len(hosts) and len(sizes) == 1:
        return sizes.pop()
    warnings.warn(f"commlib: the group's ranks are not laid out node-major with equal ranks per host "
                  f"(hosts in rank order: {[(h, n) for h, n in runs]}); treating the group as one node. "
                  "Set COMMLIB_RANKS_PER_NODE, or order the ranks by host.", RuntimeWarning, stacklevel=3)
    return None
