"""Peer memory over CUDA IPC: one buffer per rank, every rank's buffer mapped into every process.

Each rank cudaMallocs ``num_bytes`` (CuPy's runtime, not torch's allocator, so the IPC handle
covers exactly this allocation), zeroes it, and exchanges its cudaIpc handle with
``all_gather_object`` on the group (NCCL or gloo: the group only carries these few bytes, never
data). Works between processes sharing a GPU too. Used by the NVLink engine's buffer and by the
low-latency buffer (commlib/backends/nvlink_ll.py).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .. import kernels as K


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
        everyone: list = [None] * num_ranks
        dist.all_gather_object(everyone, (handle, os.getpid(), dev), group=group)
        bases = []
        with cp.cuda.Device(dev):
            for r, (h, _pid, _dev) in enumerate(everyone):
                if r == rank:
                    bases.append(self.base)
                    continue
                p = int(cp.cuda.runtime.ipcOpenMemHandle(h))
                self.peer_ptrs[r] = p
                bases.append(p)
        self.peer_bases = torch.tensor(bases, dtype=torch.int64, device=device)

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
