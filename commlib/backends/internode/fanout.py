"""The internode engine's fan-out inside a node over CUDA IPC: csrc/fanout.cu behind ``NodeFanout``.

Legend: P local ranks of the node (the node group, local rank p = rank p of that group), J rows of one
landed network chunk, W payload bytes of a row.

Every local rank owns one peer-memory buffer (``commlib.backends.nvlink.peer_memory.PeerMemory``)
that every process of the node maps:
  [0, SIGNAL_BYTES)           signal area: arrival u64 [MAX_RANKS] (barriers local rank q entered,
                              added by q), then this rank's ticket u64 (barriers it entered << 32)
                              and its done count u64 (csrc/common.cuh NodeSync)
  [DATA_OFFSET, + capacity)   data area: this rank's landing rows (``rows``), DATA_OFFSET a multiple
                              of SLOT_ALIGN
The kernels:
  barrier   one CTA: arrival[me] += 1 at every local rank (release, system scope); wait until every
            own arrival[q] >= the number of barriers this rank entered (acquire). Device-side only
            (no host sync), so it can be captured in a CUDA graph and replayed; a peer that never
            comes traps after the timeout with "[commlib] rank L timeout in fanout ... waiting for
            node barrier from rank q: expected >= e, seen s".
  sync      forward and reduce (and kernels.rows into an area) also take the barrier in pieces,
            ``sync`` flags (csrc/common.cuh NODE_SYNC_*): SYNC_ENTER, a whole barrier at the
            kernel's start; SYNC_ARRIVE_END, the arrival once every CTA's stores are visible (the
            last CTA); SYNC_WAIT_END, with it, that CTA's wait (a whole barrier at the end);
            SYNC_WAIT_START, every CTA's wait at the start for the barrier this rank arrived at
            last; SYNC_ARRIVE_START (a cached dispatch's pack, kernels.pack_spec), the arrival
            alone, which later kernels' SYNC_WAIT_START complete. A kernel with flags runs even
            with no rows (a launch that only syncs).
  forward   a landed chunk (uint8 [J, >= W + 4 P]: W payload bytes, then P int32 = the row's final row
            on local rank p, -1 where p does not get it): the payload of row j is stored straight into
            local rank p's data area at row pos[j, p] (row stride ``row_bytes``, default W), and, given
            ``pos_out`` (int32 [J, P]), the positions into pos_out[j] (combine's sources). With a
            window [lo, hi) of final rows and a first area row ``at``: only the pairs with
            lo <= pos[j, p] < hi are stored, at area row at + pos[j, p] - lo (no window: lo 0, hi
            unbounded, at 0); a row none of whose positions is in the window is not even read.
  reduce    combine mirror: out row j = bf16(sum in ascending p over the p with pos[j, p] >= 0 of
            float(peer p's row pos[j, p]).y), then the float32 sum of the .w parts, from +0.0 with
            IEEE adds: ``common.sum_rows`` (index_add_ per local rank, in rank order, into zeros)
            followed by ``.to(torch.bfloat16)``, bit for bit. A row of the data areas is H bf16 then K
            float32, packed (``rows.combine_packer(H, K)``).

Protocol (every local rank makes the same barriers in the same order, on one stream each):
  dispatch   barrier            every peer is past its reads of the previous call's rows (here: its
                                own rows, read after the last barrier of that call)
             forward per chunk  plain stores into the peers' data areas
             barrier            every peer's stores into my area are done and visible
             read own rows      ``rows(n, row_bytes)``
  combine    barrier            every peer is past its previous reads of my area (the previous
                                reduce) and of its own
             write own rows     into ``rows(n, row_bytes)``
             barrier            every peer's rows are written
             reduce per chunk   loads from the peers' data areas
The next call's first barrier keeps a peer from overwriting rows still being read. The engine's calls
(node.py ForwarderNode, kept.py) fold the barriers into the kernels beside them (``sync``): a
dispatch's first forward has SYNC_ENTER and its last SYNC_ARRIVE_END | SYNC_WAIT_END (both at one
chunk); a combine's rows kernel has SYNC_ENTER | SYNC_ARRIVE_END and its first reduce SYNC_WAIT_START,
the same barriers in the same order with no launch of their own. A dispatch on the kernel path (fresh
or cached), its chunks on two streams, has its pack arrive (SYNC_ARRIVE_START) and the first forward
of each stream wait (SYNC_WAIT_START) instead of the first forward's SYNC_ENTER (``two_stream_syncs``);
the torch steps' and the windowed dispatches' forwards keep SYNC_ENTER. Nothing here
checks that a position is below the rows reserved (that would need a host sync): the caller's
plan does (positions are final output rows, < the rows it reserved). A windowed forward is bounded
by construction: it stores only into area rows [at, at + hi - lo), which ``forward`` checks.

Windows (a dispatch whose rows would outgrow the areas, node.py ``ForwarderNode.window``,
the num_worst_tokens route): the final rows [0, N) are landed win rows at a time, window i = rows
[i win, (i + 1) win) into area rows [(i % 2) win, + win) (two alternating halves of 2 win rows):
  window 0   barrier, forward per chunk as it lands (window [0, win)), barrier, read own half 0
  window i   forward every landed row (window i, half i % 2), barrier, read own half i % 2
One barrier per window suffices: window i's stores go to half i % 2, which a peer q last read in
window i - 2 (or in an earlier call, before this call's first barrier); q's read of window i - 2
precedes on q's stream its forward of window i - 1 and the barrier after it, which this rank has
passed (it needs q's arrival) before it issues window i's forward; the other half, which q may
still be reading, is not written. The window count depends only on host values the local ranks
share (N, the row stride, the areas' capacity, the knob), so every local rank makes the same
barriers; one window is the unwindowed dispatch, launch for launch.
Combine has no windows: its reduce sums a landed row's local-rank rows in ascending p, each read at
its final row on p, and a window of final rows would split one row's sum across windows (another
order of float adds). Its area holds every row the rank sends back (N rows of 2 H + 4 K bytes).

Memory: ``reserve(rows, row_bytes)`` before a call, collective on the node group with the same values
on every rank; it grows the buffers when they are too small (device sync, group barrier, new
buffers, handles exchanged: never inside a CUDA graph capture), and is free otherwise. Growth zeroes
the signal areas (every rank's at once, so the epochs stay in step) and invalidates earlier ``rows``
views; captured graphs stay valid (the kernels read the peers' addresses from a device tensor this
object keeps and refills).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from commlib.backends.nvlink.peer_memory import SLOT_ALIGN, PeerMemory
from commlib.cuda import loader
from commlib.utils import env
from commlib.utils.math import align_up

FAMILY = "fanout"
SIGNAL_OFFSET = 0
SIGNAL_BYTES = 4096          # arrival [MAX_RANKS] u64 + ticket u64 + done u64 (csrc/common.cuh), padded to a page
DATA_OFFSET = align_up(SIGNAL_BYTES, SLOT_ALIGN)
BARRIER_THREADS = 32         # one warp (csrc/fanout.cu: lane q speaks for local rank q)
THREADS = 512                # forward / reduce: a warp per row
GROWTH_ALIGN = 2 << 20       # data areas grow in 2 MiB steps, by at least half their size
# argument slots of forward_spec / reduce_spec a kept launch sets per call (with its grid)
FORWARD_LANDED, FORWARD_J, FORWARD_POS, FORWARD_SYNC = 0, 1, 10, 14
REDUCE_POS, REDUCE_J, REDUCE_OUT, REDUCE_SYNC = 0, 1, 8, 13
FORWARD_ALL = (1 << 31) - 1  # hi of the window of every final row
# the barrier's pieces a forward / reduce / rows kernel takes (csrc/common.cuh NODE_SYNC_*)
SYNC_ENTER, SYNC_ARRIVE_END, SYNC_WAIT_END, SYNC_WAIT_START, SYNC_ARRIVE_START = 1, 2, 4, 8, 16
SYNC_ALL = SYNC_ENTER | SYNC_ARRIVE_END | SYNC_WAIT_END | SYNC_WAIT_START | SYNC_ARRIVE_START
assert SIGNAL_BYTES >= 8 * (loader.MAX_RANKS + 2)


# Where the engine's calls take their barriers (node.py, kept.py; csrc/callpath_internode.cpp mirrors the
# dispatch's): (first chunk's, last chunk's) launch of a dispatch's forwards and a combine's reduces, and the
# combine's rows kernel (the module docstring's protocol)
DISPATCH_SYNC = (SYNC_ENTER, SYNC_ARRIVE_END | SYNC_WAIT_END)
COMBINE_SYNC = (SYNC_WAIT_START, 0)
COMBINE_ROWS_SYNC = SYNC_ENTER | SYNC_ARRIVE_END


def chunk_sync(k: int, n: int, first: int, last: int) -> int:
    """The sync flags of chunk k's launch of a call's n: ``first`` on chunk 0, ``last`` on chunk n - 1
    (both on one chunk), 0 elsewhere."""
    return (first if k == 0 else 0) | (last if k == n - 1 else 0)


def chunk_syncs(n: int, first: int, last: int) -> list:
    """``chunk_sync`` of each of a call's n chunks."""
    return [chunk_sync(k, n, first, last) for k in range(n)]


# A dispatch on the kernel path (device.py, kept.py) runs its chunks on two streams (network.py ``stream``
# with ``sides``; csrc/callpath_internode.cpp mirrors it): each
# chunk's collective and forward on one stream, chunk k + 1 on the other, so that its collective needs no
# wait for chunk k's and its forward none for its own collective. Its pack arrives at the entering barrier
# (DISPATCH_PACK_SYNC) before the side stream forks; the first forward on each stream waits for it; the last
# chunk runs on the current stream after it joined the side stream, and its forward takes the barrier after
# the stores.
DISPATCH_PACK_SYNC = SYNC_ARRIVE_START


def chunk_sides(n: int) -> list:
    """Per chunk of a call's n, whether it runs on the side stream: the last on the current stream, the
    ones before alternating back."""
    return [(n - 1 - k) % 2 == 1 for k in range(n)]


def two_stream_syncs(n: int) -> list:
    """The sync flags of a kernel-path dispatch's n forwards (their pack arrived): SYNC_WAIT_START on the
    first forward of each stream (chunks 0 and 1: chunk_sides alternates), SYNC_ARRIVE_END |
    SYNC_WAIT_END on the last."""
    return [(SYNC_WAIT_START if k <= 1 else 0) | (SYNC_ARRIVE_END | SYNC_WAIT_END if k == n - 1 else 0)
            for k in range(n)]


class _DeviceRows:
    """A raw device range seen by torch.as_tensor as uint8 [n, row_bytes] (__cuda_array_interface__)."""

    def __init__(self, addr: int, n: int, row_bytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (n, row_bytes), "typestr": "|u1", "data": (addr, False),
                                         "strides": None, "version": 2}


class NodeFanout:
    """The fan-out of landed rows to the local ranks of a node, and its combine mirror (module docstring).

    ``group``: the node group (local rank = rank in it); ``device``: this rank's GPU; ``num_ctas``:
    grid of forward / reduce; ``timeout_s``: how long the barrier waits for a peer before it traps
    (default COMMLIB_TIMEOUT_S). Collective on ``group`` at creation.
    """

    def __init__(self, group, device: torch.device, num_ctas: int = 16, timeout_s: float | None = None) -> None:
        self.group = group
        self.local_rank = dist.get_rank(group)
        self.num_local = dist.get_world_size(group)
        if self.num_local > loader.MAX_RANKS:
            raise ValueError(f"NodeFanout: {self.num_local} local ranks, at most {loader.MAX_RANKS}")
        if num_ctas < 1:
            raise ValueError(f"NodeFanout: num_ctas must be >= 1, got {num_ctas}")
        self.device = torch.device(device)
        if self.device.index is None:  # "cuda": the current device
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.num_ctas = int(num_ctas)
        self.timeout_ns = int(float(env.timeout_s() if timeout_s is None else timeout_s) * 1e9)
        self.capacity = 0  # bytes of the data area
        # (capacity, data_address()) while open, else None: what a call whose rows fit reads instead of
        # calling reserve and data_address (the C++ call path: no call into Python)
        self.settled: tuple | None = None
        with torch.cuda.device(self.device):
            for name in loader.FAMILIES[FAMILY]:  # compile / load now, never inside a graph capture
                loader._launcher(FAMILY, name, self.device.index)
        self.mem: PeerMemory | None = None
        self.peer_bases = torch.zeros(self.num_local, dtype=torch.int64, device=self.device)
        self._open(0)

    # ------------------------------------------------------------------ memory
    def _open(self, capacity: int) -> None:
        """Collective: new buffers of ``capacity`` data bytes on every rank (zeroed), mapped everywhere."""
        self.mem = PeerMemory(DATA_OFFSET + capacity, self.group, self.local_rank, self.num_local, self.device)
        self.peer_bases.copy_(self.mem.peer_bases)
        self.capacity = capacity
        self.settled = (capacity, self.mem.base + DATA_OFFSET)
        self.mem.all_opened(self.group, self.local_rank, self.num_local)  # (syncs the device first)

    def reserve(self, rows: int, row_bytes: int) -> None:
        """Make room for ``rows`` rows of ``row_bytes`` in every data area. Collective on the node group
        (every local rank calls it with the same values); free when they fit already."""
        self._alive()
        need = int(rows) * int(row_bytes)
        if rows < 0 or row_bytes < 0:
            raise ValueError(f"NodeFanout.reserve: rows ({rows}) and row_bytes ({row_bytes}) must be >= 0")
        if need <= self.capacity:
            return
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"[commlib local rank {self.local_rank}] NodeFanout.reserve({rows}, {row_bytes}) must "
                               f"grow the buffers ({self.capacity} bytes) inside a CUDA graph capture; reserve "
                               "before capturing")
        capacity = align_up(max(need, self.capacity + self.capacity // 2), GROWTH_ALIGN)
        # every rank's work on the old buffers (its own and its peers') is done before any is freed
        torch.cuda.synchronize(self.device)
        dist.all_gather_object([None] * self.num_local, self.local_rank, group=self.group)
        self.close()
        self._open(capacity)

    def rows(self, n: int, row_bytes: int) -> torch.Tensor:
        """uint8 [n, row_bytes] view of this rank's data area (row r at DATA_OFFSET + r * row_bytes).
        Valid until the next ``reserve`` that grows or ``close``."""
        self._alive()
        if n < 0 or row_bytes < 0 or n * row_bytes > self.capacity:
            raise ValueError(f"NodeFanout.rows({n}, {row_bytes}): {n * row_bytes} bytes, the data area holds "
                             f"{self.capacity} (reserve first)")
        if n == 0 or row_bytes == 0:
            return torch.empty(n, row_bytes, dtype=torch.uint8, device=self.device)
        view = torch.as_tensor(_DeviceRows(self.mem.base + DATA_OFFSET, n, row_bytes), device=self.device)
        assert view.data_ptr() == self.mem.base + DATA_OFFSET and view.dtype == torch.uint8
        return view

    def data_address(self) -> int:
        """Device address of this rank's data area (row r at + r * row stride), for kernels that read
        or write its rows without a tensor view; valid as ``rows``' views are."""
        self._alive()
        return self.mem.base + DATA_OFFSET

    # ------------------------------------------------------------------ kernels
    def barrier(self) -> None:
        """All local ranks meet (device side, on the current stream; CUDA-graph capturable)."""
        loader.launch(*self.barrier_spec())

    def barrier_spec(self) -> tuple:
        """``barrier``'s launch as a spec (family, name, grid, block, args, shared memory): it never
        changes while this object lives (the peers' addresses are read from ``peer_bases``)."""
        self._alive()
        return (FAMILY, "fanout_barrier_kernel", 1, BARRIER_THREADS,
                [self.peer_bases.data_ptr(), self.local_rank, self.num_local, SIGNAL_OFFSET, self.timeout_ns], 0)

    def grid(self, J: int) -> int:
        """CTAs of forward / reduce for J rows (a warp per row, at most num_ctas)."""
        return max(1, min(self.num_ctas, -(-J // (THREADS // 32))))

    def sync_args(self, sync: int) -> list:
        """The barrier's arguments of a kernel that takes its pieces (kernels.rows_spec's ``sync``): the
        peers' addresses, local rank, P, signal offset, timeout and the flags."""
        self._alive()
        return [self.peer_bases.data_ptr(), self.local_rank, self.num_local, SIGNAL_OFFSET, self.timeout_ns, int(sync)]

    def _check_sync(self, sync: int) -> int:
        sync = int(sync)
        if sync & ~(SYNC_ALL & ~SYNC_ARRIVE_START) or (sync & SYNC_WAIT_END and not sync & SYNC_ARRIVE_END) \
                or (sync & SYNC_WAIT_START and sync & SYNC_ENTER):
            raise ValueError(f"[commlib local rank {self.local_rank}] NodeFanout: sync flags {sync:#x}: "
                             "WAIT_END needs ARRIVE_END, WAIT_START does not go with ENTER (a whole barrier), "
                             "ARRIVE_START is a pack's")
        return sync

    def forward(self, landed: torch.Tensor, W: int, row_bytes: int | None = None, window: tuple | None = None,
                pos_out: torch.Tensor | None = None, sync: int = 0) -> None:
        """Store the W payload bytes of every landed row at its final row on each local rank that gets
        it (``landed``: uint8 [J, >= W + 4 P], see the module docstring). ``row_bytes``: the row stride
        of the data areas (default W). W, the strides and landed's address: multiples of 4.
        ``window`` (lo, hi, at): only final rows lo <= pos < hi, stored at area row at + pos - lo
        (module docstring); the area must hold at + hi - lo rows. ``pos_out``: int32 [J, P]
        (contiguous), where every row's P positions are also stored. ``sync``: the barrier's pieces it
        takes (module docstring; with flags it runs even with no rows)."""
        spec = self.forward_spec(landed, W, row_bytes, window, pos_out, sync)
        if spec is not None:
            loader.launch(*spec)

    def forward_spec(self, landed: torch.Tensor, W: int, row_bytes: int | None = None, window: tuple | None = None,
                     pos_out: torch.Tensor | None = None, sync: int = 0):
        """``forward``'s checks, then its launch as a spec (None: no rows and no sync); arguments
        FORWARD_LANDED, FORWARD_POS and FORWARD_SYNC are landed's and pos_out's addresses (0: none) and
        the sync flags."""
        self._alive()
        sync = self._check_sync(sync)
        P = self.num_local
        dst_stride = int(W if row_bytes is None else row_bytes)
        lo, hi, at = (0, FORWARD_ALL, 0) if window is None else (int(v) for v in window)
        if window is not None and not (0 <= lo < hi <= FORWARD_ALL and at >= 0
                                       and (at + hi - lo) * dst_stride <= self.capacity):
            raise ValueError(f"[commlib local rank {self.local_rank}] NodeFanout.forward: window (lo {lo}, hi {hi}, at "
                             f"{at}) must have 0 <= lo < hi and its {hi - lo} rows of {dst_stride} bytes from area row "
                             f"{at} within the data area ({self.capacity} bytes)")
        if landed.dtype != torch.uint8 or landed.dim() != 2 or landed.device != self.device:
            raise ValueError(f"NodeFanout.forward: landed must be a 2-D uint8 tensor on {self.device}, got "
                             f"{tuple(landed.shape)} {landed.dtype} on {landed.device}")
        J = landed.shape[0]
        if J == 0 and not sync:   # nothing to store and no barrier to take: no launch
            return None
        row_stride = landed.stride(0)
        if J:   # (with no rows the kernel only syncs: it reads no argument of the rows)
            if landed.shape[1] < W + 4 * P or (landed.shape[1] > 1 and landed.stride(1) != 1):
                raise ValueError(f"NodeFanout.forward: landed rows must hold W + 4 P = {W + 4 * P} contiguous bytes, "
                                 f"got shape {tuple(landed.shape)} strides {landed.stride()}")
            if W % 4 or row_stride % 4 or dst_stride % 4 or landed.data_ptr() % 4 or W <= 0:
                raise ValueError(f"NodeFanout.forward: W ({W}), the landed row stride ({row_stride}), row_bytes "
                                 f"({dst_stride}) and landed's address must be positive multiples of 4")
            if dst_stride < W:
                raise ValueError(f"NodeFanout.forward: row_bytes ({dst_stride}) < W ({W})")
            if pos_out is not None and (pos_out.dtype != torch.int32 or tuple(pos_out.shape) != (J, P)
                                        or pos_out.device != self.device or not pos_out.is_contiguous()):
                raise ValueError(f"NodeFanout.forward: pos_out must be a contiguous int32 [{J}, {P}] tensor on "
                                 f"{self.device}, got {tuple(pos_out.shape)} {pos_out.dtype} strides "
                                 f"{pos_out.stride()} on {pos_out.device}")
        return (FAMILY, "fanout_forward_kernel", self.grid(J), THREADS,
                [landed.data_ptr(), J, row_stride, W, P, self.peer_bases.data_ptr(), DATA_OFFSET + at * dst_stride,
                 dst_stride, lo, hi, 0 if pos_out is None else pos_out.data_ptr(), self.local_rank, SIGNAL_OFFSET,
                 self.timeout_ns, sync], 0)

    def reduce(self, pos: torch.Tensor, H: int, K: int, out: torch.Tensor, row_bytes: int | None = None,
               sync: int = 0) -> None:
        """out[j] = the local ranks' rows pos[j, p] summed in ascending p (module docstring): bf16 [H]
        then float32 [K] packed into the uint8 row out[j] (``out``: uint8 [J, >= 2 H + 4 K], row
        stride even). ``pos``: int32 [J, P]; ``row_bytes``: the data areas' row stride (default 2 H + 4 K);
        ``sync``: the barrier's pieces it takes (SYNC_WAIT_START: it runs even with no rows)."""
        spec = self.reduce_spec(pos.contiguous(), H, K, out, row_bytes, sync)
        if spec is not None:
            loader.launch(*spec)

    def reduce_spec(self, pos: torch.Tensor, H: int, K: int, out: torch.Tensor, row_bytes: int | None = None,
                    sync: int = 0):
        """``reduce``'s checks, then its launch as a spec (None: no rows and no sync); arguments
        REDUCE_OUT and REDUCE_SYNC are out's address and the sync flags. ``pos`` (contiguous) must stay
        alive while the spec is used (its address is in it)."""
        self._alive()
        sync = self._check_sync(sync)
        P = self.num_local
        W = 2 * H + 4 * K
        src_stride = int(W if row_bytes is None else row_bytes)
        if pos.dim() != 2 or pos.shape[1] != P or pos.dtype != torch.int32 or pos.device != self.device:
            raise ValueError(f"NodeFanout.reduce: pos must be int32 [J, {P}] on {self.device}, got "
                             f"{tuple(pos.shape)} {pos.dtype} on {pos.device}")
        J = pos.shape[0]
        if out.dtype != torch.uint8 or out.dim() != 2 or out.shape[0] != J or out.shape[1] < W \
                or out.device != self.device or (out.shape[1] > 1 and out.stride(1) != 1):
            raise ValueError(f"NodeFanout.reduce: out must be uint8 [{J}, >= {W}] (rows contiguous) on {self.device}, "
                             f"got {tuple(out.shape)} {out.dtype} strides {out.stride()} on {out.device}")
        if H < 0 or K < 0 or src_stride < W or src_stride % 2 or out.stride(0) % 2 or out.data_ptr() % 2:
            raise ValueError(f"NodeFanout.reduce: H ({H}), K ({K}), row_bytes ({src_stride} >= {W}), out's row "
                             "stride and address must be even")
        if J == 0 and not sync:   # nothing to sum and no barrier to wait for: no launch
            return None
        if J and not pos.is_contiguous():
            raise ValueError(f"NodeFanout.reduce: pos must be contiguous, got strides {pos.stride()}")
        return (FAMILY, "fanout_reduce_kernel", self.grid(J), THREADS,
                [pos.data_ptr(), J, P, self.peer_bases.data_ptr(), DATA_OFFSET, src_stride, H, K, out.data_ptr(),
                 out.stride(0), self.local_rank, SIGNAL_OFFSET, self.timeout_ns, sync], 0)

    # ------------------------------------------------------------------ lifetime
    def _alive(self) -> None:
        if self.mem is None:
            raise RuntimeError(f"[commlib local rank {self.local_rank}] NodeFanout is closed")

    def close(self) -> None:
        """Free this rank's buffer and close its peer mappings (waits for this device; collective-free).
        Peers must be done with this rank's buffer: call it after a barrier every rank has passed."""
        if self.mem is not None:
            self.settled = None
            self.mem.close()
            self.mem = None
