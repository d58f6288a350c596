"""Peer memory over CUDA IPC: one buffer per rank, every rank's buffer mapped into every process.

Each rank cudaMallocs ``num_bytes`` (CuPy's runtime, not torch's allocator, so the IPC handle
covers exactly this allocation), zeroes it, and exchanges its cudaIpc handle with
``all_gather_object`` on the group (NCCL or gloo: the group only carries these few bytes, never
data). Works between processes sharing a GPU too. Used by the NVLink engine's buffer and by the
low-latency buffer (commlib/backends/low_latency/nvlink.py).

``HostPeerMemory`` has the same interface over pinned host memory: each rank's buffer is a memfd
that every process of the node maps and registers with CUDA (cudaHostRegister, mapped), so kernels
and copy engines of any rank reach it over PCIe without peer access between the GPUs.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import socket

import torch
import torch.distributed as dist

from commlib.cuda import loader as K

SLOT_ALIGN = 128  # staging slots never share a cache line (a line read early could be stale)


def _exchange(mem, token, group, rank: int, num_ranks: int, open_peer, device_ctx) -> None:
    """Collective: all-gather every rank's ``token`` (what a peer needs to map its buffer) and map each
    peer's with ``open_peer(r, token) -> address`` inside ``device_ctx``; sets ``mem.peer_ptrs`` and
    ``mem.peer_bases`` (own ``mem.base`` included)."""
    everyone: list = [None] * num_ranks
    dist.all_gather_object(everyone, token, group=group)
    bases = []
    with device_ctx:
        for r, theirs in enumerate(everyone):
            if r == rank:
                bases.append(mem.base)
                continue
            mem.peer_ptrs[r] = open_peer(r, theirs)
            bases.append(mem.peer_ptrs[r])
    mem.peer_bases = torch.tensor(bases, dtype=torch.int64, device=mem.device)


class PeerMemory:
    """``base``: this rank's buffer; ``peer_ptrs``: {rank: mapped address} of the others;
    ``peer_bases``: [R] int64 device tensor of every rank's address in this process (own included).

    Collective at creation. The caller makes sure every rank has opened the handles (a barrier)
    before any kernel writes into a peer, and synchronizes its device before ``close()``.
    """

    def __init__(self, num_bytes: int, group, rank: int, num_ranks: int, device: torch.device) -> None:
        cp = K.cupy()
        self.num_bytes = int(num_bytes)
        self.device = device
        self.peer_ptrs: dict[int, int] = {}
        dev = device.index
        with cp.cuda.Device(dev):
            self.base: int | None = int(cp.cuda.runtime.malloc(self.num_bytes))
            cp.cuda.runtime.memset(self.base, 0, self.num_bytes)
            cp.cuda.runtime.deviceSynchronize()
            handle = bytes(cp.cuda.runtime.ipcGetMemHandle(self.base))
        _exchange(self, handle, group, rank, num_ranks,
                  lambda r, h: int(cp.cuda.runtime.ipcOpenMemHandle(h)), cp.cuda.Device(dev))

    def all_opened(self, group, rank: int, num_ranks: int) -> None:
        """Collective: returns once every rank has opened every handle (after a device sync), so no
        kernel writes into a peer that has not mapped this rank's buffer yet."""
        torch.cuda.synchronize(self.device)
        dist.all_gather_object([None] * num_ranks, rank, group=group)

    def close(self) -> None:
        """Wait for this device's work, close the peer mappings and free this rank's buffer.
        Collective-free (safe from __del__)."""
        if self.base is None:
            return
        try:
            torch.cuda.synchronize(self.device)
        except Exception:  # noqa: BLE001 - a failed context still frees what it can
            pass
        cp = K.cupy()
        with cp.cuda.Device(self.device.index):
            for p in self.peer_ptrs.values():
                try:
                    cp.cuda.runtime.ipcCloseMemHandle(p)
                except Exception:  # noqa: BLE001
                    pass
            try:
                cp.cuda.runtime.free(self.base)
            except Exception:  # noqa: BLE001
                pass
        self.peer_ptrs.clear()
        self.base = None


CUDA_HOST_REGISTER_PORTABLE, CUDA_HOST_REGISTER_MAPPED = 1, 2
CUDA_DEV_ATTR_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM = 91


class HostPeerMemory:
    """PeerMemory's interface over pinned host memory shared between the node's processes.

    Each rank creates a ``num_bytes`` memfd (zero-filled), maps it and registers the mapping with
    CUDA; the others open it through ``/proc/<pid>/fd/<fd>`` (same host, same user), map and register
    it too. ``base`` / ``peer_ptrs`` / ``peer_bases`` are addresses in this process, usable by kernels
    (system-scope loads and stores over PCIe) and by cudaMemcpyAsync (cudaMemcpyDefault). Collective at
    creation, like PeerMemory.
    """

    def __init__(self, num_bytes: int, group, rank: int, num_ranks: int, device: torch.device) -> None:
        cp = K.cupy()
        self.num_bytes = int(num_bytes)
        self.device = device
        self.peer_ptrs: dict[int, int] = {}
        self._maps: list = []  # (mmap, ctypes view, address) per mapping, own first
        dev = device.index
        if not cp.cuda.runtime.deviceGetAttribute(CUDA_DEV_ATTR_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM, dev):
            raise RuntimeError(f"[commlib rank {rank}] host staging: device {dev} cannot use host pointers of "
                               "registered memory (cudaDevAttrCanUseHostPointerForRegisteredMem = 0)")
        self._fd = os.memfd_create(f"commlib_peer_{rank}")
        self.base: int | None = 0
        try:
            self._open_all(cp, group, rank, num_ranks, dev)
        except BaseException:
            self.close()
            raise

    def _open_all(self, cp, group, rank: int, num_ranks: int, dev) -> None:
        os.ftruncate(self._fd, self.num_bytes)
        with cp.cuda.Device(dev):
            self.base = self._map(self._fd)

        def open_peer(r: int, token) -> int:
            pid, fd, host = token
            if host != socket.gethostname():
                raise RuntimeError(f"[commlib rank {rank}] host staging needs every rank on one host; rank {r} "
                                   f"is on {host}")
            peer_fd = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR)
            try:
                return self._map(peer_fd)
            finally:
                os.close(peer_fd)

        _exchange(self, (os.getpid(), self._fd, socket.gethostname()), group, rank, num_ranks, open_peer,
                  cp.cuda.Device(dev))

    def _map(self, fd: int) -> int:
        mm = mmap.mmap(fd, self.num_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        view = (ctypes.c_char * self.num_bytes).from_buffer(mm)
        addr = ctypes.addressof(view)
        self._maps.append((mm, view, addr))  # before registering: close() releases it either way
        K.cupy().cuda.runtime.hostRegister(addr, self.num_bytes,
                                           CUDA_HOST_REGISTER_PORTABLE | CUDA_HOST_REGISTER_MAPPED)
        return addr

    all_opened = PeerMemory.all_opened

    def close(self) -> None:
        """Wait for this device's work, unregister and unmap every mapping, close the memfd."""
        if self.base is None:
            return
        try:
            torch.cuda.synchronize(self.device)
        except Exception:  # noqa: BLE001
            pass
        cp = K.cupy()
        maps, self._maps = self._maps, []
        while maps:
            mm, view, addr = maps.pop()
            try:
                cp.cuda.runtime.hostUnregister(addr)
            except Exception:  # noqa: BLE001
                pass
            del view  # the last reference to the ctypes view: the mapping can close
            try:
                mm.close()
            except Exception:  # noqa: BLE001 - a view still exported: the mapping goes with the process
                pass
        os.close(self._fd)
        self.peer_ptrs.clear()
        self.base = None
