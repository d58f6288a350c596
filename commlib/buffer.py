"""Buffer: DeepEP-compatible dispatch / combine / get_dispatch_layout.

Legend: T tokens on this rank, H hidden, K top-k, E experts, R ranks, N rows received.

A Buffer owns the communication state of one expert-parallel group: the transport (backend), the
comm stream, and (for GPU backends) the peer buffers exchanged once at creation. All validation
happens here, before any byte moves; backends get clean requests (commlib/backends/base.py).
"""
from __future__ import annotations

import dataclasses
import itertools
import os
from typing import Optional, Sequence, Union

import torch
import torch.distributed as dist

from commlib.utils import env
from commlib.utils.dist import group_from_comm
from commlib.utils.errors import is_device_failure
from commlib.backends import make_backend, make_low_latency
from commlib.backends.base import (Backend, BackendContext, CombineRequest, DispatchRequest, PendingCombine,
                                   set_stream as _set_stream)
from commlib.config import Config, default_combine_config, default_dispatch_config, slot_bytes
from commlib.fp8 import BLOCK
from commlib.handle import DispatchHandle
from commlib.layout import Layout
from commlib.utils.event import EventHandle, EventOverlap
from commlib.topology import DEFAULT_MAX_NODES_PER_TOKEN, Topology, gpu_share, local_facts
from commlib.tuning import cache as tuning_cache
from commlib.cuda import callpath
from commlib.cuda.loader import cupy_available as _cupy_available
from commlib.low_latency_mode import LowLatencyMode, Runtime
from commlib.validate import (CommlibError, check_layout, check_num_experts, check_routing, check_tensor,
                              expert_id_error, refuse_inside_capture, scales_carrier, scales_from_carrier,
                              split_x)

_buffer_ids = itertools.count(1)
# torch.cuda.Event's record / wait without their Python frames (every call issues two of each)
_EVENT = getattr(torch._C, "_CudaEventBase", None)
_event_record = getattr(_EVENT, "record", None)   # None on a build without CUDA (no comm stream there)
_event_wait = getattr(_EVENT, "wait", None)
# a call's event, made without torch.cuda.Event.__new__'s Python frame (its defaults: no timing, no
# blocking sync, not interprocess)
_EVENT_NEW, _CUDA_EVENT = getattr(_EVENT, "__new__", None), torch.cuda.Event

XType = Union[torch.Tensor, tuple]


class Buffer(LowLatencyMode):
    """The communication buffer of one expert-parallel group (a drop-in for ``deep_ep.Buffer``).

    Positional arguments are DeepEP v1's, in its order.

    Args:
        group: the torch.distributed group of the EP ranks (None: ``comm``, or the default group).
        num_nvl_bytes: bytes of the NVLink buffer; size it with
            ``Config.get_nvl_buffer_size_hint(hidden_bytes, ranks_per_node)``.
        num_rdma_bytes: bytes of the network staging buffer (several nodes), or of the low-latency
            buffer (``Buffer.get_low_latency_rdma_size_hint``).
        low_latency_mode: DeepEP's decode mode (low_latency_dispatch / low_latency_combine): GPU
            kernels on the nvlink backend (commlib/backends/low_latency/nvlink.py), collectives on the
            reference backend; internode: NotImplementedError.
        num_qps_per_rank, allow_nvlink_for_low_latency_mode, allow_mnnvl, use_fabric: accepted for API
            compatibility; they tune InfiniBand queue pairs, NVSHMEM, MNNVL and fabric memory handles,
            which commlib does not use.
        explicitly_destroy: if True the caller must call ``destroy()``; otherwise resources are
            released when the Buffer is garbage-collected.
        enable_shrink: low-latency shrink mode: a per-rank mask (low_latency_update_mask_buffer /
            low_latency_query_mask_buffer / low_latency_clean_mask_buffer); dispatch and combine skip
            masked ranks, and a rank that does not answer within COMMLIB_TIMEOUT_S is masked.
        comm: an mpi4py communicator used when ``group`` is None.
        backend: "auto" | "reference" | "nvlink" | "internode" (keyword only; default COMMLIB_BACKEND).
        ranks_per_node: override the launcher's ranks per node (emulated nodes).
        max_nodes_per_token: node-limited routing bound checked on several nodes (default 4).

    Attributes (DeepEP's): rank, group_size, group, num_nvl_bytes, num_rdma_bytes, low_latency_mode,
    explicitly_destroy, enable_shrink, runtime (a small stand-in for DeepEP's C++ runtime object), and
    the class attribute num_sms.
    """

    num_sms: int = env.num_sms()
    # tuning.autotune.get_config, set when commlib is imported: tunes on first use with COMMLIB_AUTOTUNE=1
    autotuner = None

    def __init__(self, group=None, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0,
                 low_latency_mode: bool = False, num_qps_per_rank: int = 24,
                 allow_nvlink_for_low_latency_mode: bool = True, allow_mnnvl: bool = False,
                 use_fabric: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False,
                 comm=None, *, backend: Optional[str] = None, ranks_per_node: Optional[int] = None,
                 max_nodes_per_token: int = DEFAULT_MAX_NODES_PER_TOKEN) -> None:
        if group is None:
            if comm is not None:
                group = group_from_comm(comm)
            elif dist.is_initialized():
                group = dist.group.WORLD
            else:
                raise ValueError("Buffer: pass a torch.distributed group or an mpi4py comm "
                                 "(torch.distributed is not initialised)")
        for name, value in (("num_nvl_bytes", num_nvl_bytes), ("num_rdma_bytes", num_rdma_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Buffer: {name} must be a non-negative int, got {value!r}")
        if max_nodes_per_token <= 0:
            raise ValueError(f"Buffer: max_nodes_per_token must be positive, got {max_nodes_per_token}")
        self.group = group
        self.rank = dist.get_rank(group)
        refuse_inside_capture(f"[commlib rank {self.rank}] Buffer")
        self.num_ranks = dist.get_world_size(group)
        self.group_size = self.num_ranks
        facts = [None] * self.num_ranks  # where every rank runs: host, boot id, GPU and its peer access
        dist.all_gather_object(facts, local_facts(), group=group)
        self.topology = Topology.detect(self.rank, self.num_ranks, ranks_per_node, facts=facts)
        self.gpu_share = gpu_share(facts)
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = bool(enable_shrink)
        self.use_fabric = bool(use_fabric)
        self.num_qps_per_rank = num_qps_per_rank
        self.max_nodes_per_token = max_nodes_per_token
        self.timeout_s = env.timeout_s()
        self.buffer_id = next(_buffer_ids) + (os.getpid() << 20)
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if torch.cuda.is_available() else torch.device("cpu"))
        # High priority (as DeepEP): communication CTAs get SMs ahead of queued GEMM blocks, which is
        # what lets the dual pipeline hide it (measured: default priority made overlap slower).
        self.comm_stream = (torch.cuda.Stream(device=self.device, priority=-1)
                            if self.device.type == "cuda" else None)
        self._entry_event = torch.cuda.Event() if self.comm_stream is not None else None  # see _enter
        self._destroyed = False
        self._stream_cache: dict = {}  # raw cudaStream_t -> torch.cuda.Stream (see _current_stream)
        self._tuned: dict = {}
        self._configs: dict = {}   # (kind, tokens, hidden, dtype, num_sms) -> the Config _resolve_config found
        self._prepared: dict = {}  # a validated non-cached dispatch's signature -> (Config, num_experts)
        self._rings: dict = {}
        self._local_buffers: dict = {}  # use_rdma_buffer -> uint8 tensor (get_local_buffer_tensor)
        self._mask = torch.zeros(self.num_ranks, dtype=torch.int32, device="cpu")  # shrink mode: 1 = masked rank (host)
        self._check_world_agrees()
        self.backend_name = self._choose_backend(backend)
        self.backend: Backend = self._make_backend(self.backend_name)
        # backends that keep plans of cached dispatches and combines (NVLinkBackend.plan_for) replay them
        self._replays = self.comm_stream is not None and hasattr(self.backend, "plan_for")
        # the C++ call path (commlib.cuda.callpath) of those backends where it loads; _cp: the one in use
        # (the internode engine's: csrc/callpath_internode.cpp, its twins made through backend.cpp_twin)
        self._cpp = (callpath.engine(buffer_type=Buffer, comm_stream=self.comm_stream, entry_event=self._entry_event,
                                     device_index=self.device.index, rank=self.rank, num_ranks=self.num_ranks,
                                     timeout_ns=self.backend.timeout_ns,
                                     make_twin=getattr(self.backend, "cpp_twin", None))
                     if self._replays and getattr(self.backend, "_twins", False) else None)
        self._cp = self._cpp
        # a cached dispatch or combine the internode C++ path declines (a recording probe, no twin) may
        # still be a Python replay
        self._replay_after_cpp = self._cpp is not None and hasattr(self.backend, "cpp_twin")
        # the GPU engines check expert ids on the device: a non-cached dispatch's argument checks read
        # no values, so a signature that passed them once passes again (_prepare_dispatch)
        self._memo_checks = self.device.type == "cuda" and self.backend_name != "reference"
        self.runtime = Runtime(self)
        self._low_latency = None
        if low_latency_mode:
            try:
                self._low_latency = make_low_latency(self.backend_name, self._ctx, self.backend)
                if self.enable_shrink:
                    self._low_latency.enable_shrink()
            except BaseException:
                self.backend.destroy()
                raise

    # ------------------------------------------------------------------ set-up
    def _check_world_agrees(self) -> None:
        """Every rank must build the Buffer with the same sizes and topology."""
        mine = (self.num_nvl_bytes, self.num_rdma_bytes, self.topology.ranks_per_node, self.num_ranks,
                bool(self.low_latency_mode), self.enable_shrink)
        everyone = [None] * self.num_ranks
        dist.all_gather_object(everyone, mine, group=self.group)
        for r, theirs in enumerate(everyone):
            if theirs != mine:
                raise ValueError(
                    f"[commlib rank {self.rank}] Buffer arguments differ between ranks: rank {r} has "
                    f"(num_nvl_bytes, num_rdma_bytes, ranks_per_node, world, low_latency_mode, enable_shrink) = "
                    f"{theirs}, this rank {mine}")

    def _choose_backend(self, requested: Optional[str]) -> str:
        name = (requested or env.backend()).lower()
        if name not in ("auto", "reference", "nvlink", "internode"):
            raise ValueError(f"Buffer: backend must be auto, reference, nvlink or internode, got {name!r}")
        if name == "auto":
            if self.topology.num_nodes == 1:
                return "nvlink" if self.device.type == "cuda" and _cupy_available() else "reference"
            # Several nodes: the internode engine, faster than the reference in every op measured
            # (docs/internode.md). It builds rail and node subgroups, which torch.distributed lets
            # only the whole world create, and it has no low-latency mode: otherwise the reference.
            if self.low_latency_mode or self.num_ranks != dist.get_world_size():
                return "reference"
            return "internode"
        if name == "nvlink" and self.device.type != "cuda":
            raise ValueError(f"Buffer: backend {name!r} needs CUDA GPUs; this rank has none")
        if name == "nvlink" and self.topology.num_nodes != 1:
            raise ValueError(f"Buffer: the nvlink backend serves one node; the topology has "
                             f"{self.topology.num_nodes} nodes (use internode, auto or reference)")
        if name == "internode" and self.topology.num_nodes < 2:
            raise ValueError("Buffer: the internode backend needs several nodes (set ranks_per_node / "
                             "COMMLIB_RANKS_PER_NODE), or use nvlink / reference on one node")
        return name

    def _make_backend(self, name: str) -> Backend:
        self._ctx = BackendContext(
            group=self.group, rank=self.rank, num_ranks=self.num_ranks, topology=self.topology,
            device=self.device, buffer_id=self.buffer_id, timeout_s=self.timeout_s,
            num_nvl_bytes=self.num_nvl_bytes, num_rdma_bytes=self.num_rdma_bytes,
            max_nodes_per_token=self.max_nodes_per_token, num_sms=lambda: Buffer.num_sms,
            default_config=lambda kind, r: (Buffer.get_dispatch_config if kind == "dispatch"
                                            else Buffer.get_combine_config)(r),
            run=self._run, comm_stream=self.comm_stream, gpu_share=self.gpu_share)
        return make_backend(name, self._ctx)

    def destroy(self) -> None:
        """Release peer buffers and streams. The Buffer refuses every call afterwards."""
        if self._destroyed:
            return
        self._destroyed = True
        if self._low_latency is not None:
            self._low_latency.destroy()
        self.backend.destroy()

    def __del__(self) -> None:
        try:
            if not self.explicitly_destroy and not self._destroyed:
                if getattr(self, "_low_latency", None) is not None:
                    self._low_latency.destroy()
                self.backend.destroy()
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass

    def _alive(self) -> None:
        if self._destroyed:
            raise CommlibError(f"[commlib rank {self.rank}] Buffer used after destroy()")
        failed = getattr(self.backend, "failed", None)
        if failed:
            raise CommlibError(f"[commlib rank {self.rank}] Buffer is unusable after an earlier failure: {failed}")

    # ------------------------------------------------------------------ static API (DeepEP)
    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        """SMs every later default config uses (even: two CTAs per channel)."""
        if isinstance(new_num_sms, bool) or not isinstance(new_num_sms, int) or new_num_sms <= 0 or new_num_sms % 2:
            raise ValueError(f"Buffer.set_num_sms: expected a positive even int, got {new_num_sms!r}")
        Buffer.num_sms = new_num_sms

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        return default_dispatch_config(num_ranks, Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        return default_combine_config(num_ranks, Buffer.num_sms)

    @staticmethod
    def is_sm90_compiled() -> bool:
        """True when the GPU kernels can be built for sm_90 (they are compiled at first use)."""
        return _cupy_available()

    @staticmethod
    def capture() -> EventOverlap:
        """An EventOverlap marking the current point of the current stream (None event without CUDA)."""
        return EventOverlap(EventHandle())

    def get_comm_stream(self):
        """The communication stream (a torch.cuda.Stream; None on CPU ranks, which have no stream)."""
        return self.comm_stream

    @property
    def call_path(self) -> str:
        """(commlib extension) "cpp" while repeated calls run through the C++ call path
        (csrc/callpath.cpp, COMMLIB_CALLPATH), else "python"."""
        return "cpp" if self._cp is not None else "python"

    def set_call_path(self, path: str) -> None:
        """(commlib extension) Run this Buffer's later calls through the C++ call path ("cpp") or the
        Python one ("python"); both give the same results (benchmarks and tests compare them).
        ValueError for "cpp" where it did not load (COMMLIB_CALLPATH=python, no compiler, CPU ranks)."""
        if path not in ("cpp", "python"):
            raise ValueError(f"[commlib rank {self.rank}] set_call_path: expected 'cpp' or 'python', got {path!r}")
        if path == "cpp" and self._cpp is None:
            why = callpath.why_unavailable or f"the {self.backend_name} backend has no C++ call path"
            raise ValueError(f"[commlib rank {self.rank}] the C++ call path is unavailable here: {why}")
        self._cp = self._cpp if path == "cpp" else None

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """A 1-D ``dtype`` view of this rank's ``num_nvl_bytes`` (or ``num_rdma_bytes``) scratch buffer,
        from byte ``offset``; with ``size``, its first ``size.numel()`` elements viewed as ``size``.

        DeepEP returns its registered communication memory here; commlib's transports own theirs,
        so this is a separate local buffer of the same size, allocated on first use and kept for the
        Buffer's life (what clients use it for: a scratch area the size of the buffer).
        """
        self._alive()
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"[commlib rank {self.rank}] get_local_buffer_tensor: dtype must be a torch.dtype, "
                            f"got {type(dtype).__name__}")
        nbytes = self.num_rdma_bytes if use_rdma_buffer else self.num_nvl_bytes
        if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset <= nbytes:
            raise ValueError(f"[commlib rank {self.rank}] get_local_buffer_tensor: offset must be an int in "
                             f"[0, {nbytes}], got {offset!r}")
        raw = self._local_buffers.get(bool(use_rdma_buffer))
        if raw is None:
            raw = self._local_buffers[bool(use_rdma_buffer)] = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        item = torch.empty(0, dtype=dtype, device="cpu").element_size()
        n = (nbytes - offset) // item
        tensor = raw[offset:offset + n * item].view(dtype)
        if size is None:
            return tensor
        size = torch.Size(size)
        if size.numel() > tensor.numel():
            raise ValueError(f"[commlib rank {self.rank}] get_local_buffer_tensor: size {tuple(size)} needs "
                             f"{size.numel()} elements, the buffer holds {tensor.numel()} from offset {offset}")
        return tensor[:size.numel()].view(size)

    @property
    def counters(self) -> dict:
        """Rows moved so far: internode_rows, intranode_rows, local_rows."""
        return dict(self.backend.counters)

    # ------------------------------------------------------------------ streams
    def _run(self, fn, inputs: Sequence, previous_event: Optional[EventOverlap], async_finish: bool,
             allocate_on_comm_stream: bool, on_caller_stream: bool = False):
        """fn() on the comm stream with DeepEP's event semantics (``on_caller_stream``: on the current
        stream, no event), turning a CUDA failure into a CommlibError that retires the Buffer."""
        if allocate_on_comm_stream and (previous_event is None or not async_finish):
            raise ValueError("allocate_on_comm_stream=True needs previous_event and async_finish=True")
        if previous_event is not None and not isinstance(previous_event, EventOverlap):
            raise TypeError(f"previous_event must be an EventOverlap, got {type(previous_event).__name__}")
        if self.comm_stream is None or on_caller_stream:
            try:
                return fn(), EventOverlap(None)
            except RuntimeError as e:
                self._retire_on_device_failure(e)
                raise
        try:
            return self._run_cuda(fn, inputs, previous_event, async_finish, allocate_on_comm_stream)
        except RuntimeError as e:
            self._retire_on_device_failure(e)
            raise

    def _retire_on_device_failure(self, e: RuntimeError) -> None:
        """A sticky CUDA error (a kernel trapped on a device timeout or a peer mismatch, a dead peer's
        memory, an illegal access) leaves the context unusable: raise CommlibError, and this Buffer
        refuses every later call. Any other error (host-side, whatever its message) returns here and
        is raised as itself; the Buffer keeps working."""
        if isinstance(e, CommlibError) or not is_device_failure(e):
            return
        text = str(e).strip()[:300]
        if hasattr(self.backend, "failed") and not self.backend.failed:
            self.backend.failed = f"[commlib rank {self.rank}] CUDA error during a call: {text}"
        raise CommlibError(f"[commlib rank {self.rank}] CUDA error during a call; this Buffer is unusable "
                           f"from now on (see the '[commlib]' device line above, if any): {text}") from e

    def _run_cuda(self, fn, inputs: Sequence, previous_event: Optional[EventOverlap], async_finish: bool,
                  allocate_on_comm_stream: bool = False):
        compute = self._current_stream()
        comm = self.comm_stream
        outputs_on_compute = self._enter(compute, previous_event, allocate_on_comm_stream)
        ctx = self._ctx
        index = self.device.index
        if compute.device_index == index and torch._C._cuda_getDevice() == index:
            ctx.out_stream = compute if outputs_on_compute else None
            # set_stream rather than the stream context manager: same effect on the buffer's own
            # device, a fraction of the host time (the context manager re-queries both devices);
            # base.set_stream: torch.cuda.set_stream without its Python frames
            _set_stream(comm)
            try:
                result = fn()
            finally:
                _set_stream(compute)
                ctx.out_stream = None
        else:
            outputs_on_compute = False
            with torch.cuda.stream(comm):
                result = fn()
        return result, self._leave(compute, result, getattr(result, "blocks", None), inputs, async_finish,
                                   outputs_on_compute)

    def _enter(self, compute, previous_event: Optional[EventOverlap], allocate_on_comm_stream: bool) -> bool:
        """The comm stream waits for ``previous_event``, or for the caller's stream. Returns whether the
        call's outputs belong to the caller's stream (as DeepEP: no record_stream needed, and freed
        blocks are reused in stream order); not after a previous_event, since the comm stream then does
        not wait for the caller's later work, which may still use a block it freed."""
        if previous_event is not None and previous_event.event is not None:
            self.comm_stream.wait_event(previous_event.event)
            return False
        # one kept event: a wait takes the event's state when it is enqueued, so re-recording it later
        # cannot move an earlier wait
        _event_record(self._entry_event, compute)
        _event_wait(self._entry_event, self.comm_stream)
        return not allocate_on_comm_stream

    def _leave(self, compute, result, blocks: Optional[tuple], inputs: Sequence, async_finish: bool,
               outputs_on_compute: bool) -> EventOverlap:
        """Tell the allocator which streams use what, record the call's event; the caller's stream
        waits for it unless ``async_finish``."""
        comm = self.comm_stream
        # Inputs need a record only when the caller may free them before the comm stream is done
        # (async_finish); otherwise the compute stream waits below before anything reuses them.
        # A handle passed in (cached mode) was recorded when it was made.
        if async_finish:
            for t in inputs:
                if isinstance(t, torch.Tensor) and t.is_cuda:
                    t.record_stream(comm)
        if blocks is not None:
            # the backend's allocations: owned by the caller's stream, the comm stream writes them
            # (recorded there when the caller may free them early), or owned by the comm stream
            if outputs_on_compute:
                if async_finish:
                    for b in blocks:
                        b.record_stream(comm)
            else:
                for b in blocks:
                    b.record_stream(compute)
        else:
            # outputs allocated on the comm stream and used on the compute stream: tell the allocator,
            # once per allocation (outputs that are views of one block share it)
            recorded = set()
            for t in _tensors_of(result, skip=inputs):
                base = t._base if t._base is not None else t
                if id(base) not in recorded:
                    recorded.add(id(base))
                    base.record_stream(compute)
        event = _EVENT_NEW(_CUDA_EVENT)
        _event_record(event, comm)
        if not async_finish:
            _event_wait(event, compute)
        return EventOverlap(event, [t for t in inputs if isinstance(t, torch.Tensor)] if async_finish else None)

    def _replay(self, handle: DispatchHandle, key: tuple, x: torch.Tensor, second, config, previous_event,
                async_finish: bool, allocate_on_comm_stream: bool, inputs: tuple):
        """A cached dispatch or a combine the backend made before with the same arguments, replayed
        (``NVLinkBackend.plan_for``): none of the validation, config resolution and launch set-up of
        the full path, whose checks that call already passed. Returns (first output, second output,
        event), or None for the full path (anything differs, or its argument errors must be raised)."""
        plan = self.backend.plan_for(handle, key, x, config, second)
        if (plan is None or (previous_event is not None and not isinstance(previous_event, EventOverlap))
                or (allocate_on_comm_stream and (previous_event is None or not async_finish))
                or torch._C._cuda_getDevice() != self.device.index):
            return None
        compute = self._current_stream()
        on_compute = self._enter(compute, previous_event, allocate_on_comm_stream)
        try:
            first, second_out = self.backend.run_plan(plan, x, second, self.comm_stream.cuda_stream,
                                                      None if on_compute else (self.comm_stream, compute))
        except RuntimeError as e:
            self._retire_on_device_failure(e)
            raise
        blocks = (first,) if second_out is None else (first, second_out)
        return first, second_out, self._leave(compute, None, blocks, inputs, async_finish, on_compute)

    def _current_stream(self) -> "torch.cuda.Stream":
        """torch's current stream on the buffer's device, through a raw-pointer cache (host-cheap)."""
        idx = self.device.index
        raw = torch._C._cuda_getCurrentRawStream(idx)
        stream = self._stream_cache.get(raw)
        if stream is None:
            stream = self._stream_cache[raw] = torch.cuda.current_stream(self.device)
        return stream

    # ------------------------------------------------------------------ layout
    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False):
        """Routing -> counts.

        Args:
            topk_idx: [T, K] int64 expert ids (-1 = empty slot).
            num_experts: E, divisible by the number of ranks.
        Returns:
            (num_tokens_per_rank [R] int32, num_tokens_per_rdma_rank [nodes] int32 or None on one
            node, num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool, event)
        """
        cp = self._cp
        if cp is not None and previous_event is None and not async_finish and not allocate_on_comm_stream:
            try:   # a layout like an earlier one: in C++ (None: the path below). Inline: a frame costs ~0.3 us
                out = cp.layout(self, topk_idx, num_experts)
            except RuntimeError as e:   # a CUDA failure retires the Buffer, as in _run
                self._retire_on_device_failure(e)
                raise
            if out is not None:
                return out
        self._alive()
        check_num_experts(num_experts, self.num_ranks, self.rank)
        check_tensor("topk_idx", topk_idx, self.rank, dtype=torch.int64, dim=2, device=self.device)
        self._check_expert_ids(topk_idx, num_experts)
        fn = lambda: self.backend.get_dispatch_layout(topk_idx, num_experts)  # noqa: E731
        if previous_event is None and not async_finish and not allocate_on_comm_stream:
            # nothing to overlap: the layout runs on the caller's stream, in its order (as DeepEP's
            # synchronous call ends, with no event to wait for)
            layout, event = self._run(fn, (), None, False, False, on_caller_stream=True)
        else:
            layout, event = self._run(fn, [topk_idx], previous_event, async_finish, allocate_on_comm_stream)
        return (layout.num_tokens_per_rank, layout.num_tokens_per_rdma_rank, layout.num_tokens_per_expert,
                layout.is_token_in_rank, event)

    def _check_expert_ids(self, topk_idx: torch.Tensor, num_experts: int) -> None:
        # On the GPU engines the layout kernel checks ids itself (a host check would cost a sync).
        if self.backend_name == "reference" or not topk_idx.is_cuda:
            msg = expert_id_error(topk_idx, num_experts)
            if msg:
                raise ValueError(f"[commlib rank {self.rank}] {msg}")

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, x: XType, handle: Optional[DispatchHandle] = None,
                 num_tokens_per_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_rdma_rank: Optional[torch.Tensor] = None,
                 is_token_in_rank: Optional[torch.Tensor] = None,
                 num_tokens_per_expert: Optional[torch.Tensor] = None,
                 topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config: Optional[Config] = None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False, prepacked=None):
        """Send each token to the ranks holding its experts (once per rank).

        Args:
            x: [T, H] bf16, or (FP8 E4M3 [T, H], scales [T, S]): scales float32 or int32 (packed
                UE8M0), any strides (column-major included), 1 <= S <= H / 128 ([T, 1] per token,
                [T, H / 128], [T, H / 512]); they are moved, not read.
            handle: a previous dispatch's handle: cached mode (same routing; no layout, no count
                exchange; topk outputs are None).
            num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank, num_tokens_per_expert:
                what get_dispatch_layout returned (computed here from topk_idx if the first ones are
                omitted; num_tokens_per_expert is always needed in non-cached mode).
            topk_idx: [T, K] int64, or None (DeepEP's dispatch without top-k: the rows go where
                is_token_in_rank says, recv_topk_idx / recv_topk_weights are None, and the per-expert
                list sums the senders' num_tokens_per_expert); topk_weights: [T, K] float32 or None.
            expert_alignment: per-expert counts are rounded up to a multiple of this.
            num_worst_tokens: > 0 pads outputs to that many rows and avoids any host sync.
            prepacked: what prepack() returned for this x (and handle); the layout arguments may
                then be omitted (a non-cached prepack computed them). None: nothing prepacked.
        Returns:
            (recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event)
            recv_x: [N, H] bf16 or (fp8 [N, H], scales [N, S] of x's scales dtype); rows grouped by source rank.
        """
        cp = self._cp
        if (handle is not None and topk_idx is None and topk_weights is None and prepacked is None
                and not num_worst_tokens):
            if cp is not None:   # the C++ call path: the whole replayed call (None: the full path below)
                try:
                    out = cp.cached_dispatch(self, x, handle, expert_alignment, config, previous_event, async_finish,
                                             allocate_on_comm_stream)
                except RuntimeError as e:
                    self._retire_on_device_failure(e)
                    raise
                if out is not None:
                    return out
            if ((cp is None or self._replay_after_cpp) and type(expert_alignment) is int and expert_alignment > 0
                    and self._replays
                    and type(handle) is DispatchHandle and handle.buffer_id == self.buffer_id):
                data, scales = (x, None) if isinstance(x, torch.Tensor) else (x if type(x) is tuple and len(x) == 2
                                                                                else (None, None))
                if (isinstance(data, torch.Tensor) and data.dim() == 2
                        and (config is None or isinstance(config, Config))):
                    cfg = self._resolve_config(config, "dispatch", data.shape[0], data.shape[1],
                                               "bf16" if scales is None else "fp8")
                    out = self._replay(handle, ("dispatch", data.dtype), data, scales, cfg, previous_event,
                                       async_finish, allocate_on_comm_stream, (data, scales))
                    if out is not None:
                        return ((out[0] if scales is None else (out[0], out[1])), None, None, None, handle, out[2])
        elif cp is not None and handle is None and prepacked is None and topk_idx is not None:
            try:   # a non-cached dispatch like one the path below ran: in C++ (None: the path below)
                out = cp.dispatch(self, x, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                                  num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
                                  config, previous_event, async_finish, allocate_on_comm_stream)
            except RuntimeError as e:   # as the backend's own dispatch does, where it has its way (NVLink)
                if (hasattr(self.backend, "_device_failure") and not isinstance(e, CommlibError)
                        and is_device_failure(e)):
                    raise self.backend._device_failure("dispatch", e) from e
                self._retire_on_device_failure(e)   # (else the Buffer's: CommlibError, the backend failed)
                raise
            if out is not None:
                return out
        self._alive()
        try:
            if prepacked is not None:
                self._check_prepacked(prepacked, split_x(x, self.rank, self.device)[0], handle, num_worst_tokens)
            layout = getattr(prepacked, "layout", None)
            if layout is not None and num_tokens_per_rank is None and is_token_in_rank is None:
                num_tokens_per_rank, num_tokens_per_rdma_rank = layout.num_tokens_per_rank, layout.num_tokens_per_rdma_rank
                num_tokens_per_expert, is_token_in_rank = layout.num_tokens_per_expert, layout.is_token_in_rank
            req = self._prepare_dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                                         num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                                         num_worst_tokens, config)
            req.prepacked = prepacked
        except (TypeError, ValueError):
            self._rejected(2 if handle is not None else 1,
                           num_tokens_per_expert.shape[0] if isinstance(num_tokens_per_expert, torch.Tensor)
                           and num_tokens_per_expert.dim() == 1 else 0)
            raise
        scales_in = req.x_scales
        inputs = [req.x, scales_in, topk_idx, topk_weights, is_token_in_rank, handle]

        def call():
            # on the comm stream: the scales' carrier rows are made after the wait for previous_event,
            # and the received ones are turned back before the event that the caller waits on
            if scales_in is not None:
                req.x_scales = scales_carrier(scales_in, req.x.shape[1])
            res = self.backend.dispatch(req)
            if res.recv_x_scales is not None:
                carrier = res.recv_x_scales
                res.recv_x_scales = scales_from_carrier(carrier, scales_in.shape[1], scales_in.dtype)
                if res.blocks is not None and res.recv_x_scales.data_ptr() != carrier.data_ptr():
                    # narrower scales were copied out on the comm stream, outside the backend's blocks
                    out = self._ctx.out_stream
                    if out is not None:
                        res.recv_x_scales.record_stream(out)
                    else:
                        res.blocks += (res.recv_x_scales,)
            return res

        res, event = self._run(call, inputs, previous_event, async_finish, allocate_on_comm_stream)
        res.handle.buffer_id = self.buffer_id
        if cp is not None and handle is None and prepacked is None and topk_idx is not None:
            full = getattr(self.backend, "last_full_plan", None)
            if full is not None and full.cpp is not None:   # the next call like this one runs in C++
                cp.keep_dispatch(x, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                                 num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
                                 config, full.cpp, res.handle)
        per_expert = res.num_recv_tokens_per_expert_list
        if handle is None and req.topk_idx is None and not getattr(self.backend, "counts_experts_without_topk", False):
            # no top-k to count: the per-expert list comes from the senders' num_tokens_per_expert (as DeepEP)
            per_expert = [] if num_worst_tokens else self._recv_per_expert(num_tokens_per_expert, expert_alignment)
        recv_x = res.recv_x if res.recv_x_scales is None else (res.recv_x, res.recv_x_scales)
        return (recv_x, res.recv_topk_idx, res.recv_topk_weights, per_expert, res.handle, event)

    def _recv_per_expert(self, num_tokens_per_expert: torch.Tensor, alignment: int) -> list:
        """Rows this rank's local experts receive, from every rank's num_tokens_per_expert (collective)."""
        R, me = self.num_ranks, self.rank
        dev = torch.device("cpu") if dist.get_backend(self.group) == "gloo" else self.device
        mine = num_tokens_per_expert.to(dev, torch.int64).contiguous()
        everyone = [torch.empty_like(mine) for _ in range(R)]
        dist.all_gather(everyone, mine, group=self.group)
        L = mine.numel() // R
        counts = torch.stack(everyone)[:, me * L:(me + 1) * L].sum(0).tolist()
        return [(int(c) + alignment - 1) // alignment * alignment for c in counts]

    def prepack(self, x: XType, topk_idx: Optional[torch.Tensor] = None, topk_weights: Optional[torch.Tensor] = None,
                num_experts: Optional[int] = None, handle: Optional[DispatchHandle] = None):
        """Pack x's rows for a coming dispatch now, on the current stream (commlib extension).

        On the copy-engine path (COMMLIB_CE_BYTES) a dispatch first gathers each destination's rows
        into one contiguous block for the copy engines. Inside the call that gather runs on the comm
        stream, where beside a GEMM it gets only the SMs the GEMM leaves. Called right after the
        compute that produced x (as the dual pipeline does, commlib.training.pipeline.schedule), the gather runs there on
        every SM in a fraction of the time. Non-cached (topk_idx and num_experts given): the layout
        (get_dispatch_layout) is computed here too. Pass the result to dispatch(prepacked=...) with the
        same x (and handle); it is used once, and holds a pack buffer until then (at most 4 may be
        outstanding; a fifth raises ValueError). Returns None where there is nothing to do (another
        backend or path, COMMLIB_CE_PREPACK=0, more tokens than a staging region holds): dispatch
        then packs itself, as without a prepack.
        """
        self._alive()
        fn = getattr(self.backend, "prepack", None)
        if fn is None or self.comm_stream is None:
            return None
        data, scales = split_x(x, self.rank, self.device)
        T, H = data.shape
        scales = scales_carrier(scales, H) if scales is not None else None
        if handle is not None:
            self._check_handle(handle, T, H)
            if topk_idx is not None or topk_weights is not None:
                raise ValueError(f"[commlib rank {self.rank}] cached prepack (handle given) takes no topk_idx / "
                                 "topk_weights")
        else:
            if topk_idx is None or num_experts is None:
                raise ValueError(f"[commlib rank {self.rank}] prepack needs topk_idx and num_experts "
                                 "(or a handle for a cached dispatch)")
            check_routing(topk_idx, topk_weights, T, self.rank, self.device)
            check_num_experts(num_experts, self.num_ranks, self.rank)
            self._check_expert_ids(topk_idx, num_experts)
        return fn(data, scales, topk_idx, topk_weights, int(num_experts or 0), handle)

    def _check_prepacked(self, p, data: torch.Tensor, handle, num_worst_tokens) -> None:
        """prepack()'s token fits this dispatch: same x (storage and shape) and handle, unused, a call
        the copy engines take. Raised before the call's collectives, like any bad input."""
        me = self.rank
        if not hasattr(self.backend, "prepack"):
            raise ValueError(f"[commlib rank {me}] prepacked rows given to a {self.backend_name} Buffer, whose "
                             "prepack() returns None")
        x = getattr(p, "x", None)
        if x is None or not hasattr(p, "consumed"):
            raise ValueError(f"[commlib rank {me}] prepacked must come from this Buffer's prepack(), got "
                             f"{type(p).__name__}")
        if p.consumed:
            raise ValueError(f"[commlib rank {me}] these prepacked rows were already dispatched (one dispatch "
                             "per prepack)")
        if p.handle is not handle or x.data_ptr() != data.data_ptr() or x.shape != data.shape:
            raise ValueError(f"[commlib rank {me}] prepacked rows belong to another dispatch: prepack and dispatch "
                             "must get the same x (and handle, for a cached dispatch)")
        if num_worst_tokens:
            raise ValueError(f"[commlib rank {me}] prepacked rows need a copy-engine dispatch; num_worst_tokens "
                             "takes the SM kernels")

    def _rejected(self, op: int, num_experts: int = 0) -> None:
        """Input refused on this rank: backends that agree per call let the peers know (``num_experts``:
        the call's, where its num_tokens_per_expert says; the internode engine's exchange is sized by it)."""
        notify = getattr(self.backend, "on_rejected", None)
        if notify is not None:
            notify(op, num_experts)

    def _prepare_dispatch(self, x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                          num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
                          config) -> DispatchRequest:
        # A non-cached dispatch whose arguments look as those of one that passed the checks below
        # (_dispatch_signature: every property the checks read) passes them again; on the GPU engines
        # no check reads a value (the layout and notify kernels check expert ids on the device).
        sig = None
        if (handle is None and num_tokens_per_rank is not None and is_token_in_rank is not None
                and self._memo_checks):
            sig = _dispatch_signature(x, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                                      num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                                      num_worst_tokens, config)
            hit = self._prepared.get(sig) if sig is not None else None
            if hit is not None:
                data, scales = (x, None) if type(x) is torch.Tensor else x
                return DispatchRequest(data, scales, topk_idx, topk_weights,
                                       Layout(num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert,
                                              is_token_in_rank),
                                       None, hit[1], expert_alignment, num_worst_tokens, hit[0])
        req = self._check_dispatch(x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                                   num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
                                   config)
        if sig is not None:
            if len(self._prepared) > 64:
                self._prepared.clear()
            self._prepared[sig] = (req.config, req.num_experts)
        return req

    def _check_dispatch(self, x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank, is_token_in_rank,
                        num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
                        config) -> DispatchRequest:
        # FP8 scales stay the caller's tensor here; dispatch() turns them into the carrier rows the
        # transports move on the comm stream, after its wait for previous_event.
        data, scales = split_x(x, self.rank, self.device)
        T, H = data.shape
        if isinstance(expert_alignment, bool) or not isinstance(expert_alignment, int) or expert_alignment <= 0:
            raise ValueError(f"[commlib rank {self.rank}] expert_alignment must be a positive int, got {expert_alignment!r}")
        if isinstance(num_worst_tokens, bool) or not isinstance(num_worst_tokens, int) or num_worst_tokens < 0:
            raise ValueError(f"[commlib rank {self.rank}] num_worst_tokens must be a non-negative int, got {num_worst_tokens!r}")
        config = self._resolve_config(config, "dispatch", T, H, "fp8" if scales is not None else "bf16")
        hidden_bytes = H * data.element_size()
        self._check_capacity(hidden_bytes, config, H // BLOCK if scales is not None else 0,
                             topk_idx.shape[1] if handle is None and isinstance(topk_idx, torch.Tensor) and topk_idx.dim() == 2
                             else 0)

        if handle is not None:
            self._check_handle(handle, T, H)
            if topk_idx is not None or topk_weights is not None:
                raise ValueError(f"[commlib rank {self.rank}] cached dispatch (handle given) takes no topk_idx / topk_weights")
            # as DeepEP: a cached dispatch returns as many rows as the handle's recv_src_idx, so a handle
            # from a num_worst_tokens dispatch keeps its padding (and its freedom from host reads)
            return DispatchRequest(data, scales, None, None, None, handle, handle.num_experts, expert_alignment,
                                   num_worst_tokens or handle.num_worst_tokens, config)
        else:
            if topk_idx is None:
                # DeepEP's dispatch without top-k: the layout says where each token goes
                if num_tokens_per_rank is None or is_token_in_rank is None or num_tokens_per_expert is None:
                    raise ValueError(f"[commlib rank {self.rank}] dispatch needs topk_idx, or (without top-k) "
                                     "num_tokens_per_rank, is_token_in_rank and num_tokens_per_expert, or a handle "
                                     "for cached mode")
                if topk_weights is not None:
                    raise ValueError(f"[commlib rank {self.rank}] topk_weights given without topk_idx")
                if num_worst_tokens:
                    raise ValueError(f"[commlib rank {self.rank}] num_worst_tokens needs topk_idx (as in DeepEP)")
            else:
                check_routing(topk_idx, topk_weights, T, self.rank, self.device)
            if num_tokens_per_expert is None:
                raise ValueError(f"[commlib rank {self.rank}] dispatch needs num_tokens_per_expert "
                                 "(from get_dispatch_layout) to know num_experts")
            num_experts = int(num_tokens_per_expert.shape[0])
            check_num_experts(num_experts, self.num_ranks, self.rank)
            R = self.num_ranks
            if num_tokens_per_rank is None or is_token_in_rank is None:
                layout = self.backend.get_dispatch_layout(topk_idx, num_experts)
            else:
                check_layout("num_tokens_per_rank", num_tokens_per_rank, (R,), torch.int32, self.rank, self.device)
                check_layout("is_token_in_rank", is_token_in_rank, (T, R), torch.bool, self.rank, self.device)
                check_layout("num_tokens_per_expert", num_tokens_per_expert, (num_experts,), torch.int32,
                             self.rank, self.device)
                rdma = num_tokens_per_rdma_rank
                if self.topology.num_nodes > 1 and rdma is not None:
                    check_layout("num_tokens_per_rdma_rank", rdma, (self.topology.num_nodes,), torch.int32,
                                 self.rank, self.device)
                layout = Layout(num_tokens_per_rank, rdma, num_tokens_per_expert, is_token_in_rank)
            if topk_idx is not None:
                self._check_expert_ids(topk_idx, num_experts)
            req = DispatchRequest(data, scales, topk_idx, topk_weights, layout, None, num_experts,
                                  expert_alignment, num_worst_tokens, config)
        return req

    # ------------------------------------------------------------------ combine
    def combine(self, x: torch.Tensor, handle: DispatchHandle, topk_weights: Optional[torch.Tensor] = None,
                bias: Union[torch.Tensor, Sequence[torch.Tensor], None] = None, config: Optional[Config] = None,
                previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False, finish_later: bool = False):
        """Return each received row to its token's home rank and sum the rows of each token.

        Args:
            x: [N, H] bf16, rows in the order dispatch delivered them.
            handle: the dispatch handle.
            topk_weights: [N, K] float32 (summed the same way) or None.
            bias: None, a [T, H] bf16 tensor, or a tuple of up to two: the float32 sum starts from
                0 + bias0 + bias1, then adds the rows (DeepEP's order).
            finish_later: (commlib extension) return a PendingCombine in place of the two outputs;
                its finish(), called on the consuming stream after that stream waited for the
                event, returns them. The copy-engine path with host staging runs its sum there,
                with every SM, instead of on the comm stream beside the compute; elsewhere
                finish() hands over outputs that are already complete.
        Returns:
            (combined_x [T, H] bf16, combined_topk_weights [T, K] float32 or None, event);
            finish_later: (PendingCombine, None, event)
        """
        cp = self._cp
        if bias is None and not finish_later and cp is not None:   # the whole replayed call in C++
            try:
                out = cp.combine(self, x, handle, topk_weights, config, previous_event, async_finish,
                                 allocate_on_comm_stream)
            except RuntimeError as e:
                self._retire_on_device_failure(e)
                raise
            if out is not None:
                return out
        if (bias is None and not finish_later and (cp is None or self._replay_after_cpp) and self._replays
                and type(handle) is DispatchHandle
                and handle.buffer_id == self.buffer_id and isinstance(x, torch.Tensor) and x.dim() == 2
                and (config is None or isinstance(config, Config))
                and (topk_weights is None or isinstance(topk_weights, torch.Tensor) and topk_weights.dim() == 2)):
            cfg = self._resolve_config(config, "combine", handle.num_tokens, x.shape[1])
            out = self._replay(handle, ("combine", 0 if topk_weights is None else topk_weights.shape[1]), x,
                               topk_weights, cfg, previous_event, async_finish, allocate_on_comm_stream,
                               (x, topk_weights))
            if out is not None:
                return out
        self._alive()
        try:
            req = self._prepare_combine(x, handle, topk_weights, bias, config)
        except (TypeError, ValueError):
            self._rejected(3)
            raise
        req.finish_later = bool(finish_later)
        res, event = self._run(lambda: self.backend.combine(req), [x, topk_weights, *req.bias, handle], previous_event,
                               async_finish, allocate_on_comm_stream)
        if not finish_later:
            return res.combined_x, res.combined_topk_weights, event
        pending = res.pending or PendingCombine(result=(res.combined_x, res.combined_topk_weights))
        return pending, None, event

    def _prepare_combine(self, x, handle, topk_weights, bias, config) -> CombineRequest:
        if not isinstance(handle, DispatchHandle):
            raise TypeError(f"[commlib rank {self.rank}] handle must be the DispatchHandle dispatch returned, "
                            f"got {type(handle).__name__}")
        self._check_handle(handle, None, None)
        check_tensor("x", x, self.rank, dtype=torch.bfloat16, dim=2, device=self.device)
        N = handle.recv_src_idx.shape[0]
        if x.shape[0] != N:
            raise ValueError(f"[commlib rank {self.rank}] combine x has {x.shape[0]} rows but the handle "
                             f"received {N}")
        T, H = handle.num_tokens, x.shape[1]
        if handle.hidden and H != handle.hidden:
            raise ValueError(f"[commlib rank {self.rank}] combine x has hidden {H}, the dispatch had {handle.hidden}")
        if topk_weights is not None:
            check_tensor("topk_weights", topk_weights, self.rank, dtype=torch.float32, dim=2, device=self.device)
            if topk_weights.shape[0] != N:
                raise ValueError(f"[commlib rank {self.rank}] topk_weights has {topk_weights.shape[0]} rows, "
                                 f"expected {N}")
        biases: tuple = ()
        if bias is not None:
            biases = (bias,) if isinstance(bias, torch.Tensor) else tuple(b for b in bias if b is not None)
            if len(biases) > 2:
                raise ValueError(f"[commlib rank {self.rank}] bias takes at most two tensors, got {len(biases)}")
            for i, b in enumerate(biases):
                check_tensor(f"bias[{i}]", b, self.rank, dtype=torch.bfloat16, dim=2, device=self.device)
                if tuple(b.shape) != (T, H):
                    raise ValueError(f"[commlib rank {self.rank}] bias[{i}] must have shape [{T}, {H}], "
                                     f"got {list(b.shape)}")
        order = handle.sum_order if self.topology.num_nodes == 1 else None  # several nodes: node, rail order
        if order is not None:
            check_tensor("handle.sum_order", order, self.rank, dtype=torch.int32, dim=1, device=self.device)
            if order.shape[0] != T or not order.is_contiguous():
                raise ValueError(f"[commlib rank {self.rank}] handle.sum_order must be contiguous of shape [{T}], "
                                 f"got {list(order.shape)} (strides {order.stride()})")
        config = self._resolve_config(config, "combine", T, H)
        # combine's rows travel on the dispatch's channels (the handle's), whatever num_sms it runs with
        rings = self._combine_rings(config, handle.num_channels)
        self._check_capacity(H * 2, rings, 0, topk_weights.shape[1] if topk_weights is not None else 0)
        return CombineRequest(x, handle, topk_weights, biases, config, sum_order=order)

    # DeepEP's internode entry points (its dispatch / combine call them on several nodes): the same
    # signatures and meaning as dispatch / combine here, where the backend decides the path.
    internode_dispatch = dispatch
    internode_combine = combine

    # ------------------------------------------------------------------ helpers
    def _resolve_config(self, config: Optional[Config], kind: str, num_tokens: int, hidden: int,
                        dtype: str = "bf16") -> Config:
        if config is not None:
            if not isinstance(config, Config):
                raise TypeError(f"[commlib rank {self.rank}] config must be a commlib.Config, got {type(config).__name__}")
            return config.check_runnable(self.rank)
        # A tuned config (commlib.tuning.autotune) for this shape, looked up once per (kind, hidden, dtype, token
        # bucket) and remembered. The lookup is local (no collective on the hot path): ranks must call
        # with token counts in the same power-of-two bucket, as with any per-shape config. With
        # COMMLIB_AUTOTUNE=1 a miss tunes now, collectively.
        exact = (kind, num_tokens, hidden, dtype, Buffer.num_sms)
        hit = self._configs.get(exact)
        if hit is not None:
            return hit
        key = (kind, hidden, dtype, tuning_cache.token_bucket(num_tokens), Buffer.num_sms)
        if key not in self._tuned:
            if env.autotune():
                if Buffer.autotuner is None:
                    raise RuntimeError("COMMLIB_AUTOTUNE=1 needs commlib.tuning.autotune imported (import commlib does it)")
                found = Buffer.autotuner(self, kind, (num_tokens, hidden), dtype)
            else:
                found = tuning_cache.cached_config(kind=kind, num_ranks=self.num_ranks,
                                           ranks_per_node=self.topology.ranks_per_node, hidden=hidden,
                                           dtype=dtype, num_tokens=num_tokens, device=self.device,
                                           num_nvl_bytes=self.num_nvl_bytes, num_rdma_bytes=self.num_rdma_bytes)
            # no tuned config: the default, made once (a Config validates every field when built)
            self._tuned[key] = found if found is not None else \
                (Buffer.get_dispatch_config if kind == "dispatch" else Buffer.get_combine_config)(self.num_ranks)
        if len(self._configs) > 256:
            self._configs.clear()
        self._configs[exact] = found = self._tuned[key]   # per exact call shape: no bucket arithmetic next time
        return found

    def _combine_rings(self, config: Config, num_channels: int) -> Config:
        """``config`` with the handle's channels (2 SMs each), remembered per (config, channels): a
        Config validates every field when built, and combine asks on every call."""
        if not num_channels:
            return config
        key = (id(config), num_channels)
        hit = self._rings.get(key)
        if hit is None or hit[0] is not config:   # the config held in the entry keeps its id unique
            if len(self._rings) > 64:
                self._rings.clear()
            hit = self._rings[key] = (config, dataclasses.replace(config, num_sms=2 * num_channels))
        return hit[1]

    def _check_capacity(self, hidden_bytes: int, config: Config, num_scales: int = 0,
                        num_topk: int = 0) -> None:
        """The call must fit what it uses: the NVLink rings of this node's ranks and the config's channels,
        with slots for this call's rows (``hidden_bytes``, FP8 scales, top-k). Any token count streams
        through them; no backend uses network staging yet."""
        P = self.topology.ranks_per_node
        C, ring = config.num_channels, config.num_max_nvl_chunked_recv_tokens
        row = slot_bytes(hidden_bytes, num_scales, num_topk)
        need = config.nvl_ring_bytes(P, row)
        if self.num_nvl_bytes < need:
            raise ValueError(
                f"[commlib rank {self.rank}] num_nvl_bytes={self.num_nvl_bytes} is too small for this call's rings: "
                f"{P} ranks x {C} channels x num_max_nvl_chunked_recv_tokens {ring} slots x {row} bytes = {need}; "
                f"build the Buffer with num_nvl_bytes >= config.get_nvl_buffer_size_hint({hidden_bytes}, "
                f"{self.num_ranks}) or pass a Config with a smaller ring")

    def _check_handle(self, handle: DispatchHandle, num_tokens: Optional[int], hidden: Optional[int]) -> None:
        if not isinstance(handle, DispatchHandle):
            raise TypeError(f"[commlib rank {self.rank}] handle must be a DispatchHandle, got {type(handle).__name__}")
        if handle.buffer_id != self.buffer_id:
            raise ValueError(f"[commlib rank {self.rank}] handle was made by another Buffer "
                             f"(id {handle.buffer_id}, this one {self.buffer_id})")
        if num_tokens is not None and handle.num_tokens != num_tokens:
            raise ValueError(f"[commlib rank {self.rank}] cached dispatch: x has {num_tokens} tokens, the handle "
                             f"was made for {handle.num_tokens}")
        if hidden is not None and handle.hidden and handle.hidden != hidden:
            raise ValueError(f"[commlib rank {self.rank}] cached dispatch: x has hidden {hidden}, the handle "
                             f"was made for {handle.hidden}")


_PLAIN = (int, float, bool, str, type(None))
_TENSOR = torch.Tensor


def _tensor_signature(t):
    """What the dispatch checks read of a tensor argument (its type exactly a Tensor: a subclass
    takes the checks every time), or None for None."""
    if t is None:
        return None
    if type(t) is not _TENSOR:
        raise TypeError
    return (t.dtype, t.shape, t.is_contiguous(), t.get_device())


def _dispatch_signature(x, ntr, nrr, tir, nte, topk_idx, topk_weights, expert_alignment, num_worst_tokens,
                        config) -> Optional[tuple]:
    """Every property of a non-cached dispatch's arguments that Buffer._check_dispatch reads (dtypes,
    shapes, contiguity, devices; FP8 scales: any strides; the ints; the Config's identity and fields;
    the SM budget a default Config follows), or None where an argument is of an unexpected type."""
    try:
        if type(x) is _TENSOR:
            xs = _tensor_signature(x)
        elif type(x) is tuple and len(x) == 2 and type(x[1]) is _TENSOR:
            sc = x[1]
            xs = (_tensor_signature(x[0]), sc.dtype, sc.shape, sc.get_device())
        else:
            return None
        if type(expert_alignment) is not int or type(num_worst_tokens) is not int:
            return None
        if config is None:
            cs = Buffer.num_sms
        elif type(config) is Config:
            cs = (id(config), config.num_sms, config.num_max_nvl_chunked_send_tokens,
                  config.num_max_nvl_chunked_recv_tokens, config.num_max_rdma_chunked_send_tokens,
                  config.num_max_rdma_chunked_recv_tokens)
        else:
            return None
        return (xs, _tensor_signature(ntr), _tensor_signature(nrr), _tensor_signature(tir), _tensor_signature(nte),
                _tensor_signature(topk_idx), _tensor_signature(topk_weights), expert_alignment, num_worst_tokens, cs)
    except TypeError:
        return None


def _tensors_of(obj, skip=()) -> list:
    """Tensors inside a result (dataclasses, tuples, lists), not descending into objects listed in
    ``skip``. This runs on every call: a list or tuple whose first item is a plain value (a
    dispatch's per-expert counts) is taken to hold plain values only and is not walked."""
    skip_ids = {id(s) for s in skip}
    found = []

    def walk(o) -> None:
        if isinstance(o, _PLAIN) or id(o) in skip_ids:
            return
        if isinstance(o, torch.Tensor):
            found.append(o)
        elif hasattr(o, "__dataclass_fields__"):
            for name in o.__dataclass_fields__:
                walk(getattr(o, name))
        elif isinstance(o, (tuple, list)) and o and not isinstance(o[0], _PLAIN):
            for item in o:
                walk(item)
    walk(obj)
    return found
