"""Internode engine: each token crosses the network once per node, in chunks, then fans out in the node.

The engine builds the groups (groups.py: a rail per local rank, a group per node), chooses its two
seams once (the network step: network.NETWORK_STEPS; the node step: groups.choose_node_step) and,
per call, a path: the kernels (device.py) where they fit, the num_worst_tokens path (padded.py),
else the torch steps (counted.py). docs/internode.md describes the protocol; outputs and handles are the
reference backend's bit for bit (backends/base.py states the contract).

Legend: R ranks, M nodes, P ranks per node, Kc the most network chunks a call may use, E experts.
"""
from __future__ import annotations

import warnings
from typing import NamedTuple

import torch
import torch.distributed as dist

from commlib import layout as L
from commlib.backends.base import Backend, CombineRequest, CombineResult, DispatchRequest, DispatchResult
from commlib.backends.common import OPS, gather, signature, wait
from commlib.backends.internode import counted, device, padded
from commlib.backends.internode.exchange import INTERNODE_SIG_FIELDS, check_exchange, row_len
from commlib.backends.internode.geometry import Plan, ring_rows
from commlib.backends.internode.groups import capped_nccl_options, choose_node_step, rail_group, same_everywhere
from commlib.backends.internode.kept import replay
from commlib.backends.internode.twins import NoTwin, full_twin, twin_on
from commlib.backends.internode.network import NETWORK_STEPS
from commlib.backends.internode.wiring import Wiring
from commlib.cuda import callpath
from commlib.cuda.loader import cupy_available
from commlib.utils import env
from commlib.utils.dist import direct_collective
from commlib.validate import CommlibError


_PATHS = {"device": device, "padded": padded, "counted": counted}   # Plan.path -> its module


class FullTwin(NamedTuple):
    """The last non-cached dispatch's C++ twin, as Buffer.dispatch reads it (``backend.last_full_plan.cpp``)."""
    cpp: object


class InternodeBackend(Backend):
    """The multi-node engine (module docstring). ``network`` and ``node`` are its two seams; ``probe``
    (ctx.probe, the null probe by default) is told of its steps, reads and device operations."""

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
        self.group = ctx.group
        self.nccl = dist.get_backend(self.group) == "nccl"
        self._all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        # NCCL: the count exchange through the group's own all-gather (no torch.distributed frames), on
        # the current stream (the comm stream: the digest launch follows it there, no event between)
        self._gather_direct = direct_collective(self.group, "all_gather_single", async_op=False) if self.nccl else None
        self.comm_device = ctx.device if self.nccl else torch.device("cpu")
        self.probe = ctx.probe
        self.calls = 0          # ops issued on this Buffer; identical on every rank unless ranks diverge
        self.replayed = 0       # cached dispatches and combines served from a kept call (plan_for / run_plan)
        self.failed = None
        self._phase = ""
        self._last_num_experts = 0   # E of the last dispatch: the row length a refused call sends
        R = topo.num_ranks
        self.max_chunks = same_everywhere(env.network_chunks(), self.group, "COMMLIB_NETWORK_CHUNKS", topo.rank, R)
        if topo.ranks_per_node == 1:
            # chunks pay only where the node step of chunk k overlaps chunk k + 1 on the wire
            self.max_chunks = 1
        # One SM budget: the network step and the node step run at once, so NCCL's CTAs for each are
        # capped at half of the Buffer's SM budget when the groups are made.
        self.nccl_ctas = max(1, ctx.num_sms() // 2) if self.nccl else 0
        world_ranks = dist.get_process_group_ranks(self.group)
        self.node_group = None
        self.rail_group = rail_group(topo, world_ranks, capped_nccl_options(self.nccl_ctas) if self.nccl else None)
        self.network = NETWORK_STEPS["rail"](self.rail_group, self._wait_for, self.probe, self.nccl, topo.rank)
        self.node = choose_node_step(self, world_ranks)
        # the per-token steps as kernels (device.py) where rows go straight to their rows: one rank per
        # node, or the forwarder kernel (COMMLIB_INTERNODE_KERNELS=0: the torch steps, for comparison)
        self.device_steps = (self.nccl and self.comm_device.type == "cuda" and cupy_available()
                             and self.node.name in ("local", "kernel") and env.internode_kernels())
        self.wiring = Wiring(topology=topo, device=self.comm_device, nccl=self.nccl, network=self.network,
                             node=self.node, probe=self.probe, counters=self.counters, max_chunks=self.max_chunks,
                             max_nodes=ctx.max_nodes_per_token, gather=self._gather, gather_into=self._gather_into,
                             phase=self._set_phase, ctx=ctx)
        self.head = device.HeadRow()
        self.scratch = device.Scratch()
        # the Buffer's C++ call path replays kept calls through twins (cpp_twin; csrc/callpath_internode.cpp)
        self._twins = self.device_steps and callpath.load_internode() is not None
        # the C++ call path's non-cached dispatch (experimental, opt-in): the last dispatch's twin for the Buffer
        self._full_twins = self._twins and env.callpath_internode_dispatch()
        self.last_full_plan = None
        self.timeout_ns = int(float(ctx.timeout_s) * 1e9)

    def set_probe(self, probe) -> None:
        """Report to ``probe`` from now on (benchmarks and experiments; ctx.probe at construction)."""
        self.probe = self.wiring.probe = self.network.probe = probe
        if hasattr(self.node, "probe"):
            self.node.probe = probe

    def destroy(self) -> None:
        """Free the node step's IPC area and the staging rows (collective-free, as the nvlink engine: safe
        from __del__; kept calls of live handles hold their rows until they go)."""
        if self.node is not None:
            self.node.close()
            self.node = None
        w = getattr(self, "wiring", None)   # (an __init__ that failed early has none)
        if w is not None:
            w.stage = None

    @property
    def host_reads(self) -> int:
        """Device -> host reads of counts so far (one per non-cached dispatch without num_worst_tokens)."""
        return self.wiring.reads[0]

    # ------------------------------------------------------------------ waits, exchange, agreement
    def _set_phase(self, what: str) -> None:
        self._phase = what

    def _wait_for(self, work, what=None) -> None:
        """NCCL: the current stream waits for the collective, the host does not (NCCL's watchdog bounds
        it). gloo: a host wait with COMMLIB_TIMEOUT_S; a timeout poisons the Buffer. None: a collective
        issued on the current stream (sync), ordered there: nothing to wait for."""
        if what is not None:
            self._phase = what
        if work is None:
            return
        if self.nccl:
            probe = self.probe
            if probe.recording:
                probe.wait(work)
                probe.op("event_ops")
            else:
                work.wait()
            return
        wait(work, self.ctx.timeout_s, self.topology.rank, self._phase, self.calls, self._fail)

    def _fail(self, message: str) -> None:
        self.failed = message

    def _gather(self, row: torch.Tensor, out=None) -> torch.Tensor:
        return gather(row, self.group, self.comm_device, self._wait_for, out, issue=self.probe.collective)

    def _gather_into(self, row: torch.Tensor, out: torch.Tensor) -> None:
        """The count exchange of the device path: ``row`` (contiguous, on the engine's device) from every
        rank into ``out`` [R * n] (kept by the caller): no view, no new tensor, no lookup per call."""
        direct = self._gather_direct
        if direct is not None:
            probe = self.probe
            self._wait_for(probe.collective(direct[0], out, row, direct[1]) if probe.recording
                           else direct[0](out, row, direct[1]))
            return
        self._wait_for(self.probe.collective(self._all_gather, out, row, group=self.group, async_op=True))

    def _row_len(self, num_experts: int) -> int:
        topo = self.topology
        return row_len(topo.num_ranks, topo.num_nodes, topo.ranks_per_node, self.max_chunks, num_experts)

    def signature(self, op, hidden, num_experts, fp8, topk, weights, config) -> list:
        return signature(op, self.calls, hidden, num_experts, fp8, topk, weights, config) + \
            [config.num_max_rdma_chunked_recv_tokens]

    def _agree(self, sig: list, num_experts: int) -> None:
        """gloo, cached dispatch and combine: an exchange-sized row of [0, signature, zeros], so a rank
        that calls a dispatch instead meets it in the same collective and every rank raises."""
        self._phase = f"{OPS[sig[0]]} (agreement)"
        row = torch.zeros(self._row_len(num_experts), dtype=torch.int64, device=self.comm_device)
        row[1:1 + len(sig)] = torch.tensor(sig, dtype=torch.int64, device=self.comm_device)
        topo = self.topology
        check_exchange(self._gather(row), sig, me=topo.rank, R=topo.num_ranks, E=num_experts,
                       max_nodes=self.ctx.max_nodes_per_token)

    def on_rejected(self, op: int, num_experts: int = 0) -> None:
        """This rank's input was refused: take part in what the peers run before they can raise.

        Every op on gloo, and a dispatch on NCCL, starts with an exchange-sized all-gather: send one
        with the error word set, sized by the call's num_experts (or the previous dispatch's, where
        the refused call did not say: a wrong guess leaves the peers to the collective's timeout).
        Cached dispatch and combine have no exchange on NCCL (as on the nvlink engine)."""
        if self.nccl and op != 1:
            return
        self.calls += 1
        row = torch.zeros(self._row_len(num_experts or self._last_num_experts), dtype=torch.int64,
                          device=self.comm_device)
        row[0] = 1
        try:
            self._gather(row)
        except CommlibError:
            pass

    def get_dispatch_layout(self, topk_idx, num_experts):
        """The reference's layout, with ids outside [-1, E) read as -1 (no host check, no device fault):
        dispatch counts them in its exchange and raises on every rank."""
        ok = (topk_idx >= -1) & (topk_idx < num_experts)
        return L.dispatch_layout(torch.where(ok, topk_idx, torch.full_like(topk_idx, -1)), num_experts,
                                 self.topology)

    # ------------------------------------------------------------------ calls
    def _plan(self, h) -> Plan:
        plan = h.extra.get("plan") if h.backend == self.name else None
        if not isinstance(plan, Plan):
            raise CommlibError(f"[commlib rank {self.topology.rank}] handle was made by backend {h.backend!r}, "
                               f"not {self.name!r}")
        return plan

    def _probed(self, name: str, fn, *args):
        """``fn(*args)`` as the recording probe's call ``name`` (the null probe: called, nothing else)."""
        with self.probe.call(name):
            self.probe.mark("buffer")
            return fn(*args)

    def dispatch(self, req: DispatchRequest) -> DispatchResult:
        if self.probe.recording:
            return self._probed("cached dispatch" if req.handle is not None else "dispatch", self._dispatch, req)
        return self._dispatch(req)

    def _dispatch(self, req: DispatchRequest) -> DispatchResult:
        self.wiring.blocks.clear()   # what a call that raised had allocated
        if req.handle is not None:
            return self._dispatch_cached(req)
        x, E = req.x, req.num_experts
        K = req.topk_idx.shape[1] if req.topk_idx is not None else 0
        self.calls += 1
        self._last_num_experts = E
        sig = self.signature(1, x.shape[1], E, req.x_scales is not None, K, req.topk_weights is not None, req.config)
        ring = ring_rows(req.config)
        self.last_full_plan = None
        if self.device_steps and device.fits(req):
            res = device.dispatch(self.wiring, self.head, self.scratch, req, sig, ring, self.name)
            if self._full_twins:
                twin = full_twin(self.wiring, self.scratch, res, sig, E, req.expert_alignment, ring, self)
                self.last_full_plan = None if twin is None else FullTwin(twin)
            return res
        if req.num_worst_tokens:
            return padded.dispatch(self.wiring, req, sig, ring, self.name,
                                   kernels=self.device_steps and padded.fits(self.wiring, req))
        return counted.dispatch(self.wiring, req, sig, ring, self.name)

    def _dispatch_cached(self, req: DispatchRequest) -> DispatchResult:
        h = req.handle
        plan = self._plan(h)
        self.calls += 1
        if not self.nccl:
            self._agree(self.signature(2, req.x.shape[1], h.num_experts, req.x_scales is not None, 0, False,
                                       req.config), h.num_experts)
        return _PATHS[plan.path].dispatch_cached(self.wiring, req, plan)

    # ------------------------------------------------------------------ kept calls (the Buffer's fast path)
    def plan_for(self, handle, key: tuple, x: torch.Tensor, config, second):
        """The kept call (internode/kept.py) of ``handle`` for a cached dispatch (``key`` ("dispatch",
        x dtype), ``second``: FP8 scales) or a combine (("combine", K), ``second``: weights) with these
        arguments, or None when anything differs from the call it was made from, or while a CUDA graph
        is captured: then the call takes the full path, which checks it as always."""
        plan = handle.extra.get("plan")
        kept = plan.kept.get(key) if type(plan) is Plan else None
        if (kept is None or self.failed or self.node is None or not kept.fits(handle, x, second, config)
                or (self.comm_device.type == "cuda" and torch._C._cuda_isCurrentStreamCapturing())):
            return None
        return kept

    def run_plan(self, kept, x: torch.Tensor, second, comm_raw: int, switch=None) -> tuple:
        """The kept call on new tensors (kept.replay: outputs where ``switch`` says, the rest on the comm
        stream). Returns (first output, second output or None)."""
        self.calls += 1
        self.replayed += 1
        if self.probe.recording:
            return self._probed(kept.op, replay, kept, x, second, self.ctx.comm_stream, comm_raw, switch)
        return replay(kept, x, second, self.ctx.comm_stream, comm_raw, switch)

    def cpp_twin(self, handle, kind: int, x: torch.Tensor, config, second):
        """The C++ call path's twin (twins.twin_on) of the kept call plan_for gives for a cached dispatch
        (``kind`` 0) or a combine (1) with these arguments, made on the handle's first call the C++
        engine sees; None: the call takes the Python path (and, where no twin can be made, from now on)."""
        key = ("dispatch", x.dtype) if kind == 0 else ("combine", 0 if second is None else second.shape[1])
        kept = self.plan_for(handle, key, x, config, second)
        if kept is None or not self._twins:
            return None
        try:
            return twin_on(self.wiring, kept, handle, self)
        except NoTwin:   # this call (a launch mode, a debug network): the Python replay
            return None
        except (RuntimeError, TypeError, ValueError) as e:   # for good: the Python replay serves every later call
            self._twins = False
            warnings.warn(f"commlib rank {self.topology.rank}: the internode C++ call path cannot replay "
                          f"{kept.op}s, the Python path does: {type(e).__name__}: {e}", RuntimeWarning, stacklevel=2)
            return None

    def combine(self, req: CombineRequest) -> CombineResult:
        return self._probed("combine", self._combine, req) if self.probe.recording else self._combine(req)

    def _combine(self, req: CombineRequest) -> CombineResult:
        self.wiring.blocks.clear()   # what a call that raised had allocated
        h = req.handle
        plan = self._plan(h)
        has_w = req.topk_weights is not None
        K = req.topk_weights.shape[1] if has_w else 0
        self.calls += 1
        if not self.nccl:
            self._agree(self.signature(3, req.x.shape[1], h.num_experts, False, K, has_w, req.config), h.num_experts)
        self._phase = "combine"
        return _PATHS[plan.path].combine(self.wiring, req, plan)


__all__ = ["InternodeBackend"]
