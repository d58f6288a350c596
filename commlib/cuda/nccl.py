"""NCCL called directly (ctypes), on a communicator of commlib's own.

torch.distributed's ProcessGroupNCCL wraps every collective in a work object, start/end events, a join
of its internal stream with the caller's, per-tensor stream records and a watchdog entry. That is most
of what the internode engine's NCCL steps cost the host on each call (``experiments/host_cost_nccl``,
``raw_*`` rows against the torch rows). Here a step is ``ncclGroupStart``, one ``ncclSend`` /
``ncclRecv`` per peer with rows, ``ncclGroupEnd``, issued straight onto the caller's stream: no event,
no stream join, no allocation.

What ProcessGroupNCCL gave for free is done here explicitly:
- **a deadline**: every issued step records where it ends (one CUDA event per step, recycled); a
  watchdog thread aborts the communicator when one is not done within ``timeout_s`` (the kernels then
  leave, the stream moves on) and the next step, or :meth:`NcclComm.check`, raises with the rank, the
  step's name and how long it waited;
- **memory lifetime**: the caller keeps its tensors alive until the stream is past the step (the
  engine's tensors are the Buffer's outputs or stream-ordered allocator blocks, as with torch's
  ``record_stream``-free paths).

The library is the ``libnccl.so.2`` torch loaded (one NCCL per process); the communicator is created
once per process group (unique id broadcast over that group), with the CTA cap of the group it
replaces.
"""
from __future__ import annotations

import ctypes
import math
import sys
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist

from commlib.utils import env
from commlib.utils.errors import CommlibError

_UINT8 = 1          # ncclUint8
_API_MAGIC = 0xCAFEBEEF
_CONFIG_UNDEF_INT = -(2 ** 31)
_VERSION_2_17 = 21700   # the ncclConfig_t prefix below (blocking .. netName) is the 2.17 layout


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * 128)]


def id_bytes(uid: _UniqueId) -> bytes:
    """All 128 bytes of a unique id (``uid.internal`` would stop at its first zero byte)."""
    return ctypes.string_at(ctypes.addressof(uid), ctypes.sizeof(uid))


def id_from(raw: bytes) -> _UniqueId:
    if len(raw) != ctypes.sizeof(_UniqueId):
        raise CommlibError(f"commlib: an NCCL unique id has {ctypes.sizeof(_UniqueId)} bytes, got {len(raw)}")
    return _UniqueId.from_buffer_copy(raw)


class _Config(ctypes.Structure):
    """ncclConfig_t as of NCCL 2.17: NCCL reads ``size`` bytes and fills later fields with defaults."""
    _fields_ = [("size", ctypes.c_size_t), ("magic", ctypes.c_uint), ("version", ctypes.c_uint),
                ("blocking", ctypes.c_int), ("cgaClusterSize", ctypes.c_int), ("minCTAs", ctypes.c_int),
                ("maxCTAs", ctypes.c_int), ("netName", ctypes.c_char_p)]


_lib = None
_lib_lock = threading.Lock()


def library() -> ctypes.CDLL:
    """The process's NCCL (the one torch loaded), with the signatures commlib calls."""
    global _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        names = [env.nccl_library(), "libnccl.so.2", "libnccl.so"]
        err = None
        for name in filter(None, names):
            try:
                lib = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
                break
            except OSError as e:
                err = e
        else:
            raise CommlibError(f"commlib: cannot load NCCL ({err}); set COMMLIB_NCCL_LIBRARY to libnccl.so.2")
        vp, sz, i, p = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.POINTER
        sigs = {
            "ncclGetVersion": [p(i)],
            "ncclGetUniqueId": [p(_UniqueId)],
            "ncclCommInitRankConfig": [p(vp), i, _UniqueId, i, p(_Config)],
            "ncclCommDestroy": [vp],
            "ncclCommAbort": [vp],
            "ncclCommGetAsyncError": [vp, p(i)],
            "ncclGroupStart": [],
            "ncclGroupEnd": [],
            "ncclSend": [vp, sz, i, i, vp, vp],
            "ncclRecv": [vp, sz, i, i, vp, vp],
            "ncclAllGather": [vp, vp, sz, i, vp, vp],
        }
        for name, args in sigs.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
        lib.ncclGetErrorString.argtypes, lib.ncclGetErrorString.restype = [i], ctypes.c_char_p
        _lib = lib
        return lib


_exchange_mode = None


def _capture_mode_fn():
    """``cudaThreadExchangeStreamCaptureMode`` of the CUDA runtime torch loaded (None where not found)."""
    global _exchange_mode
    if _exchange_mode is None:
        paths = [line.split()[-1] for line in open("/proc/self/maps") if "libcudart.so" in line.rsplit("/", 1)[-1]]
        for path in [None] + list(dict.fromkeys(paths)):
            try:
                fn = ctypes.CDLL(path).cudaThreadExchangeStreamCaptureMode
            except (OSError, AttributeError):
                continue
            fn.argtypes, fn.restype = [ctypes.POINTER(ctypes.c_int)], ctypes.c_int
            _exchange_mode = fn
            break
    return _exchange_mode


def _relax_capture_mode() -> None:
    """Make the calling thread's CUDA calls exempt from other threads' global-mode graph captures: the
    watchdog's event queries would otherwise be refused and invalidate a capture on the caller's thread."""
    fn = _capture_mode_fn()
    if fn is None:
        raise CommlibError("commlib: cudaThreadExchangeStreamCaptureMode not found in the CUDA runtime torch loaded")
    mode = ctypes.c_int(2)   # cudaStreamCaptureModeRelaxed
    code = fn(ctypes.byref(mode))
    if code != 0:
        raise CommlibError(f"commlib: cudaThreadExchangeStreamCaptureMode failed (CUDA error {code})")


def available() -> bool:
    """NCCL, and the CUDA runtime call the watchdog needs, can be called directly in this process."""
    try:
        library()
    except CommlibError:
        return False
    return _capture_mode_fn() is not None


def version() -> int:
    v = ctypes.c_int()
    _check(library().ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
    return v.value


def _check(code: int, what: str) -> None:
    if code != 0:
        msg = library().ncclGetErrorString(code).decode(errors="replace")
        raise CommlibError(f"commlib: {what} failed: NCCL error {code} ({msg})")


class NcclComm:
    """A communicator over the ranks of ``group`` (a torch process group), on ``device``.

    ``all_to_all`` and ``all_gather`` issue onto ``stream`` (default: the current stream) and return
    at once. A step not done within ``timeout_s`` aborts the communicator (see the module docstring).
    """

    def __init__(self, group, device: torch.device, max_ctas: int = 0, timeout_s: float = 100.0,
                 name: str = "nccl", label: str = "") -> None:
        lib = self.lib = library()
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.device, self.timeout_s, self.name = device, timeout_s, name
        self.label = label or f"commlib rank {self.rank} of {name}"   # how errors name this process
        uid = _UniqueId()
        if self.rank == 0:
            _check(lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        box = [id_bytes(uid) if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        uid = id_from(box[0])
        cfg = _Config(size=ctypes.sizeof(_Config), magic=_API_MAGIC, version=_VERSION_2_17,
                      blocking=_CONFIG_UNDEF_INT, cgaClusterSize=_CONFIG_UNDEF_INT, minCTAs=_CONFIG_UNDEF_INT,
                      maxCTAs=max_ctas if max_ctas > 0 else _CONFIG_UNDEF_INT, netName=None)
        comm = ctypes.c_void_p()
        with torch.cuda.device(device):
            _check(lib.ncclCommInitRankConfig(ctypes.byref(comm), self.size, uid, self.rank, ctypes.byref(cfg)),
                   f"ncclCommInitRankConfig ({name}, rank {self.rank} of {self.size})")
        self.comm = comm
        self.failed: Optional[str] = None
        self.watch_error: Optional[str] = None
        # the watchdog: (event, issued at, step name) of steps the stream may not be past yet
        self._pending: list = []
        self._free_events: list = []
        self._lock = threading.Lock()
        self._issue_lock = threading.RLock()   # an abort never runs while this process issues a step
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"commlib-{name}-watchdog", daemon=True)
        self._thread.start()
        # connect to every peer now: NCCL connects on a peer's first step, and the host blocks until the
        # peer takes part (no deadline could end that wait); later steps only enqueue
        with torch.cuda.device(device):
            probe = torch.zeros(self.size, dtype=torch.uint8, device=device)
            got = torch.empty_like(probe)
            self.all_to_all(got, probe, [1] * self.size, [1] * self.size, f"{name}: connect")
            self.all_gather(got, probe[:1], f"{name}: connect")
            self.wait_host(f"{name}: connect")

    # ------------------------------------------------------------------ steps
    def all_to_all(self, out: torch.Tensor, send: torch.Tensor, send_splits: list, recv_splits: list,
                   what: str, stream=None) -> None:
        """Rows of ``send`` to every rank (``send_splits[r]`` rows to rank r, in rank order) into ``out``
        (``recv_splits[r]`` rows from rank r). Both contiguous, same row size."""
        self.check()
        row = math.prod(send.shape[1:]) * send.element_size()
        s = self._stream(stream)
        lib = self.lib
        sp, rp = send.data_ptr(), out.data_ptr()
        with self._issue_lock:
            comm = self._live()
            _check(lib.ncclGroupStart(), "ncclGroupStart")
            try:
                for peer in range(self.size):
                    n_s, n_r = send_splits[peer] * row, recv_splits[peer] * row
                    if n_s:
                        _check(lib.ncclSend(sp, n_s, _UINT8, peer, comm, s), f"ncclSend ({what})")
                    if n_r:
                        _check(lib.ncclRecv(rp, n_r, _UINT8, peer, comm, s), f"ncclRecv ({what})")
                    sp += n_s
                    rp += n_r
            finally:
                _check(lib.ncclGroupEnd(), f"ncclGroupEnd ({what})")
            self._issued(what, stream)

    def all_gather(self, out: torch.Tensor, row: torch.Tensor, what: str, stream=None) -> None:
        """``row`` (contiguous) of every rank into ``out`` ([size, *row.shape], rank order)."""
        self.check()
        n = row.numel() * row.element_size()
        with self._issue_lock:
            _check(self.lib.ncclAllGather(row.data_ptr(), out.data_ptr(), n, _UINT8, self._live(),
                                          self._stream(stream)), f"ncclAllGather ({what})")
            self._issued(what, stream)

    def _live(self):
        if self.comm is None:
            raise CommlibError(self.failed or f"commlib: the {self.name} NCCL communicator is closed")
        return self.comm

    def _stream(self, stream) -> int:
        return (stream or torch.cuda.current_stream(self.device)).cuda_stream

    # ------------------------------------------------------------------ deadline
    def _issued(self, what: str, stream) -> None:
        if torch.cuda.is_current_stream_capturing():
            return   # a captured step runs at replay: no host deadline for it (as with torch's watchdog)
        with self._lock:
            ev = self._free_events.pop() if self._free_events else torch.cuda.Event()
        ev.record(stream or torch.cuda.current_stream(self.device))
        with self._lock:
            self._pending.append((ev, time.monotonic(), what))

    def _first_late(self) -> Optional[tuple]:
        """Drop the steps the stream is past; (name, seconds waited) of the oldest one still running
        if it has run past the deadline, else None. Steps end in issue order (one stream)."""
        with self._lock:
            pending = list(self._pending)
        done, late = 0, None
        for ev, t0, what in pending:
            if ev.query():
                done += 1
                continue
            waited = time.monotonic() - t0
            if waited > self.timeout_s:
                late = (what, waited)
            break
        with self._lock:
            self._free_events.extend(ev for ev, _, _ in self._pending[:done])
            del self._pending[:done]
        return late

    def _fail(self, what: str, waited: float) -> None:
        """Abort the communicator for a late step: its kernels leave, the stream moves on, every later
        step (and :meth:`check`) raises this message."""
        with self._issue_lock:
            if self.failed:
                return
            self.failed = (f"[{self.label}] {what}: timed out, the NCCL step ({self.name}) was not done after "
                           f"{waited:.1f} s (COMMLIB_TIMEOUT_S={self.timeout_s:g}): a peer exited, skipped this "
                           "call, or is stuck elsewhere; the communicator was aborted")
        print(self.failed, file=sys.stderr, flush=True)
        self._abort()

    def _watch(self) -> None:
        """The watchdog: steps no host read follows (cached dispatch, combine) get the deadline too."""
        try:
            _relax_capture_mode()
        except CommlibError as e:   # no deadline without it (a query could break a capture): say so once
            self.watch_error = str(e)
            return
        period = min(0.05, self.timeout_s / 4)
        while not self._stop.wait(period):
            late = self._first_late()
            if late is not None:
                self._fail(*late)
                return

    def check(self) -> None:
        """Raise if a step ran past the deadline (the communicator was aborted)."""
        if self.failed:
            raise CommlibError(self.failed)

    def wait_host(self, what: str) -> None:
        """Block the host until the stream is past every issued step: a host read that follows a step
        raises once the oldest running step passes the deadline (``what``: what the host waits for,
        named if the communicator is closed meanwhile)."""
        with self._lock:
            last = self._pending[-1][0] if self._pending else None
        while last is not None and not last.query():
            if self.failed:
                raise CommlibError(self.failed)
            late = self._first_late()
            if late is not None:
                self._fail(*late)
                raise CommlibError(self.failed)
            if self.comm is None:
                raise CommlibError(f"commlib: {what}: the {self.name} NCCL communicator is closed")
            time.sleep(0)

    def _abort(self) -> None:
        with self._issue_lock:
            comm, self.comm = self.comm, None
        if comm:
            self.lib.ncclCommAbort(comm)

    def close(self) -> None:
        """Free the communicator (local: no peer takes part) once the stream is past its steps; one whose
        steps are not done within the deadline is aborted instead. A failed one was aborted already."""
        self._stop.set()
        try:
            self.wait_host(f"{self.name}: close")
        except Exception:   # noqa: BLE001 - late steps: aborted above; a torn-down CUDA context at exit: nothing to wait for
            pass
        with self._issue_lock:
            comm, self.comm = self.comm, None
        if comm:
            self.lib.ncclCommDestroy(comm)
