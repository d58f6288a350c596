"""``deep_ep.utils.envs`` (DeepEP V2's module path): process-group set-up, seeds, printing, domain sizes.

What V2's clients and tests call from it, written for commlib (V2 reaches its compiled extension for
the domain sizes; commlib asks the group, as its Buffer does):
    init_dist(local_rank, num_local_ranks, seed)   -> (rank, world size, a group of every rank)
    init_seed / get_local_seed / get_global_seed, dist_print(s, once_in_node)
    get_physical_domain_size(group), get_logical_domain_size(group, allow_hybrid_mode)
    check_nvlink_connections, check_torch_deterministic, get_nvlink_gbs, get_rdma_gbs,
    check_fast_rdma_atomic_support
docs/deep_ep.md lists what differs from V2.
"""
from __future__ import annotations

import sys

import inspect
import os
import random
from typing import Optional, Tuple

import torch
import torch.distributed as dist

from commlib.elastic import DEFAULT_NVLINK_GBS, DEFAULT_RDMA_GBS, detect_topology, logical_domain_size

_state = {"local_rank": None, "local_seed": 0, "global_seed": 0}


def init_seed(global_seed: int) -> None:
    """Seed torch and ``random`` with global_seed + this rank (the local seed); remember both."""
    local = global_seed + dist.get_rank()
    _state["global_seed"], _state["local_seed"] = global_seed, local
    torch.manual_seed(local)
    random.seed(local)


def get_local_seed() -> int:
    """The seed init_seed gave this rank (global seed + rank)."""
    return _state["local_seed"]


def get_global_seed() -> int:
    """The seed init_seed was called with."""
    return _state["global_seed"]


def dist_print(s: str = "", once_in_node: bool = False) -> None:
    """Print ``s`` on every rank (``once_in_node``: local rank 0 only), then a group barrier."""
    if _state["local_rank"] is None:
        raise RuntimeError("deep_ep.utils.envs.dist_print: call init_dist first")
    if not once_in_node or _state["local_rank"] == 0:
        # one write per line: with PYTHONUNBUFFERED, print() writes the text and its newline apart,
        # and two ranks sharing a pipe then interleave them
        sys.stdout.write(f"{s}\n")
        sys.stdout.flush()
    dist.barrier()


def init_dist(local_rank: int, num_local_ranks: int, seed: int = 0) -> Tuple[int, int, dist.ProcessGroup]:
    """Join the job as local rank ``local_rank`` of ``num_local_ranks`` on node $RANK of $WORLD_SIZE nodes.

    Rendezvous at tcp://$MASTER_ADDR:$MASTER_PORT (default 127.0.0.1:8361); global rank =
    node * num_local_ranks + local_rank. With CUDA: NCCL, device cuda:local_rank, default device
    cuda; without (commlib's addition, for CPU ranks): gloo, default device cpu. Default dtype bf16;
    then init_seed(seed).
    Returns:
        (rank, world size, a new group of all ranks)
    """
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "8361"))
    num_nodes = int(os.environ.get("WORLD_SIZE", "1"))
    node = int(os.environ.get("RANK", "0"))
    _state["local_rank"] = local_rank
    cuda = torch.cuda.is_available()
    kwargs = dict(backend="nccl" if cuda else "gloo", init_method=f"tcp://{addr}:{port}",
                  world_size=num_nodes * num_local_ranks, rank=node * num_local_ranks + local_rank)
    if cuda and "device_id" in inspect.signature(dist.init_process_group).parameters:
        kwargs["device_id"] = torch.device("cuda", local_rank)
    dist.init_process_group(**kwargs)
    torch.set_default_dtype(torch.bfloat16)
    if cuda:
        torch.set_default_device("cuda")
        torch.cuda.set_device(local_rank)
    init_seed(seed)
    world = dist.get_world_size()
    return dist.get_rank(), world, dist.new_group(list(range(world)))


def get_physical_domain_size(group: dist.ProcessGroup, ranks_per_node: Optional[int] = None) -> Tuple[int, int]:
    """(nodes, ranks per node) of ``group``, as commlib's Buffer lays it out (V2: RDMA x NVLink ranks).
    A collective: every rank of the group calls it."""
    topo = detect_topology(group, ranks_per_node)
    return topo.num_nodes, topo.ranks_per_node


def get_logical_domain_size(group: dist.ProcessGroup, allow_hybrid_mode: bool = True,
                            ranks_per_node: Optional[int] = None) -> Tuple[int, int]:
    """(scaleout ranks, scaleup ranks): the physical domain with allow_hybrid_mode, else (1, R). A collective."""
    return logical_domain_size(*get_physical_domain_size(group, ranks_per_node), allow_hybrid_mode)


def check_nvlink_connections(group: dist.ProcessGroup) -> None:
    """Accepts any group: commlib checks the peer access it needs when a GPU engine opens peer memory."""


def check_torch_deterministic() -> None:
    """Refuse deterministic algorithms together with fill_uninitialized_memory (as V2): torch then fills
    every empty tensor with a kernel that may run beside communication on another stream."""
    if torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory:
        raise RuntimeError("deep_ep: torch deterministic algorithms with fill_uninitialized_memory=True are not "
                           "supported (set torch.utils.deterministic.fill_uninitialized_memory = False)")


def get_nvlink_gbs(factor: float = 0.9) -> float:
    """NVLink GB/s the SM model assumes: commlib does not probe nvidia-smi, so NV18's 450 GB/s x factor."""
    return DEFAULT_NVLINK_GBS / 0.9 * factor


def get_rdma_gbs(nic_name: str = "mlx5_0") -> float:
    """Network GB/s the SM model assumes: commlib does not probe ibstat, so one 400 Gb/s NIC."""
    return DEFAULT_RDMA_GBS


def check_fast_rdma_atomic_support(nic_name: str = "mlx5_0") -> bool:
    """False: commlib uses no RDMA atomics."""
    return False
