"""The internode engine's process groups and its node step, chosen once at construction.

Every rank creates every group, in the same order (torch.distributed's rule for new_group): a rail
per local rank (the M ranks with that local rank: the network step's NCCL communicator) and, where
needed, a group per node. The node step is the IPC forwarder kernel where the node's GPUs map each
other's memory, else the node group's all-to-all, nothing with one rank per node (node.NODE_STEPS).

Legend: R ranks, M nodes, P ranks per node.
"""
from __future__ import annotations

import warnings

import torch.distributed as dist

from commlib.backends.internode.node import NODE_STEPS, NodeStep
from commlib.cuda.loader import cupy_available
from commlib.topology import local_facts, share_memory
from commlib.utils import env


def same_everywhere(value, group, what: str, rank: int, size: int):
    """``value``, after checking every rank of ``group`` has the same (collective); else ValueError."""
    theirs = [None] * size
    dist.all_gather_object(theirs, value, group=group)
    if any(t != value for t in theirs):
        raise ValueError(f"[commlib rank {rank}] {what} differs between ranks: {theirs}")
    return value


def capped_nccl_options(max_ctas: int):
    """NCCL communicator options with at most ``max_ctas`` CTAs; None (and a warning) where this
    torch / NCCL build has no such knob."""
    try:
        options = dist.ProcessGroupNCCL.Options()
        options.config.min_ctas = 1
        options.config.max_ctas = max_ctas
        return options
    except AttributeError:
        warnings.warn("commlib: this torch/NCCL cannot cap NCCL's CTAs; the internode engine's collectives are "
                      "not held to the SM budget")
        return None


def rail_group(topo, world_ranks: list, options):
    """This rank's rail (the ranks of its local rank on every node); every rank creates every rail."""
    mine = None
    for loc in range(topo.ranks_per_node):
        g = dist.new_group([world_ranks[r] for r in topo.rail_ranks(loc)], pg_options=options)
        mine = g if loc == topo.local_rank else mine
    return mine


def node_groups(topo, world_ranks: list, **kw):
    """This rank's node group; every rank creates every node's, in the same order."""
    mine = None
    for n in range(topo.num_nodes):
        g = dist.new_group([world_ranks[r] for r in topo.node_ranks(n)], **kw)
        mine = g if n == topo.node else mine
    return mine


def choose_node_step(engine, world_ranks: list) -> NodeStep:
    """The node step of ``engine`` (an InternodeBackend being built: its topology, group, nccl,
    comm_device, nccl_ctas, ctx, probe and _wait_for; sets its node_group where one is made).

    The IPC forwarder kernel where the node's GPUs map each other's memory (NCCL, CUDA, CuPy,
    COMMLIB_NODE_FANOUT=kernel): its node group carries only IPC handles and barriers, so it is a
    gloo group (no NCCL communicator, no device memory). Else the node group's all-to-all (an NCCL
    group on NCCL, made only where some node needs it); nothing with one rank per node."""
    topo, e = engine.topology, engine
    if topo.ranks_per_node == 1:
        return NODE_STEPS["local"](None, 0, 1, e.comm_device, e._wait_for)
    forwarder, side = False, None
    if e.nccl and e.comm_device.type == "cuda" and same_everywhere(
            env.node_fanout(), e.group, "COMMLIB_NODE_FANOUT", topo.rank, topo.num_ranks) == "kernel":
        side = node_groups(topo, world_ranks, backend="gloo")
        if cupy_available():
            facts = [None] * topo.ranks_per_node
            dist.all_gather_object(facts, local_facts(e.comm_device), group=side)
            forwarder = share_memory(facts)
            if not forwarder:
                warnings.warn(f"commlib rank {topo.rank}: the ranks of node {topo.node} cannot map each other's "
                              "GPU memory (other hosts, or no peer access); the node step uses NCCL")
        everyone = [None] * topo.num_ranks
        dist.all_gather_object(everyone, forwarder, group=e.group)
        need_groups = not all(everyone)
    else:
        need_groups = True
    if need_groups:   # some node runs the node step on its group
        options = capped_nccl_options(e.nccl_ctas) if e.nccl else None
        e.node_group = node_groups(topo, world_ranks, pg_options=options)
    if forwarder:
        return NODE_STEPS["kernel"](side, e.comm_device, e.nccl_ctas, e.ctx.timeout_s, e.probe,
                                    budget=e.ctx.num_nvl_bytes, gpu_share=getattr(e.ctx, "gpu_share", 1))
    return NODE_STEPS["nccl"](e.node_group, topo.local_rank, topo.ranks_per_node, e.comm_device, e._wait_for)


__all__ = ["same_everywhere", "capped_nccl_options", "rail_group", "node_groups", "choose_node_step"]
