"""Bootstrapping torch.distributed from torchrun or MPI, so one script runs under either launcher."""
from __future__ import annotations

import datetime
import os
import socket
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as _c10d

from commlib.utils.launch import SAFE_ENV, free_port


def _default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _mpi_rank_size() -> Optional[tuple[int, int, int]]:
    """(rank, size, local_rank) from an MPI launcher's environment, or None."""
    pairs = (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
             ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
             ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK"),
             ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"))
    for r, s, l in pairs:
        if r in os.environ and s in os.environ:
            return int(os.environ[r]), int(os.environ[s]), int(os.environ.get(l, os.environ[r]))
    return None


def _set_device(local_rank: int) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())


def init_distributed(backend: Optional[str] = None, comm: Any = None,
                     timeout_s: float = 300.0) -> "dist.ProcessGroup":
    """Initialise the default process group (if needed) and return it.

    Order: already initialised -> torchrun's env (RANK/WORLD_SIZE/MASTER_ADDR) -> an mpi4py
    communicator (``comm``, or MPI.COMM_WORLD when an MPI launcher's env is present): rank 0
    picks a free port and broadcasts its address over MPI.
    """
    for key, value in SAFE_ENV.items():
        os.environ.setdefault(key, value)
    if dist.is_initialized():
        return dist.group.WORLD
    backend = backend or _default_backend()
    timeout = datetime.timedelta(seconds=timeout_s)
    if comm is None and "RANK" in os.environ and "MASTER_ADDR" in os.environ:
        _set_device(int(os.environ.get("LOCAL_RANK", os.environ["RANK"])))
        dist.init_process_group(backend, timeout=timeout)
        return dist.group.WORLD
    if comm is None and _mpi_rank_size() is None:
        raise RuntimeError("init_distributed: no launcher found (run under torchrun or mpirun, "
                           "or pass an mpi4py communicator)")
    if comm is None:
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    env_info = _mpi_rank_size()
    local_rank = env_info[2] if env_info else rank
    if rank == 0:
        # One host: loopback. Several: this host's address, reachable by the other nodes.
        local_size = int(os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE", os.environ.get("MPI_LOCALNRANKS", size)))
        default = "127.0.0.1" if local_size >= size else socket.gethostbyname(socket.gethostname())
        addr = os.environ.get("MASTER_ADDR", default)
        port = int(os.environ.get("MASTER_PORT", 0)) or free_port()
        info = (addr, port)
    else:
        info = None
    addr, port = comm.bcast(info, root=0)
    _set_device(local_rank)
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=size,
                            timeout=timeout)
    return dist.group.WORLD


def group_from_comm(comm: Any) -> "dist.ProcessGroup":
    """The torch.distributed group spanning the ranks of an mpi4py communicator."""
    if not dist.is_initialized():
        init_distributed(comm=comm)
    ranks = comm.allgather(dist.get_rank())
    if len(ranks) == dist.get_world_size():
        return dist.group.WORLD
    return dist.new_group(sorted(ranks))


# torch.distributed's function -> (the ProcessGroup methods it calls, newest name first; its options class)
_DIRECT = {"all_to_all_single": (("all_to_all_single", "alltoall_base"), "AllToAllOptions"),
           "all_gather_single": (("all_gather_single", "_allgather_base"), "AllgatherOptions")}


def direct_collective(group, name: str, async_op: bool = True):
    """``(fn, opts)``: the C++ method of process group ``group`` that torch.distributed's ``name``
    ("all_to_all_single" or "all_gather_single") calls, and its options, so that ``fn(out, in,
    [out_splits, in_splits,] opts)`` issues the same collective without the Python wrapper's frames
    (a hot path issues it every call). ``async_op``: True, on the group's own stream, returning its
    work; False (NCCL in torch versions that have asyncOp), on the current stream, ordered with what
    follows there, returning no work (None; an older torch returns one, to be waited for as usual).
    None where ``group`` is None (the default group), this torch has no such method, or a
    synchronous collective is asked of a torch whose options cannot say so."""
    if group is None:
        return None
    methods, options = _DIRECT[name]
    fn = next((getattr(group, m) for m in methods if hasattr(group, m)), None)
    cls = getattr(_c10d, options, None)
    if fn is None or cls is None:
        return None
    opts = cls()
    try:
        opts.asyncOp = async_op
    except AttributeError:
        if not async_op:
            return None
    return fn, opts
