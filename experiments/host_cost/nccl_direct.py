"""NCCL called directly (ctypes) on a communicator of its own: what torch.distributed's wrapping of a
collective costs the host, measured (``experiments.host_cost.nccl``, its ``raw_*`` rows).

A step is ``ncclGroupStart``, one ``ncclSend`` / ``ncclRecv`` per peer, ``ncclGroupEnd`` (or one
``ncclAllGather``), issued onto the current stream: no work object, no events, no stream join. The
library is the ``libnccl.so.2`` torch loaded; the unique id is broadcast over the torch group.

Measured on one H200 with ranks as emulated hosts (NCCL's socket transport; docs/internode.md,
"Measured"): issuing from an idle device costs about what torch's all_to_all_single costs, because
NCCL's own issue of a network step dominates; so the internode engine keeps torch.distributed for its
NCCL steps. No deadline here: an experiment's peers always take part.
"""
from __future__ import annotations

import ctypes
import math
import os

import torch
import torch.distributed as dist

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


def library() -> ctypes.CDLL:
    """The process's NCCL (the one torch loaded), with the signatures this module calls."""
    global _lib
    if _lib is None:
        names = [os.environ.get("NCCL_LIBRARY", ""), "libnccl.so.2", "libnccl.so"]
        err = None
        for name in filter(None, names):
            try:
                lib = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
                break
            except OSError as e:
                err = e
        else:
            raise CommlibError(f"commlib: cannot load NCCL ({err}); set NCCL_LIBRARY to the path of libnccl.so.2")
        vp, sz, i, p = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.POINTER
        sigs = {
            "ncclGetUniqueId": [p(_UniqueId)],
            "ncclCommInitRankConfig": [p(vp), i, _UniqueId, i, p(_Config)],
            "ncclCommDestroy": [vp],
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
    return _lib


def _check(code: int, what: str) -> None:
    if code != 0:
        msg = library().ncclGetErrorString(code).decode(errors="replace")
        raise CommlibError(f"commlib: {what} failed: NCCL error {code} ({msg})")


class NcclComm:
    """A communicator over the ranks of ``group`` (a torch process group), on ``device``.
    ``all_to_all`` and ``all_gather`` issue onto ``stream`` (default: the current stream) and return."""

    def __init__(self, group, device: torch.device, max_ctas: int = 0, name: str = "nccl") -> None:
        lib = self.lib = library()
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.device, self.name = device, name
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

    def all_to_all(self, out: torch.Tensor, send: torch.Tensor, send_splits: list, recv_splits: list,
                   what: str = "", stream=None) -> None:
        """Rows of ``send`` to every rank (``send_splits[r]`` rows to rank r, in rank order) into ``out``
        (``recv_splits[r]`` rows from rank r). Both contiguous, same row size."""
        row = math.prod(send.shape[1:]) * send.element_size()
        s, lib, comm = self._stream(stream), self.lib, self.comm
        sp, rp = send.data_ptr(), out.data_ptr()
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

    def all_gather(self, out: torch.Tensor, row: torch.Tensor, what: str = "", stream=None) -> None:
        """``row`` (contiguous) of every rank into ``out`` ([size, *row.shape], rank order)."""
        n = row.numel() * row.element_size()
        _check(self.lib.ncclAllGather(row.data_ptr(), out.data_ptr(), n, _UINT8, self.comm, self._stream(stream)),
               f"ncclAllGather ({what})")

    def _stream(self, stream) -> int:
        return (stream or torch.cuda.current_stream(self.device)).cuda_stream

    def close(self) -> None:
        """Free the communicator once the device is past its steps (local: no peer takes part)."""
        comm, self.comm = self.comm, None
        if comm:
            torch.cuda.synchronize(self.device)
            self.lib.ncclCommDestroy(comm)
