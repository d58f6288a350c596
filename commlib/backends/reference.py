"""Reference backend: the executable specification, on torch.distributed collectives.

It runs the same algorithm as the GPU engines, hop by hop, with all_to_all_single:
  one node:  dispatch = one exchange of rows among the ranks; combine = the reverse + a sum
             (float32 from 0 + the biases, then the rows in rank order or the handle's sum_order).
  M nodes:   dispatch = (1) each token crosses to a node once, to the rank with the sender's local
             rank there (the "rail" peer), then (2) that forwarder fans it out to the ranks of its
             node that hold the token's experts. Combine reverses it: the forwarder reduces the
             rows of its node (float32, local-rank order, cast to bf16) before one row per node
             crosses back, and the home rank adds the node partials in node order to 0 + the biases.
Rows travel as raw bytes (gloo refuses bf16 / int16 in all_to_all_single), so every column of a
token (hidden, FP8 scales, source index, top-k ids and weights) moves in one collective.
On a gloo group with CUDA tensors the collectives run on CPU copies.

Legend: T tokens here, H hidden, K top-k, R ranks, P ranks per node, M nodes, C channels,
N rows received, J rows a forwarder received in the network hop.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from commlib import layout as L
from commlib.handle import DispatchHandle
from commlib.validate import CommlibError
from commlib.utils.math import SORT_KEY_BIG
from commlib.backends.base import Backend, CombineRequest, CombineResult, DispatchRequest, DispatchResult
from commlib.backends.common import (HOST, OPS, SIG_FIELDS, Packer, a2a_rows, bias_start, check_agreement, check_counts,
                                     gather, int32_columns, pad_rows, signature, sum_places, sum_rows, wait)


class ReferenceBackend(Backend):
    name = "reference"
    sig_fields = SIG_FIELDS   # names of signature()'s words, for the disagreement message

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.group = ctx.group
        backend = dist.get_backend(self.group)
        self.comm_device = torch.device("cpu") if backend == "gloo" else ctx.device
        self.calls = 0          # ops issued on this Buffer; identical on every rank unless ranks diverge
        self.failed: Optional[str] = None
        self._phase = ""

    # ------------------------------------------------------------------ waits and agreement
    def _wait(self, work) -> None:
        """Wait for a collective, at most COMMLIB_TIMEOUT_S; a timeout poisons the Buffer."""
        wait(work, self.ctx.timeout_s, self.topology.rank, self._phase, self.calls, self._fail)

    def _fail(self, message: str) -> None:
        self.failed = message

    def signature(self, op: int, hidden: int, num_experts: int, fp8: bool, topk: int, weights: bool,
                  config) -> list[int]:
        return signature(op, self.calls, hidden, num_experts, fp8, topk, weights, config)

    def on_rejected(self, op: int, num_experts: int = 0) -> None:
        """This rank's input was refused: tell the peers (they are waiting in the agreement)."""
        self.calls += 1
        self._phase = f"{OPS[op]} (reporting this rank's input error)"
        sig = [op, self.calls] + [0] * (len(self.sig_fields) - 2)
        try:
            self._all_gather_rows(torch.tensor([1, *sig] + [0] * self._extra_len, dtype=torch.int64, device=HOST))
        except CommlibError:
            pass

    def _agree(self, sig: list[int], extra: list[int]) -> torch.Tensor:
        """All-gather [error, signature, extra]; raise on every rank if any rank refused its input
        or the ranks disagree on the op. Returns the gathered extras [R, len(extra)]."""
        me = self.topology.rank
        self._phase = f"{OPS[sig[0]]} (agreement + count exchange)"
        n = len(sig)
        # Fixed length whatever the op, so mismatched ops meet in a same-sized collective.
        row = [0, *sig, *extra] + [0] * (self._extra_len - len(extra))
        g = self._all_gather_rows(torch.tensor(row, dtype=torch.int64, device=HOST))
        check_agreement(me, g[:, :1 + n].tolist(), sig, self.sig_fields, 1 + n)
        return g[:, 1 + n:1 + n + len(extra)]

    @property
    def _extra_len(self) -> int:
        return self.topology.num_ranks + 1  # dispatch: per-rank counts + tokens over the node limit

    # ------------------------------------------------------------------ collectives
    def _to_comm(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if t is None else t.to(self.comm_device)

    def _a2a_rows(self, rows: torch.Tensor, send_counts: list[int], recv_counts: list[int],
                  group=None) -> torch.Tensor:
        """Rows to every rank of ``group`` (the Buffer's by default), ``send_counts`` rows each."""
        return a2a_rows(rows, send_counts, recv_counts, group or self.group, self.comm_device, self._wait)

    def _gather(self, row: torch.Tensor, group=None) -> torch.Tensor:
        """[n] -> [ranks of ``group``, n] on the comm device (row r from rank r); no host read."""
        return gather(row, group or self.group, self.comm_device, self._wait)

    def _all_gather_rows(self, row: torch.Tensor) -> torch.Tensor:
        """[n] int64 -> [R, n] int64 on the host (row r from rank r)."""
        return self._gather(row.to(torch.int64)).cpu()

    # ------------------------------------------------------------------ layout
    def get_dispatch_layout(self, topk_idx, num_experts):
        return L.dispatch_layout(topk_idx, num_experts, self.topology)

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, req: DispatchRequest) -> DispatchResult:
        topo = self.topology
        me, R = topo.rank, topo.num_ranks
        x, scales = req.x, req.x_scales
        T, H = x.shape
        out_device = x.device
        cached = req.handle is not None
        C = req.handle.num_channels if cached else req.config.num_channels
        self.calls += 1
        K = req.topk_idx.shape[1] if req.topk_idx is not None else 0
        sig = self.signature(2 if cached else 1, H, req.handle.num_experts if cached else req.num_experts,
                             scales is not None, K, req.topk_weights is not None, req.config)
        is_tir = (req.handle.is_token_in_rank if cached else req.layout.is_token_in_rank).to(self.comm_device)

        # ---- metadata: counts matrix, errors agreed on by every rank ----
        if cached:
            h = req.handle
            rank_prefix = h.rank_prefix_matrix.cpu()
            counts_all = torch.diff(rank_prefix.to(torch.int64), dim=0,
                                    prepend=torch.zeros(1, R, dtype=torch.int64, device=HOST))
            chan_prefix = h.channel_prefix_matrix
            recv_chan_prefix = h.recv_channel_prefix_matrix
            num_experts = h.num_experts
            self._agree(sig, [])
        else:
            num_experts = req.num_experts
            send_counts = is_tir.sum(dim=0).to(torch.int64)
            node_excess = 0
            if topo.num_nodes > 1:
                nodes_per_token = L.token_in_node(is_tir, topo).sum(dim=1)
                limit = self.ctx.max_nodes_per_token
                node_excess = int((nodes_per_token > limit).sum())
            gathered = self._agree(sig, send_counts.cpu().tolist() + [node_excess])
            counts_all = gathered[:, :R]
            check_counts(me, self.ctx.max_nodes_per_token, gathered[:, R], None, 0)
            rank_prefix = torch.cumsum(counts_all, dim=0).to(torch.int32)
            chan_prefix = L.channel_prefix_matrix(is_tir, C)
            recv_chan_prefix = self._a2a_rows(chan_prefix.contiguous().view(torch.uint8).view(R, -1).cpu(),
                                              [1] * R, [1] * R).view(torch.int32).view(R, C)
        recv_counts = counts_all[:, me].tolist()
        num_recv = int(sum(recv_counts))
        worst = req.num_worst_tokens
        check_counts(me, self.ctx.max_nodes_per_token, None, counts_all, worst)

        # ---- the payload: one byte row per token ----
        self._phase = "dispatch (data exchange)"
        has_w = req.topk_weights is not None
        cols = [("x", x.dtype, (H,))]
        tensors = [x]
        if scales is not None:
            cols.append(("scales", torch.float32, (scales.shape[1],)))
            tensors.append(scales)
        cols.append(("src_idx", torch.int32, ()))
        tensors.append(torch.arange(T, dtype=torch.int32, device=out_device))
        if K:
            cols.append(("topk_idx", torch.int64, (K,)))
            tensors.append(req.topk_idx)
            if has_w:
                cols.append(("topk_w", torch.float32, (K,)))
                tensors.append(req.topk_weights)
        elif not cached and topo.num_nodes > 1:
            # no top-k to route by at the forwarder: the row carries its is_token_in_rank
            cols.append(("tir", torch.uint8, (R,)))
            tensors.append(is_tir.to(torch.uint8))
        packer = Packer(cols)
        payload = packer.pack([self._to_comm(t) for t in tensors])

        if topo.num_nodes == 1:
            recv, plan = self._dispatch_flat(payload, is_tir, counts_all)
        else:
            recv, plan = self._dispatch_hierarchical(payload, packer, is_tir, counts_all, req, num_experts, cached)
        cols_out = packer.unpack(recv)

        # ---- outputs ----
        rows = max(num_recv, worst) if worst else num_recv
        recv_x = pad_rows(cols_out["x"], rows, 0).to(out_device)
        recv_scales = pad_rows(cols_out["scales"], rows, 0).to(out_device) if scales is not None else None
        recv_src_idx = pad_rows(cols_out["src_idx"], rows, -1).to(out_device)
        recv_topk_idx = recv_topk_w = per_expert = None
        num_local = num_experts // R
        if not cached and K:
            local_idx = L.local_expert_ids(cols_out["topk_idx"], me, num_local)
            if not worst:
                per_expert = L.tokens_per_expert_list(local_idx, num_local, req.expert_alignment)
            else:
                per_expert = []
            recv_topk_idx = pad_rows(local_idx, rows, -1).to(out_device)
            if has_w:
                w = torch.where(local_idx >= 0, cols_out["topk_w"], torch.zeros_like(cols_out["topk_w"]))
                recv_topk_w = pad_rows(w, rows, 0).to(out_device)
        elif not cached:
            per_expert = [] if worst else [0] * num_local

        if cached:
            handle = req.handle
        else:
            handle = DispatchHandle(
                rank_prefix_matrix=rank_prefix.to(out_device),
                channel_prefix_matrix=chan_prefix.to(out_device),
                recv_channel_prefix_matrix=recv_chan_prefix.to(out_device),
                recv_src_idx=recv_src_idx,
                is_token_in_rank=is_tir.to(out_device),
                send_head=L.send_head(is_tir, rank_prefix.to(is_tir.device), me).to(out_device),
                topology=topo, num_tokens=T, hidden=H, num_experts=num_experts, num_channels=C,
                num_recv_tokens=None if worst else num_recv, num_worst_tokens=worst, backend=self.name,
                extra={"plan": plan, "num_recv": num_recv, "counts_all": counts_all},
            )
        return DispatchResult(recv_x, recv_scales, recv_topk_idx, recv_topk_w, per_expert, handle)

    def _dispatch_flat(self, payload, is_tir, counts_all):
        me, R = self.topology.rank, self.topology.num_ranks
        order = [torch.nonzero(is_tir[:, r]).flatten() for r in range(R)]
        send = payload[torch.cat(order)] if order else payload[:0]
        send_counts = [int(o.numel()) for o in order]
        recv_counts = counts_all[:, me].tolist()
        recv = self._a2a_rows(send, send_counts, recv_counts)
        self._count_rows(send_counts, intranode=True)
        return recv, {"order": order, "recv_counts": recv_counts}

    def _dispatch_hierarchical(self, payload, packer, is_tir, counts_all, req, num_experts, cached):
        topo = self.topology
        me, R, M = topo.rank, topo.num_ranks, topo.num_nodes
        local = topo.local_rank
        in_node = L.token_in_node(is_tir, topo)

        # (1) network hop: each token once to each node it needs, to the rail peer there.
        order1 = [torch.nonzero(in_node[:, m]).flatten() for m in range(M)]
        send1_counts = [0] * R
        for m in range(M):
            send1_counts[topo.global_rank(m, local)] = int(order1[m].numel())
        counts1 = self._all_gather_rows(torch.tensor(send1_counts, device=HOST))
        recv1_counts = counts1[:, me].tolist()
        send1 = payload[torch.cat(order1)]
        recv1 = self._network_a2a(send1, send1_counts, recv1_counts)
        self._count_rows(send1_counts, intranode=False)
        src_rank1 = torch.repeat_interleave(torch.arange(R, device=HOST), torch.tensor(recv1_counts, device=HOST)).to(torch.int32).to(recv1.device)

        # (2) fan-out inside the node, then rows grouped by source rank, token order within.
        plan = {"order1": order1, "recv1_counts": recv1_counts, "send1_counts": send1_counts}
        arrived, arrived_src, fanout_plan = self._fanout(recv1, src_rank1, packer, num_experts,
                                                         req.handle.extra["plan"] if cached else None, req)
        plan.update(fanout_plan)
        src_idx = packer.unpack(arrived)["src_idx"].flatten().to(torch.int64)
        plan["sort"] = torch.argsort(arrived_src.to(torch.int64) * SORT_KEY_BIG + src_idx, stable=True)
        return arrived[plan["sort"]], plan

    def _network_a2a(self, rows: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        """The network hop (counts are world-sized; only rail peers are non-zero)."""
        return self._a2a_rows(rows, send_counts, recv_counts)

    def _fanout(self, recv1, src_rank1, packer, num_experts, cached_plan, req):
        """Forward each row the network hop delivered to the ranks of this node that need it.

        Returns (rows as they arrive here, their source ranks, plan entries for combine)."""
        topo = self.topology
        me, R, P, node = topo.rank, topo.num_ranks, topo.ranks_per_node, topo.node
        J = recv1.shape[0]
        if cached_plan is not None:
            fwd_mask = cached_plan["fwd_mask"]
        else:
            cols1 = packer.unpack(recv1)
            tir = (L.token_in_rank(cols1["topk_idx"], num_experts, R) if "topk_idx" in cols1
                   else cols1["tir"].bool())  # [J, R]
            fwd_mask = tir[:, node * P:(node + 1) * P].contiguous()
        fwd_order = [torch.nonzero(fwd_mask[:, p]).flatten() for p in range(P)]
        send2 = torch.cat([recv1[o] for o in fwd_order]) if J else recv1[:0]
        send2_src = torch.cat([src_rank1[o] for o in fwd_order]) if J else src_rank1[:0]
        send2_counts = [0] * R
        for p in range(P):
            send2_counts[topo.global_rank(node, p)] = int(fwd_order[p].numel())
        counts2 = self._all_gather_rows(torch.tensor(send2_counts, device=HOST))
        recv2_counts = counts2[:, me].tolist()
        src_col = send2_src.view(torch.uint8).view(-1, 4)
        recv2 = self._a2a_rows(torch.cat([send2, src_col], dim=1), send2_counts, recv2_counts)
        self._count_rows(send2_counts, intranode=True)
        arrived_src = int32_columns(recv2, recv2.shape[1] - 4, recv2.shape[1]).flatten()
        plan = {"fwd_mask": fwd_mask, "fwd_order": fwd_order, "send2_counts": send2_counts,
                "recv2_counts": recv2_counts}
        return recv2[:, :-4], arrived_src, plan

    def _count_rows(self, send_counts: list[int], intranode: bool) -> None:
        topo = self.topology
        for r, n in enumerate(send_counts):
            if r == topo.rank:
                self.counters["local_rows"] += n
            elif topo.node_of(r) != topo.node:
                self.counters["internode_rows"] += n
            else:
                self.counters["intranode_rows"] += n

    # ------------------------------------------------------------------ combine
    def combine(self, req: CombineRequest) -> CombineResult:
        h = req.handle
        topo = self.topology
        T, H = h.num_tokens, req.x.shape[1]
        out_device = req.x.device
        plan_of(self, h)
        n = h.extra["num_recv"]
        y = req.x[:n]
        w = req.topk_weights[:n] if req.topk_weights is not None else None
        K = w.shape[1] if w is not None else 0
        self.calls += 1
        self._agree(self.signature(3, H, h.num_experts, False, K, w is not None, req.config), [])
        self._phase = "combine (data exchange)"
        cols = [("y", torch.bfloat16, (H,))] + ([("w", torch.float32, (K,))] if K else [])
        packer = Packer(cols)
        payload = packer.pack([self._to_comm(y)] + ([self._to_comm(w)] if K else []))
        start = bias_start(req.bias, T, H, payload.device)  # the biases first, then the rows
        if topo.num_nodes == 1:
            acc_y, acc_w = self._combine_flat(payload, packer, h, T, H, K, start, req.sum_order)
        else:
            acc_y, acc_w = self._combine_hierarchical(payload, packer, h, T, H, K, start)
        combined_x = acc_y.to(torch.bfloat16).to(out_device)
        combined_w = acc_w.to(out_device) if K else None
        return CombineResult(combined_x, combined_w)

    def _combine_flat(self, payload, packer, h, T, H, K, start, sum_order):
        plan = h.extra["plan"]
        order = plan["order"]
        back_counts = [int(o.numel()) for o in order]
        recv = self._a2a_rows(payload, plan["recv_counts"], back_counts)
        self._count_rows(plan["recv_counts"], intranode=True)
        places = sum_places(h.is_token_in_rank.to(recv.device), sum_order) if sum_order is not None else None
        return sum_rows(packer.unpack(recv), order, T, H, K, start, places)  # rank order, or sum_order's

    def _combine_hierarchical(self, payload, packer, h, T, H, K, start):
        plan = h.extra["plan"]
        # Undo the sort (back to arrival order), reduce inside the node: one bf16 row per (token, node).
        arrival = torch.empty_like(payload)
        arrival[plan["sort"]] = payload
        part_y, part_w = self._fanout_reduce(arrival, packer, plan, H, K)
        partial = packer.pack([part_y] + ([part_w] if K else []))
        back1 = self._network_a2a(partial, plan["recv1_counts"], plan["send1_counts"])
        self._count_rows(plan["recv1_counts"], intranode=False)
        return sum_rows(packer.unpack(back1), plan["order1"], T, H, K, start)  # node order

    def _fanout_reduce(self, arrival, packer, plan, H, K):
        """Combine's half of the fan-out: rows back to their forwarder, summed there in float32 in
        local-rank order; returns (bf16 [J, H], float32 [J, K] or None)."""
        back2 = self._a2a_rows(arrival, plan["recv2_counts"], plan["send2_counts"])
        self._count_rows(plan["recv2_counts"], intranode=True)
        J = int(sum(plan["recv1_counts"]))
        part_y, part_w = sum_rows(packer.unpack(back2), plan["fwd_order"], J, H, K)  # local-rank order
        return part_y.to(torch.bfloat16), part_w


def plan_of(backend, h) -> dict:
    """The backend-private plan a handle carries; a clear error for another backend's handle."""
    if h.backend != backend.name or "plan" not in h.extra:
        raise CommlibError(f"[commlib rank {backend.topology.rank}] handle was made by backend {h.backend!r}, "
                           f"not {backend.name!r}")
    return h.extra["plan"]
