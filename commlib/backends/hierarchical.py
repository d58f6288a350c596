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

Pipelining: the network hop moves in chunks of ``Config.num_max_rdma_chunked_send_tokens`` rows per
(source, destination node); chunk k+1 is on the wire (an async collective) while chunk k is fanned
out inside the node, and combine mirrors it (chunk k's node reduction overlaps chunk k-1's trip
back). Every rank runs the same number of chunks (the largest any rail pair needs), since each
chunk's fan-out is a collective of the node.

The forwarded row is the reference's packed byte row (hidden, FP8 scales, source token, top-k ids
and weights) plus the source rank, padded to 16 bytes and viewed as bf16: the intranode engine
moves it unchanged. Its routing there is the node-local view of the token's experts.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
import torch.distributed as dist

from commlib import layout as L
from commlib.utils.math import SORT_KEY_BIG, align_up
from commlib.backends.base import CombineRequest, DispatchRequest
from commlib.backends.reference import ReferenceBackend, sum_rows


# Pipeline depth of the network hop. Each chunk is one collective on the rail group plus one
# fan-out call (a count exchange with a host read on the GPU engine), ~0.3-1 ms of fixed cost, so
# chunks are never smaller than 1/MAX_NETWORK_CHUNKS of the largest rail transfer: enough stages to
# overlap the hop with the fan-out, few enough that fixed costs do not dominate (measured on
# 2 x H200: 63 chunks of 64 rows took 84 ms for a 4096-token dispatch).
MAX_NETWORK_CHUNKS = 4


def network_chunk_rows(max_rows: int, send_chunk: int) -> int:
    """Rows per network chunk: the config's send chunk, raised so that at most MAX_NETWORK_CHUNKS run."""
    return max(1, int(send_chunk), math.ceil(max_rows / MAX_NETWORK_CHUNKS))


def _clip(count: int, k: int, chunk: int) -> int:
    """Rows of chunk k out of ``count`` rows cut into chunks of ``chunk``."""
    return max(0, min(chunk, count - k * chunk))


class HierarchicalBackend(ReferenceBackend):
    name = "hierarchical"

    def __init__(self, ctx, intranode_backend: Optional[str] = None) -> None:
        super().__init__(ctx)
        topo = self.topology
        if topo.num_nodes < 2:
            raise ValueError(f"[commlib rank {topo.rank}] the hierarchical engine needs several nodes, the "
                             "topology has one (use nvlink or reference)")
        # One SM budget: NCCL's CTAs for the network hop are capped through the communicator config
        # and taken out of the fan-out's num_sms (both run at once when the hop is pipelined).
        self.network_ctas = 0
        rail_options = None
        if dist.get_backend(self.group) == "nccl":
            self.network_ctas = max(2, ctx.num_sms() // 5)
            try:
                rail_options = dist.ProcessGroupNCCL.Options()
                rail_options.config.min_ctas = 1
                rail_options.config.max_ctas = self.network_ctas
            except AttributeError:  # an NCCL build without the config knobs: uncapped, said once
                import warnings
                warnings.warn("commlib: this torch/NCCL cannot cap NCCL's CTAs; the network hop's CTAs are "
                              "not taken out of the SM budget")
                rail_options, self.network_ctas = None, 0
        # Every rank creates every group, in the same order (torch.distributed's rule).
        world_ranks = dist.get_process_group_ranks(self.group)
        self.rail_group = self.node_group = None
        for l in range(topo.ranks_per_node):
            g = dist.new_group([world_ranks[r] for r in topo.rail_ranks(l)], pg_options=rail_options)
            if l == topo.local_rank:
                self.rail_group = g
        for n in range(topo.num_nodes):
            g = dist.new_group([world_ranks[r] for r in topo.node_ranks(n)])
            if n == topo.node:
                self.node_group = g
        self.intranode_backend = intranode_backend or ("nvlink" if ctx.device.type == "cuda" else "reference")
        self._node_buffer = None
        self._node_buffer_bytes = 0

    def destroy(self) -> None:
        if self._node_buffer is not None:
            self._node_buffer.destroy()
            self._node_buffer = None

    # ------------------------------------------------------------------ pipelined hops
    def _dispatch_hierarchical(self, payload, packer, is_tir, counts_all, req, num_experts, cached):
        topo = self.topology
        me, R, M = topo.rank, topo.num_ranks, topo.num_nodes
        rail = topo.rail_ranks()
        in_node = L.token_in_node(is_tir, topo)
        order1 = [torch.nonzero(in_node[:, m]).flatten() for m in range(M)]
        send1_counts = [0] * R
        for m in range(M):
            send1_counts[rail[m]] = int(order1[m].numel())
        counts1 = self._all_gather_rows(torch.tensor(send1_counts))
        recv1_counts = counts1[:, me].tolist()
        cached_plan = req.handle.extra["plan"] if cached else None
        most = int(counts1.max())
        chunk = cached_plan["chunk"] if cached else network_chunk_rows(most, req.config.num_max_rdma_chunked_send_tokens)
        num_chunks = max(1, math.ceil(most / chunk))  # the same on every rank
        rows_to = [payload[order1[m]].to(self.comm_device) for m in range(M)]
        from_rail = [recv1_counts[r] for r in rail]

        def post(k):
            send_counts = [_clip(int(order1[m].numel()), k, chunk) for m in range(M)]
            recv_counts = [_clip(n, k, chunk) for n in from_rail]
            send = torch.cat([rows_to[m][k * chunk:k * chunk + send_counts[m]] for m in range(M)])
            out = torch.empty(sum(recv_counts), payload.shape[1], dtype=payload.dtype, device=self.comm_device)
            work = dist.all_to_all_single(out, send.contiguous(), recv_counts, send_counts, group=self.rail_group,
                                          async_op=True)
            return out, work, recv_counts

        arrived, arrived_src, node_handles = [], [], []
        in_flight = post(0)
        for k in range(num_chunks):
            recv1, work, recv_counts = in_flight
            self._wait(work)
            if k + 1 < num_chunks:
                in_flight = post(k + 1)  # on the wire while this chunk fans out
            src_rank1 = torch.repeat_interleave(torch.tensor(rail, dtype=torch.int32), torch.tensor(recv_counts))
            got, got_src, fplan = self._fanout(recv1, src_rank1.to(recv1.device), packer, num_experts,
                                               {"node_handle": cached_plan["node_handles"][k]} if cached else None,
                                               req)
            arrived.append(got)
            arrived_src.append(got_src)
            node_handles.append(fplan["node_handle"])
        self._count_rows(send1_counts, intranode=False)
        rows = torch.cat(arrived)
        src = torch.cat(arrived_src).to(torch.int64)
        src_idx = packer.unpack(rows)["src_idx"].flatten().to(torch.int64)
        sort = torch.argsort(src * SORT_KEY_BIG + src_idx, stable=True)
        plan = {"order1": order1, "recv1_counts": recv1_counts, "send1_counts": send1_counts, "chunk": chunk,
                "num_chunks": num_chunks, "node_handles": node_handles,
                "arrived_rows": [int(a.shape[0]) for a in arrived], "sort": sort}
        return rows[sort], plan

    def _combine_hierarchical(self, payload, packer, h, T, H, K):
        topo = self.topology
        M = topo.num_nodes
        rail = topo.rail_ranks()
        plan = h.extra["plan"]
        chunk, num_chunks = plan["chunk"], plan["num_chunks"]
        arrival = torch.empty_like(payload)
        arrival[plan["sort"]] = payload
        parts = arrival.split(plan["arrived_rows"])
        from_rail = [plan["recv1_counts"][r] for r in rail]
        to_node = [int(plan["order1"][m].numel()) for m in range(M)]
        back = [[] for _ in range(M)]   # partial rows from node m, chunk by chunk
        pending = None

        def land(p):
            out, work, counts = p
            self._wait(work)
            for m, part in enumerate(out.split(counts)):
                back[m].append(part)

        for k in range(num_chunks):
            part_y, part_w = self._reduce(parts[k], packer, plan["node_handles"][k], K)
            partial = packer.pack([part_y] + ([part_w] if K else [])).to(self.comm_device)
            send_counts = [_clip(n, k, chunk) for n in from_rail]
            recv_counts = [_clip(n, k, chunk) for n in to_node]
            out = torch.empty(sum(recv_counts), partial.shape[1], dtype=partial.dtype, device=self.comm_device)
            work = dist.all_to_all_single(out, partial.contiguous(), recv_counts, send_counts, group=self.rail_group,
                                          async_op=True)
            if pending is not None:
                land(pending)      # chunk k-1 came back while chunk k was reduced in the node
            pending = (out, work, recv_counts)
        land(pending)
        self._count_rows(plan["recv1_counts"], intranode=False)
        rows = torch.cat([part for m in range(M) for part in back[m]])  # node order
        return sum_rows(packer.unpack(rows), plan["order1"], T, H, K)

    # ------------------------------------------------------------------ fan-out
    def _node(self, row_bytes: int, config):
        """The intranode Buffer, (re)made when a call needs more buffer than it has (collective). Its
        size is the config's size hint: any row count streams through its rings."""
        P = self.topology.ranks_per_node
        need = max(self.ctx.num_nvl_bytes, config.get_nvl_buffer_size_hint(row_bytes, P))
        if self._node_buffer is None or need > self._node_buffer_bytes:
            if self._node_buffer is not None:
                self._node_buffer.destroy()
            self._node_buffer = self.ctx.make_node_buffer(self.node_group, need, P, self.intranode_backend)
            self._node_buffer_bytes = need
        return self._node_buffer.backend

    def _fanout(self, recv1, src_rank1, packer, num_experts, cached_plan, req):
        topo = self.topology
        M, node = topo.num_nodes, topo.node
        J, row_bytes = recv1.shape
        width = align_up(row_bytes + 4)
        rows = torch.zeros(J, width, dtype=torch.uint8, device=recv1.device)
        rows[:, :row_bytes] = recv1
        rows[:, row_bytes:row_bytes + 4] = src_rank1.view(torch.uint8).view(-1, 4)
        x = rows.view(torch.bfloat16).to(self.ctx.device)
        config = self._fanout_config(req.config)
        node_backend = self._node(width, config)
        if cached_plan is not None:
            sub = DispatchRequest(x, None, None, None, None, cached_plan["node_handle"], 0, 1, 0, config)
        else:
            # node-local routing: experts of this node, renumbered for a P-rank world of E / M experts
            topk = packer.unpack(recv1)["topk_idx"]
            per_node = num_experts // M
            local = topk - node * per_node
            local = torch.where((topk >= 0) & (local >= 0) & (local < per_node), local, torch.full_like(local, -1))
            local = local.to(self.ctx.device).contiguous()
            layout = node_backend.get_dispatch_layout(local, per_node)
            sub = DispatchRequest(x, None, local, None, layout, None, per_node, 1, 0, config)
        res = node_backend.dispatch(sub)
        node_handle = res.handle
        self._count_node_rows(node_handle)
        got = res.recv_x.view(torch.uint8).view(-1, width).to(self.comm_device)
        arrived_src = got[:, row_bytes:row_bytes + 4].contiguous().view(torch.int32).flatten()
        return got[:, :row_bytes].contiguous(), arrived_src, {"node_handle": node_handle}

    def _fanout_config(self, config):
        """The call's config less the network hop's CTAs (even, at least one channel)."""
        if not self.network_ctas:
            return config
        sms = max(2, (config.num_sms - self.network_ctas) // 2 * 2)
        return dataclasses.replace(config, num_sms=sms)

    def _count_node_rows(self, node_handle) -> None:
        """Rows the fan-out moved (from the node handle: send_head >= 0 marks a row sent to that rank)."""
        topo = self.topology
        known = node_handle.extra.get("send_counts")  # the GPU engine read them with its count exchange
        heads = node_handle.send_head
        for p in range(topo.ranks_per_node):
            n = int(known[p]) if known else int((heads[:, p] >= 0).sum())
            key = "local_rows" if p == topo.local_rank else "intranode_rows"
            self.counters[key] += n

    def _reduce(self, rows, packer, node_handle, K):
        """One chunk's node reduction: the intranode Buffer's combine (float32 sum in local-rank
        order, cast to bf16). Returns (bf16 [J_k, H], float32 [J_k, K] or None)."""
        cols = packer.unpack(rows)
        y = cols["y"].to(self.ctx.device).contiguous()
        w = cols["w"].to(self.ctx.device).contiguous() if K else None
        config = self._fanout_config(self.ctx.default_config("combine", self.topology.ranks_per_node))
        res = self._node_buffer.backend.combine(CombineRequest(y, node_handle, w, (), config))
        self._count_node_rows(node_handle)
        part_w = res.combined_topk_weights.to(self.comm_device) if K else None
        return res.combined_x.to(self.comm_device), part_w
