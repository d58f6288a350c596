"""The C++ call path's twins of the internode engine's calls (csrc/callpath_internode.cpp): what the
Python path kept of a call, handed over so that a later call like it runs whole in C++.

* ``twin_on``: a kept cached dispatch or combine (kept.py ``KeptDispatch`` / ``KeptCombine``) as an
  ``InPlan``: its launches as steps (the argument slots set per call and where each value comes
  from), its network chunks, and whether they run on the current stream.
* ``full_twin``: a non-cached dispatch just run (device.py ``Fresh``: its kept launches, the
  scratch they point into) as an ``InFull``, with the shapes, the plan's fields and the hooks its
  error paths call.

Each raises ``NoTwin`` (``twin_on``) or returns None (``full_twin``) where the C++ path cannot take
the call; the call then stays on the Python path.
"""
from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from commlib.backends.base import DispatchResult
from commlib.backends.internode import device
from commlib.backends.internode import kernels as IK
from commlib.backends.internode.fanout import (FORWARD_J, FORWARD_LANDED, FORWARD_POS, FORWARD_SYNC, REDUCE_J,
                                               REDUCE_OUT, REDUCE_POS, REDUCE_SYNC)
from commlib.backends.internode.fanout import THREADS as FAN_THREADS
from commlib.backends.internode.kept import KeptCombine, KeptDispatch, keep
from commlib.backends.internode.wiring import Wiring
from commlib.cuda import callpath, loader
from commlib.cuda.callpath import IN_AREA, IN_OUT0, IN_OUT1, IN_SCRATCH, IN_SECOND, IN_X
from commlib.utils.math import align_up


class NoTwin(Exception):
    """A kept call the C++ call path cannot replay (a launch off the driver's path, a debug network)."""


def _step(replay, fixed: list, per_call: list, grid=None) -> tuple:
    if type(replay) is not loader.Replay or not replay.current():
        raise NoTwin("a launch is not a current driver replay")
    return callpath.in_step(replay, fixed, per_call, grid)


def _chunks(kept: KeptDispatch | KeptCombine, out_splits: list, in_splits: list, node_steps: list) -> list:
    """The twin's network chunks: (send row, rows, out row, rows, out splits, in splits, node steps)."""
    nch, sizes = kept.plan.num_chunks, kept.sizes
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    return [(starts[k], sizes[k], starts[nch + k], sizes[nch + k], list(out_splits[k]), list(in_splits[k]),
             node_steps[k]) for k in range(nch)]


def _dispatch_twin(kept: KeptDispatch) -> tuple:
    """(pre, chunks, post) of a cached dispatch's run, as twin steps (KeptDispatch.run, in its order)."""
    L, plan, second = kept.launches, kept.plan, kept.second_shape is not None
    pre, post = [], []
    if kept.shape[0] or kept.in_area:   # (with the forwarder its pack arrives at the barrier, even with no rows)
        pre.append(_step(L.pack, [(IK.PACK_SLOT, kept.slot_ptr), (IK.PACK_SEND_HEAD, kept.send_head_ptr)],
                         [(IK.PACK_X, IN_X, 0), (IK.PACK_SEND, IN_SCRATCH, 0)]
                         + ([(IK.PACK_SCALES, IN_SECOND, 0)] if second else [])))
    nodes = [[] for _ in range(plan.num_chunks)]
    if kept.in_area:   # the forwards take the barrier's pieces (KeptDispatch.run); no chunk: one barrier launch
        for k, (off, J, grid, sync) in enumerate(kept.chunks):
            if J or sync:
                nodes[k] = [_step(L.forward, [(FORWARD_J, J), (FORWARD_SYNC, sync)], [(FORWARD_LANDED, IN_SCRATCH, off)],
                                  grid)]
        if not kept.chunks:
            post.append(_step(L.barrier, [], []))
    if kept.land_n:
        rows = (IK.LAND_ROWS, IN_AREA, 0) if kept.in_area else (IK.LAND_ROWS, IN_SCRATCH, kept.S * kept.width)
        post.append(_step(L.land, [(IK.LAND_N, kept.land_n), (IK.LAND_N_OUT, plan.num_recv)],
                          [rows, (IK.LAND_X, IN_OUT0, 0)] + ([(IK.LAND_SCALES, IN_OUT1, 0)] if second else []),
                          kept.land_grid))
    return pre, _chunks(kept, plan.recv_splits, plan.send_splits, nodes), post


def _combine_twin(kept: KeptCombine) -> tuple:
    """(pre, chunks, post) of a combine's run, as twin steps (KeptCombine.run, in its order)."""
    L, plan, second = kept.launches, kept.plan, kept.K > 0
    pre, post = [], []
    if kept.rows_n or kept.in_area:   # (into the area it takes the barriers' pieces, even with no rows)
        pre.append(_step(L.rows, [(IK.ROWS_POS, kept.rows_pos), (IK.ROWS_N, kept.rows_n)],
                         [(IK.ROWS_Y, IN_X, 0), (IK.ROWS_OUT, IN_AREA if kept.in_area else IN_SCRATCH, 0)]
                         + ([(IK.ROWS_W, IN_SECOND, 0)] if second else []), kept.rows_grid))
    nodes = [[] for _ in range(plan.num_chunks)]
    if kept.in_area:
        for k, (off, J, grid, pos, sync) in enumerate(kept.chunks):
            if J or sync:
                nodes[k] = [_step(L.reduce, [(REDUCE_POS, pos), (REDUCE_J, J), (REDUCE_SYNC, sync)],
                                  [(REDUCE_OUT, IN_SCRATCH, off)], grid)]
    if kept.T:
        post.append(_step(L.home, [(IK.HOME_SLOT, kept.slot_ptr)],
                          [(IK.HOME_BACK, IN_SCRATCH, kept.J * kept.Wc), (IK.HOME_Y, IN_OUT0, 0)]
                          + ([(IK.HOME_W, IN_OUT1, 0)] if second else [])))
    return pre, _chunks(kept, plan.send_splits, plan.recv_splits, nodes), post


def twin_on(w: Wiring, kept: KeptDispatch | KeptCombine, handle, owner):
    """The C++ twin of ``kept`` (csrc/callpath_internode.cpp InPlan: the same launches, chunks and
    checks), kept on ``handle`` beside its other twins; ``owner``: the backend. Raises NoTwin where
    the C++ call path cannot replay it."""
    net = w.network
    if getattr(net, "stall_ms", 0) or not hasattr(net, "group") or not w.nccl:
        raise NoTwin("the network step is not the NCCL rail all-to-all")
    dispatch = isinstance(kept, KeptDispatch)
    pre, chunks, post = _dispatch_twin(kept) if dispatch else _combine_twin(kept)
    (s1, d1), spec2 = kept.outputs
    plan = kept.plan
    if plan.row_counts is None:
        raise NoTwin("the plan's rows were never counted")
    two = _side(w) if dispatch and kept.sides is not None and plan.num_chunks > 1 else None
    twin = callpath.in_plan({
        "owner": owner, "kind": 0 if dispatch else 1, "key": 0 if dispatch else kept.K, "kept": kept,
        "dtype": kept.dtype, "shape": list(kept.shape),
        "second_shape": None if kept.second_shape is None else list(kept.second_shape),
        "config": kept.config, "send_head": kept.send_head_of if dispatch else None,
        "num_tokens": 0 if dispatch else kept.T, "out_shape": list(s1), "out_dtype": d1,
        "out2_shape": None if spec2 is None else list(spec2[0]), "rows": kept.rows, "width": kept.width,
        "scratch": kept.scratch(),
        "pre": pre, "chunks": chunks, "post": post, "node_after": dispatch and kept.in_area,
        "ordered": net.ordered, "sync": net.on_current_stream(plan.num_chunks, kept.in_area), "group": net.group,
        "two": two,
        "row_counts": list(plan.row_counts)})
    twins = handle.extra.get("cpp_internode")
    if twins is None:
        twins = handle.extra["cpp_internode"] = callpath.in_plan_set()
    twins.add(twin)
    return twin


def full_twin(w: Wiring, scratch: device.Scratch, res: DispatchResult, sig: list, num_experts: int, alignment: int,
              ring: int, owner):
    """The C++ call path's twin of the non-cached dispatch just run (csrc/callpath_internode.cpp InFull:
    its Fresh's launches; with the forwarder, its barrier and forward as kept launches), or None where
    that path cannot take it: a node step other than the forwarder (several ranks per node), a network
    that is not the NCCL rail all-to-all, a launch off the driver's path."""
    f, plan, h = scratch.last, res.handle.extra.get("plan"), res.handle
    net, topo = w.network, w.topology
    P = topo.ranks_per_node
    if (f is None or plan is None or (P > 1 and not w.node.in_area) or not w.nccl or getattr(net, "stall_ms", 0)
            or not hasattr(net, "group") or res.recv_topk_idx is None):
        return None
    launches = [f.meta, f.digest, f.pack, f.land, f.recv_chan]
    if P > 1:   # node.py ForwarderNode's barrier and forward (the kept calls' launches), made once per shape
        if f.node_launches is None:
            W = f.packer.row_bytes
            one_row = torch.empty(1, W + 4 * P, dtype=torch.uint8, device=w.device)   # (forward_spec's checks)
            f.node_launches = (keep(w.node.barrier_spec()), keep(w.node.forward_spec(one_row, W, align_up(W, 16))))
        launches += f.node_launches
    if any(r is None or type(r) is not loader.Replay or not r.current() for r in launches):
        return None
    scales = res.recv_x_scales
    fields = {"owner": owner, "fresh": f, "sig": list(sig), "num_experts": num_experts, "row": f.row,
              "g": f.g_flat, "dig": f.dig, "pinned": w.cuda, "ends": f.ends[1:6], "M": topo.num_nodes,
              "P": topo.ranks_per_node, "Kc": w.max_chunks, "Lx": f.Lx, "T": h.num_tokens, "H": h.hidden,
              "C": h.num_channels, "K": res.recv_topk_idx.shape[1], "W": f.packer.row_bytes,
              "scales": -1 if scales is None else scales.shape[1], "weights": res.recv_topk_weights is not None,
              "dtype": res.recv_x.dtype, "threads": IK.THREADS, "max_ctas": IK.MAX_CTAS,
              "slots": {k: getattr(IK, k) for k in dir(IK) if k.startswith(("META_", "PACK_", "LAND_", "RECV_CHAN_"))
                        and k not in ("META_THREADS", "RECV_CHAN_THREADS")},
              # the plan as ``dispatch`` makes it: its class and fields (the per-call ones set per call), the
              # rows counted (Wiring.count_rows), the digest's read counted, the per-expert list's alignment
              "plan_cls": type(plan), "plan_fields": {**vars(plan), "slot": None, "land_all": None},
              "alignment": alignment,
              "node": w.my_node, "loc": w.my_local_rank, "reads": w.reads, "counters": w.counters,
              # the hooks, called with the backend (held by nothing here: no reference cycle through C++)
              "failed": functools.partial(device.full_failed, f.g, num_experts), "timed_out": device.read_timed_out,
              # the Buffer's group (the count exchange) and the rail group; None: the default group, as there
              "group": _group(owner.group) if w.cuda else None, "rail": _group(net.group) if w.cuda else None,
              # the chunks (geometry.chunk_rows) and the forwarder's areas, grid and per-chunk slots
              "ring": ring, "area_row": f.area_row, "fwd_threads": FAN_THREADS,
              "fwd_ctas": w.node.fan.num_ctas if P > 1 else 1,
              "fwd_slots": (FORWARD_LANDED, FORWARD_J, FORWARD_POS, FORWARD_SYNC),
              "two": _side(w) if P > 1 else None}
    return callpath.in_full(fields, *launches)


def _side(w: Wiring):
    """The side stream a dispatch's chunks alternate with (network.py stream's ``sides``; csrc
    SideStream), or None where the network runs one stream. In tests (no CUDA) the C++ path records its
    streams instead."""
    net = w.network
    if not getattr(net, "two_streams", False):
        return None
    if not w.cuda:
        return {"stream_id": 0, "raw": 0, "fork": 0, "join": 0, "keep": None}
    side, _, raw, fork_ev, join_ev = net.side(w.dev_index if w.dev_index >= 0 else torch.cuda.current_device())
    return {"stream_id": side.stream_id, "raw": raw, "fork": fork_ev.cuda_event, "join": join_ev.cuda_event,
            "keep": (side, fork_ev, join_ev)}


def _group(g):
    return dist.group.WORLD if g is None else g


__all__ = ["NoTwin", "twin_on", "full_twin"]
