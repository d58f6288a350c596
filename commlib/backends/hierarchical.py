"""Hierarchical engine: across nodes once per node over the network, then a fan-out inside the node.

It is the reference algorithm (backends/reference.py) with its two data hops handed to real
transports:
  network hop  all_to_all_single on the rail group (the ranks sharing this local rank, one per
               node); on GPUs that group is NCCL, which runs over InfiniBand / RoCE between nodes.
  fan-out      an intranode Buffer on the node's ranks (the NVLink engine on GPUs, the reference
               transport on CPUs): each forwarded row is *dispatched* to the ranks of this node that
               hold its experts, and combine's node-level reduction is that Buffer's *combine*
               (float32 sum in local-rank order, cast to bf16: exactly the partial the reference
               sends back across the network).
Metadata (counts, the rank prefix matrix, channel prefixes) stays on the world group, so handles
and outputs are those of the reference backend, bit for bit.

The forwarded row is the reference's packed byte row (hidden, FP8 scales, source token, top-k ids
and weights) plus the source rank, padded to 16 bytes and viewed as bf16: the intranode engine
moves it unchanged. Its routing there is the node-local view of the token's experts.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .base import CombineRequest, DispatchRequest
from .reference import ReferenceBackend


def _pad16(n: int) -> int:
    return (n + 15) // 16 * 16


class HierarchicalBackend(ReferenceBackend):
    name = "hierarchical"

    def __init__(self, buffer, intranode_backend: Optional[str] = None) -> None:
        super().__init__(buffer)
        topo = self.topology
        if topo.num_nodes < 2:
            raise ValueError(f"[commlib rank {topo.rank}] the hierarchical engine needs several nodes, the "
                             "topology has one (use nvlink or reference)")
        # Every rank creates every group, in the same order (torch.distributed's rule).
        world_ranks = dist.get_process_group_ranks(self.group)
        self.rail_group = self.node_group = None
        for l in range(topo.ranks_per_node):
            g = dist.new_group([world_ranks[r] for r in topo.rail_ranks(l)])
            if l == topo.local_rank:
                self.rail_group = g
        for n in range(topo.num_nodes):
            g = dist.new_group([world_ranks[r] for r in topo.node_ranks(n)])
            if n == topo.node:
                self.node_group = g
        self.intranode_backend = intranode_backend or ("nvlink" if buffer.device.type == "cuda" else "reference")
        self._node_buffer = None
        self._node_buffer_bytes = 0

    def destroy(self) -> None:
        if self._node_buffer is not None:
            self._node_buffer.destroy()
            self._node_buffer = None

    # ------------------------------------------------------------------ network hop
    def _network_a2a(self, rows, send_counts, recv_counts):
        rail = self.topology.rail_ranks()
        send = [send_counts[r] for r in rail]
        recv = [recv_counts[r] for r in rail]
        rows = rows.to(self.comm_device).contiguous()
        out = torch.empty(sum(recv), rows.shape[1], dtype=rows.dtype, device=self.comm_device)
        self._wait(dist.all_to_all_single(out, rows, recv, send, group=self.rail_group, async_op=True))
        return out

    # ------------------------------------------------------------------ fan-out
    def _node(self, row_bytes: int, config):
        """The intranode Buffer, (re)made when a call needs more buffer than it has (collective)."""
        from ..buffer import Buffer
        P = self.topology.ranks_per_node
        need = max(self.buffer.num_nvl_bytes, config.get_nvl_buffer_size_hint(row_bytes, P))
        if self._node_buffer is None or need > self._node_buffer_bytes:
            if self._node_buffer is not None:
                self._node_buffer.destroy()
            self._node_buffer = Buffer(self.node_group, need, ranks_per_node=P, backend=self.intranode_backend)
            self._node_buffer_bytes = need
        return self._node_buffer.backend

    def _fanout(self, recv1, src_rank1, packer, num_experts, cached_plan, req):
        topo = self.topology
        M, node = topo.num_nodes, topo.node
        J, row_bytes = recv1.shape
        width = _pad16(row_bytes + 4)
        rows = torch.zeros(J, width, dtype=torch.uint8, device=recv1.device)
        rows[:, :row_bytes] = recv1
        rows[:, row_bytes:row_bytes + 4] = src_rank1.view(torch.uint8).view(-1, 4)
        x = rows.view(torch.bfloat16).to(self.buffer.device)
        config = req.config
        node_backend = self._node(width, config)
        if cached_plan is not None:
            sub = DispatchRequest(x, None, None, None, None, cached_plan["node_handle"], 0, 1, 0, config)
        else:
            # node-local routing: experts of this node, renumbered for a P-rank world of E / M experts
            topk = packer.unpack(recv1)["topk_idx"]
            per_node = num_experts // M
            local = topk - node * per_node
            local = torch.where((topk >= 0) & (local >= 0) & (local < per_node), local, torch.full_like(local, -1))
            local = local.to(self.buffer.device).contiguous()
            layout = node_backend.get_dispatch_layout(local, per_node)
            sub = DispatchRequest(x, None, local, None, layout, None, per_node, 1, 0, config)
        res = node_backend.dispatch(sub)
        node_handle = res.handle
        self._count_node_rows(node_handle)
        got = res.recv_x.view(torch.uint8).view(-1, width).to(self.comm_device)
        arrived_src = got[:, row_bytes:row_bytes + 4].contiguous().view(torch.int32).flatten()
        return got[:, :row_bytes].contiguous(), arrived_src, {"node_handle": node_handle}

    def _count_node_rows(self, node_handle) -> None:
        """Rows the fan-out moved (from the node handle: send_head >= 0 marks a row sent to that rank)."""
        topo = self.topology
        heads = node_handle.send_head
        for p in range(topo.ranks_per_node):
            n = int((heads[:, p] >= 0).sum())
            key = "local_rows" if p == topo.local_rank else "intranode_rows"
            self.counters[key] += n

    def _fanout_reduce(self, arrival, packer, plan, H, K):
        cols = packer.unpack(arrival)
        y = cols["y"].to(self.buffer.device).contiguous()
        w = cols["w"].to(self.buffer.device).contiguous() if K else None
        node_handle = plan["node_handle"]
        config = self.buffer.get_combine_config(self.topology.ranks_per_node)
        res = self._node_buffer.backend.combine(CombineRequest(y, node_handle, w, (), config))
        self._count_node_rows(node_handle)
        part_w = res.combined_topk_weights.to(self.comm_device) if K else None
        return res.combined_x.to(self.comm_device), part_w
