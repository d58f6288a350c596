"""The contract every transport implements; ``reference`` is its executable specification.

The Buffer validates all input, resolves configs, and sets the CUDA stream (the comm stream)
before it calls a backend; a backend allocates its outputs on the current stream and never
synchronises the device unless the call needs a host-side count (non-cached dispatch without
num_worst_tokens).

Semantics every backend must reproduce bit for bit (BF16; FP8 rows and scales are moved, not
changed, so they are bit-exact too):
  dispatch: rank r receives every token t of source s with is_token_in_rank_s[t][r], once,
    rows grouped by source rank in rank order, token order within a source. recv_topk_idx holds
    local expert ids (global - r * num_local_experts) and -1 for experts elsewhere;
    recv_topk_weights holds the weight for local experts and 0 elsewhere. With
    num_worst_tokens > 0 outputs have that many rows; rows past the received count are 0 in
    recv_x / scales, -1 in recv_topk_idx, 0 in recv_topk_weights, and the per-expert list is [].
  combine: combined_x[t] = bf16(acc) with acc = 0.f; acc += float(bias0[t]); acc += float(bias1[t])
    (DeepEP's order: the biases first); then for r over the ranks holding t, in rank order or in
    the handle's sum_order (one node; common.sum_places): acc += float(row of t on r).
    On several nodes the rows of one node are first reduced from 0 in local-rank order and cast
    to bf16 before crossing the network; the home rank then adds the node partials, in node
    order, to its acc (biases first). combined_topk_weights likewise in float32 from 0 (no cast,
    no bias).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import torch

from commlib.config import Config
from commlib.handle import DispatchHandle
from commlib.layout import Layout
from commlib.topology import Topology
from commlib.backends.probe import NULL_PROBE, Probe


@dataclasses.dataclass
class DispatchRequest:
    x: torch.Tensor                          # [T, H] bf16, or float8_e4m3fn when x_scales is given
    x_scales: Optional[torch.Tensor]         # [T, H / 128] float32 (FP8 only)
    topk_idx: Optional[torch.Tensor]         # [T, K] int64 (None in cached mode)
    topk_weights: Optional[torch.Tensor]     # [T, K] float32 (None allowed)
    layout: Optional[Layout]                 # None in cached mode
    handle: Optional[DispatchHandle]         # given in cached mode
    num_experts: int                         # 0 in cached mode (taken from the handle)
    expert_alignment: int
    num_worst_tokens: int
    config: Config
    prepacked: Optional[object] = None       # Buffer.prepack's token for this call (backend-specific)


@dataclasses.dataclass
class DispatchResult:
    recv_x: torch.Tensor                     # [N, H]
    recv_x_scales: Optional[torch.Tensor]    # [N, H / 128] float32 (FP8 only)
    recv_topk_idx: Optional[torch.Tensor]    # [N, K] int64, None in cached mode or without topk
    recv_topk_weights: Optional[torch.Tensor]  # [N, K] float32, None in cached mode or without weights
    num_recv_tokens_per_expert_list: Optional[list]  # [local experts] ints, None in cached mode
    handle: DispatchHandle
    # the allocations behind the outputs, made on BackendContext.out_stream (or the comm stream where
    # that is None): the Buffer records only these. None: it records every tensor it finds in the result.
    blocks: Optional[tuple] = None


@dataclasses.dataclass
class CombineRequest:
    x: torch.Tensor                          # [N, H] bf16, rows as dispatch delivered them
    handle: DispatchHandle
    topk_weights: Optional[torch.Tensor]     # [N, K] float32
    bias: Sequence[torch.Tensor]             # 0 to 2 tensors [T, H] bf16
    config: Config
    finish_later: bool = False               # leave the sum to PendingCombine.finish() where a backend can
    sum_order: Optional[torch.Tensor] = None  # [T] int32 (DispatchHandle.sum_order; None on several nodes)


@dataclasses.dataclass
class CombineResult:
    combined_x: torch.Tensor                 # [T, H] bf16
    combined_topk_weights: Optional[torch.Tensor]  # [T, K] float32
    pending: Optional["PendingCombine"] = None  # finish_later: the outputs are written by pending.finish()
    blocks: Optional[tuple] = None           # as DispatchResult.blocks


class PendingCombine:
    """What combine(finish_later=True) returns in place of its outputs: ``finish()``, called on the
    stream that consumes them after it waited for the call's event, runs what is left of the combine
    on that stream (the copy-engine path's sum, with every SM) and returns (combined_x,
    combined_topk_weights). Once; a backend with nothing left to run hands its finished outputs."""

    def __init__(self, fn=None, result: Optional[tuple] = None) -> None:
        self._fn, self._result, self._done = fn, result, False

    def finish(self) -> tuple:
        if self._done:
            raise RuntimeError("PendingCombine.finish() was already called")
        self._done = True
        if self._fn is not None:
            self._result, self._fn = self._fn(), None
        return self._result

@dataclasses.dataclass
class BackendContext:
    """What a backend may know of the Buffer that owns it (built by the Buffer, read-only here)."""

    group: Any                      # the torch.distributed process group of the Buffer
    rank: int
    num_ranks: int
    topology: Topology
    device: torch.device
    buffer_id: int                  # unique per Buffer and process (names staging, keys caches)
    timeout_s: float                # longest host or device wait (COMMLIB_TIMEOUT_S)
    num_nvl_bytes: int
    num_rdma_bytes: int
    max_nodes_per_token: int
    num_sms: Callable[[], int]      # the current SM budget (Buffer.set_num_sms changes it)
    default_config: Callable[[str, int], Config]   # (kind, num_ranks) -> the default Config
    # run(fn, inputs, previous_event, async_finish, allocate_on_comm_stream): fn on the comm stream
    # with DeepEP's event semantics; returns (fn's result, EventOverlap or None).
    run: Callable[..., Any]
    comm_stream: Any = None         # the Buffer's comm stream (None on CPU)
    # Per call, set by the Buffer before it calls the backend: the stream outputs should be allocated
    # on (the caller's stream, which then owns them), or None for the current (comm) stream.
    out_stream: Any = None
    # instrumentation of the calls (backends/probe.py): the null probe unless a benchmark passes one
    probe: Probe = NULL_PROBE
    # the most ranks of the group on one GPU (topology.gpu_share): > 1 when ranks share a GPU
    gpu_share: int = 1


def set_stream(stream) -> None:
    """torch.cuda.set_stream without its Python frames (host time on every call path)."""
    torch._C._cuda_setStream(stream.stream_id, stream.device_index, stream.device_type)


def alloc_outputs(out, back, specs: Sequence, device: torch.device, made: list) -> list:
    """A tensor per spec ((shape, dtype), or None for no tensor) on the call's output stream ``out``
    (the Buffer's ``ctx.out_stream``: the caller's stream, which then owns them, so a freed block is
    reused in that stream's order, as DeepEP's outputs are, instead of after a record_stream event;
    None: the current stream), then back on stream ``back``. Appends each tensor to ``made`` (the
    result's ``blocks``: the Buffer records only those, for the comm stream when the call is
    asynchronous). Separate allocations: on the host a view costs more than one."""
    if out is not None:
        set_stream(out)
    try:
        tensors = [None if sp is None else torch.empty(sp[0], dtype=sp[1], device=device) for sp in specs]
    finally:
        if out is not None:
            set_stream(back)
    made.extend([t for t in tensors if t is not None])
    return tensors


class Outputs(tuple):
    """A backend call's result tuple with ``blocks``: the allocations behind its outputs made by
    alloc_outputs (the Buffer's _leave reads it, as DispatchResult.blocks)."""

    blocks: Optional[tuple] = None

    @classmethod
    def of(cls, values, blocks) -> "Outputs":
        out = cls(values)
        out.blocks = tuple(blocks)
        return out


class Backend:
    """Base class. ``ctx`` (a BackendContext) is all a backend knows of its Buffer."""

    name = "base"

    def __init__(self, ctx: "BackendContext") -> None:
        self.ctx = ctx
        self.topology = ctx.topology
        # Rows moved, for tests and benchmarks: internode = rows that crossed between nodes,
        # intranode = rows that moved between two ranks of one node (local copies not counted).
        self.counters = {"internode_rows": 0, "intranode_rows": 0, "local_rows": 0}

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int) -> Layout:
        raise NotImplementedError

    def dispatch(self, req: DispatchRequest) -> DispatchResult:
        raise NotImplementedError

    def combine(self, req: CombineRequest) -> CombineResult:
        raise NotImplementedError

    def destroy(self) -> None:
        pass
