"""Start N local ranks (processes) with torch.distributed set up, for tests, the main job and benchmarks.

``parallel_launch(world_size, worker, *args)`` spawns ``world_size`` processes; each calls
``worker(ctx, *args)`` with a ``RankContext``. The return value of rank 0 (or of every rank, with
``return_all``) is handed back. When any rank raises or dies, the parent stops the whole world at
once (ranks blocked in a collective with the failed rank would wait for their timeouts) and raises
with that rank's traceback, plus those of ranks that failed in the same moment. Ranks get a GPU each
(round-robin, several processes per GPU when world_size > GPUs) when ``use_gpu`` is set and CUDA
is present; the process group is NCCL with one process per GPU, otherwise gloo.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import sys
import time
import traceback
from typing import Any, Callable, NoReturn, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# NVLink multicast stays off in everything commlib starts (it can take shared GPUs down).
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


@dataclasses.dataclass
class RankContext:
    rank: int
    world_size: int
    ranks_per_node: int
    device: torch.device
    group: Any  # the default process group
    store: Any = None  # the group's key-value store (a TCPStore): side-channel exchanges with a timeout


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def exit_rank(code: int = 0) -> NoReturn:
    """End a rank process: destroy its process groups, finalize MPI, flush stdio, ``os._exit(code)``.

    A rank must not leave through the interpreter's finalization: gloo's worker threads can still
    drop the last reference to a tensor that has a Python object after the collective that used it
    has completed. If that happens while the interpreter finalizes, taking the GIL ends the thread
    and the C++ runtime aborts the rank (SIGABRT after a clean run; seen once in CI at the end of
    alltoall_perf under mpirun, and reported upstream for PyTorch). ``os._exit`` skips finalization,
    so everything a rank needs done at exit is done here, in order.
    """
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - still leave, with the reason on stderr
        print(f"[commlib] exit_rank: destroy_process_group failed: {exc!r}", file=sys.stderr)
        code = code or 1
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()  # Open MPI's launcher counts a rank that skips MPI_Finalize as failed
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream has nothing left to write
            pass
    os._exit(code)


# How long the parent keeps collecting other ranks' errors after the first one, before it stops the world.
ERROR_GRACE_S = 1.0


def _entry(rank: int, world_size: int, ranks_per_node: int, port: int, use_gpu: bool,
           worker: Callable, args: tuple, queue, group_backend: Optional[str] = None,
           return_all: bool = False, emulate_hosts: bool = False) -> None:
    os.environ.update(SAFE_ENV)
    if emulate_hosts:  # NCCL sees each emulated node as its own host (its socket transport between them)
        os.environ["NCCL_HOSTID"] = f"commlib-emulated-node-{rank // ranks_per_node}"
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["COMMLIB_RANKS_PER_NODE"] = str(ranks_per_node)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        device = torch.device("cpu")
        backend = "gloo"
        if use_gpu and torch.cuda.is_available():
            num_gpus = torch.cuda.device_count()
            device = torch.device("cuda", rank % num_gpus)
            torch.cuda.set_device(device)
            if world_size <= num_gpus:
                backend = "nccl"
        backend = group_backend or backend
        kwargs = {"device_id": device} if backend == "nccl" else {}
        # the parent hosts the store, so it outlives every rank (a late rank can still read it)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=300))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, **kwargs)
        ctx = RankContext(rank, world_size, ranks_per_node, device, dist.group.WORLD, store)
        result = worker(ctx, *args)
        queue.put((rank, "ok", result if rank == 0 or return_all else None))
        code = 0
    except BaseException:  # noqa: BLE001 - forwarded to the parent with the traceback
        queue.put((rank, "error", traceback.format_exc()))
        code = 1
    exit_rank(code)


def parallel_launch(world_size: int, worker: Callable, *args: Any, ranks_per_node: Optional[int] = None,
                    use_gpu: bool = False, timeout_s: float = 600.0, allow_exit: bool = False,
                    group_backend: Optional[str] = None, return_all: bool = False,
                    emulate_hosts: bool = False) -> Any:
    """Run ``worker(ctx, *args)`` on ``world_size`` local ranks; return rank 0's result.

    ``return_all``: return a list of every rank's result instead (None for a rank that left
    without reporting, under ``allow_exit``).
    ``group_backend``: force the process group's backend ("gloo" / "nccl"); by default NCCL with one
    process per GPU, gloo otherwise.
    ``emulate_hosts``: each emulated node gets its own NCCL_HOSTID, so NCCL runs between processes
    sharing one GPU (as separate hosts, over its socket transport: correctness only, never timing).
    ``allow_exit``: ranks that end with exit code 0 without reporting (fault-injection tests that
    make a rank leave) count as finished instead of being waited for.
    Raises RuntimeError with the failed ranks' tracebacks as soon as a rank raises or dies (the
    other ranks are terminated), or when ``timeout_s`` passes.
    """
    ranks_per_node = ranks_per_node or world_size
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    port = store.port
    procs = [ctx.Process(target=_entry, args=(r, world_size, ranks_per_node, port, use_gpu, worker, args, queue,
                                                  group_backend, return_all, emulate_hosts),
                         daemon=False) for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    results: dict[int, tuple[str, Any]] = {}
    errors: list[str] = []
    failed_at = None
    while len(results) < world_size:
        if failed_at is not None and time.monotonic() > failed_at + ERROR_GRACE_S:
            break
        if not queue.empty():
            rank, status, payload = queue.get()
            results[rank] = (status, payload)
            if status == "error":
                errors.append(f"--- rank {rank} ---\n{payload}")
                failed_at = failed_at or time.monotonic()
            continue
        if failed_at is not None:
            time.sleep(0.01)
            continue
        if time.monotonic() > deadline:
            errors.append(f"timed out after {timeout_s:.0f} s; ranks that finished: {sorted(results)}")
            break
        if allow_exit and queue.empty():
            for i, p in enumerate(procs):
                if p.exitcode == 0 and i not in results:
                    results[i] = ("exited", None)
        dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in results]
        if dead and queue.empty():
            time.sleep(0.2)
            if queue.empty():
                errors.append(f"ranks {dead} died (exit codes {[procs[i].exitcode for i in dead]})")
                break
        time.sleep(0.01)
    if errors:
        _stop(procs)
        raise RuntimeError("parallel_launch failed:\n" + "\n".join(errors))
    for p in procs:
        p.join(timeout=60)
    if return_all:
        return [results[r][1] for r in range(world_size)]
    return results[0][1]


def _stop(procs) -> None:
    """Terminate every live rank (SIGTERM, then SIGKILL for one that ignores it)."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
            p.join(timeout=10)
