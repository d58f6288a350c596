"""Topology: which node and local rank every rank is, so multi-node logic runs on one machine.

Ranks are laid out node-major: rank = node * ranks_per_node + local_rank. ``ranks_per_node``
comes from COMMLIB_RANKS_PER_NODE or the launcher (torchrun's LOCAL_WORLD_SIZE, Open MPI's
OMPI_COMM_WORLD_LOCAL_SIZE, MPICH's MPI_LOCALNRANKS); without any (vLLM and SGLang start their own
workers), from the group itself: every rank's RankFacts (local_facts), which the Buffer gathers.
A node is the ranks of one host (same hostname and kernel boot id) whose GPUs reach each other with
peer access (ranks_per_node_from_facts). 8 CPU processes can thus be 2 emulated nodes x 4, and 2
GPUs 2 nodes x 1.
"""
from __future__ import annotations

import dataclasses
import os
import socket
import warnings
from typing import Optional, Sequence

import torch

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
               hostnames: Optional[Sequence[str]] = None,
               facts: Sequence[RankFacts] | None = None) -> Topology:
        """Topology from an explicit value, else the environment, else the ranks' facts (RankFacts,
        one per rank in rank order: ranks_per_node_from_facts) or hostnames, else a single node."""
        if ranks_per_node is None:
            ranks_per_node = env.ranks_per_node()
        if ranks_per_node is None and facts is not None:
            ranks_per_node = ranks_per_node_from_facts(facts)
        elif ranks_per_node is None and hostnames is not None:
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


# ------------------------------------------------------------------ evidence from the ranks themselves
@dataclasses.dataclass(frozen=True)
class RankFacts:
    """Where one rank runs, as the other ranks need to know it to group ranks into nodes.

    hostname  socket.gethostname()
    boot_id   /proc/sys/kernel/random/boot_id: one per running kernel, so two machines (or VMs) with
              the same hostname differ; "" where the file does not exist
    gpu       this rank's GPU (gpu_id: its UUID, else its PCI address); "" on a CPU rank
    visible   the GPUs this process sees (gpu_id each)
    peers     of those, the ones this rank's GPU can reach with peer access (its own GPU included)
    """
    hostname: str
    boot_id: str = ""
    gpu: str = ""
    visible: tuple = ()
    peers: tuple = ()


def gpu_id(index: int) -> str:
    """A GPU's identity, the same in every process of its host: its UUID, else its PCI address."""
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        return f"GPU-{uuid}"
    if hasattr(props, "pci_bus_id"):
        return f"{getattr(props, 'pci_domain_id', 0):04x}:{props.pci_bus_id:02x}:{getattr(props, 'pci_device_id', 0):02x}"
    return f"{socket.gethostname()}/cuda:{index}"


BOOT_ID = "/proc/sys/kernel/random/boot_id"


def _boot_id() -> str:
    if not os.path.exists(BOOT_ID):
        return ""
    try:
        with open(BOOT_ID) as f:
            return f.read().strip()
    except OSError:
        return ""


def local_facts(device: torch.device | None = None) -> RankFacts:
    """This rank's RankFacts. ``device``: its GPU (default: the current CUDA device when CUDA is
    available, else none: a CPU rank)."""
    if device is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    if device is None or device.type != "cuda":
        return RankFacts(socket.gethostname(), _boot_id())
    me = device.index if device.index is not None else torch.cuda.current_device()
    visible = tuple(gpu_id(i) for i in range(torch.cuda.device_count()))
    peers = tuple(visible[i] for i in range(len(visible)) if i == me or torch.cuda.can_device_access_peer(me, i))
    return RankFacts(socket.gethostname(), _boot_id(), visible[me], visible, peers)


def _reaches(a: RankFacts, b: RankFacts) -> bool:
    """Can a's GPU reach b's (same host)? Yes for one GPU, CPU ranks, and GPUs a's process does not
    see (no evidence but the host); otherwise a's peer access decides."""
    if not a.gpu or not b.gpu or a.gpu == b.gpu or b.gpu not in a.visible:
        return True
    return b.gpu in a.peers


def share_memory(facts: Sequence[RankFacts]) -> bool:
    """Can every one of these ranks map every other's GPU memory (CUDA IPC: one running kernel, i.e.
    the same host and boot, and peer access between their GPUs, or one GPU)?"""
    host = {(f.hostname, f.boot_id) for f in facts}
    return len(host) <= 1 and all(_reaches(a, b) for a in facts for b in facts)


def gpu_share(facts: Sequence[RankFacts]) -> int:
    """The most ranks of these that run on one GPU (same host, boot and GPU id; 1 for CPU ranks).
    Ranks sharing a GPU under CUDA MPS run their kernels side by side, so every rank's spinning
    communication CTAs must fit on the GPU's SMs together (docs/launch.md)."""
    seen: dict = {}
    for f in facts:
        if f is not None and f.gpu:
            key = (f.hostname, f.boot_id, f.gpu)
            seen[key] = seen.get(key, 0) + 1
    return max(seen.values(), default=1)


def node_groups(facts: Sequence[RankFacts]) -> list:
    """The ranks (lists, in rank order) of each node the facts show, nodes ordered by their first rank.

    A node is the ranks of one host (hostname and boot id) whose GPUs reach each other (_reaches, both
    ways). Raises ValueError where peer access inside a host does not split it into such groups
    (A and B reach each other, B and C too, A and C do not)."""
    n = len(facts)
    parent = list(range(n))

    def root(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    def linked(i: int, j: int) -> bool:
        a, b = facts[i], facts[j]
        return (a.hostname, a.boot_id) == (b.hostname, b.boot_id) and _reaches(a, b) and _reaches(b, a)

    for i in range(n):
        for j in range(i + 1, n):
            if linked(i, j):
                parent[root(j)] = root(i)
    groups: dict = {}
    for r in range(n):
        groups.setdefault(root(r), []).append(r)
    out = sorted(groups.values())
    for g in out:
        for x, i in enumerate(g):
            for j in g[x + 1:]:
                if not linked(i, j):
                    raise ValueError(
                        f"commlib: GPU peer access on host {facts[i].hostname} does not split its ranks into groups "
                        f"that all reach each other (ranks {i} and {j} are linked through others, not directly); set "
                        "COMMLIB_RANKS_PER_NODE or pass Buffer(ranks_per_node=...)")
    return out


def ranks_per_node_from_facts(facts: Sequence[RankFacts]) -> int | None:
    """Ranks per node from every rank's RankFacts (one per rank, in rank order): node_groups must be
    runs of consecutive ranks of equal size (node-major), which gives ranks_per_node.

    Otherwise, on CPU ranks: a RuntimeWarning and None (one node: the reference backend is right on any
    layout). On GPU ranks a ValueError naming the layout: one node there would put ranks that cannot
    reach each other's memory into one NVLink engine."""
    if not facts:
        return None
    groups = node_groups(facts)
    sizes = {len(g) for g in groups}
    if len(sizes) == 1 and all(g == list(range(g[0], g[0] + len(g))) for g in groups):
        return sizes.pop()
    where = [(facts[g[0]].hostname, g) for g in groups]
    if any(f.gpu for f in facts):
        raise ValueError(f"commlib: the group's ranks are not laid out node-major with equal ranks per node "
                         f"(nodes: (host, ranks) {where}); start the ranks host by host, or set "
                         "COMMLIB_RANKS_PER_NODE / Buffer(ranks_per_node=...) (COMMLIB_RANKS_PER_NODE=<world "
                         "size> with backend='reference' runs any layout)")
    warnings.warn(f"commlib: the group's ranks are not laid out node-major with equal ranks per node "
                  f"(nodes: (host, ranks) {where}); treating the group as one node. Set COMMLIB_RANKS_PER_NODE, "
                  "or order the ranks by host.", RuntimeWarning, stacklevel=3)
    return None
