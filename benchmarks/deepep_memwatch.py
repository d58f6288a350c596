"""Run a DeepEP test file unchanged and report each spawned rank's device memory when it ends.

    python -m benchmarks.deepep_memwatch test_low_latency.py [its arguments]

The test runs as its own ``__main__`` (runpy); ``torch.multiprocessing.spawn`` is wrapped so each
rank's function runs inside ``Watched``, which prints one line per rank when the function returns or
raises (an out-of-memory error included, before it propagates):

    [memwatch rank R] ok|raised <Error>: torch peak alloc A, peak reserved B, reserved now C, segments S,
        commlib IPC D, device used U of T (GiB)

``peak alloc`` is what the test and commlib held in tensors at most; ``peak reserved`` minus it is the
caching allocator's slack (fragmentation). ``commlib IPC`` is the Buffer's communication memory
(cudaMalloc'ed outside torch's allocator). Nothing else of the test or its environment changes.
"""
from __future__ import annotations

import gc
import os
import runpy
import sys

GIB = float(1 << 30)


def _ipc_bytes() -> int:
    try:
        from commlib.backends.nvlink.peer_memory import PeerMemory
    except Exception:  # noqa: BLE001 - commlib not importable: nothing to count
        return 0
    return sum(o.num_bytes for o in gc.get_objects() if isinstance(o, PeerMemory) and o.base is not None)


def memory_line(rank, outcome: str) -> str:
    import torch
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return f"[memwatch rank {rank}] {outcome}: no CUDA context"
    s = torch.cuda.memory_stats()
    free, total = torch.cuda.mem_get_info()
    return (f"[memwatch rank {rank}] {outcome}: torch peak alloc {s.get('allocated_bytes.all.peak', 0) / GIB:.2f}, "
            f"peak reserved {s.get('reserved_bytes.all.peak', 0) / GIB:.2f}, "
            f"reserved now {s.get('reserved_bytes.all.current', 0) / GIB:.2f}, "
            f"segments {s.get('segment.all.current', 0)}, commlib IPC {_ipc_bytes() / GIB:.2f}, "
            f"device used {(total - free) / GIB:.2f} of {total / GIB:.2f} (GiB)")


class Watched:
    """A spawned rank's function, reporting its memory when it ends (picklable: spawn sends it)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, rank, *args):
        try:
            result = self.fn(rank, *args)
        except BaseException as e:
            print(memory_line(rank, f"raised {type(e).__name__}"), file=sys.stderr, flush=True)
            raise
        print(memory_line(rank, "ok"), file=sys.stderr, flush=True)
        return result


def _install() -> None:
    import torch.multiprocessing as mp
    # run as -m this module is __main__, whose names the spawned ranks cannot look up: use the module
    from benchmarks.deepep_memwatch import Watched as watched
    original = mp.spawn
    if getattr(original, "_memwatch", False):
        return

    def spawn(fn, args=(), nprocs=1, *rest, **kw):
        return original(watched(fn), args, nprocs, *rest, **kw)

    spawn._memwatch = True
    mp.spawn = spawn


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        raise SystemExit("usage: python -m benchmarks.deepep_memwatch TEST.py [ARGS...]")
    _install()
    sys.argv = argv
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as `python TEST.py` would have it
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
