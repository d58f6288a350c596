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

    def post(self, send: torch.Tensor, send_splits: list, recv_splits: list, out: Optional[torch.Tensor] = None):
        raise NotImplementedError

    def land(self, posted, what: str) -> torch.Tensor:
        raise NotImplementedError

    def on_current_stream(self, n: int, node_steps: bool) -> bool:
        """Whether a call of ``n`` chunks, with or without a node step beside them, has its chunks issued
        on the current stream (``stream`` sets ``sync`` so; a step that can then issues them there)."""
        return False


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

    def on_current_stream(self, n, node_steps):
        return self._direct_sync is not None and (n == 1 or not node_steps)

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
           after: Optional[Callable] = None) -> None:
    """Run the ``n`` chunks of a call. Chunk k: ``before(k)`` (a node step that makes its rows:
    combine's reduce), ``post(k)`` (a NetworkStep.post), and once it landed ``after(k, rows)`` (a
    node step on what landed: dispatch's fan-out). Chunk k + 1 is on the wire before chunk k is
    waited for, so the node step of one chunk overlaps the network step of the next. Without
    ``after`` on an ordered network, only the last chunk is waited for. Where no node step would
    overlap a chunk on the wire (one chunk, or no ``before`` / ``after``), the chunks may run on the
    current stream (``net.sync``)."""
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


__all__ = ["NetworkStep", "RailStep", "NETWORK_STEPS", "stream"]
