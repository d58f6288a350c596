"""Internode engine: each token crosses the network once per node, in chunks, then fans out in the node.

Legend: T tokens here, H hidden, K top-k, R ranks, M nodes, P ranks per node, me = (node n, local
rank l), rail = the M ranks of local rank l (one per node), J rows of one landed network chunk,
Kc = the most network chunks a call may use (``COMMLIB_NETWORK_CHUNKS``), N rows received.

Dispatch (non-cached):
  1. metadata on the device, no host sync: per-rank, per-node, per-expert counts, each row's final
     position on every rank of its destination node (DeepEP's send_head), and, per destination node,
     per chunk and per local rank there, how many rows the forwarder will pass on;
  2. one all-gather of a row per rank on device tensors (signature, counts, errors, the per-chunk
     forwarding counts), reduced on the device to what this rank needs of it (``exchange_digest``:
     an error flag and every row count the data steps need; it grows with nodes, ranks per node and
     experts per rank, not with ranks x experts), then ONE host read of that;
  3. the network leg: rows packed once per (token, destination node) in chunk-major order, each
     chunk one grouped send/recv to every rail peer (``RailTransport``, the seam where a
     GPU-initiated transport can replace NCCL's host-issued one);
  4. the fan-out: while chunk k+1 is on the wire, the rows of chunk k go to the ranks of this node
     that need them (one all-to-all on the node group, sizes known from step 2) and land straight
     at their final row (the position they carry), so no sort is needed.
Cached dispatch and combine issue the same data steps from the handle's plan: no metadata, no host
read, CUDA-graph capturable on NCCL.

Combine mirrors it: rows go back to their forwarder chunk by chunk, which sums them in local-rank
order (float32, cast to bf16: the reference's node partial), the partial crosses the network back,
and the home rank sums the <= max_nodes_per_token node partials in node order. Outputs and handles
are the reference backend's bit for bit (backends/base.py states the contract).

On a gloo group (CPU ranks) the same steps run on CPU tensors; every call there also runs the
reference's agreement (host-side and free), so mismatched calls raise on every rank.
"""
from __future__ import annotations

import math
import random
import time
import warnings

import torch
import torch.distributed as dist

from commlib import layout as L
from commlib.utils import env
from commlib.utils.math import align_up
from commlib.utils.timing import thread_usage
from commlib.handle import DispatchHandle
from commlib.topology import local_facts, share_memory
from commlib.cuda.loader import cupy_available as _cupy_available
from commlib.backends.fanout import NodeFanout
from commlib.backends import internode_kernels as IK
from commlib.backends.base import CombineRequest, CombineResult, DispatchRequest, DispatchResult
from commlib.backends.reference import (_OPS, SIG_FIELDS, ReferenceBackend, _Packer, check_counts, int32_columns,
                                        plan_of, sum_rows)

# The reference's signature plus the network ring (it sets the chunk geometry every rank must share).
INTERNODE_SIG_FIELDS = SIG_FIELDS + ("rdma_recv_tokens",)


def chunk_rows(count: int, ring_rows: int, max_chunks: int) -> int:
    """Rows per network chunk of a stream of ``count`` rows: the config's ring half, raised so that
    at most ``max_chunks`` chunks carry it."""
    return max(1, ring_rows, -(-count // max_chunks))


def clip(count: int, k: int, rows: int) -> int:
    """Rows of chunk k of a stream of ``count`` rows cut into chunks of ``rows``."""
    return max(0, min(rows, count - k * rows))


def exchange_digest(g: torch.Tensor, *, n_sig: int, me: int, node: int, loc: int, M: int, P: int, Kc: int,
                    ring: int, Lx: int) -> torch.Tensor:
    """What the host needs of the gathered exchange ``g`` [R, row_len] (``InternodeBackend._row_len``),
    as one int64 vector, so the one host read of a dispatch does not grow with ranks x experts:
    [error (a refused row, ranks disagreeing on the op, ids out of range, tokens over the node limit),
    network chunks (the most of any rank's stream to any node), rows received here, the most rows a
    rank of this node receives] + this rank's rows per node [M] + rows each rail peer (node order)
    sends this node [M] + this forwarder's rows per (chunk, local rank) [Kc, P] + rows each forwarder
    of this node passes here per (chunk, forwarder) [Kc, P] + tokens per expert of this rank [Lx].
    The device path computes it with one launch (``internode_kernels.digest``); this is its spec."""
    R = g.shape[0]
    width = n_sig + R + 2 + M   # the row up to the (node, chunk, local rank) blocks
    error = ((g[:, 0] != 0) | (g[:, 1:n_sig] != g[me, 1:n_sig]).any(dim=1)
             | (g[:, n_sig + R:n_sig + R + 2] > 0).any(dim=1)).any()
    send1 = g[:, width - M:width]                                                   # [R, M]
    rows = torch.clamp((send1 + Kc - 1) // Kc, min=max(1, ring))
    chunks = ((send1 + rows - 1) // rows).max()
    totals = g[:, n_sig + node * P:n_sig + (node + 1) * P].sum(dim=0)               # [P]
    blocks = g[:, width + node * Kc * P:width + (node + 1) * Kc * P].reshape(M, P, Kc, P).sum(dim=0)   # [q, k, p]
    ex = width + M * Kc * P + me * Lx
    head = torch.stack([error.to(torch.int64), chunks, totals[loc], totals.max()])
    return torch.cat([head, send1[me], send1[loc::P, node], blocks[loc].flatten(), blocks[:, :, loc].t().flatten(),
                      g[:, ex:ex + Lx].sum(dim=0)])


def compact(mask: torch.Tensor, total: int) -> torch.Tensor:
    """Flat indices g * n + i of the True entries of ``mask`` [n, G], group by group, row order
    within a group. ``total`` (the number of True entries) comes from the host, so nothing syncs."""
    n, G = mask.shape
    if total == 0 or n == 0:
        return torch.empty(0, dtype=torch.int64, device=mask.device)
    keys = torch.arange(n * G, dtype=torch.int64, device=mask.device).view(G, n)
    keys = torch.where(mask.t(), keys, torch.full_like(keys, n * G))
    return keys.flatten().sort().values[:total]


def _ring_rows(config) -> int:
    """Rows of one network chunk slot: half of a (node, channel) ring of the Config, over its channels
    (the size hint's ring: Config.rdma_ring_bytes)."""
    return max(1, config.num_channels * config.num_max_rdma_chunked_recv_tokens // 2)


class RailTransport:
    """The network step of a chunk: rows to and from every rail peer (one per node).

    ``exchange`` posts it and returns a token; ``land`` makes the current stream wait for it (NCCL:
    no host wait) or waits on the host with a deadline (gloo). The only seam between the engine and
    the network: a GPU-initiated transport (NCCL's device API) can replace this class.
    """

    def __init__(self, group, backend: ReferenceBackend) -> None:
        self.group = group
        self.backend = backend
        self.stall_ms = env.debug_network_stall_ms()
        self._rng = random.Random(1000 + backend.topology.rank)

    def _stall(self) -> None:
        if self.stall_ms:
            time.sleep(self._rng.uniform(0, self.stall_ms) / 1000)

    def exchange(self, send: torch.Tensor, send_splits: list, recv_splits: list, out=None):
        """Post one chunk; ``out``: where the rows land (contiguous, sum(recv_splits) rows), else a new tensor."""
        self._stall()
        if out is None:
            out = torch.empty(sum(recv_splits), *send.shape[1:], dtype=send.dtype, device=send.device)
        work = dist.all_to_all_single(out, send, recv_splits, send_splits, group=self.group, async_op=True)
        return out, work

    def land(self, posted, what: str) -> torch.Tensor:
        out, work = posted
        self._stall()
        self.backend._phase = what
        self.backend._wait(work)
        return out


class InternodeBackend(ReferenceBackend):
    name = "internode"
    sig_fields = INTERNODE_SIG_FIELDS
    # without top-k the per-expert list comes from the senders' num_tokens_per_expert, summed in the
    # count exchange: the Buffer needs no collective of its own for it
    counts_experts_without_topk = True

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        topo = self.topology
        if topo.num_nodes < 2:
            raise ValueError(f"[commlib rank {topo.rank}] the internode engine needs several nodes, the "
                             "topology has one (use nvlink or reference)")
        self.nccl = dist.get_backend(self.group) == "nccl"
        self.max_chunks = env.network_chunks()
        theirs = [None] * topo.num_ranks
        dist.all_gather_object(theirs, self.max_chunks, group=self.group)
        if any(t != self.max_chunks for t in theirs):
            raise ValueError(f"[commlib rank {topo.rank}] COMMLIB_NETWORK_CHUNKS differs between ranks: {theirs}")
        if topo.ranks_per_node == 1:
            # chunks pay only where the fan-out of chunk k overlaps chunk k + 1 on the wire; with one rank
            # per node there is no fan-out, and every chunk would be one more collective to issue
            self.max_chunks = 1
        # One SM budget: the network leg (rail) and the fan-out (node) run at once, so NCCL's CTAs for
        # each are capped at half of the Buffer's SM budget when the groups are made.
        self.nccl_ctas = max(1, ctx.num_sms() // 2) if self.nccl else 0
        rail_options = node_options = None
        if self.nccl:
            rail_options, node_options = _capped_nccl_options(self.nccl_ctas), _capped_nccl_options(self.nccl_ctas)
        # Every rank creates every group, in the same order (torch.distributed's rule).
        world_ranks = dist.get_process_group_ranks(self.group)
        self.rail_group = self.node_group = None
        for loc in range(topo.ranks_per_node):
            g = dist.new_group([world_ranks[r] for r in topo.rail_ranks(loc)], pg_options=rail_options)
            if loc == topo.local_rank:
                self.rail_group = g
        for n in range(topo.num_nodes):
            g = dist.new_group([world_ranks[r] for r in topo.node_ranks(n)], pg_options=node_options)
            if n == topo.node:
                self.node_group = g
        self.network = RailTransport(self.rail_group, self)
        # The fan-out inside a node on GPUs: the forwarder kernel over CUDA IPC (backends/fanout.py) on
        # the other half of the SM budget; CPU ranks (and COMMLIB_NODE_FANOUT=nccl) use the node group.
        self.fanout = None
        if self.nccl and self.comm_device.type == "cuda" and topo.ranks_per_node > 1:
            mode = env.node_fanout()
            theirs = [None] * topo.num_ranks
            dist.all_gather_object(theirs, mode, group=self.group)
            if any(t != mode for t in theirs):
                raise ValueError(f"[commlib rank {topo.rank}] COMMLIB_NODE_FANOUT differs between ranks: {theirs}")
            if mode == "kernel" and _cupy_available():   # the kernels load through CuPy
                # the node's ranks must map each other's memory (one host, peer access); where not
                # (e.g. nodes emulated across hosts, GPUs without peer access), the node all-to-all
                facts = [None] * topo.ranks_per_node
                dist.all_gather_object(facts, local_facts(self.comm_device), group=self.node_group)
                if share_memory(facts):
                    with torch.cuda.device(self.comm_device):
                        self.fanout = NodeFanout(self.node_group, self.comm_device, num_ctas=self.nccl_ctas,
                                                 timeout_s=self.ctx.timeout_s)
                else:
                    warnings.warn(f"commlib rank {topo.rank}: the ranks of node {topo.node} cannot map each other's "
                                  "GPU memory (other hosts, or no peer access); the fan-out inside it uses NCCL")
        # The per-token steps as kernels (csrc/internode.cu) where the rows go straight to their rows:
        # one rank per node, or the forwarder kernel. Their wire format is the torch steps', so ranks
        # need not agree on it (COMMLIB_INTERNODE_KERNELS=0: the torch steps, for comparison).
        self.device_steps = (self.nccl and self.comm_device.type == "cuda" and _cupy_available()
                             and (topo.ranks_per_node == 1 or self.fanout is not None) and env.internode_kernels())
        self.host_reads = 0      # device -> host reads of counts (tests: one per non-cached dispatch)
        self.host_read_s = 0.0   # seconds blocked in them (benchmarks: host time = wall time less this)
        # this thread's (CPU s, voluntary, involuntary switches) in them (thread_usage; benchmarks set it
        # to a tuple to have it kept: a spinning wait is CPU time too, and not the engine's)
        self.host_read_usage = None
        # where a call's host time goes (benchmarks --profile): a list of (step, perf_counter, host_read_s,
        # thread_usage(), host_read_usage) marks while not None; one attribute test per step otherwise
        self.trace = None
        self._head, self._head_busy = None, False   # the meta kernel's head row (_head_row)
        # E of the last dispatch: a rank whose dispatch input is refused on NCCL sends an agreement row
        # of that length (the peers' rows have their E; the first dispatch refused: see on_rejected)
        self._last_num_experts = 0

    def destroy(self) -> None:
        """Free the fan-out's IPC area (collective-free, as the nvlink engine: safe from __del__)."""
        if self.fanout is not None:
            self.fanout.close()
            self.fanout = None
        super().destroy()

    # ------------------------------------------------------------------ helpers
    def _wait(self, work) -> None:
        """NCCL: the current stream waits for the collective, the host does not (a wait with a deadline
        would block the host until the transfer ends; NCCL's watchdog bounds it with the process
        group's timeout). gloo: the reference's host wait with COMMLIB_TIMEOUT_S."""
        if self.nccl:
            work.wait()
        else:
            super()._wait(work)

    def _mark(self, step: str) -> None:
        """End of ``step`` of the current call, for the host-time trace (``self.trace``)."""
        if self.trace is not None:
            self.trace.append((step, time.perf_counter(), self.host_read_s, thread_usage(), self.host_read_usage))

    def _head_row(self, sig: list) -> torch.Tensor:
        """[0] + ``sig`` (int64) for the meta kernel, in pinned host memory it reads through the mapped
        address (no copy, no allocation per call). Kept between calls; rewritten only when a host read
        (``_read``) has shown the stream past its meta kernel (else a fresh one is made)."""
        n = 1 + len(sig)
        if self._head is None or self._head[0].numel() != n or self._head_busy:
            t = torch.zeros(n, dtype=torch.int64).pin_memory()
            self._head = (t, t.numpy())
        t, arr = self._head
        arr[1:] = sig
        self._head_busy = True
        return t

    def _h2d(self, values: list, dtype=torch.int64) -> torch.Tensor:
        """A small host list on the comm device without a stream sync (pinned, non-blocking)."""
        t = torch.tensor(values, dtype=dtype)
        if self.comm_device.type == "cuda":
            return t.pin_memory().to(self.comm_device, non_blocking=True)
        return t

    def _node_a2a(self, send: torch.Tensor, send_splits: list, recv_splits: list) -> torch.Tensor:
        """The fan-out step on the node group (one rank per node: the rows stay here)."""
        if self.topology.ranks_per_node == 1:
            return send
        return self._a2a_rows(send, send_splits, recv_splits, self.node_group)

    # how _read brings a tensor to the host (a synchronous copy); experiments/host_cost_wait swaps it
    _to_host = staticmethod(torch.Tensor.cpu)

    def _read(self, t: torch.Tensor) -> torch.Tensor:
        """The one device -> host read of a non-cached dispatch."""
        self.host_reads += 1
        u0 = thread_usage() if self.host_read_usage is not None else None
        t0 = time.perf_counter()
        out = self._to_host(t)
        self.host_read_s += time.perf_counter() - t0
        if u0 is not None:
            self.host_read_usage = tuple(a + b - c for a, b, c in zip(self.host_read_usage, thread_usage(), u0))
        self._head_busy = False   # the stream is past every kernel before the read: the head row was read
        return out

    def on_rejected(self, op: int, num_experts: int = 0) -> None:
        """This rank's input was refused: take part in what the peers run before they can raise.

        gloo: the reference's agreement (every op starts with it there). NCCL: a dispatch's count
        exchange with the error word set; the row is sized by the call's num_experts (or
        the previous dispatch's, where the refused call did not say: a wrong guess leaves the peers to
        NCCL's timeout). Cached dispatch and combine have no exchange on NCCL (as on the nvlink engine).
        """
        if not self.nccl:
            return super().on_rejected(op, num_experts)
        if op != 1:
            return  # cached dispatch / combine have no agreement on NCCL: the peers' NCCL timeout names it
        self.calls += 1
        row = self._h2d([1] + [0] * (self._row_len(num_experts or self._last_num_experts) - 1))
        self._gather(row)

    def _kernels_fit(self, req: DispatchRequest) -> bool:
        """Whether a non-cached dispatch takes the per-token kernels: where ``device_steps`` holds, without
        num_worst_tokens (the padded path stays torch), and with a hidden size whose rows the kernels move
        in 4-byte words in every dtype of its handle's later calls (FP8 x: H bytes; BF16: 2 H): H % 4 == 0."""
        return self.device_steps and not req.num_worst_tokens and req.x.shape[1] % 4 == 0

    def _row_len(self, num_experts: int) -> int:
        """Length of the count exchange's row: [error, signature, counts per rank, tokens over the node
        limit, expert ids out of range, rows per destination node, rows per (destination node, chunk,
        local rank there), tokens per expert, tokens]."""
        topo = self.topology
        M, P = topo.num_nodes, topo.ranks_per_node
        return 1 + len(INTERNODE_SIG_FIELDS) + topo.num_ranks + 2 + M + M * self.max_chunks * P + num_experts + 1

    def signature(self, op, hidden, num_experts, fp8, topk, weights, config) -> list:
        return super().signature(op, hidden, num_experts, fp8, topk, weights, config) + \
            [config.num_max_rdma_chunked_recv_tokens]

    def get_dispatch_layout(self, topk_idx, num_experts):
        """The reference's layout, with ids outside [-1, E) read as -1 (no host check, no device fault):
        dispatch counts them in its agreement and raises on every rank."""
        ok = (topk_idx >= -1) & (topk_idx < num_experts)
        return super().get_dispatch_layout(torch.where(ok, topk_idx, torch.full_like(topk_idx, -1)), num_experts)

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, req: DispatchRequest) -> DispatchResult:
        if req.handle is not None:
            return self._dispatch_cached(req)
        topo = self.topology
        me, R, M, P = topo.rank, topo.num_ranks, topo.num_nodes, topo.ranks_per_node
        Kc = self.max_chunks
        dev = self.comm_device
        x, scales = req.x, req.x_scales
        T, H = x.shape
        out_device = x.device
        E = req.num_experts
        Lx = E // R
        K = req.topk_idx.shape[1] if req.topk_idx is not None else 0
        has_w = req.topk_weights is not None
        self.calls += 1
        self._last_num_experts = E
        sig = self.signature(1, H, E, scales is not None, K, has_w, req.config)
        ring = _ring_rows(req.config)
        if self._kernels_fit(req):
            return self._dispatch_device(req, sig, ring)
        if not self.nccl:  # gloo: the reference's fixed-size agreement first (free on CPU ranks)
            self._agree(sig, [])

        # ---- 1. metadata on the device ----
        is_tir = req.layout.is_token_in_rank.to(dev)
        in_node = is_tir.view(T, M, P).any(dim=2)                                   # [T, M]
        per_rank = is_tir.sum(dim=0)                                                 # [R]
        send1 = in_node.sum(dim=0)                                                   # [M]
        excess = (in_node.sum(dim=1) > self.ctx.max_nodes_per_token).sum().view(1)
        bad_ids = ((req.topk_idx < -1) | (req.topk_idx >= E)).sum().view(1).to(dev) if K else excess * 0
        if K:
            topk = req.topk_idx.to(dev)
            ids = torch.where((topk >= 0) & (topk < E), topk, torch.full_like(topk, E)).flatten()
            per_expert = torch.zeros(E + 1, dtype=torch.int64, device=dev)
            per_expert.scatter_add_(0, ids, torch.ones_like(ids))
            per_expert = per_expert[:E]
        else:
            per_expert = req.layout.num_tokens_per_expert.to(dev, torch.int64)
        worst = req.num_worst_tokens
        # num_worst_tokens: no host read, every stream padded to cap = num_worst_tokens // R tokens
        over_cap = bool(worst) and T > worst // R
        head = self._h2d([int(over_cap)] + sig)
        # per destination node m, chunk k, local rank p: rows the forwarder (m, l) passes to p
        spos = torch.cumsum(in_node.to(torch.int64), dim=0) - 1                     # [T, M]
        crows = torch.clamp((send1 + Kc - 1) // Kc, min=ring)                        # [M] rows per chunk
        chunk = torch.where(in_node, spos // crows, torch.zeros_like(spos))         # [T, M]
        slot = ((torch.arange(M, device=dev).view(1, M) * Kc + chunk) * P).unsqueeze(2) + \
            torch.arange(P, device=dev).view(1, 1, P)                               # [T, M, P]
        blocks = torch.zeros(M * Kc * P, dtype=torch.int64, device=dev)
        blocks.scatter_add_(0, slot.flatten(), is_tir.to(torch.int64).flatten())
        row = torch.cat([head, per_rank, excess, bad_ids, send1, blocks, per_expert, per_rank.new_full((1,), T)])

        # ---- 2. one collective, one host read ----
        self._phase = "dispatch (agreement + count exchange)"
        g = self._gather(row)                                                        # [R, row]
        n_sig = 1 + len(sig)
        if over_cap:
            raise ValueError(f"[commlib rank {me}] dispatch with num_worst_tokens={worst} sends at most "
                             f"num_worst_tokens // num_ranks = {worst // R} tokens per rank (the padded streams "
                             f"that need no host read); this rank has {T}")
        if worst:
            return self._dispatch_padded(req, g, sig, n_sig, is_tir, in_node, spos, topk if K else None, ring)
        tokens_of = g[:, -1]                                                         # [R] T of every rank
        counts = self._read_counts(g, self._digest(g, E, n_sig, ring), sig, n_sig, E)
        num_recv, expert_counts = counts["num_recv"], counts["experts"]

        # ---- the handle's matrices (device, from the gathered counts: no host -> device copy) ----
        C = req.config.num_channels
        counts_dev = g[:, n_sig:n_sig + R]
        rank_prefix = torch.cumsum(counts_dev, dim=0).to(torch.int32)
        chan_prefix = L.channel_prefix_matrix(is_tir, C)
        send_head = L.send_head(is_tir, rank_prefix, me)                             # [T, R] final rows

        # ---- 3. the plan: chunk geometry (host) and row order (device) ----
        plan = self._plan(counts, ring, in_node, chunk, T)
        plan["node_rows"] = counts["node_rows"]
        packer, tensors = self._payload(req, topk if K else None)
        plan["area_row"] = _area_row(packer, H, K)
        plan["num_recv"] = num_recv
        recv = self._move(packer, tensors, send_head, plan)
        cols = packer.unpack(recv)

        # ---- outputs, as the reference makes them ----
        recv_x = cols["x"].to(out_device)
        recv_scales = cols["scales"].to(out_device) if scales is not None else None
        recv_src_idx = cols["src_idx"].to(out_device)
        # each source's channel prefixes towards this rank, from the rows that landed (no collective)
        recv_chan_prefix = L.recv_channel_prefix(cols["src_idx"], rank_prefix[:, me], tokens_of, C)
        recv_topk_idx = recv_topk_w = None
        if K:
            local_idx = L.local_expert_ids(cols["topk_idx"], me, Lx)
            recv_topk_idx = local_idx.to(out_device)
            if has_w:
                w = torch.where(local_idx >= 0, cols["topk_w"], torch.zeros_like(cols["topk_w"]))
                recv_topk_w = w.to(out_device)
        per_expert_list = [align_up(int(c), req.expert_alignment) for c in expert_counts]
        handle = DispatchHandle(
            rank_prefix_matrix=rank_prefix.to(out_device), channel_prefix_matrix=chan_prefix.to(out_device),
            recv_channel_prefix_matrix=recv_chan_prefix.to(out_device), recv_src_idx=recv_src_idx,
            is_token_in_rank=is_tir.to(out_device), send_head=send_head.to(out_device),
            topology=topo, num_tokens=T, hidden=H, num_experts=E, num_channels=C,
            num_recv_tokens=num_recv, num_worst_tokens=0, backend=self.name,
            extra={"plan": plan, "num_recv": num_recv})
        return DispatchResult(recv_x, recv_scales, recv_topk_idx, recv_topk_w, per_expert_list, handle)

    # ------------------------------------------------------------------ dispatch on the device kernels
    def _dispatch_device(self, req: DispatchRequest, sig: list, ring: int) -> DispatchResult:
        """A non-cached dispatch with the per-token steps as kernels (``internode_kernels``): meta (the
        exchange row, scans), the one exchange and read, pack (send rows, the handle's matrices), the
        network chunks (and the forwarder), land (the outputs' columns), recv_chan. The torch steps of
        ``dispatch`` are their specification; the device tests hold the two to the reference."""
        self._mark("buffer")   # the Buffer's checks and the backend's entry
        topo = self.topology
        me, R, M, P = topo.rank, topo.num_ranks, topo.num_nodes, topo.ranks_per_node
        Kc, dev = self.max_chunks, self.comm_device
        x = req.x.to(dev).contiguous()
        scales = req.x_scales.to(dev).contiguous() if req.x_scales is not None else None
        T, H = x.shape
        E = req.num_experts
        Lx = E // R
        K = req.topk_idx.shape[1] if req.topk_idx is not None else 0
        C = req.config.num_channels
        tir = req.layout.is_token_in_rank.to(dev).contiguous()
        topk = req.topk_idx.to(dev).contiguous() if K else None
        w = req.topk_weights.to(dev).contiguous() if K and req.topk_weights is not None else None
        experts_in = None if K else req.layout.num_tokens_per_expert.to(dev, torch.int32).contiguous()
        self._mark("inputs")

        # ---- 1. metadata: one launch ----
        head = self._head_row(sig)
        n_sig = 1 + len(sig)
        row = torch.empty(self._row_len(E), dtype=torch.int64, device=dev)
        before = torch.empty(T, R, dtype=torch.int32, device=dev)
        spos = torch.empty(T, M, dtype=torch.int32, device=dev)
        IK.meta(tir, topk, experts_in, head, row, before, spos, M=M, P=P, E=E, Kc=Kc, ring=ring,
                max_nodes=self.ctx.max_nodes_per_token)
        self._mark("meta")

        # ---- 2. one collective, one host read (of the gathered rows' digest) ----
        self._phase = "dispatch (agreement + count exchange)"
        g = self._gather(row)
        self._mark("exchange")
        counts = self._read_counts(g, self._digest(g, E, n_sig, ring), sig, n_sig, E)
        num_recv, expert_counts = counts["num_recv"], counts["experts"]
        self._mark("read")
        plan = self._geometry(counts, ring)
        self._mark("geometry")

        # ---- 3. pack: the send rows and the handle's matrices ----
        packer = self._packer(x, scales, K, w is not None)
        W = packer.row_bytes
        send = torch.empty(plan["send_starts"][-1], W + 4 * P, dtype=torch.uint8, device=dev)
        # the handle's int32 tensors (and the plan's) are views of one allocation: one allocation, and
        # one stream record where the Buffer hands them to the caller's stream
        n_land = plan["recv_starts"][-1] if self.fanout is None else 0
        rank_prefix, chan_prefix, recv_chan_prefix, send_head, slot, recv_src_idx, land_pos = _int32_views(
            dev, (R, R), (R, C), (R, C), (T, R), (T, M), (num_recv,), (n_land,))
        IK.pack(g, send, slot, send_head, x, scales, topk, w, me=me, M=M, P=P, Kc=Kc, ring=ring, n_sig=n_sig,
                tir=tir, before=before, spos=spos, rank_prefix=rank_prefix, chan_prefix=chan_prefix)
        plan.update(device=True, slot=slot, num_recv=num_recv, area_row=_area_row(packer, H, K),
                    node_rows=counts["node_rows"])
        self._mark("pack")

        # ---- 4. network chunks (and the forwarder), 5. land ----
        landed, addr, stride, pos_off, n_rows = self._move_device(send, W, plan, cached=False)
        self._mark("network")
        recv_x = torch.empty(num_recv, H, dtype=x.dtype, device=dev)
        recv_scales = torch.empty(num_recv, scales.shape[1], dtype=torch.float32, device=dev) \
            if scales is not None else None
        recv_topk_idx = torch.empty(num_recv, K, dtype=torch.int64, device=dev) if K else None
        recv_topk_w = torch.empty(num_recv, K, dtype=torch.float32, device=dev) if w is not None else None
        if self.fanout is None:   # combine gathers its rows by where each landed row went
            plan["land_pos"] = land_pos
        self._mark("outputs")
        IK.land(addr, n_rows, stride, pos_off, recv_x, recv_scales, recv_src_idx, recv_topk_idx, recv_topk_w, K=K, expert_lo=me * Lx, num_local=Lx,
                pos_out=plan["land_pos"] if self.fanout is None else None)
        del landed   # its memory may be reused now: the launches above read it first (stream order)
        self._mark("land")
        IK.recv_chan(recv_src_idx, g, recv_chan_prefix, n_sig=n_sig, me=me)
        self._mark("recv_chan")

        out = req.x.device
        moved = (lambda t: t) if out == dev else (lambda t: None if t is None else t.to(out))
        handle = DispatchHandle(
            rank_prefix_matrix=moved(rank_prefix), channel_prefix_matrix=moved(chan_prefix),
            recv_channel_prefix_matrix=moved(recv_chan_prefix), recv_src_idx=moved(recv_src_idx),
            is_token_in_rank=moved(tir), send_head=moved(send_head),
            topology=topo, num_tokens=T, hidden=H, num_experts=E, num_channels=C,
            num_recv_tokens=num_recv, num_worst_tokens=0, backend=self.name,
            extra={"plan": plan, "num_recv": num_recv})
        a = req.expert_alignment
        per_expert_list = expert_counts if a == 1 else [align_up(c, a) for c in expert_counts]
        return DispatchResult(moved(recv_x), moved(recv_scales), moved(recv_topk_idx), moved(recv_topk_w),
                              per_expert_list, handle)

    def _move_device(self, send: torch.Tensor, W: int, plan: dict, cached: bool) -> tuple:
        """The network chunks of the device steps. One rank per node: every chunk lands in one buffer
        (rows carry their final row at byte W); with the forwarder, chunk k fans out while k + 1 is on
        the wire and the rows sit at their final rows of this rank's area. Returns (the landing buffer or
        None, address, row stride, position byte or -1, rows) of what ``IK.land`` reads: the caller
        holds the buffer until the land kernel is launched, or the allocator could hand its memory to
        the outputs allocated in between."""
        P, dev = self.topology.ranks_per_node, self.comm_device
        nch, ss, rs = plan["num_chunks"], plan["send_starts"], plan["recv_starts"]
        post = lambda k, out=None: self.network.exchange(send[ss[k]:ss[k + 1]], plan["send_splits"][k],
                                                         plan["recv_splits"][k], out=out)
        self._count_rows_internode(plan)
        fan = self.fanout
        if fan is None:   # P == 1: NCCL runs a group's collectives in order, so the last wait covers all
            recv = torch.empty(rs[-1], W + 4 * P, dtype=torch.uint8, device=dev)
            last = None
            for k in range(nch):
                last = post(k, recv[rs[k]:rs[k + 1]])
            self._mark("network post")
            if last is not None:
                self.network.land(last, f"dispatch (network chunks 0-{nch - 1})")
            return recv, recv.data_ptr(), W + 4 * P, W, rs[-1]
        Wd = align_up(W, 16)
        fan.reserve(plan["node_rows"], plan["area_row"])
        fan.barrier()
        in_flight = post(0) if nch else None
        for k in range(nch):
            landed = self.network.land(in_flight, f"dispatch (network chunk {k} of {nch})")
            if k + 1 < nch:
                in_flight = post(k + 1)   # on the wire while chunk k fans out
            if not cached:
                plan["landed_pos"].append(int32_columns(landed, W, W + 4 * P))   # combine's sources
            self._phase = f"dispatch (fan-out of chunk {k})"
            fan.forward(landed, W, Wd)
        fan.barrier()
        return None, fan.data_address(), Wd, -1, plan["num_recv"]

    # ------------------------------------------------------------------ num_worst_tokens: no host read
    def _dispatch_padded(self, req: DispatchRequest, g: torch.Tensor, sig: list, n_sig: int,
                         is_tir: torch.Tensor, in_node: torch.Tensor, spos: torch.Tensor, topk,
                         ring: int) -> DispatchResult:
        """A dispatch with ``num_worst_tokens`` (W rows out): nothing is read to the host. Every rank
        may send cap = W // R tokens, so every (rank, node) stream is padded to cap rows and every size
        the collectives need is known on the host: chunks of ``chunk_rows(cap)`` rows, each chunk a
        fixed slot per (token, node) pair; the fan-out gathers each landed chunk to every rank of the
        node, which keeps the rows whose position for it is set.

        Cost against the counted path: the network carries cap rows per (rank, node) instead of the
        rows that go there (1 / P(a token reaches a given node) as many: ~1.0x for V3 on 2 nodes,
        ~2x at 8 nodes with 4 per token), and the node step P x the landed rows. Errors (ranks
        disagreeing, expert ids out of range, too many nodes per token) are found on the device:
        on CPU ranks every rank raises as usual; on a GPU a device-side assert stops the process
        (there is no host read to raise from)."""
        topo = self.topology
        me, R = topo.rank, topo.num_ranks
        x, scales = req.x, req.x_scales
        T, H = x.shape
        E = req.num_experts
        K = topk.shape[1] if topk is not None else 0
        has_w = req.topk_weights is not None
        worst, dev, out_device = req.num_worst_tokens, self.comm_device, x.device
        if dev.type == "cpu":   # the host has the counts for free: the counted path's checks and messages
            self._check_exchange(g, sig, n_sig, E)
        else:   # every rank's signature against this rank's own row
            problems = ((g[:, 0] != 0).any() | (g[:, 1:n_sig] != g[me, 1:n_sig].view(1, -1)).any()
                        | (g[:, n_sig + R] > 0).any() | (g[:, n_sig + R + 1] > 0).any())
            torch._assert_async(~problems, "commlib internode dispatch (num_worst_tokens): ranks disagree on the "
                                "op, an expert id is out of range, or a token reaches too many nodes")
        counts_dev = g[:, n_sig:n_sig + R]
        rank_prefix = torch.cumsum(counts_dev, dim=0).to(torch.int32)
        C = req.config.num_channels
        chan_prefix = L.channel_prefix_matrix(is_tir, C)
        send_head = L.send_head(is_tir, rank_prefix, me)
        plan = self._padded_plan(in_node, spos, worst, ring)
        plan["num_recv_dev"] = rank_prefix[-1, me].to(torch.int64)
        packer, tensors = self._payload(req, topk)
        plan["area_row"] = _area_row(packer, H, K)
        cols = packer.unpack(self._move_padded(packer, tensors, send_head, plan))
        recv_topk_idx = recv_topk_w = None
        if K:
            local_idx = L.local_expert_ids(cols["topk_idx"], me, E // R)
            recv_topk_idx = local_idx.to(out_device)
            if has_w:
                recv_topk_w = torch.where(local_idx >= 0, cols["topk_w"], torch.zeros_like(cols["topk_w"])).to(out_device)
        recv_chan_prefix = L.recv_channel_prefix(cols["src_idx"], rank_prefix[:, me], g[:, -1], C)
        handle = DispatchHandle(
            rank_prefix_matrix=rank_prefix.to(out_device), channel_prefix_matrix=chan_prefix.to(out_device),
            recv_channel_prefix_matrix=recv_chan_prefix.to(out_device), recv_src_idx=cols["src_idx"].to(out_device),
            is_token_in_rank=is_tir.to(out_device), send_head=send_head.to(out_device),
            topology=topo, num_tokens=T, hidden=H, num_experts=E, num_channels=C,
            num_recv_tokens=None, num_worst_tokens=worst, backend=self.name,
            extra={"plan": plan, "num_recv": worst})
        return DispatchResult(cols["x"].to(out_device), cols["scales"].to(out_device) if scales is not None else None,
                              recv_topk_idx, recv_topk_w, [], handle)

    def _padded_plan(self, in_node: torch.Tensor, spos: torch.Tensor, worst: int, ring: int) -> dict:
        """Host geometry of a num_worst_tokens call (the same on every rank: cap, the ring and the
        chunk cap are agreed) and each (token, node) pair's slot in the send rows: chunk-major, then
        node, then the pair's row among its node's (pairs not sent: the dump slot past the end)."""
        M = self.topology.num_nodes
        cap = worst // self.topology.num_ranks
        crows = chunk_rows(cap, ring, self.max_chunks)
        nch = -(-cap // crows)
        slots = nch * M * crows
        nodes = torch.arange(M, device=in_node.device).view(1, M)
        slot = ((spos // crows) * M + nodes) * crows + spos % crows
        slot = torch.where(in_node, slot, torch.full_like(slot, slots))            # [T, M]
        return {"padded": True, "num_chunks": nch, "crows": crows, "slots": slots, "slot": slot,
                "num_recv": worst, "fan_pos": []}

    def _move_padded(self, packer: _Packer, tensors: list, send_head: torch.Tensor, plan: dict) -> torch.Tensor:
        """The data steps of a num_worst_tokens dispatch (fresh or cached): [W rows, packer.row_bytes]."""
        topo = self.topology
        M, P, loc = topo.num_nodes, topo.ranks_per_node, topo.local_rank
        dev, W, T = self.comm_device, packer.row_bytes, send_head.shape[0]
        nch, crows, slots, rows = plan["num_chunks"], plan["crows"], plan["slots"], plan["num_recv"]
        send = torch.zeros(slots + 1, W + 4 * P, dtype=torch.uint8, device=dev)
        send[:, W:] = 0xFF                                                          # no position: -1
        if T:
            row = torch.empty(T, W + 4 * P, dtype=torch.uint8, device=dev)
            row[:, :W] = packer.pack(tensors)
            heads = send_head.view(T, M, P)
            for m in range(M):   # a token's row once per destination node, with its positions there
                row[:, W:] = heads[:, m].contiguous().view(torch.uint8).view(T, 4 * P)
                send.index_copy_(0, plan["slot"][:, m], row)
        fan = self.fanout
        # rows nothing lands on read as padding (zeros, -1 ids); without the forwarder, + the dump row
        out = torch.zeros(1 if fan is not None else rows + 1, W, dtype=torch.uint8, device=dev)
        _fill_ids(out, packer)
        per = M * crows
        cached = bool(plan["fan_pos"])
        if fan is not None:
            Wd = align_up(W, 16)
            fan.reserve(rows, plan["area_row"])
            fan.barrier()
        post = lambda k: self.network.exchange(send[k * per:(k + 1) * per], [crows] * M, [crows] * M)
        in_flight = post(0) if nch else None
        for k in range(nch):
            landed = self.network.land(in_flight, f"dispatch (network chunk {k} of {nch})")
            if k + 1 < nch:
                in_flight = post(k + 1)
            self._phase = f"dispatch (fan-out of chunk {k})"
            if fan is not None:   # [per, P]: this forwarder's landed rows (combine's map)
                if not cached:
                    plan["fan_pos"].append(int32_columns(landed, W, W + 4 * P))
                fan.forward(landed, W, Wd)
                continue
            got = landed if P == 1 else self._gather(landed.flatten(), self.node_group).view(P * per, -1)
            if not cached:
                plan["fan_pos"].append(int32_columns(got, W, W + 4 * P))          # [P * per, P] (combine's map)
            at = plan["fan_pos"][k][:, loc].to(torch.int64)
            out.index_copy_(0, torch.where(at >= 0, at, torch.full_like(at, rows)), got[:, :W])
        self._count_padded(plan)
        if fan is not None:
            fan.barrier()
            # rows past the received count hold older bytes there: the padding row instead
            # (in place: a [rows, W] copy would double the largest transient of a num_worst_tokens call)
            landed_rows = torch.arange(rows, device=dev) < plan["num_recv_dev"]
            area = fan.rows(rows, Wd)[:, :W]
            return torch.where(landed_rows.view(rows, 1), area, out, out=area)
        return out[:rows]

    def _count_padded(self, plan: dict) -> None:
        """Rows moved by a padded call, padding included (what crossed the links)."""
        topo = self.topology
        sent = plan["num_chunks"] * plan["crows"]
        self.counters["local_rows"] += sent
        self.counters["internode_rows"] += sent * (topo.num_nodes - 1)
        if self.fanout is None:   # the node all-gather; the kernel's rows are known on the device only
            self.counters["intranode_rows"] += sent * topo.num_nodes * (topo.ranks_per_node - 1)

    def _combine_padded(self, req: CombineRequest, plan: dict, packer: _Packer, w, T: int, H: int, K: int):
        """Combine of a num_worst_tokens handle: the dispatch's steps backwards with the same fixed
        sizes. Each rank of a node sends every forwarder its rows for that forwarder's landed rows
        (zeros where it has none), the forwarder sums them in local-rank order, the partial goes back
        over the network to its slot, and the home rank sums its node partials in node order.
        Adding a zero row changes no float32 sum here (a sum of rows never becomes -0.0), so this
        equals the counted path's sums of only the rows that exist."""
        topo = self.topology
        M, P, loc = topo.num_nodes, topo.ranks_per_node, topo.local_rank
        dev = self.comm_device
        nch, crows, rows = plan["num_chunks"], plan["crows"], plan["num_recv"]
        per = M * crows
        tensors = [req.x[:rows].to(dev)] + ([w] if K else [])
        fan = self.fanout
        if fan is not None:   # packed straight into this rank's area: no [rows, W] copy on the side
            Wd = self._publish(fan, lambda stride: packer.pack(tensors, out=fan.rows(rows, stride)[:, :packer.row_bytes]),
                               rows, plan["area_row"], packer.row_bytes)
        else:   # + a zero row: the slot of positions nothing landed on
            mine = torch.zeros(rows + 1, packer.row_bytes, dtype=torch.uint8, device=dev)
            packer.pack(tensors, out=mine[:rows])
        back, posted = [], None
        for k in range(nch):
            if fan is not None:   # the forwarder sums its landed rows' copies from the node's areas
                rows_k = torch.empty(per, packer.row_bytes, dtype=torch.uint8, device=dev)
                fan.reduce(plan["fan_pos"][k], H, K, rows_k, Wd)
            else:
                at = plan["fan_pos"][k][:, loc].to(torch.int64)
                rows_k = mine.index_select(0, torch.where(at >= 0, at, torch.full_like(at, rows)))  # [P * per, Wc]
            if P > 1 and fan is None:   # to each forwarder its rows, then the forwarder's sum in local-rank order
                got = packer.unpack(self._node_a2a(rows_k, [per] * P, [per] * P))
                acc_y = torch.zeros(per, H, dtype=torch.float32, device=dev)
                acc_w = torch.zeros(per, K, dtype=torch.float32, device=dev)
                for p in range(P):
                    acc_y += got["y"][p * per:(p + 1) * per].float()
                    if K:
                        acc_w += got["w"][p * per:(p + 1) * per]
                rows_k = packer.pack([acc_y.to(torch.bfloat16)] + ([acc_w] if K else []))
            if posted is not None:
                back.append(self.network.land(posted, f"combine (network chunk {k - 1})"))
            posted = self.network.exchange(rows_k, [crows] * M, [crows] * M)
        if posted is not None:
            back.append(self.network.land(posted, f"combine (network chunk {nch - 1})"))
        back.append(torch.zeros(1, packer.row_bytes, dtype=torch.uint8, device=dev))   # the dump slot
        parts = packer.unpack(torch.cat(back))
        acc_y = torch.zeros(T, H, dtype=torch.float32, device=dev)
        acc_w = torch.zeros(T, K, dtype=torch.float32, device=dev)
        for m in range(M):   # node partials in node order; pairs not sent read the zero dump slot
            slot = plan["slot"][:, m]
            acc_y += parts["y"].index_select(0, slot).float()
            if K:
                acc_w += parts["w"].index_select(0, slot)
        self._count_padded(plan)
        return acc_y, acc_w

    def _digest(self, g: torch.Tensor, E: int, n_sig: int, ring: int) -> torch.Tensor:
        """The exchange digest of ``g`` on its device: one launch on the device steps, else torch ops."""
        topo = self.topology
        M, P, Kc = topo.num_nodes, topo.ranks_per_node, self.max_chunks
        kw = dict(n_sig=n_sig, me=topo.rank, node=topo.node, loc=topo.local_rank, M=M, P=P, Kc=Kc, ring=ring,
                  Lx=E // topo.num_ranks)
        if self.device_steps and g.is_cuda:
            out = torch.empty(IK.digest_len(M, P, Kc, kw["Lx"]), dtype=torch.int64, device=g.device)
            IK.digest(g, out, **kw)
            return out
        return exchange_digest(g, **kw)

    def _read_counts(self, g: torch.Tensor, digest: torch.Tensor, sig: list, n_sig: int, E: int) -> dict:
        """The one host read of a non-cached dispatch: the digest of the gathered rows ``g``
        (``exchange_digest``: its size grows with nodes, ranks per node and experts per rank, not with
        ranks x experts) as plain lists. When it flags an error, the whole ``g`` is read too (a second
        read, on the error path only) and the checks raise alike on every rank: every rank holds the
        same ``g``."""
        topo = self.topology
        M, P, Kc, Lx = topo.num_nodes, topo.ranks_per_node, self.max_chunks, E // topo.num_ranks
        d = self._read(digest).tolist()
        if d[0]:
            self._check_exchange(self._read(g), sig, n_sig, E)
            raise RuntimeError(f"[commlib rank {topo.rank}] the count exchange flagged an error that its checks "
                               "did not find (a commlib bug: please report it)")
        i = 4 + 2 * M
        per_chunk = lambda at: [d[at + k * P:at + (k + 1) * P] for k in range(Kc)]
        return {"num_chunks": d[1], "num_recv": d[2], "node_rows": d[3], "mine": d[4:4 + M], "rail_in": d[4 + M:i],
                "fan_send": per_chunk(i), "fan_recv": per_chunk(i + Kc * P), "experts": d[i + 2 * Kc * P:i + 2 * Kc * P + Lx]}

    def _check_exchange(self, gh, sig: list, n_sig: int, E: int) -> None:
        """The count exchange's errors, raised alike on every rank (they all read the same rows ``gh``:
        the gathered rows on the host, a tensor or lists): a refused input or disagreeing ranks, expert
        ids out of range, tokens over the node limit. (num_worst_tokens is checked before the exchange:
        each rank against its cap.) Plain list reads: a few us, not one torch op per element."""
        me, R = self.topology.rank, self.topology.num_ranks
        rows = gh.tolist() if isinstance(gh, torch.Tensor) else gh
        self._check_agreement(rows, sig, n_sig)
        wrong_ids = [(r, row[n_sig + R + 1]) for r, row in enumerate(rows) if row[n_sig + R + 1] > 0]
        if wrong_ids:
            raise ValueError(f"[commlib rank {me}] dispatch aborted: topk_idx holds expert ids outside [-1, {E}) "
                             f"(rank, ids out of range): {wrong_ids}; nothing was sent")
        if any(row[n_sig + R] > 0 for row in rows):
            check_counts(me, self.ctx.max_nodes_per_token, torch.tensor([row[n_sig + R] for row in rows]), None, 0)

    def _check_agreement(self, rows: list, sig: list, n_sig: int) -> None:
        """Raise on every rank when a rank refused its input or the ranks disagree on the op (``rows``:
        the gathered rows as lists)."""
        me = self.topology.rank
        refused = [r for r, row in enumerate(rows) if row[0]]
        if refused:
            raise ValueError(f"[commlib rank {me}] dispatch aborted: rank(s) {refused} rejected their "
                             "input (see the error on those ranks); nothing was sent")
        for r, row in enumerate(rows):
            theirs = row[1:n_sig]
            if theirs != sig:
                diffs = [f"{self.sig_fields[i]}: rank {r} has {_OPS.get(theirs[i], theirs[i]) if i == 0 else theirs[i]}, "
                         f"rank {me} has {_OPS.get(sig[i], sig[i]) if i == 0 else sig[i]}"
                         for i in range(len(sig)) if theirs[i] != sig[i]]
                raise ValueError(f"[commlib rank {me}] ranks disagree on the op: " + "; ".join(diffs)
                                 + " (every rank must make the same sequence of calls with the same shapes/config)")

    def _payload(self, req: DispatchRequest, topk) -> tuple:
        """The rows a dispatch moves, as (packer, per-column tensors on the comm device): x, its
        scales, the source token index and, with ``topk`` (the ids on the comm device), the ids and
        weights. Cached dispatch passes None: its rows carry no routing."""
        x, scales, dev = req.x, req.x_scales, self.comm_device
        K = topk.shape[1] if topk is not None else 0
        has_w = K > 0 and req.topk_weights is not None
        tensors = [x.to(dev)] + ([scales.to(dev)] if scales is not None else []) + \
            [torch.arange(x.shape[0], dtype=torch.int32, device=dev)]
        if K:
            tensors.append(topk)
            if has_w:
                tensors.append(req.topk_weights.to(dev))
        return self._packer(x, scales, K, has_w), tensors

    @staticmethod
    def _packer(x, scales, K: int, has_w: bool) -> _Packer:
        H = x.shape[1]
        cols = [("x", x.dtype, (H,))]
        if scales is not None:
            cols.append(("scales", torch.float32, (scales.shape[1],)))
        cols.append(("src_idx", torch.int32, ()))
        if K:
            cols.append(("topk_idx", torch.int64, (K,)))
            if has_w:
                cols.append(("topk_w", torch.float32, (K,)))
        return _Packer(cols)

    def _geometry(self, counts: dict, ring: int) -> dict:
        """Chunk geometry: host ints from the digest (``_read_counts``) that every rank derives alike
        (rows per chunk to and from every rail peer and, in the node, to and from every forwarder),
        with each chunk's first row in the send rows and in the landed rows."""
        M, Kc = self.topology.num_nodes, self.max_chunks
        num_chunks, mine = counts["num_chunks"], counts["mine"]
        rows_of = [chunk_rows(c, ring, Kc) for c in mine]
        send_splits = [[clip(mine[m], k, rows_of[m]) for m in range(M)] for k in range(num_chunks)]
        recv_splits = [[clip(c, k, chunk_rows(c, ring, Kc)) for c in counts["rail_in"]] for k in range(num_chunks)]
        send_starts, recv_starts = [0], [0]
        for k in range(num_chunks):
            send_starts.append(send_starts[-1] + sum(send_splits[k]))
            recv_starts.append(recv_starts[-1] + sum(recv_splits[k]))
        return {"num_chunks": num_chunks, "send_splits": send_splits, "recv_splits": recv_splits,
                "fan_send": counts["fan_send"][:num_chunks], "fan_recv": counts["fan_recv"][:num_chunks],
                "home_lens": list(mine), "send_starts": send_starts, "recv_starts": recv_starts, "fan_rows": [],
                "land_pos": [], "landed_pos": []}

    def _plan(self, counts: dict, ring, in_node, chunk, T) -> dict:
        """The chunk geometry (``_geometry``) and the order of this rank's send rows (device):
        chunk-major, then node, then token."""
        M = self.topology.num_nodes
        plan = self._geometry(counts, ring)
        num_chunks = plan["num_chunks"]
        S = sum(plan["home_lens"])
        dev = in_node.device
        # send rows, chunk-major: key = (chunk * M + m) * T + t over the (token, node) pairs
        keys = (chunk * M + torch.arange(M, device=dev).view(1, M)) * T + torch.arange(T, device=dev).view(T, 1)
        keys = torch.where(in_node, keys, torch.full_like(keys, num_chunks * M * T + 1)).flatten()
        order = keys.sort().values[:S] if S else keys[:0]
        send_tok = order % T
        send_node = (order // T) % M
        # the same rows, node-major (the home sum adds node partials in node order)
        home = compact(torch.nn.functional.one_hot(send_node, M).bool(), S) % max(S, 1) if S else order
        plan.update(send_tok=send_tok, send_node=send_node, home=home)
        return plan

    def _move(self, packer: _Packer, tensors: list, send_head: torch.Tensor, plan: dict,
              cached: bool = False) -> torch.Tensor:
        """The data steps of a dispatch: pack, network chunks, fan-out, land at the final rows.
        Returns [num_recv, packer.row_bytes] uint8: every row is written once (by its forwarder)."""
        topo = self.topology
        M, P, loc = topo.num_nodes, topo.ranks_per_node, topo.local_rank
        dev = self.comm_device
        T = send_head.shape[0]
        tok, nod = plan["send_tok"], plan["send_node"]
        # each send row carries its final row on every rank of its destination node
        pos = send_head.view(T, M, P)[tok, nod] if tok.numel() else send_head.new_empty(0, P)
        base = packer.pack([t.index_select(0, tok) if t.shape[0] == T else t for t in tensors]) if tok.numel() \
            else torch.empty(0, packer.row_bytes, dtype=torch.uint8, device=dev)
        send = torch.cat([base, pos.contiguous().view(torch.uint8).view(-1, 4 * P)], dim=1) if tok.numel() \
            else torch.empty(0, packer.row_bytes + 4 * P, dtype=torch.uint8, device=dev)
        W = packer.row_bytes
        rows = plan["num_recv"]
        fan = self.fanout
        out = torch.empty(rows, W, dtype=torch.uint8, device=dev) if fan is None else None
        self._count_rows_internode(plan)
        starts = plan["send_starts"]
        post = lambda k: self.network.exchange(send[starts[k]:starts[k + 1]], plan["send_splits"][k],
                                               plan["recv_splits"][k])
        if fan is not None:   # rows land in the node's IPC areas at their final row
            Wd = align_up(W, 16)
            fan.reserve(plan["node_rows"], plan["area_row"])
            fan.barrier()
        in_flight = post(0) if plan["num_chunks"] else None
        for k in range(plan["num_chunks"]):
            landed = self.network.land(in_flight, f"dispatch (network chunk {k} of {plan['num_chunks']})")
            if k + 1 < plan["num_chunks"]:
                in_flight = post(k + 1)   # on the wire while chunk k fans out
            if fan is not None:
                if not cached:
                    plan["landed_pos"].append(int32_columns(landed, W, W + 4 * P))   # combine's sources
                self._phase = f"dispatch (fan-out of chunk {k})"
                fan.forward(landed, W, Wd)
                continue
            J = landed.shape[0]
            if cached:
                fan_rows = plan["fan_rows"][k]
            else:
                fan_rows = None  # one rank per node: every landed row is this rank's
                if P > 1:
                    lpos = int32_columns(landed, W, W + 4 * P)
                    fan_rows = compact(lpos >= 0, sum(plan["fan_send"][k])) % max(J, 1)
                plan["fan_rows"].append(fan_rows)
            self._phase = f"dispatch (fan-out of chunk {k})"
            got = self._node_a2a(landed.index_select(0, fan_rows) if fan_rows is not None else landed,
                                 plan["fan_send"][k], plan["fan_recv"][k])
            if cached:
                at = plan["land_pos"][k]
            else:
                at = int32_columns(got, W + 4 * loc, W + 4 * loc + 4).flatten().to(torch.int64)
                plan["land_pos"].append(at)
            out.index_copy_(0, at, got[:, :W])
        if fan is not None:
            fan.barrier()
            return fan.rows(rows, Wd)[:, :W]   # every row below num_recv landed; unpack copies it out
        return out

    def _count_rows_internode(self, plan: dict) -> None:
        topo = self.topology
        for m, n in enumerate(plan["home_lens"]):
            key = "local_rows" if m == topo.node else "internode_rows"
            self.counters[key] += n
        for k in range(plan["num_chunks"]):
            for p, n in enumerate(plan["fan_send"][k]):
                self.counters["local_rows" if p == topo.local_rank else "intranode_rows"] += n

    def _dispatch_cached(self, req: DispatchRequest) -> DispatchResult:
        h = req.handle
        plan = plan_of(self, h)
        self.calls += 1
        x, scales = req.x, req.x_scales
        T, H = x.shape
        if not self.nccl:
            self._agree(self.signature(2, H, h.num_experts, scales is not None, 0, False, req.config), [])
        dev = self.comm_device
        if plan.get("device"):
            return self._dispatch_cached_device(req, plan)
        packer, tensors = self._payload(req, None)
        if plan.get("padded"):
            recv = self._move_padded(packer, tensors, h.send_head.to(dev), plan)
        else:
            recv = self._move(packer, tensors, h.send_head.to(dev), plan, cached=True)
        cols = packer.unpack(recv)
        return DispatchResult(cols["x"].to(x.device), cols["scales"].to(x.device) if scales is not None else None,
                              None, None, None, h)

    def _dispatch_cached_device(self, req: DispatchRequest, plan: dict) -> DispatchResult:
        """Cached dispatch on the device kernels: pack by the plan's slots and the handle's send_head,
        the network chunks, land (no routing columns)."""
        self._mark("buffer")
        topo, dev, h = self.topology, self.comm_device, req.handle
        x = req.x.to(dev).contiguous()
        scales = req.x_scales.to(dev).contiguous() if req.x_scales is not None else None
        packer = self._packer(x, scales, 0, False)
        W = packer.row_bytes
        send = torch.empty(plan["send_starts"][-1], W + 4 * topo.ranks_per_node, dtype=torch.uint8, device=dev)
        IK.pack(None, send, plan["slot"], h.send_head.to(dev).contiguous(), x, scales, None, None, me=topo.rank,
                M=topo.num_nodes, P=topo.ranks_per_node, Kc=self.max_chunks, ring=1)
        self._mark("pack")
        landed, addr, stride, pos_off, n_rows = self._move_device(send, W, plan, cached=True)
        self._mark("network")
        n = plan["num_recv"]
        recv_x = torch.empty(n, x.shape[1], dtype=x.dtype, device=dev)
        recv_scales = torch.empty(n, scales.shape[1], dtype=torch.float32, device=dev) if scales is not None else None
        self._mark("outputs")
        IK.land(addr, n_rows, stride, pos_off, recv_x, recv_scales)
        del landed   # held until the land kernel read it
        self._mark("land")
        out = req.x.device
        return DispatchResult(recv_x.to(out), recv_scales.to(out) if scales is not None else None, None, None, None, h)

    def _combine_device(self, req: CombineRequest, plan: dict) -> CombineResult:
        """Combine on the device kernels: this rank's rows gathered per landed row (one rank per node)
        or published into its area and summed by the forwarder per chunk, the partials back over the
        network chunk by chunk, the home sum (node order, then the biases) in one launch."""
        self._mark("buffer")
        h, dev, fan = req.handle, self.comm_device, self.fanout
        n, T = plan["num_recv"], h.num_tokens
        y = _rows_on(req.x, n, dev)
        H = y.shape[1]
        w = _rows_on(req.topk_weights, n, dev) if req.topk_weights is not None else None
        K = w.shape[1] if w is not None else 0
        Wc = 2 * H + 4 * K
        nch, ss, rs = plan["num_chunks"], plan["send_starts"], plan["recv_starts"]
        partial = torch.empty(rs[-1], Wc, dtype=torch.uint8, device=dev)
        if fan is None:
            IK.rows(plan["land_pos"], rs[-1], y, w, partial.data_ptr(), Wc)
        else:   # this rank's rows written by a kernel straight into its area
            Wd = self._publish(fan, lambda stride: IK.rows(None, n, y, w, fan.data_address(), stride),
                               plan["node_rows"], plan["area_row"], Wc)
        self._mark("rows")
        back = torch.empty(ss[-1], Wc, dtype=torch.uint8, device=dev)
        last = None
        for k in range(nch):
            if fan is not None:
                fan.reduce(plan["landed_pos"][k], H, K, partial[rs[k]:rs[k + 1]], Wd)
            last = self.network.exchange(partial[rs[k]:rs[k + 1]], plan["recv_splits"][k], plan["send_splits"][k],
                                         out=back[ss[k]:ss[k + 1]])
        self._mark("network post")
        if last is not None:   # NCCL runs a group's collectives in order: the last wait covers all
            self.network.land(last, f"combine (network chunks 0-{nch - 1})")
        self._count_rows_internode(plan)
        self._mark("network")
        out_y = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
        out_w = torch.empty(T, K, dtype=torch.float32, device=dev) if K else None
        self._mark("outputs")
        IK.home(back, plan["slot"], [b.to(dev).contiguous() for b in req.bias], out_y, out_w, H=H, K=K)
        self._mark("home")
        out = req.x.device
        return CombineResult(out_y.to(out), out_w.to(out) if K else None)

    # ------------------------------------------------------------------ combine
    def combine(self, req: CombineRequest) -> CombineResult:
        h = req.handle
        plan = plan_of(self, h)
        T, H = h.num_tokens, req.x.shape[1]
        dev = self.comm_device
        n = plan["num_recv"]
        has_w = req.topk_weights is not None
        K = req.topk_weights.shape[1] if has_w else 0
        self.calls += 1
        if not self.nccl:
            self._agree(self.signature(3, H, h.num_experts, False, K, has_w, req.config), [])
        self._phase = "combine"
        if plan.get("device"):
            return self._combine_device(req, plan)
        w = _rows_on(req.topk_weights, n, dev) if has_w else None
        packer = _Packer([("y", torch.bfloat16, (H,))] + ([("w", torch.float32, (K,))] if K else []))
        if plan.get("padded"):
            acc_y, acc_w = self._combine_padded(req, plan, packer, w, T, H, K)
            return self._combined(req, acc_y, acc_w, K)
        rows = packer.pack([req.x[:n].to(dev)] + ([w] if K else []))          # [n, W] at the final rows
        S = sum(plan["home_lens"])
        back = torch.empty(S, packer.row_bytes, dtype=torch.uint8, device=dev)
        start, posted = 0, None
        fan = self.fanout
        if fan is not None:
            Wd = self._publish(fan, rows, plan["node_rows"], plan["area_row"], packer.row_bytes)
        for k in range(plan["num_chunks"]):
            J = sum(plan["recv_splits"][k])
            if fan is not None:   # the forwarder sums its landed rows' copies straight from the node's areas
                partial = torch.empty(J, packer.row_bytes, dtype=torch.uint8, device=dev)
                fan.reduce(plan["landed_pos"][k], H, K, partial, Wd)
            else:
                # rows of chunk k back to their forwarders (this rank received them in land_pos order)
                got = self._node_a2a(rows.index_select(0, plan["land_pos"][k]), plan["fan_recv"][k],
                                     plan["fan_send"][k])
                partial = self._reduce(got, packer, plan["fan_rows"][k], plan["fan_send"][k], J, H, K)
            if posted is not None:
                self._land_back(posted, back, k - 1)
            posted = (self.network.exchange(partial, plan["recv_splits"][k], plan["send_splits"][k]), start)
            start += sum(plan["send_splits"][k])
        if posted is not None:
            self._land_back(posted, back, plan["num_chunks"] - 1)
        self._count_rows_internode(plan)
        # home: node partials in node order
        tok = plan["send_tok"].index_select(0, plan["home"])
        acc_y, acc_w = sum_rows(packer.unpack(back.index_select(0, plan["home"])), tok.split(plan["home_lens"]),
                                T, H, K)
        return self._combined(req, acc_y, acc_w, K)

    def _combined(self, req: CombineRequest, acc_y: torch.Tensor, acc_w: torch.Tensor, K: int) -> CombineResult:
        """The home sum plus the biases, in bf16 (weights float32) on the caller's device."""
        for b in req.bias:
            acc_y += b.to(self.comm_device).float()
        out_device = req.x.device
        return CombineResult(acc_y.to(torch.bfloat16).to(out_device), acc_w.to(out_device) if K else None)

    @staticmethod
    def _publish(fan, rows, capacity: int, area_row: int, row_bytes: int) -> int:
        """Combine on the forwarder kernel's path: this rank's rows into its IPC area, between barriers
        (peers are past their reads of it before, every rank's rows are there after). ``rows``: uint8
        [n, row_bytes], or a callable that writes them given the areas' row stride (a kernel). Returns
        the areas' row stride."""
        Wd = align_up(row_bytes, 16)
        fan.reserve(capacity, area_row)   # free: the dispatch reserved room for its combine's rows
        fan.barrier()
        if callable(rows):
            rows(Wd)
        elif rows.shape[0]:
            fan.rows(rows.shape[0], Wd)[:, :row_bytes].copy_(rows)
        fan.barrier()
        return Wd

    def _land_back(self, posted, back: torch.Tensor, k: int) -> None:
        (pair, start) = posted
        got = self.network.land(pair, f"combine (network chunk {k})")
        back[start:start + got.shape[0]] = got

    @staticmethod
    def _reduce(got: torch.Tensor, packer: _Packer, fan_rows, fan_send: list, J: int, H: int, K: int):
        """One chunk's node reduction at the forwarder: rows from local rank 0, 1, ... added in that
        order (float32) to the landed row they came from; the bf16 partial (weights stay float32)."""
        if fan_rows is None:   # one rank per node: the partial is the row itself (bf16 -> f32 -> bf16)
            return got
        acc_y, acc_w = sum_rows(packer.unpack(got), fan_rows.split(fan_send), J, H, K)
        return packer.pack([acc_y.to(torch.bfloat16)] + ([acc_w] if K else []))


def _rows_on(t: torch.Tensor, n: int, device) -> torch.Tensor:
    """The first ``n`` rows of ``t``, contiguous on ``device`` (``t`` itself where it already is)."""
    if t.shape[0] != n:
        t = t[:n]
    return t.to(device).contiguous()


def _int32_views(device, *shapes) -> list:
    """int32 tensors of ``shapes``, views of one allocation (one allocator call, one stream record)."""
    sizes = [math.prod(s) for s in shapes]
    parts = torch.empty(sum(sizes), dtype=torch.int32, device=device).split(sizes)   # one operation for all
    return [p if len(s) == 1 else p.view(s) for p, s in zip(parts, shapes)]


def _area_row(packer: _Packer, H: int, K: int) -> int:
    """Bytes per row of the forwarder's landing areas for a dispatch (``packer``: its rows) and its
    cached dispatch and combine (bf16 [H] + float32 [K]): the widest, 16-byte aligned, so no later
    call of the handle grows the areas (growing is collective and syncs the host). The same on every
    rank of a node (the ranks agree on the call)."""
    return max(align_up(packer.row_bytes, 16), align_up(2 * H + 4 * K, 16))


def _capped_nccl_options(max_ctas: int):
    """NCCL communicator options with at most ``max_ctas`` CTAs; None (and a warning, once) where this
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


def _fill_ids(out: torch.Tensor, packer: _Packer) -> None:
    """Rows nothing lands on read as the reference's padding: -1 source index and expert ids."""
    offset = 0
    for (name, _, _), w in zip(packer.columns, packer.widths):
        if name in ("src_idx", "topk_idx"):
            out[:, offset:offset + w] = 0xFF
        offset += w


__all__ = ["InternodeBackend", "RailTransport", "chunk_rows", "clip", "compact"]
