"""Loads csrc/*.cu with CuPy's NVRTC (compiled at first use, cached on disk) and launches them on
PyTorch's current stream.

Nothing here imports CuPy at module import time: CPU code can import commlib (and this module)
without CuPy installed. Kernels take raw device pointers (``numpy.uint64``) and scalars
(``numpy.int32`` / ``numpy.uint64``), so any torch tensor can be passed with ``ptr(t)``.

Every family file includes ``common.cuh``; the header's text is pasted into the source here
rather than found through ``-I``, because CuPy's on-disk cache key covers the source text and the
options but not included files: an edited header must change the key.
"""
from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from . import env

CSRC = Path(__file__).resolve().parent.parent / "csrc"

# Limits and the control-region layout, shared with csrc/common.cuh (passed with -D, one source).
MAX_RANKS = 8
MAX_CHANNELS = 128
CONTROL_LAYOUT = {
    "COMMLIB_OFF_DISPATCH_TAIL": 0,
    "COMMLIB_OFF_DISPATCH_DONE": 8 * MAX_RANKS * MAX_CHANNELS,
    "COMMLIB_OFF_COMBINE_TAIL": 2 * 8 * MAX_RANKS * MAX_CHANNELS,
    "COMMLIB_OFF_COMBINE_DONE": 3 * 8 * MAX_RANKS * MAX_CHANNELS,
    "COMMLIB_OFF_NOTIFY_FLAG": 4 * 8 * MAX_RANKS * MAX_CHANNELS,
    "COMMLIB_OFF_NOTIFY_DATA": 4 * 8 * MAX_RANKS * MAX_CHANNELS + 4096,
}
NOTIFY_WORD_EXPERT = 16 + MAX_CHANNELS       # COMMLIB_NW_EXPERT
HOST_COUNTS = {"total": 0, "bad_me": 1, "bad_rank": 2, "bad_value": 3, "sent": 4, "recv": 12, "expert": 20}
HOST_COUNTS_EXPERT = HOST_COUNTS["expert"]   # HC_* in notify.cu
NOTIFY_REJECTED = 0x40000000                 # REJECTED in notify.cu
NUM_SEQ_COUNTERS = 3 * 2 * MAX_CHANNELS      # [kind][role][channel]
LAYOUT_THREADS = 256
NOTIFY_THREADS = 512
# Compile-time knobs of the data kernels (each set is its own cached build). The defaults are what
# benchmarks/bench_intranode.py --variants measured best on 2 x H200 (docs/nvlink_engine.md:
# 1024 threads + local half in the receiver: cached BF16 dispatch 253 us vs 288 us with 512 threads
# and the local half in the sender, V3 shape, 4096 tokens); set_variant() swaps them.
DEFAULT_VARIANT = {
    "DISPATCH_THREADS": 1024,     # 31 copy warps + 1 publisher warp (64 registers/thread, some spills)
    "COMBINE_THREADS": 1024,
    "DISPATCH_UNROLL": 4,         # 16-byte vectors in flight per lane
    "COMBINE_COPY_UNROLL": 4,
    "COMBINE_SUM_UNROLL": 2,      # per rank; two ranks' loads in flight together
    "LOCAL_IN_RECEIVER": 1,       # the receiver CTA copies the local half, the sender only pushes
}

_FAMILIES = {
    "layout": ("layout_kernel",),
    "notify": ("notify_kernel",),
    "dispatch": ("dispatch_kernel",),
    "combine": ("combine_kernel",),
}

_lock = threading.Lock()
_modules: dict = {}
_streams: dict = {}
_plain_override: Optional[bool] = None
_recording: Optional[list] = None
_sleep_cycles = 0
_variant: dict = dict(DEFAULT_VARIANT)


def cupy():
    """The cupy module, imported on first use (raises ImportError with a hint when missing)."""
    try:
        import cupy as cp
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise ImportError("commlib's GPU kernels need CuPy (pip install cupy-cuda13x or cupy-cuda12x)") from e
    return cp


def set_plain(plain: Optional[bool]) -> None:
    """Force plain loads/stores (True), the PTX-hinted ones (False), or follow COMMLIB_PLAIN_LDST (None).

    For A/B benchmarks; takes effect at the next launch (both builds stay cached).
    """
    global _plain_override
    _plain_override = plain


def plain_mode() -> bool:
    return env.plain_ldst() if _plain_override is None else bool(_plain_override)


def set_variant(overrides: Optional[dict] = None) -> dict:
    """Use DEFAULT_VARIANT updated with ``overrides`` for later launches (None: the defaults).

    For A/B benchmarks; every rank must use the same variant (it changes the block size).
    """
    global _variant
    unknown = set(overrides or {}) - set(DEFAULT_VARIANT)
    if unknown:
        raise ValueError(f"unknown kernel variant keys {sorted(unknown)}; known: {sorted(DEFAULT_VARIANT)}")
    _variant = dict(DEFAULT_VARIANT)
    _variant.update({k: int(v) for k, v in (overrides or {}).items()})
    return dict(_variant)


def variant() -> dict:
    return dict(_variant)


def threads(family: str) -> int:
    """Threads per CTA of a data kernel family under the current variant."""
    return {"dispatch": _variant["DISPATCH_THREADS"], "combine": _variant["COMBINE_THREADS"],
            "layout": LAYOUT_THREADS, "notify": NOTIFY_THREADS}[family]


def source(family: str) -> str:
    """The full NVRTC source of one kernel family (common.cuh pasted in)."""
    if family not in _FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}; expected one of {sorted(_FAMILIES)}")
    common = (CSRC / "common.cuh").read_text()
    text = (CSRC / f"{family}.cu").read_text()
    include = '#include "common.cuh"'
    if include not in text:
        raise RuntimeError(f"csrc/{family}.cu must include common.cuh")
    return text.replace(include, common, 1)


def options(plain: bool, knobs: Optional[dict] = None) -> tuple:
    defines = dict(CONTROL_LAYOUT)
    defines.update({
        "COMMLIB_PLAIN": int(plain),
        "COMMLIB_MAX_RANKS": MAX_RANKS,
        "COMMLIB_MAX_CHANNELS": MAX_CHANNELS,
    })
    defines.update({f"COMMLIB_{k}": v for k, v in (knobs if knobs is not None else _variant).items()})
    return ("-std=c++17", "--gpu-architecture=sm_90") + tuple(f"-D{k}={v}" for k, v in defines.items())


_functions: dict = {}  # (family, name, plain, variant, device) -> CuPy function: the launch hot path


def _function(family: str, name: str, plain: bool):
    cp = cupy()
    device = cp.cuda.runtime.getDevice()
    knobs = tuple(sorted(_variant.items()))
    fkey = (family, name, plain, knobs, device)
    fn = _functions.get(fkey)
    if fn is not None:
        return fn
    key = (family, plain, knobs, device)
    with _lock:
        module = _modules.get(key)
        if module is None:
            module = cp.RawModule(code=source(family), options=options(plain, dict(knobs)))
            _modules[key] = module
        fn = _functions[fkey] = module.get_function(name)
        return fn


def compile_all(plain: Optional[bool] = None) -> dict:
    """Compile (or load from cache) every family for the current device; returns {name: function}."""
    modes = [plain_mode()] if plain is None else [plain]
    out = {}
    for mode in modes:
        for family, names in _FAMILIES.items():
            for name in names:
                out[(name, mode)] = _function(family, name, mode)
    return out


def _current_stream():
    import torch

    cp = cupy()
    s = torch.cuda.current_stream()
    key = (s.cuda_stream, s.device.index)
    stream = _streams.get(key)
    if stream is None:
        stream = cp.cuda.ExternalStream(s.cuda_stream, s.device.index)
        _streams[key] = stream
    return stream


def launch(family: str, name: str, grid: int, block: int, args: Sequence, shared_mem: int = 0) -> None:
    """Launch ``name`` from ``csrc/<family>.cu`` on torch's current stream."""
    fn = _function(family, name, plain_mode())
    with _current_stream():  # CuPy launches on its current stream: torch's, wrapped
        if _recording is None:
            fn((int(grid),), (int(block),), tuple(args), shared_mem=int(shared_mem))
            return
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if _sleep_cycles:  # keep the device busy while the host issues the launch
            torch.cuda._sleep(_sleep_cycles)
        start.record()
        fn((int(grid),), (int(block),), tuple(args), shared_mem=int(shared_mem))
        end.record()
        _recording.append((name, start, end))


@contextlib.contextmanager
def record_launches(sleep_cycles: int = 0):
    """Record CUDA events around every kernel launched inside the block (kernel-only timing).

    Yields a list that fills with (kernel name, start event, end event); read it after a sync.
    ``sleep_cycles`` > 0 queues a device sleep before each start event, so the host's launch
    overhead lands before the start event instead of inside the measured span.
    """
    global _recording, _sleep_cycles
    previous, _recording = _recording, []
    previous_sleep, _sleep_cycles = _sleep_cycles, int(sleep_cycles)
    try:
        yield _recording
    finally:
        _recording, _sleep_cycles = previous, previous_sleep


# ---------------------------------------------------------------------------------------------
# Argument helpers
# ---------------------------------------------------------------------------------------------

def ptr(t) -> np.uint64:
    """Device address of a tensor (0 for None or an empty tensor)."""
    if t is None:
        return np.uint64(0)
    return np.uint64(t.data_ptr())


def i32(v: int) -> np.int32:
    return np.int32(v)


def u64(v: int) -> np.uint64:
    return np.uint64(v)


def notify_slot_words(num_ranks: int) -> int:
    """int32 words of one notify slot: a fixed stride, so even a rank that rejected its input (and
    may not know num_experts) writes its slot where the peers read it."""
    from .config import CONTROL_BYTES

    free = CONTROL_BYTES - CONTROL_LAYOUT["COMMLIB_OFF_NOTIFY_DATA"]
    return free // (2 * num_ranks * 4) // 4 * 4
