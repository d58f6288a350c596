"""The node step of the internode engine (what happens inside a node around each network chunk),
its implementations and registry.

  dispatch  after chunk k landed: pass each landed row to the local ranks that need it, at its
            final row there (``dispatch_begin`` / ``dispatch_chunk`` / ``dispatch_end``);
  combine   before chunk k is sent: bring those rows' results back and sum them in local-rank
            order into the node partial (``combine_begin`` / ``combine_chunk``).
Implementations: ``LocalNode`` (one rank per node: the rows are this rank's), ``GroupNode`` (an
all-to-all on the node group: NCCL, or gloo on CPU ranks) and ``ForwarderNode`` (the IPC forwarder
kernel, fanout.py: rows stored straight into the peers' memory). Each path calls the same methods;
the plan (geometry.Plan) keeps what a dispatch found for its cached dispatch and combine.

Legend: P ranks per node, loc this rank's local rank, J rows of one landed chunk, W payload bytes
of a row (each landed row carries int32 [P] final rows after them), Wd the areas' row stride.
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch

from commlib.backends.common import Packer, a2a_rows, gather, int32_columns, sum_rows
from commlib.backends.internode.fanout import (COMBINE_ROWS_SYNC, COMBINE_SYNC, DISPATCH_PACK_SYNC, DISPATCH_SYNC,
                                               SYNC_ARRIVE_END, SYNC_ENTER, NodeFanout, chunk_sync,
                                               two_stream_syncs)
from commlib.backends.internode.geometry import Plan, compact
from commlib.backends.internode.rows import fill_ids
from commlib.backends.probe import Probe
from commlib.utils import env
from commlib.utils.math import align_up

# a windowed dispatch may grow the areas to 2 / MAX_WINDOWS of its rows' bytes (two halves of a window)
# where they hold less (a first call), so it takes at most about MAX_WINDOWS windows; and to
# WINDOW_FLOOR bytes (small calls land in one window whatever the areas held before)
MAX_WINDOWS = 8
WINDOW_FLOOR = 16 << 20


class NodeStep:
    """The interface (module docstring). ``in_area``: dispatch rows land in node-shared memory
    (the forwarder's areas) rather than in a buffer of this rank's; ``counted``: the host knows the
    rows it moves (the forwarder's are known on the device only under num_worst_tokens)."""

    name = "base"
    in_area = False

    def dispatch_begin(self, plan: Plan, W: int, packer: Packer) -> None:
        raise NotImplementedError

    def dispatch_chunk(self, k: int, landed: torch.Tensor, plan: Plan, W: int, cached: bool, hi=None,
                       pos_out=None) -> None:
        """Chunk k's landed rows to the node's ranks (``cached``: the plan holds what combine needs
        already). An in-area step also takes ``hi`` (a window of final rows) and ``pos_out`` (where
        the rows' positions go, for combine)."""
        raise NotImplementedError

    def dispatch_end(self, plan: Plan, W: int) -> torch.Tensor:
        raise NotImplementedError

    def combine_begin(self, rows, plan: Plan, row_bytes: int) -> None:
        raise NotImplementedError

    def combine_chunk(self, k: int, plan: Plan, packer: Packer, H: int, K: int, out=None) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        pass


class GroupNode(NodeStep):
    """The node step as collectives on the node group (``wait``: the engine's wait)."""

    name = "nccl"

    def __init__(self, group, loc: int, P: int, device, wait: Callable) -> None:
        self.group, self.loc, self.P, self.device = group, loc, P, device
        self.wait = wait
        self._out = None
        self._rows = None

    def a2a(self, send: torch.Tensor, send_splits: list, recv_splits: list) -> torch.Tensor:
        return a2a_rows(send, send_splits, recv_splits, self.group, self.device, lambda w: self.wait(w, None))

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        return gather(t, self.group, self.device, lambda w: self.wait(w, None))

    # ---- dispatch ----
    def dispatch_begin(self, plan, W, packer):
        rows = plan.num_recv
        if plan.path == "padded":   # rows nothing lands on read as padding; + the dump row
            self._out = torch.zeros(rows + 1, W, dtype=torch.uint8, device=self.device)
            fill_ids(self._out, packer)
        else:
            self._out = torch.empty(rows, W, dtype=torch.uint8, device=self.device)

    def dispatch_chunk(self, k, landed, plan, W, cached, hi=None, pos_out=None):
        P, loc = self.P, self.loc
        if plan.path == "padded":   # every landed chunk to every rank of the node; keep the rows set for me
            got = landed if P == 1 else self.all_gather(landed.flatten()).view(P * landed.shape[0], -1)
            if not cached:
                plan.land_pos.append(int32_columns(got, W, W + 4 * P))          # [P * per, P] (combine's map)
            at = plan.land_pos[k][:, loc].to(torch.int64)
            rows = plan.num_recv
            self._out.index_copy_(0, torch.where(at >= 0, at, torch.full_like(at, rows)), got[:, :W])
            return
        J = landed.shape[0]
        if cached:
            fan_rows = plan.fan_rows[k]
        else:
            fan_rows = None  # one rank per node: every landed row is this rank's
            if P > 1:
                lpos = int32_columns(landed, W, W + 4 * P)
                fan_rows = compact(lpos >= 0, sum(plan.fan_send[k])) % max(J, 1)
            plan.fan_rows.append(fan_rows)
        got = self.a2a(landed.index_select(0, fan_rows) if fan_rows is not None else landed,
                       plan.fan_send[k], plan.fan_recv[k])
        if cached:
            at = plan.land_pos[k]
        else:
            at = int32_columns(got, W + 4 * loc, W + 4 * loc + 4).flatten().to(torch.int64)
            plan.land_pos.append(at)
        self._out.index_copy_(0, at, got[:, :W])

    def dispatch_end(self, plan, W):
        out, self._out = self._out, None
        return out[:plan.num_recv] if plan.path == "padded" else out

    # ---- combine ----
    def combine_begin(self, rows, plan, row_bytes):
        if plan.path == "padded":   # + a zero row: what a slot without a row of mine reads
            rows = torch.cat([rows, torch.zeros(1, row_bytes, dtype=torch.uint8, device=self.device)])
        self._rows = rows

    def combine_chunk(self, k, plan, packer, H, K, out=None):
        P, dev = self.P, self.device
        if plan.path == "padded":
            at = plan.land_pos[k][:, self.loc].to(torch.int64)
            per = at.shape[0] // P
            rows_k = self._rows.index_select(0, torch.where(at >= 0, at, torch.full_like(at, plan.num_recv)))
            if P == 1:
                return rows_k
            # to each forwarder its rows, then the forwarder's sum in local-rank order
            got = packer.unpack(self.a2a(rows_k, [per] * P, [per] * P))
            acc_y = torch.zeros(per, H, dtype=torch.float32, device=dev)
            acc_w = torch.zeros(per, K, dtype=torch.float32, device=dev)
            for p in range(P):
                acc_y += got["y"][p * per:(p + 1) * per].float()
                if K:
                    acc_w += got["w"][p * per:(p + 1) * per]
            return packer.pack([acc_y.to(torch.bfloat16)] + ([acc_w] if K else []))
        # rows of chunk k back to their forwarders (this rank received them in land_pos order)
        got = self.a2a(self._rows.index_select(0, plan.land_pos[k]), plan.fan_recv[k], plan.fan_send[k])
        fan_rows = plan.fan_rows[k]
        if fan_rows is None:   # one rank per node: the partial is the row itself (bf16 -> f32 -> bf16)
            return got
        J = sum(plan.recv_splits[k])
        acc_y, acc_w = sum_rows(packer.unpack(got), fan_rows.split(plan.fan_send[k]), J, H, K)
        return packer.pack([acc_y.to(torch.bfloat16)] + ([acc_w] if K else []))


class LocalNode(GroupNode):
    """One rank per node: what landed is this rank's; nothing moves inside the node."""

    name = "local"

    def a2a(self, send, send_splits, recv_splits):
        return send

    def all_gather(self, t):
        return t


class ForwarderNode(NodeStep):
    """The IPC forwarder kernel (fanout.NodeFanout): landed rows stored straight into the local
    ranks' areas at their final rows; combine sums the local ranks' rows from their areas.
    ``window_rows``: the most rows a windowed dispatch lands per window (``window``; None:
    COMMLIB_FANOUT_WINDOW_ROWS, 0: only where the rows would outgrow the areas), the same on every
    local rank (checked at creation, collective on ``group`` as the NodeFanout is)."""

    name = "kernel"
    in_area = True
    # a dispatch's barriers not yet taken by a forward (finish_forward issues them), whether its forwards
    # take them (not a windowed one's), whether a combine's first reduce waits for its rows kernel's arrival,
    # a dispatch's forwards' flags after its pack's arrival (None: chunk 0's forward enters)
    _owed, _fold, _await, _syncs = 0, False, False, None
    gpu_share = 1   # ranks of the Buffer's group on one GPU (kernels.synced_ctas)

    def __init__(self, group, device, num_ctas: int, timeout_s: float, probe: Probe, budget: int = 0,
                 window_rows: int | None = None, gpu_share: int = 1) -> None:
        with torch.cuda.device(device):
            self.fan = NodeFanout(group, device, num_ctas=num_ctas, timeout_s=timeout_s)
        self.P = self.fan.num_local
        self.device = device
        self.probe = probe
        self.Wd = 0
        self.budget = budget   # the Buffer's num_nvl_bytes: the areas count against it
        self.gpu_share = max(1, int(gpu_share))
        self._told = False
        self.window_rows = int(env.fanout_window_rows() if window_rows is None else window_rows)
        theirs = [None] * self.P
        torch.distributed.all_gather_object(theirs, self.window_rows, group=group)
        if self.window_rows < 0 or any(t != self.window_rows for t in theirs):
            raise ValueError(f"[commlib local rank {self.fan.local_rank}] the forwarder's window rows "
                             f"(COMMLIB_FANOUT_WINDOW_ROWS) must be >= 0 and the same on every rank of the node, got "
                             f"{theirs}")

    def _reserve(self, plan, row_bytes: int | None = None) -> None:
        """Room for the plan's rows (of ``row_bytes``, default the plan's area row) in every area
        (collective on the node; free when they fit), and a warning, once, when the area outgrows the
        Buffer's num_nvl_bytes."""
        self._grow(plan.node_rows, plan.area_row if row_bytes is None else row_bytes)

    def _grow(self, rows: int, row_bytes: int) -> None:
        self.fan.reserve(rows, row_bytes)
        if self.fan.capacity > self.budget and not self._told:
            self._told = True
            warnings.warn(f"commlib rank {self.fan.local_rank} of its node: the internode forwarder's landing area "
                          f"({self.fan.capacity / 2**20:.0f} MiB: the node's most rows a rank receives, or a "
                          f"num_worst_tokens combine's rows, x {row_bytes} bytes) exceeds the Buffer's num_nvl_bytes "
                          f"({self.budget / 2**20:.0f} MiB), which it stands for")

    def dispatch_begin(self, plan, W, packer, arrived: bool = False):
        """Room in the areas; the barrier before the forwards comes with the first (fanout.py sync), or
        (``arrived``: the pack kernel arrived at it, DISPATCH_PACK_SYNC) with the first of each stream
        (the chunks on two streams: fanout.two_stream_syncs)."""
        self.Wd = align_up(W, 16)
        self._reserve(plan)
        self._owed, self._fold = 1 if arrived else 2, True
        self._syncs = two_stream_syncs(plan.num_chunks) if arrived else None
        if plan.path == "padded":   # rows past the received count read as padding
            self._pad = torch.zeros(1, W, dtype=torch.uint8, device=self.device)
            fill_ids(self._pad, packer)

    def dispatch_chunk(self, k, landed, plan, W, cached, hi=None, pos_out=None):
        """Chunk k's rows into the areas (``hi``: window [0, hi) of a windowed dispatch); ``pos_out``: where
        the forward kernel also stores the rows' positions (a cached dispatch has them already)."""
        if not cached:
            plan.landed_pos.append(int32_columns(landed, W, W + 4 * self.P))   # combine's sources
        sync = 0
        if self._fold:   # chunk 0's forward enters the barrier before the stores (or, after the pack's
            s = self._syncs   # arrival, the first of each stream waits), the last one the one after
            sync = s[k] if s is not None else chunk_sync(k, plan.num_chunks, *DISPATCH_SYNC)
            self._owed -= bool(sync & SYNC_ENTER) + bool(sync & SYNC_ARRIVE_END)
        self.fan.forward(landed, W, self.Wd, None if hi is None else (0, hi, 0), pos_out, sync)
        if landed.shape[0] or sync:
            self.probe.op("launches")

    def finish_forward(self) -> None:
        """The barrier after the chunks (every peer's stores into this rank's area are done and visible),
        where the last forward did not take it (a windowed dispatch, no chunks)."""
        for _ in range(self._owed):
            self.fan.barrier()
            self.probe.op("launches")
        self._owed, self._fold, self._syncs = 0, False, None

    def pack_sync(self) -> list:
        """The node barrier's arguments of a kernel-path dispatch's pack, which arrives at the barrier
        before the forwards' stores (kernels.pack_spec ``sync``; dispatch_begin ``arrived``)."""
        return self.fan.sync_args(DISPATCH_PACK_SYNC)

    def dispatch_end(self, plan, W):
        self.finish_forward()
        rows = self.fan.rows(plan.num_recv, self.Wd)[:, :W]   # every row below num_recv landed
        if plan.path != "padded":
            return rows
        # rows past the received count hold older bytes there: the padding row instead
        landed_rows = torch.arange(plan.num_recv, device=self.device) < plan.num_recv_dev
        return torch.where(landed_rows.view(-1, 1), rows, self._pad)

    def address(self) -> tuple:
        """(address, row stride) of this rank's area: where ``dispatch_end``'s rows are."""
        return self.fan.data_address(), self.Wd

    # ---- a windowed dispatch (padded.py's kernel route; fanout.py's module docstring, Windows) ----
    def window(self, n: int, Wd: int) -> int:
        """Rows per window for landing final rows [0, n) of stride Wd: n (one window: today's dispatch)
        where they fit the bound, else half of it. The bound: the areas as they are (what earlier
        calls reserved, so no growth), at least 2 / MAX_WINDOWS of the rows' bytes and WINDOW_FLOOR (a
        first call grows the areas that far); ``window_rows`` caps it. Host values the local ranks
        share only."""
        if self.window_rows:
            return n if n <= self.window_rows else self.window_rows
        need = n * Wd
        bound = max(self.fan.capacity, min(need, max(WINDOW_FLOOR, -(-2 * need // MAX_WINDOWS))))
        return n if need <= bound else max(1, bound // Wd // 2)

    def windows_begin(self, plan, W: int) -> int:
        """``dispatch_begin`` of a windowed dispatch of ``plan.num_recv`` final rows of W bytes: room
        for them all, or for two halves of windows (collective where the areas grow), the first
        barrier. Rows are counted at the handle's widest (``plan.area_row``: one window leaves room
        for its combine, as an unwindowed dispatch). Returns rows per window (>= num_recv: one)."""
        self.Wd = align_up(W, 16)
        row = max(self.Wd, plan.area_row)
        n = plan.num_recv
        win = self.window(n, row)
        self._grow(n if win >= n else 2 * win, row)
        self.fan.barrier()
        self.probe.op("launches")
        self._owed, self._fold = 1, False
        return max(win, 1)

    def dispatch_window(self, landed: torch.Tensor, W: int, lo: int, hi: int, at: int) -> None:
        """Window [lo, hi) of ``landed``'s rows stored at area rows [at, at + hi - lo) of their local
        ranks, then the barrier after which they are there (``windows_begin``'s areas)."""
        self.fan.forward(landed, W, self.Wd, (lo, hi, at))
        self.fan.barrier()
        self.probe.op("launches", 2)

    # ---- a kept call's pieces (internode/kept.py): the same launches as the methods above ----
    def kept_begin(self, plan, row_bytes: int) -> int:
        """Room for the plan's rows of ``row_bytes`` (as dispatch_begin / combine_begin: collective
        where the areas grow, so only a call's full path makes it); returns the areas' row stride Wd."""
        self.Wd = align_up(row_bytes, 16)
        self._reserve(plan)
        return self.Wd

    def reserve(self, rows: int, row_bytes: int) -> int:
        """Room for ``rows`` rows of ``row_bytes`` in every area (``_reserve``'s: collective on the node
        where they grow, free where they fit) and this rank's area address: a non-cached dispatch's
        ``dispatch_begin`` on the C++ call path (csrc/callpath_internode.cpp), which issues the barrier."""
        self._grow(rows, row_bytes)
        return self.fan.data_address()

    def barrier_spec(self) -> tuple:
        return self.fan.barrier_spec()

    def area_address(self) -> int:
        """This rank's area (it moves where another call grew the areas: read it per call)."""
        return self.fan.data_address()

    def grid(self, J: int) -> int:
        """CTAs of a forward / reduce of J rows."""
        return self.fan.grid(J)

    def forward_spec(self, landed: torch.Tensor, W: int, Wd: int, sync: int = 0):
        """``dispatch_chunk``'s forward of ``landed`` into rows of stride Wd, as a launch spec."""
        return self.fan.forward_spec(landed, W, Wd, sync=sync)

    def reduce_spec(self, pos: torch.Tensor, H: int, K: int, out: torch.Tensor, Wd: int, sync: int = 0):
        """``combine_chunk``'s reduce of the rows at ``pos`` into ``out`` (areas' stride Wd), as a launch spec."""
        return self.fan.reduce_spec(pos, H, K, out, Wd, sync)

    def sync_args(self, sync: int) -> list:
        """The node barrier's arguments of a kernel that takes its pieces (kernels.rows_spec's ``sync``)."""
        return self.fan.sync_args(sync)

    def combine_begin(self, rows, plan, row_bytes):
        """This rank's rows into its area, between barriers (peers are past their reads of it before,
        every rank's rows are there after). ``rows``: uint8 [n, row_bytes] (a copy between two barrier
        launches), or a callable that writes them given the areas' address, row stride and the barrier's
        arguments (kernels.rows: the barrier before its stores and the arrival after them in the kernel,
        the first reduce's wait the other half)."""
        self.Wd = align_up(row_bytes, 16)
        self._reserve(plan, self.Wd)   # free but after a windowed dispatch: it reserved room for these rows
        self._await = callable(rows)
        if callable(rows):
            rows(self.fan.data_address(), self.Wd, self.fan.sync_args(COMBINE_ROWS_SYNC))
            self.probe.op("launches")
            return
        self.fan.barrier()
        if rows.shape[0]:
            self.fan.rows(rows.shape[0], self.Wd)[:, :row_bytes].copy_(rows)
        self.fan.barrier()
        self.probe.op("launches", 2)

    def combine_chunk(self, k, plan, packer, H, K, out=None):
        pos = plan.landed_pos[k]
        if out is None:
            out = torch.empty(pos.shape[0], packer.row_bytes, dtype=torch.uint8, device=self.device)
        sync = chunk_sync(k, plan.num_chunks, *COMBINE_SYNC) if self._await else 0   # every rank's rows are there
        self.fan.reduce(pos, H, K, out, self.Wd, sync)
        if pos.shape[0] or sync:
            self.probe.op("launches")
        return out

    def close(self) -> None:
        self.fan.close()


NODE_STEPS = {"local": LocalNode, "nccl": GroupNode, "kernel": ForwarderNode}

__all__ = ["NodeStep", "GroupNode", "LocalNode", "ForwarderNode", "NODE_STEPS"]
