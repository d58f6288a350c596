"""ElasticBuffer: DeepEP V2's dispatch / combine API (``deep_ep.ElasticBuffer``) over commlib's Buffer.

Legend: T tokens on this rank, H hidden, S scale columns, K top-k, R ranks, L local experts,
N received rows (one per token and receiving rank, grouped by source rank, in token order: the
order V2 calls deterministic), X expanded rows (one per token and local expert, expert-major,
each expert's block starting at a multiple of expert_alignment).

The transport is a commlib ``Buffer`` (NVLink engine on one node, the internode engine on several,
the reference on CPU), chosen as ``Buffer`` chooses. What V2 adds on top (its handle, the expanded
layout, the worst-case sizes without a host sync, top-k weights gathered per slot in combine) is
torch work done here on the Buffer's comm stream; no kernel is compiled for any of it, so no call
compiles anything a Buffer call would not. docs/deep_ep.md lists what differs from V2.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Tuple, Union

import torch
import torch.distributed as dist

from commlib.backends.common import bias_start
from commlib.buffer import Buffer
from commlib.config import Config
from commlib.handle import DispatchHandle
from commlib.topology import Topology, local_facts
from commlib.utils import env
from commlib.utils.event import EventHandle, EventOverlap
from commlib.utils.math import align_up
from commlib.validate import CommlibError, check_tensor, refuse_inside_capture

BUFFER_ALIGNMENT = 2 << 20     # V2 sizes its buffers in multiples of 2 MiB
SF_PACK_ALIGNMENT = 4          # TMA-aligned column-major scales: 16-byte columns of 4-byte packs
DEFAULT_NUM_DEVICE_SMS = 132   # an H100 / H200, where there is no GPU to ask
DEFAULT_NVLINK_GBS = 405.0     # NV18 (18 x 25 GB/s) at the 90 % efficiency V2 applies
DEFAULT_RDMA_GBS = 50.0        # one 400 Gb/s NIC

XType = Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


def _where(rank: int) -> str:
    return f"[commlib rank {rank}] ElasticBuffer"


def detect_topology(group: dist.ProcessGroup, ranks_per_node: Optional[int] = None) -> Topology:
    """The group's Topology as a Buffer on it would see it (one all_gather_object of the ranks' facts)."""
    facts = [None] * dist.get_world_size(group)
    dist.all_gather_object(facts, local_facts(), group=group)
    return Topology.detect(dist.get_rank(group), len(facts), ranks_per_node, facts=facts)


def logical_domain_size(num_nodes: int, ranks_per_node: int, allow_hybrid_mode: bool) -> Tuple[int, int]:
    """V2's (scaleout ranks, scaleup ranks): (nodes, ranks per node) in hybrid mode, else (1, all ranks)."""
    if allow_hybrid_mode:
        return num_nodes, ranks_per_node
    return 1, num_nodes * ranks_per_node


def _expected_groups_hit(num_experts: int, num_topk: int, num_groups: int) -> float:
    """Expected number of distinct groups (of num_experts / num_groups experts) that num_topk experts
    drawn without replacement fall into."""
    miss = math.comb(num_experts - num_experts // num_groups, num_topk) / math.comb(num_experts, num_topk)
    return num_groups * (1.0 - miss)


class EPHandle:
    """What dispatch returns and combine (or a cached dispatch) takes back. V2's attributes:

    do_expand, num_experts, expert_alignment, num_max_tokens_per_rank, num_sms.
    topk_idx: [T, K] int64, the dispatch's routing (a clone unless do_handle_copy=False).
    num_recv_tokens: N (exact with do_cpu_sync, else the worst case R * num_max_tokens_per_rank).
    num_expanded_tokens: X allocated (exact with do_cpu_sync, else V2's worst case).
    num_recv_tokens_per_expert_list: host list [L] of counts rounded up to expert_alignment
        ([] without do_cpu_sync).
    psum_num_recv_tokens_per_scaleup_rank: [scaleup ranks] int32, inclusive prefix sum of the rows
        received from each scaleup index (a token counted once per rank); the last is the total.
    psum_num_recv_tokens_per_expert: [L] int32; non-expand: inclusive prefix sum of aligned counts;
        expand: the aligned start of expert e plus its real count.
    num_unaligned_recv_tokens_per_expert: [L] int32 real counts (expand mode; None otherwise).
    recv_src_metadata: [N, K + 2] int32 per received row: source token global index
        (src_rank * num_max_tokens_per_rank + index), src_rank * K + the first local top-k slot, then
        per top-k slot its expanded row (expand) or -1. Padding rows are -1.
    dst_buffer_slot_idx: [T, K] int32: the row of this token in the receiving rank's output, -1 for
        empty slots.
    token_metadata_at_forward, channel_linked_list: None (V2's hybrid-kernel state).
    """

    def __init__(self, *, do_expand, num_experts, expert_alignment, num_max_tokens_per_rank, num_sms, topk_idx,
                 num_recv_tokens, num_expanded_tokens, num_recv_tokens_per_expert_list,
                 psum_num_recv_tokens_per_scaleup_rank, psum_num_recv_tokens_per_expert,
                 num_unaligned_recv_tokens_per_expert, recv_src_metadata, dst_buffer_slot_idx,
                 buffer_handle: DispatchHandle, recv_topk_idx: torch.Tensor, counts: torch.Tensor, owner: int):
        self.do_expand = do_expand
        self.num_experts = num_experts
        self.expert_alignment = expert_alignment
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_sms = num_sms
        self.topk_idx = topk_idx
        self.num_recv_tokens = num_recv_tokens
        self.num_expanded_tokens = num_expanded_tokens
        self.num_recv_tokens_per_expert_list = num_recv_tokens_per_expert_list
        self.psum_num_recv_tokens_per_scaleup_rank = psum_num_recv_tokens_per_scaleup_rank
        self.psum_num_recv_tokens_per_expert = psum_num_recv_tokens_per_expert
        self.num_unaligned_recv_tokens_per_expert = num_unaligned_recv_tokens_per_expert
        self.recv_src_metadata = recv_src_metadata
        self.dst_buffer_slot_idx = dst_buffer_slot_idx
        self.token_metadata_at_forward = None
        self.channel_linked_list = None
        # commlib's own state: the transport's handle, the local expert ids [N, K] (-1: not here or
        # padding), the real per-expert counts [L], and which ElasticBuffer made it
        self.buffer_handle = buffer_handle
        self.recv_topk_idx = recv_topk_idx
        self.counts = counts
        self.owner = owner
        self.config = None  # the transport's Config of the dispatch (None: the Buffer's own)

    @property
    def expanded_slots(self) -> torch.Tensor:
        """[N, K] int32: the expanded row of each (received row, top-k slot), -1 where none."""
        return self.recv_src_metadata[:, 2:]


class ElasticBuffer:
    """DeepEP V2's ``ElasticBuffer`` (expert-parallel dispatch / combine) on commlib's engines.

    Args (V2's, in its order):
        group: the torch.distributed group of the EP ranks.
        num_bytes: bytes of the buffer; None: computed from the MoE settings (get_buffer_size_hint).
        num_cpu_bytes: V2's CPU memory for Engram; accepted, nothing is allocated (Engram is not served).
        num_max_tokens_per_rank: the default per-call bound on tokens per rank (dispatch may pass another).
        hidden, num_topk, use_fp8_dispatch: the MoE settings the buffer is sized for (hidden 0: from
            num_bytes alone).
        deterministic: accepted; commlib's output order is always V2's deterministic order.
        allow_hybrid_mode: V2's logical domain: (nodes, ranks per node) if True and on several nodes,
            else (1, R). commlib's engines choose their own path; this sets the domain attributes and
            psum_num_recv_tokens_per_scaleup_rank's length.
        allow_multiple_reduction: False: an expanded combine sums every expanded row once, at home
            (V2's single reduction; one transport combine per top-k slot, docs/deep_ep.md); the
            non-expanded combine is the same either way.
        prefer_overlap_with_compute: as V2's get_theoretical_num_sms uses it.
        sl_idx, num_allocated_qps, num_cpu_timeout_secs, num_gpu_timeout_secs: InfiniBand service
            level, queue pairs and V2's timeouts; accepted and recorded (commlib's waits time out after
            COMMLIB_TIMEOUT_S). num_qps above num_allocated_qps is refused, as in V2.
        explicitly_destroy: the caller must call destroy(), as in V2.
        backend, ranks_per_node (keyword only, commlib's): as for ``Buffer``.
    Raises:
        RuntimeError when built inside a CUDA graph capture.
    """

    def __init__(self, group: dist.ProcessGroup, num_bytes: Optional[int] = None, num_cpu_bytes: int = 0,
                 num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0,
                 use_fp8_dispatch: bool = False, deterministic: bool = False, allow_hybrid_mode: bool = True,
                 allow_multiple_reduction: bool = True, prefer_overlap_with_compute: bool = True,
                 sl_idx: int = 3, num_allocated_qps: int = 0, num_cpu_timeout_secs: int = 300,
                 num_gpu_timeout_secs: int = 100, explicitly_destroy: bool = False, *,
                 backend: Optional[str] = None, ranks_per_node: Optional[int] = None) -> None:
        rank = dist.get_rank(group)
        refuse_inside_capture(_where(rank))
        for name, value in (("num_max_tokens_per_rank", num_max_tokens_per_rank), ("hidden", hidden),
                            ("num_topk", num_topk), ("num_cpu_bytes", num_cpu_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{_where(rank)}: {name} must be a non-negative int, got {value!r}")
        if num_bytes is not None and (isinstance(num_bytes, bool) or not isinstance(num_bytes, int) or num_bytes < 0):
            raise ValueError(f"{_where(rank)}: num_bytes must be None or a non-negative int, got {num_bytes!r}")
        if num_bytes is None and hidden == 0:
            raise ValueError(f"{_where(rank)}: give num_bytes, or the MoE settings (num_max_tokens_per_rank, "
                             "hidden) to size the buffer from")
        self.group = group
        self.rank_idx = rank
        self.num_ranks = dist.get_world_size(group)
        self.allow_hybrid_mode = bool(allow_hybrid_mode)
        self.allow_multiple_reduction = bool(allow_multiple_reduction)
        self.prefer_overlap_with_compute = bool(prefer_overlap_with_compute)
        self.deterministic = bool(deterministic)
        self.use_fp8_dispatch = bool(use_fp8_dispatch)
        self.num_topk = num_topk
        self.num_cpu_bytes = num_cpu_bytes
        self.sl_idx = sl_idx
        self.num_cpu_timeout_secs = num_cpu_timeout_secs
        self.num_gpu_timeout_secs = num_gpu_timeout_secs
        self.explicitly_destroy = bool(explicitly_destroy)
        self.num_max_tokens_per_rank = num_max_tokens_per_rank

        topo = detect_topology(group, ranks_per_node)
        # the SM budget the rings are sized for: a call may use fewer (num_sms), never more
        self._sized_sms = Buffer.num_sms
        nvl, rdma = self._sizes(self.num_ranks, topo.ranks_per_node, hidden, self._sized_sms)
        if num_bytes is not None:
            if hidden == 0:  # only a total: NVLink rings get it, and the network staging too on several nodes
                nvl, rdma = num_bytes, (num_bytes if topo.num_nodes > 1 else 0)
            self.num_bytes = max(num_bytes, nvl + rdma)
        else:
            self.num_bytes = align_up(nvl + rdma, BUFFER_ALIGNMENT)
        self.buffer = Buffer(group, nvl, rdma, explicitly_destroy=True, backend=backend,
                             ranks_per_node=topo.ranks_per_node)
        self.runtime = self.buffer  # V2's C++ runtime object; here the transport
        self.topology = self.buffer.topology
        M, P = self.topology.num_nodes, self.topology.ranks_per_node
        self.num_rdma_ranks, self.num_nvlink_ranks = M, P
        self.num_scaleout_ranks, self.num_scaleup_ranks = logical_domain_size(M, P, self.allow_hybrid_mode)
        self.scaleout_rank_idx = rank // self.num_scaleup_ranks
        self.scaleup_rank_idx = rank % self.num_scaleup_ranks
        if num_allocated_qps == 0:
            num_allocated_qps = 129 if self.allow_hybrid_mode else 17
        self.num_allocated_qps = num_allocated_qps
        self._sms_cache: dict = {}
        self._configs: dict = {}
        self._destroyed = False

    # ------------------------------------------------------------------ sizes (static)
    @staticmethod
    def _sizes(num_ranks: int, ranks_per_node: Optional[int], hidden: int, num_sms: int) -> tuple:
        """(num_nvl_bytes, num_rdma_bytes) a Buffer needs for BF16 rows of ``hidden`` (0: none known)."""
        if hidden == 0:
            return 0, 0
        nvl = rdma = 0
        for cfg in (Buffer.get_dispatch_config(num_ranks), Buffer.get_combine_config(num_ranks)):
            cfg = dataclasses.replace(cfg, num_sms=num_sms)
            nvl = max(nvl, cfg.get_nvl_buffer_size_hint(hidden * 2, num_ranks, ranks_per_node=ranks_per_node))
            rdma = max(rdma, cfg.get_rdma_buffer_size_hint(hidden * 2, num_ranks, ranks_per_node=ranks_per_node))
        return nvl, rdma

    @staticmethod
    def get_buffer_size_hint(group: dist.ProcessGroup, num_max_tokens_per_rank: int, hidden: int,
                             num_topk: int = 0, use_fp8_dispatch: bool = False, allow_hybrid_mode: bool = True,
                             allow_multiple_reduction: bool = True) -> int:
        """Bytes an ElasticBuffer for these MoE settings holds (a multiple of 2 MiB), without building one.

        Returns the NVLink rings plus the network staging commlib's Buffer needs for BF16 rows of
        ``hidden`` (COMMLIB_RANKS_PER_NODE or 8 ranks per node): any num_max_tokens_per_rank streams
        through them, so it does not change the size.
        """
        R = dist.get_world_size(group)
        nvl, rdma = ElasticBuffer._sizes(R, env.ranks_per_node(), hidden, Buffer.num_sms)
        return align_up(nvl + rdma, BUFFER_ALIGNMENT)

    @staticmethod
    def get_engram_storage_size_hint(num_entries: int, hidden: int, num_max_tokens_per_rank: int,
                                     dtype: torch.dtype = torch.bfloat16) -> Tuple[int, int]:
        """V2's Engram sizes (GPU receive area, CPU storage), 2 MiB multiples; Engram itself is not served."""
        row = align_up(hidden * dtype.itemsize, 32)
        return align_up(row * num_max_tokens_per_rank, BUFFER_ALIGNMENT), align_up(row * num_entries, BUFFER_ALIGNMENT)

    @staticmethod
    def get_pp_buffer_size_hint(num_max_tensor_bytes: int, num_max_inflight_tensors: int) -> int:
        """V2's pipeline send/recv size (send and receive, both ring neighbours); PP is not served."""
        return align_up(align_up(num_max_tensor_bytes, 32) * num_max_inflight_tensors * 4, BUFFER_ALIGNMENT)

    @staticmethod
    def get_agrs_num_max_session_bytes(group: dist.ProcessGroup, shapes, dtype: torch.dtype) -> int:
        """V2's all-gather session bytes for ``shapes`` (one shape or a sequence of shapes)."""
        if not isinstance(shapes[0], (tuple, list, torch.Size)):
            shapes = (shapes,)
        R = dist.get_world_size(group)
        return sum(align_up(R * math.prod(s) * dtype.itemsize, 32) for s in shapes)

    @staticmethod
    def get_agrs_buffer_size_hint(group: dist.ProcessGroup, num_max_session_bytes: int) -> int:
        """V2's AGRS buffer size for sessions of ``num_max_session_bytes``; AGRS is not served."""
        return align_up(num_max_session_bytes, BUFFER_ALIGNMENT)

    # ------------------------------------------------------------------ life and helpers
    def destroy(self) -> None:
        """Release the transport. As in V2 it needs explicitly_destroy=True at construction."""
        if not self.explicitly_destroy:
            raise RuntimeError(f"{_where(self.rank_idx)}: destroy() needs explicitly_destroy=True at construction")
        if not self._destroyed:
            self._destroyed = True
            self.buffer.destroy()
            self.runtime = None

    def __del__(self) -> None:
        try:
            if not self.explicitly_destroy and not self._destroyed:
                self.buffer.destroy()
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass

    def _alive(self) -> None:
        if self._destroyed:
            raise CommlibError(f"{_where(self.rank_idx)} used after destroy()")

    def barrier(self, use_comm_stream: bool = True, with_cpu_sync: bool = False, sequential: bool = True) -> None:
        """All ranks meet (a group barrier); with_cpu_sync also synchronizes the device before and after."""
        self._alive()
        cuda = self.buffer.device.type == "cuda"
        if with_cpu_sync and cuda:
            torch.cuda.synchronize()
        dist.barrier(group=self.group)
        if with_cpu_sync and cuda:
            torch.cuda.synchronize()

    @staticmethod
    def capture() -> EventHandle:
        """An event marking now on the current stream (V2's EventHandle; no event without CUDA)."""
        return EventHandle()

    def get_comm_stream(self):
        """The communication stream (None on CPU ranks)."""
        return self.buffer.get_comm_stream()

    def get_physical_domain_size(self) -> Tuple[int, int]:
        """(nodes, ranks per node): V2's (RDMA ranks, NVLink ranks)."""
        return self.num_rdma_ranks, self.num_nvlink_ranks

    def get_logical_domain_size(self) -> Tuple[int, int]:
        """(scaleout ranks, scaleup ranks): (nodes, ranks per node) in hybrid mode, else (1, R)."""
        return self.num_scaleout_ranks, self.num_scaleup_ranks

    def get_theoretical_num_sms(self, num_experts: int, num_topk: int, num_scaleout_topk: int = 0,
                                rdma_gbs: float = 0, nvlink_gbs: float = 0, sm_read_gbs: float = 200,
                                sm_write_gbs: float = 50) -> int:
        """V2's analytical SM count for a balanced gate (even, at least 4, at most the device's SMs).

        The traffic per token of the bounding link (network on several scaleout ranks when it is the
        slower one, else NVLink) sets how many SMs keep up with its bandwidth at sm_read_gbs /
        sm_write_gbs per SM, plus 25 %; without prefer_overlap_with_compute at least 64. Bandwidths of
        0 take DEFAULT_NVLINK_GBS / DEFAULT_RDMA_GBS (V2 asks nvidia-smi / ibstat). Remembered per
        arguments.
        """
        key = (num_experts, num_topk, num_scaleout_topk, rdma_gbs, nvlink_gbs, sm_read_gbs, sm_write_gbs)
        hit = self._sms_cache.get(key)
        if hit is not None:
            return hit
        if num_scaleout_topk != 0:
            raise ValueError(f"{_where(self.rank_idx)}: num_scaleout_topk is reserved and must be 0, got {num_scaleout_topk}")
        R, O, S = self.num_ranks, self.num_scaleout_ranks, self.num_scaleup_ranks
        rdma_gbs = rdma_gbs or DEFAULT_RDMA_GBS
        nvlink_gbs = nvlink_gbs or DEFAULT_NVLINK_GBS
        ranks_hit = _expected_groups_hit(num_experts, num_topk, R)
        per = 1.0 / ranks_hit  # one received row per hit rank: traffic per row delivered
        reads, writes, rdma, nvl = per, 0.0, 0.0, 0.0
        if O > 1:
            nodes_hit = _expected_groups_hit(num_experts, num_topk, O)
            writes += per + per * nodes_hit / O + 1.0
            reads += nodes_hit * per
            rdma = per * nodes_hit * (1.0 - 1.0 / O)
            nvl = 1.0 - 1.0 / S
        else:
            if self.num_rdma_ranks > 1:
                writes += per
            share = self.num_nvlink_ranks / R
            writes += share
            nvl = share * (1.0 - 1.0 / self.num_nvlink_ranks)
            rdma = (R - self.num_nvlink_ranks) / R
        if O > 1 and rdma / rdma_gbs > nvl / nvlink_gbs:
            traffic, gbs = rdma, rdma_gbs
        else:
            traffic, gbs = nvl, nvlink_gbs
        device_sms = (torch.cuda.get_device_properties(self.buffer.device).multi_processor_count
                      if self.buffer.device.type == "cuda" else DEFAULT_NUM_DEVICE_SMS)
        sms = float(device_sms)
        if traffic > 0:
            rows_per_s = gbs / traffic
            sms = max(rows_per_s * reads / sm_read_gbs, rows_per_s * writes / sm_write_gbs)
        n = align_up(max(4, math.ceil(sms * 1.25)), 2)
        if not self.prefer_overlap_with_compute:
            n = max(n, 64)
        n = min(n, device_sms)
        self._sms_cache[key] = n
        return n

    def get_theoretical_num_qps(self, num_sms: int) -> int:
        """V2's QP count: min(num_sms, 9) direct, num_sms * 16 + 1 hybrid, at most num_allocated_qps."""
        qps = num_sms * 16 + 1 if self.allow_hybrid_mode else min(num_sms, 9)
        return min(qps, self.num_allocated_qps)

    def _not_served(self, name: str):
        raise NotImplementedError(f"{_where(self.rank_idx)}.{name}: V2's experimental Engram / PP / AGRS "
                                  "primitives are not served by commlib (dispatch and combine are)")

    def engram_write(self, storage, sf=None):
        self._not_served("engram_write")

    def engram_fetch(self, indices, num_qps: int = 0, use_tma_aligned_col_major_sf: bool = False):
        self._not_served("engram_fetch")

    def pp_set_config(self, num_max_tensor_bytes: int, num_max_inflight_tensors: int):
        self._not_served("pp_set_config")

    def pp_send(self, t, dst_rank_idx: int, num_sms: int = 0):
        self._not_served("pp_send")

    def pp_recv(self, t, src_rank_idx: int, num_sms: int = 0):
        self._not_served("pp_recv")

    def create_agrs_session(self):
        self._not_served("create_agrs_session")

    def destroy_agrs_session(self):
        self._not_served("destroy_agrs_session")

    def agrs_new_session(self, enabled: bool = True):
        self._not_served("agrs_new_session")

    def agrs_set_config(self, num_max_session_bytes: int, num_max_all_gathers_per_session: int):
        self._not_served("agrs_set_config")

    def agrs_get_inplace_tensor(self, shapes, dtype):
        self._not_served("agrs_get_inplace_tensor")

    def all_gather(self, t):
        self._not_served("all_gather")

    # ------------------------------------------------------------------ streams
    def _config(self, kind: str, num_sms: int) -> Optional[Config]:
        """The Buffer Config for a call of ``num_sms`` SMs: None (the Buffer's own, tuned or default)
        at or above the budget the rings were sized for, else that default with fewer SMs."""
        sms = max(2, min(num_sms, self._sized_sms) // 2 * 2)
        if sms >= self._sized_sms:
            return None
        key = (kind, sms)
        cfg = self._configs.get(key)
        if cfg is None:
            base = (Buffer.get_dispatch_config if kind == "dispatch" else Buffer.get_combine_config)(self.num_ranks)
            cfg = self._configs[key] = dataclasses.replace(base, num_sms=sms)
        return cfg

    def _stream_args(self, previous_event, allocate_on_comm_stream: bool) -> Optional[EventOverlap]:
        """previous_event as the EventOverlap a Buffer waits for (None: none). Outputs are made on the
        comm stream and handed to the current one either way, so allocate_on_comm_stream only checks."""
        if previous_event is not None and not allocate_on_comm_stream:
            raise ValueError(f"{_where(self.rank_idx)}: previous_event needs allocate_on_comm_stream=True (as in V2)")
        if previous_event is None:
            return None
        if isinstance(previous_event, EventOverlap):
            return previous_event
        if isinstance(previous_event, (EventHandle, torch.cuda.Event)):
            return EventOverlap(previous_event)
        raise TypeError(f"{_where(self.rank_idx)}: previous_event must be an EventHandle (capture()) or an "
                        f"EventOverlap, got {type(previous_event).__name__}")

    def _epilogue(self, fn, before_epilogue, async_with_compute_stream: bool):
        """Run ``fn`` after the transport's call (on the comm stream with CUDA); returns (result, EventOverlap)."""
        comm = self.buffer.get_comm_stream()
        if comm is None:
            return fn(), EventOverlap(None)
        compute = torch.cuda.current_stream(self.buffer.device)
        if before_epilogue is not None:
            ev = before_epilogue.event if isinstance(before_epilogue, (EventHandle, EventOverlap)) else before_epilogue
            if ev is not None:
                comm.wait_event(ev)
        with torch.cuda.stream(comm):
            result = fn()
        for t in _tensors(result):
            t.record_stream(compute)
        event = torch.cuda.Event()
        event.record(comm)
        if not async_with_compute_stream:
            compute.wait_event(event)
            return result, EventOverlap(None)
        return result, EventOverlap(event)

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x: XType, topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None, num_experts: Optional[int] = None,
                 num_max_tokens_per_rank: Optional[int] = None, expert_alignment: Optional[int] = None,
                 num_sms: int = 0, num_qps: int = 0, previous_event=None, previous_event_before_epilogue=None,
                 async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False,
                 handle: Optional[EPHandle] = None, do_handle_copy: bool = True, do_cpu_sync: Optional[bool] = None,
                 do_expand: bool = False, do_zero_padding: bool = False, use_tma_aligned_col_major_sf: bool = False):
        """Send each token to the ranks holding its top-k experts.

        Args:
            x: [T, H] bf16, or (fp8 e4m3 [T, H], scales [T, S] float32 or int32 packed UE8M0).
            topk_idx: [T, K] int64 expert ids, -1 = no expert; None with ``handle`` (cached).
            topk_weights: [T, K] float32 or None (also allowed with ``handle``: the cached weights travel).
            cumulative_local_expert_recv_stats: [L] int32, incremented by the real per-expert counts
                (non-cached calls only).
            num_experts: E (from the handle when cached). num_max_tokens_per_rank: bound on T for every
                rank (default: the constructor's; the handle's when cached). expert_alignment: per-expert
                counts and expanded blocks are rounded up to it (default 1).
            num_sms: 0 = get_theoretical_num_sms; commlib runs min(num_sms, the budget the buffer was
                sized for). num_qps: accepted (0 = get_theoretical_num_qps), at most num_allocated_qps.
            previous_event: an EventHandle (capture()) to wait for; needs allocate_on_comm_stream.
            previous_event_before_epilogue: waited for before the layout work after the transfer.
            async_with_compute_stream: the current stream does not wait; the returned event does.
            handle: a previous dispatch's EPHandle: cached mode (same routing, no host sync).
            do_handle_copy: the handle keeps a clone of topk_idx (else topk_idx itself).
            do_cpu_sync: exact sizes through one host read (default True, False when cached); False
                allocates V2's worst case (R * num_max_tokens_per_rank rows) and never syncs.
            do_expand: the expanded layout (one row per token and local expert); do_zero_padding zeroes
                the rows no token fills (expand only); use_tma_aligned_col_major_sf: column-major
                scales, columns padded to 4 rows.
        Returns:
            (recv_x [N, H] or [X, H] (a tuple with scales [N or X, S] for FP8), recv_topk_idx [N, K]
            int64 local expert ids (-1 elsewhere; None when expanded), recv_topk_weights [N, K] float32
            (0 for other ranks' slots) or [X] expanded, or None, handle, EventOverlap).
        """
        self._alive()
        me, R = self.rank_idx, self.num_ranks
        do_expand, do_zero_padding = bool(do_expand), bool(do_zero_padding)
        if do_zero_padding and not do_expand:
            raise ValueError(f"{_where(me)}.dispatch: do_zero_padding needs do_expand=True (as in V2)")
        cached = handle is not None
        if cached:
            self._check_handle(handle)
            if topk_idx is not None:
                raise ValueError(f"{_where(me)}.dispatch: a cached dispatch (handle given) takes topk_idx=None")
            if do_cpu_sync:
                raise ValueError(f"{_where(me)}.dispatch: a cached dispatch cannot do a CPU sync (do_cpu_sync=True)")
            if cumulative_local_expert_recv_stats is not None:
                raise ValueError(f"{_where(me)}.dispatch: a cached dispatch counts no tokens "
                                 "(cumulative_local_expert_recv_stats must be None, as in V2)")
            given = (num_experts, expert_alignment, num_max_tokens_per_rank)
            saved = (handle.num_experts, handle.expert_alignment, handle.num_max_tokens_per_rank)
            if any(g is not None and g != s for g, s in zip(given, saved)):
                raise ValueError(f"{_where(me)}.dispatch: (num_experts, expert_alignment, num_max_tokens_per_rank) "
                                 f"{given} differ from the handle's {saved}")
            if do_expand != handle.do_expand:
                raise ValueError(f"{_where(me)}.dispatch: do_expand={do_expand} but the handle was made with "
                                 f"do_expand={handle.do_expand}")
            num_experts, alignment, max_tokens = saved
            cpu_sync = False
            topk_src = handle.topk_idx
        else:
            if topk_idx is None:
                raise ValueError(f"{_where(me)}.dispatch: topk_idx is needed (or a handle for a cached dispatch)")
            if num_experts is None:
                raise ValueError(f"{_where(me)}.dispatch: num_experts is needed for a non-cached dispatch")
            alignment = 1 if expert_alignment is None else expert_alignment
            max_tokens = self.num_max_tokens_per_rank if num_max_tokens_per_rank is None else num_max_tokens_per_rank
            cpu_sync = True if do_cpu_sync is None else bool(do_cpu_sync)
            topk_src = topk_idx
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0:
            raise ValueError(f"{_where(me)}.dispatch: expert_alignment must be a positive int, got {alignment!r}")
        data = x[0] if isinstance(x, (tuple, list)) else x
        T = data.shape[0] if isinstance(data, torch.Tensor) and data.dim() == 2 else -1
        check_tensor("topk_idx", topk_src, me, dtype=torch.int64, dim=2, device=self.buffer.device)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens <= 0 or T > max_tokens:
            raise ValueError(f"{_where(me)}.dispatch: num_max_tokens_per_rank must be an int >= the tokens of this "
                             f"rank ({T}), got {max_tokens!r}")
        K = topk_src.shape[1]
        if num_qps and num_qps > self.num_allocated_qps:
            raise ValueError(f"{_where(me)}.dispatch: num_qps={num_qps} exceeds num_allocated_qps={self.num_allocated_qps}")
        num_sms = self.get_theoretical_num_sms(num_experts, K) if num_sms == 0 else num_sms
        prev = self._stream_args(previous_event, allocate_on_comm_stream)
        L = num_experts // R
        if cumulative_local_expert_recv_stats is not None:
            check_tensor("cumulative_local_expert_recv_stats", cumulative_local_expert_recv_stats, me,
                         dtype=torch.int32, dim=1, device=self.buffer.device)
            if cumulative_local_expert_recv_stats.shape[0] != L:
                raise ValueError(f"{_where(me)}.dispatch: cumulative_local_expert_recv_stats must have {L} entries "
                                 f"(local experts), got {cumulative_local_expert_recv_stats.shape[0]}")

        # a cached call runs on the channels its handle was made with
        buf, cfg = self.buffer, (handle.config if cached else self._config("dispatch", num_sms))
        # the transfer: a cached Buffer dispatch, or a non-cached one (also for cached calls with
        # weights, at the handle's size so nothing syncs and rows land where they did)
        if cached and topk_weights is None:
            recv_x, _, _, _, bh, _ = buf.dispatch(x, handle=handle.buffer_handle, config=cfg, previous_event=prev,
                                                  async_finish=True)
            per_expert, recv_idx, recv_w = None, None, None
        else:
            # the ranks' common worst case; a cached call keeps the handle's rows (the first ones)
            worst = 0 if cpu_sync and not cached else R * max_tokens
            per_rank, per_rdma, per_expert_t, in_rank, ev0 = buf.get_dispatch_layout(
                topk_src, num_experts, previous_event=prev, async_finish=True)
            recv_x, recv_idx, recv_w, per_expert, bh, _ = buf.dispatch(
                x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                num_tokens_per_expert=per_expert_t, topk_idx=topk_src, topk_weights=topk_weights,
                expert_alignment=alignment, num_worst_tokens=worst, config=cfg,
                previous_event=ev0 if ev0.event is not None else None, async_finish=True)
            if cached:
                bh = handle.buffer_handle
                n = bh.recv_src_idx.shape[0]
                recv_x = tuple(t[:n] for t in recv_x) if isinstance(recv_x, tuple) else recv_x[:n]
                recv_w = recv_w[:n] if recv_w is not None else None
        recv_data, recv_sf = recv_x if isinstance(recv_x, tuple) else (recv_x, None)

        def epilogue():
            if cached:
                h = handle
            else:
                h = self._new_handle(bh, recv_idx, topk_idx, do_handle_copy, num_experts, alignment,
                                     max_tokens, num_sms, do_expand, cpu_sync, per_expert)
                h.config = cfg
            if cumulative_local_expert_recv_stats is not None:
                cumulative_local_expert_recv_stats.add_(h.counts)
            w_out = recv_w
            if h.do_expand:
                X = h.num_expanded_tokens
                slots = h.expanded_slots
                out_x = _scatter_rows(recv_data, slots, X, do_zero_padding)
                out_sf = _scatter_rows(recv_sf, slots, X, do_zero_padding) if recv_sf is not None else None
                w_out = _scatter_weights(recv_w, slots, X) if recv_w is not None else None
                out_idx = None
            else:
                out_x, out_sf = recv_data, recv_sf
                out_idx = h.recv_topk_idx.clone()  # callers rewrite it in place (vLLM globalizes the ids)
            if out_sf is not None and use_tma_aligned_col_major_sf:
                out_sf = _tma_column_major(out_sf)
            out = (out_x, out_sf) if out_sf is not None else out_x
            return out, out_idx, w_out, h

        (out, out_idx, w_out, h), event = self._epilogue(epilogue, previous_event_before_epilogue,
                                                         async_with_compute_stream)
        return out, out_idx, w_out, h, event

    def _new_handle(self, bh: DispatchHandle, recv_idx: torch.Tensor, topk_idx: torch.Tensor, do_handle_copy: bool,
                    num_experts: int, alignment: int, max_tokens: int, num_sms: int, do_expand: bool, cpu_sync: bool,
                    per_expert: Optional[list]) -> EPHandle:
        """The V2 handle of a non-cached dispatch, from the transport's handle (device work only)."""
        R, me = self.num_ranks, self.rank_idx
        L = num_experts // R
        N, K = recv_idx.shape
        dev = recv_idx.device
        col = bh.rank_prefix_matrix[:, me].to(torch.int64)              # [R] rows from sources <= r
        total = col[-1]
        rows = torch.arange(N, device=dev)
        valid = rows < total                                           # [N] padding rows are False
        src_rank = torch.searchsorted(col, rows, right=True).clamp(max=R - 1)
        from_rank = torch.diff(col, prepend=col.new_zeros(1))          # [R]
        S = self.num_scaleup_ranks
        psum_scaleup = torch.cumsum(from_rank.view(R // S, S).sum(0), 0).to(torch.int32)
        local = torch.where(valid.unsqueeze(1), recv_idx, torch.full_like(recv_idx, -1))  # [N, K] local ids
        # per-expert counts, their aligned blocks, and each (row, slot)'s rank inside its expert
        flat = torch.where(local >= 0, local, torch.full_like(local, L)).flatten()   # row-major: row, then slot
        counts = torch.zeros(L + 1, dtype=torch.int64, device=dev).scatter_add_(
            0, flat, torch.ones_like(flat))[:L]
        aligned = (counts + alignment - 1) // alignment * alignment
        starts = torch.cumsum(aligned, 0) - aligned                    # exclusive: each expert's first row
        if do_expand:
            order = torch.sort(flat, stable=True).indices              # slots grouped by expert, rows ascending
            before = torch.cumsum(counts, 0) - counts                  # valid slots of lower experts
            pos = torch.empty_like(order)
            pos[order] = torch.arange(order.numel(), device=dev)
            e = flat.clamp(max=L - 1)
            slots = torch.where(flat < L, starts[e] + pos - before[e], torch.full_like(flat, -1))
            slots = slots.view(N, K).to(torch.int32)
        else:
            slots = torch.full((N, K), -1, dtype=torch.int32, device=dev)
        meta = torch.empty((N, K + 2), dtype=torch.int32, device=dev)
        gidx = src_rank * max_tokens + bh.recv_src_idx.to(torch.int64)
        meta[:, 0] = torch.where(valid, gidx, torch.full_like(gidx, -1)).to(torch.int32)
        is_local = local >= 0
        first = torch.argmax(is_local.to(torch.int8), dim=1)
        meta[:, 1] = torch.where(valid, src_rank * K + first, torch.full_like(first, -1)).to(torch.int32)
        meta[:, 2:] = slots
        dst = None
        if bh.send_head is not None:
            owner = torch.where(topk_idx >= 0, topk_idx // L, torch.zeros_like(topk_idx))
            dst = torch.gather(bh.send_head, 1, owner)
            dst = torch.where(topk_idx >= 0, dst, torch.full_like(dst, -1)).to(torch.int32)
        if self.topology.num_nodes == 1:  # V2's summation order (several nodes: node, then rail order)
            bh.sum_order = _sum_order(topk_idx, L)
        if do_expand:
            psum_e = (starts + counts).to(torch.int32)
            unaligned = counts.to(torch.int32)
        else:
            psum_e = torch.cumsum(aligned, 0).to(torch.int32)
            unaligned = None
        if cpu_sync:
            per_list = list(per_expert) if per_expert is not None else [int(c) for c in aligned.tolist()]
            X = int(sum(per_list))
        else:
            per_list = []
            X = align_up(R * max_tokens * min(K, L) + (alignment - 1) * L, alignment)
        return EPHandle(do_expand=do_expand, num_experts=num_experts, expert_alignment=alignment,
                        num_max_tokens_per_rank=max_tokens, num_sms=num_sms,
                        topk_idx=topk_idx.clone() if do_handle_copy else topk_idx, num_recv_tokens=N,
                        num_expanded_tokens=X if do_expand else 0, num_recv_tokens_per_expert_list=per_list,
                        psum_num_recv_tokens_per_scaleup_rank=psum_scaleup, psum_num_recv_tokens_per_expert=psum_e,
                        num_unaligned_recv_tokens_per_expert=unaligned, recv_src_metadata=meta,
                        dst_buffer_slot_idx=dst, buffer_handle=bh, recv_topk_idx=local,
                        counts=counts.to(torch.int32), owner=id(self))

    def _check_handle(self, handle) -> None:
        if not isinstance(handle, EPHandle):
            raise TypeError(f"{_where(self.rank_idx)}: handle must be the EPHandle dispatch returned, got "
                            f"{type(handle).__name__}")
        if handle.owner != id(self):
            raise ValueError(f"{_where(self.rank_idx)}: handle was made by another ElasticBuffer")

    # ------------------------------------------------------------------ combine
    def combine(self, x: torch.Tensor, handle: EPHandle, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor], None] = None, num_sms: int = 0,
                num_qps: int = 0, previous_event=None, previous_event_before_epilogue=None,
                async_with_compute_stream: bool = False, allocate_on_comm_stream: bool = False):
        """Send each received row back to its token's rank and sum them there.

        Args:
            x: [N, H] bf16 (non-expand: one row per received token, summed over its local experts by the
                caller) or [X, H] (expand: one row per (token, local expert); with allow_multiple_reduction
                summed per token here in top-k order, in float32, to bf16, before it travels; without it
                every row travels as it is). Fewer rows than the handle holds are padded with zeros.
            handle: the dispatch's EPHandle.
            topk_weights: [N, K] float32 (non-expand) or [X] (expand) or None: each slot's weight comes
                back from the rank owning that slot (slots of other ranks are ignored). Refused for an
                expanded combine with allow_multiple_reduction=False (V2's kernel asserts there).
            bias: None, a [T, H] bf16 tensor or a tuple of two. The float32 sum starts from 0 + bias0 + bias1
                and adds each rank's row in the order of the rank's last top-k slot (V2's order; on several
                nodes: node, then rail order), then rounds to bf16. Expanded with
                allow_multiple_reduction=False: it adds each top-k slot's expanded row in slot order
                instead (empty slots add nothing), on every topology.
            num_sms: 0 = the dispatch's. The rest as in dispatch.
        Returns:
            (combined_x [T, H] bf16, combined_topk_weights [T, K] float32 (0 for empty slots) or None,
            EventOverlap)
        """
        self._alive()
        me = self.rank_idx
        self._check_handle(handle)
        check_tensor("x", x, me, dtype=torch.bfloat16, dim=2, device=self.buffer.device)
        if num_qps and num_qps > self.num_allocated_qps:
            raise ValueError(f"{_where(me)}.combine: num_qps={num_qps} exceeds num_allocated_qps={self.num_allocated_qps}")
        rows = handle.num_expanded_tokens if handle.do_expand else handle.num_recv_tokens
        if x.shape[0] > rows:
            raise ValueError(f"{_where(me)}.combine: x has {x.shape[0]} rows, the handle holds {rows}")
        N, K = handle.recv_topk_idx.shape
        per_slot = handle.do_expand and not self.allow_multiple_reduction
        if per_slot and topk_weights is not None:
            raise ValueError(f"{_where(me)}.combine: topk_weights must be None for an expanded combine with "
                             "allow_multiple_reduction=False (the expanded rows travel unreduced and carry no "
                             "weights; V2's kernel stops on a device assert there); build the buffer with "
                             "allow_multiple_reduction=True to get the weights back")
        biases = self._check_bias(bias, handle.buffer_handle.num_tokens, x.shape[1]) if per_slot else ()
        if topk_weights is not None:
            shape = (rows,) if handle.do_expand else (rows, K)
            check_tensor("topk_weights", topk_weights, me, dtype=torch.float32, dim=len(shape), device=self.buffer.device)
            if topk_weights.shape[0] > rows or tuple(topk_weights.shape[1:]) != shape[1:]:
                raise ValueError(f"{_where(me)}.combine: topk_weights must have shape {list(shape)} (at most "
                                 f"{rows} rows), got {list(topk_weights.shape)}")
        num_sms = handle.num_sms if num_sms == 0 else num_sms
        prev = self._stream_args(previous_event, allocate_on_comm_stream)
        comm = self.buffer.get_comm_stream()
        if comm is not None:  # the per-token preparation runs where the transfer will, after its events
            compute = torch.cuda.current_stream(self.buffer.device)
            if prev is not None and prev.event is not None:
                comm.wait_event(prev.event)
            else:
                comm.wait_stream(compute)
            for t in (x, *biases):  # read on the comm stream, maybe after the caller dropped them
                t.record_stream(comm)

        def made_on_comm(fn):
            """fn()'s tensors, made on the comm stream, and an EventOverlap after them (None on CPU)."""
            out = _on_stream(comm, fn)
            if comm is None:
                return out, None
            ev = EventOverlap(torch.cuda.Event())
            ev.event.record(comm)
            for t in out:
                if t is not None:
                    t.record_stream(compute)
            return out, ev

        config = self._config("combine", num_sms)
        if per_slot:
            # one transport combine per top-k slot j, non-zero only from the slot's owner: the sum of one
            # row and zeros is that row (-0.0 arrives as +0.0, the same to a sum that starts at +0.0)
            slots = handle.expanded_slots
            parts = []
            for j in range(K):
                (y,), ev0 = made_on_comm(lambda: (_slot_rows(x, slots[:, j]),))
                parts.append(self.buffer.combine(y, handle.buffer_handle, config=config, previous_event=ev0,
                                                 async_finish=True)[0])

            def home():
                acc = bias_start(biases, handle.buffer_handle.num_tokens, x.shape[1], x.device)
                for part in parts:  # slot order; an empty slot's part is +0.0
                    acc += part.float()
                return acc.to(torch.bfloat16), None
        else:
            (y, w), ev0 = made_on_comm(lambda: _combine_rows(x, topk_weights, handle, rows))
            combined, combined_w, _ = self.buffer.combine(y, handle.buffer_handle, topk_weights=w, bias=bias,
                                                          config=config, previous_event=ev0, async_finish=True)

            def home():
                return combined, combined_w
        (combined, combined_w), event = self._epilogue(home, previous_event_before_epilogue,
                                                       async_with_compute_stream)
        return combined, combined_w, event

    def _check_bias(self, bias, num_tokens: int, hidden: int) -> tuple:
        """The bias tensors (0, 1 or 2) a combine that sums here adds, checked as the transport checks them."""
        if bias is None:
            return ()
        biases = (bias,) if isinstance(bias, torch.Tensor) else tuple(b for b in bias if b is not None)
        if len(biases) > 2:
            raise ValueError(f"{_where(self.rank_idx)}.combine: bias takes at most two tensors, got {len(biases)}")
        for i, b in enumerate(biases):
            check_tensor(f"bias[{i}]", b, self.rank_idx, dtype=torch.bfloat16, dim=2, device=self.buffer.device)
            if tuple(b.shape) != (num_tokens, hidden):
                raise ValueError(f"{_where(self.rank_idx)}.combine: bias[{i}] must have shape "
                                 f"[{num_tokens}, {hidden}], got {list(b.shape)}")
        return biases


# ---------------------------------------------------------------------- tensor helpers (device work, no host read)
def _scatter_rows(src: torch.Tensor, slots: torch.Tensor, X: int, zero: bool) -> torch.Tensor:
    """[X, C] rows: row slots[i, j] gets src[i] for every slot >= 0. Rows nobody writes are zero when
    ``zero``, else unspecified (as V2's). Slots < 0 write a scratch row per source row."""
    N, K = slots.shape
    C = src.shape[1]
    raw = src.view(torch.uint8) if src.element_size() == 1 else src  # FP8 rows move as bytes
    out = (torch.zeros if zero else torch.empty)((X + N, C), dtype=raw.dtype, device=src.device)
    scratch = X + torch.arange(N, device=src.device)
    for j in range(K):
        s = slots[:, j].to(torch.int64)
        out.index_copy_(0, torch.where(s >= 0, s, scratch), raw)
    return out[:X].view(src.dtype)


def _scatter_weights(w: torch.Tensor, slots: torch.Tensor, X: int) -> torch.Tensor:
    """[X] float32: the weight of each expanded row's (token, expert) slot; 0 for unfilled rows."""
    N, K = slots.shape
    out = torch.zeros(X + N, dtype=w.dtype, device=w.device)
    scratch = X + torch.arange(N, device=w.device)
    for j in range(K):
        s = slots[:, j].to(torch.int64)
        out.index_copy_(0, torch.where(s >= 0, s, scratch), w[:, j].contiguous())
    return out[:X]


def _slot_rows(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[N, H]: row i is x[slots[i]], or zeros where slots[i] < 0 or past x's rows (the padding)."""
    ok = (slots >= 0) & (slots < x.shape[0])
    if x.shape[0] == 0:
        return x.new_zeros((slots.shape[0], x.shape[1]))
    rows = x.index_select(0, torch.where(ok, slots, torch.zeros_like(slots)))
    return rows.masked_fill_(~ok.unsqueeze(1), 0)


def _tma_column_major(sf: torch.Tensor) -> torch.Tensor:
    """The same values, column-major with every column padded to a multiple of SF_PACK_ALIGNMENT rows."""
    n, s = sf.shape
    out = torch.empty_strided((n, s), (1, align_up(max(n, 1), SF_PACK_ALIGNMENT)), dtype=sf.dtype, device=sf.device)
    out.copy_(sf)
    return out


def _combine_rows(x: torch.Tensor, w: Optional[torch.Tensor], h: EPHandle, rows: int) -> tuple:
    """(y [N, H] bf16, weights [N, K] float32 or None) the transport combines: expand rows summed per
    received token in top-k order (float32, then bf16); weights kept only on this rank's slots."""
    N, K = h.recv_topk_idx.shape
    if x.shape[0] < rows:
        x = torch.cat([x, x.new_zeros((rows - x.shape[0], x.shape[1]))])
    if w is not None and w.shape[0] < rows:
        w = torch.cat([w, w.new_zeros((rows - w.shape[0],) + tuple(w.shape[1:]))])
    mine = h.recv_topk_idx >= 0
    if not h.do_expand:
        wk = torch.where(mine, w, torch.zeros_like(w)) if w is not None else None
        return x, wk
    slots = h.expanded_slots.to(torch.int64)
    acc = torch.zeros((N, x.shape[1]), dtype=torch.float32, device=x.device)
    wk = torch.zeros((N, K), dtype=torch.float32, device=x.device) if w is not None else None
    for j in range(K):
        s = slots[:, j]
        ok = (s >= 0).unsqueeze(1)
        acc += torch.where(ok, x[s.clamp(min=0)].float(), torch.zeros((), device=x.device))
        if wk is not None:
            wk[:, j] = torch.where(s >= 0, w[s.clamp(min=0)], torch.zeros((), device=x.device))
    return acc.to(torch.bfloat16), wk


def _sum_order(topk_idx: torch.Tensor, num_local_experts: int) -> torch.Tensor:
    """[T] int32, DispatchHandle.sum_order: each token's ranks in the order of their last top-k slot
    (V2's combine keeps each rank's highest slot and sums the slots in ascending order), nibble i =
    the rank summed i-th."""
    T, K = topk_idx.shape
    rank = torch.where(topk_idx >= 0, topk_idx // num_local_experts, torch.full_like(topk_idx, -1))  # [T, K]
    later = torch.ones(K, K, dtype=torch.bool, device=topk_idx.device).triu(1)                      # [k, k' > k]
    again = ((rank.unsqueeze(2) == rank.unsqueeze(1)) & later).any(2)     # slot k's rank has a later slot
    last = (rank >= 0) & ~again
    place = torch.cumsum(last, 1) - last.to(torch.int64)                   # among the last slots, < 8 ranks
    return torch.where(last, rank << (4 * place), torch.zeros_like(rank)).sum(1).to(torch.int32)


def _on_stream(stream, fn):
    if stream is None:
        return fn()
    with torch.cuda.stream(stream):
        return fn()


def _tensors(obj) -> list:
    """The tensors inside nested tuples / lists / EPHandles (outputs to hand to the compute stream)."""
    out = []
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            out.extend(_tensors(o))
    elif isinstance(obj, EPHandle):
        for name in ("topk_idx", "psum_num_recv_tokens_per_scaleup_rank", "psum_num_recv_tokens_per_expert",
                     "num_unaligned_recv_tokens_per_expert", "recv_src_metadata", "dst_buffer_slot_idx",
                     "recv_topk_idx", "counts"):
            t = getattr(obj, name)
            if isinstance(t, torch.Tensor):
                out.append(t)
    return out
