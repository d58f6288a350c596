"""The network step of the internode engine, its registry, and the one chunk-streaming loop.

A network step moves one chunk of rows to and from every rail peer (the rank of this local rank on
each node). ``RailStep`` does it with a grouped NCCL (or gloo) all-to-all on the rail group; a
GPU-initiated transport (NCCL's device API) is one more class here and one entry in
``NETWORK_STEPS``. ``stream`` is the only chunk loop: dispatch, combine and the padded path run
their chunks through it.

Legend: M nodes (rail peers), k a chunk, n chunks of a call.
"""
from __future__ import annotations

import random
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from commlib.backends.probe import Probe
from commlib.utils import env
from commlib.utils.dist import direct_collective


class NetworkStep:
    """One chunk to and from every rail peer. ``post`` starts it and returns a token; ``land`` makes
    the current stream wait for it (or the host, with a deadline) and returns the landed rows.
    ``ordered``: chunks complete in the order posted, so waiting for the last covers all. ``sync``:
    nothing overlaps the chunks on the current stream (``stream`` sets it), so a step may issue them
    there, in its order, and skip the waits."""

    name = "base"
    ordered = False
    sync = False   # set by ``stream`` per call: chunks may run on the current stream, in its order
    two_streams = False   # may run a call's chunks on two streams (``fork`` / ``use`` / ``join``)
    chunk_raw = None      # while it does: the raw handle of the chunk's stream (its node step's launches)

    def post(self, send: torch.Tensor, send_splits: list, recv_splits: list, out: Optional[torch.Tensor] = None):
        raise NotImplementedError

    def land(self, posted, what: str) -> torch.Tensor:
        raise NotImplementedError

    def on_current_stream(self, n: int, node_steps: bool) -> bool:
        """Whether a call of ``n`` chunks, with or without a node step beside them, has its chunks issued
        on the current stream (``stream`` sets ``sync`` so; a step that can then issues them there)."""
        return False

    def fork(self) -> None:
        """(two_streams) The side stream waits for the current (main) one: one event op."""
        raise NotImplementedError

    def use(self, side: bool) -> None:
        """(two_streams) The side stream (or the main one) current, its raw handle ``chunk_raw``."""
        raise NotImplementedError

    def join(self) -> None:
        """(two_streams) The main stream, current, waits for the side one: one event op."""
        raise NotImplementedError

    def done(self) -> None:
        """(two_streams) The main stream current again, ``chunk_raw`` None (also after an error)."""
        raise NotImplementedError


class RailStep(NetworkStep):
    """The rail all-to-all: host-issued grouped send/recv (NCCL over IB, RoCE, sockets or NVLink;
    gloo on CPU ranks). ``wait(work, what)``: the engine's wait (the stream on NCCL, the host with
    COMMLIB_TIMEOUT_S on gloo). ``stall_ms``: a random host stall before every post and land (tests)."""

    name = "rail"

    def __init__(self, group, wait: Callable, probe: Probe, nccl: bool, rank: int) -> None:
        self.group = group
        self.wait = wait
        self.probe = probe
        self.ordered = nccl   # NCCL runs a group's collectives in order
        self.stall_ms = env.debug_network_stall_ms()
        self._rng = random.Random(1000 + rank)
        # NCCL: the group's own all-to-all and kept options (the same collective as torch.distributed's
        # all_to_all_single, without its Python frames), on its stream or (``sync``) on the current
        # one, which then needs no event to wait for it; gloo keeps the torch.distributed call
        self._direct = direct_collective(group, "all_to_all_single") if nccl else None
        self._direct_sync = direct_collective(group, "all_to_all_single", async_op=False) if nccl else None
        # two streams (where ``_direct_sync`` issues NCCL's collectives on the current stream, ordered among
        # themselves by NCCL on whichever stream they run): the side stream per device, made at its first fork
        self._cuda = nccl and torch.cuda.is_available()   # (else a CPU harness's fake NCCL: one stream, counted)
        self._sides, self._main, self._events = {}, None, None

    def on_current_stream(self, n, node_steps):
        return self._direct_sync is not None and (n == 1 or not node_steps)

    @property
    def two_streams(self) -> bool:
        return self._direct_sync is not None

    def side(self, idx: int) -> tuple:
        """Device ``idx``'s side stream and its fork and join events (each recorded once, so that its
        cudaEvent_t exists: the C++ twins take them, twins.py), made at the first call."""
        got = self._sides.get(idx)
        if got is None:
            side = torch.cuda.Stream(device=idx)
            fork_ev, join_ev = torch.cuda.Event(), torch.cuda.Event()
            fork_ev.record(side)
            join_ev.record(side)
            got = self._sides[idx] = (side, (side.stream_id, side.device_index, side.device_type), side.cuda_stream,
                                      fork_ev, join_ev)
        return got

    def fork(self):
        self.probe.op("event_ops")
        if not self._cuda:
            return
        idx = torch.cuda.current_device()
        side, self._side, self._side_raw, fork_ev, join_ev = self.side(idx)
        main = torch.cuda.current_stream(idx)
        self._main, self._main_raw, self._events = main, main.cuda_stream, (main, side, join_ev)
        fork_ev.record(main)
        side.wait_event(fork_ev)

    def use(self, side):
        m = self._main
        if m is None:
            return
        torch._C._cuda_setStream(*(self._side if side else (m.stream_id, m.device_index, m.device_type)))
        self.chunk_raw = self._side_raw if side else self._main_raw

    def join(self):
        self.probe.op("event_ops")
        if self._events is None:
            return
        main, side, ev = self._events
        ev.record(side)
        main.wait_event(ev)

    def done(self):
        m = self._main
        if m is not None:
            torch._C._cuda_setStream(m.stream_id, m.device_index, m.device_type)
        self._main = self._events = None
        self.chunk_raw = None

    def stall(self) -> None:
        if self.stall_ms:
            time.sleep(self._rng.uniform(0, self.stall_ms) / 1000)

    def post(self, send, send_splits, recv_splits, out=None):
        """Post one chunk; ``out``: where the rows land (contiguous, sum(recv_splits) rows), else a new tensor."""
        if self.stall_ms:
            self.stall()
        if out is None:
            out = torch.empty(sum(recv_splits), *send.shape[1:], dtype=send.dtype, device=send.device)
        direct, probe = self._direct_sync if self.sync and self._direct_sync else self._direct, self.probe
        if direct is not None:
            return out, (probe.collective(direct[0], out, send, recv_splits, send_splits, direct[1]) if probe.recording
                         else direct[0](out, send, recv_splits, send_splits, direct[1]))
        work = probe.collective(dist.all_to_all_single, out, send, recv_splits, send_splits, group=self.group,
                                async_op=True)
        return out, work

    def land(self, posted, what):
        out, work = posted
        if self.stall_ms:
            self.stall()
        if work is not None:   # None: issued on the current stream (sync), already ordered there
            self.wait(work, what)
        return out


NETWORK_STEPS = {"rail": RailStep}


def stream(net: NetworkStep, n: int, post: Callable, what: str, before: Optional[Callable] = None,
           after: Optional[Callable] = None, sides: Optional[list] = None) -> None:
    """Run the ``n`` chunks of a call. Chunk k: ``before(k)`` (a node step that makes its rows:
    combine's reduce), ``post(k)`` (a NetworkStep.post), and once it landed ``after(k, rows)`` (a
    node step on what landed: dispatch's fan-out). Chunk k + 1 is on the wire before chunk k is
    waited for, so the node step of one chunk overlaps the network step of the next. Without
    ``after`` on an ordered network, only the last chunk is waited for. Where no node step would
    overlap a chunk on the wire (one chunk, or no ``before`` / ``after``), the chunks may run on the
    current stream (``net.sync``). ``sides`` (with ``after``; fanout.chunk_sides, the last chunk on the
    current stream): on a network with two streams, chunk k's collective and node step both run on the
    side stream or the current one as ``sides[k]`` says, so chunk k + 1's collective overlaps chunk k's
    node step with no wait between a collective and its node step; the side stream forks from the
    current one first, and the current one joins it before the last node step."""
    if sides is not None and after is not None and n > 1 and net.two_streams:
        _two_streams(net, n, post, what, after, sides)
        return
    net.sync = n == 1 or (before is None and after is None)
    posted = None
    for k in range(n):
        if before is not None:
            before(k)
        nxt = post(k)
        if posted is not None and (after is not None or not net.ordered):
            rows = net.land(posted, f"{what} (network chunk {k - 1} of {n})")
            if after is not None:
                after(k - 1, rows)
        posted = nxt
    if posted is not None:
        if after is None and net.ordered:
            net.land(posted, f"{what} (network chunks 0-{n - 1})")
        else:
            rows = net.land(posted, f"{what} (network chunk {n - 1} of {n})")
            if after is not None:
                after(n - 1, rows)


def _two_streams(net: NetworkStep, n: int, post: Callable, what: str, after: Callable, sides: list) -> None:
    """``stream``'s chunks on two streams (``sides``): each on its stream in order, nothing waited for
    but the side stream's fork and the join before the last node step."""
    net.sync = True
    net.fork()
    try:
        for k in range(n):
            net.use(sides[k])
            rows = net.land(post(k), f"{what} (network chunk {k} of {n})")
            if k == n - 1:
                net.join()
            after(k, rows)
    finally:
        net.done()


__all__ = ["NetworkStep", "RailStep", "NETWORK_STEPS", "stream"]
