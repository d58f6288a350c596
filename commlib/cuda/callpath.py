"""The C++ call path (csrc/callpath.cpp): the NVLink engine's repeated calls (layout, cached dispatch,
combine, non-cached dispatch) as whole C++ calls, with no Python between the checks, the stream
waits, the allocations, the launches and the exit event.

The source is compiled at first use with the system C++ compiler (``CXX``, else ``c++``; no ninja)
against the installed torch's headers and libraries, cached under ``env.callpath_cache_dir()`` in a
folder named by a hash of the source, torch's version and build, the Python ABI and the command, and
imported. A file lock makes the ranks of a machine build it once. ``COMMLIB_CALLPATH``: auto (the C++
path where it builds and loads, else the Python path with one warning that says why), cpp (it must
load: an error otherwise), python (never built).

The backend makes a "twin" of each launch it keeps (``launch_of``: the same kernel, grid and packed
arguments), the Buffer an ``Engine`` (its comm stream and events) that runs the calls.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import threading
import time
import warnings
from pathlib import Path
from typing import Optional

import torch

from commlib.config import Config
from commlib.cuda import loader as K
from commlib.handle import DispatchHandle
from commlib.utils import env
from commlib.utils.errors import KernelLaunchError
from commlib.utils.event import EventOverlap

MODULE = "_commlib_callpath"
SOURCE_NAME = "callpath.cpp"
# the internode engine's call path (csrc/callpath_internode.cpp): a module of its own, the same header
INTERNODE_MODULE = "_commlib_callpath_internode"
INTERNODE_SOURCE_NAME = "callpath_internode.cpp"
BUILD_TIMEOUT_S = 900

_lock = threading.Lock()
_module = None          # the loaded extension, False once it could not be, None before the first try
_internode = None       # the same for the internode module (load_internode)
why_unavailable = ""    # why load() (or load_internode()) returned None
build_seconds: Optional[float] = None  # how long this process spent compiling it (None: taken from the cache)


def header_path() -> Path:
    return K.CSRC / "callpath.h"


def source_path(name: str = SOURCE_NAME) -> Path:
    return K.CSRC / name


def compiler() -> str:
    """The C++ compiler: $CXX, else c++ (a name on PATH or a path)."""
    name = os.environ.get("CXX") or "c++"
    found = shutil.which(name)
    if not found:
        raise RuntimeError(f"no C++ compiler: {name!r} is not on PATH (set CXX)")
    return found


def build_command(src: Path, out: Path, cxx: Optional[str] = None) -> list:
    """The compiler command that builds ``src`` into the extension ``out``: torch's include and library
    folders, its C++ ABI and pybind11 ABI defines, linked to libc10 / libtorch / libtorch_python only."""
    from torch.utils import cpp_extension

    includes = list(cpp_extension.include_paths()) + [sysconfig.get_paths()["include"]]
    libs = list(cpp_extension.library_paths())
    defines = [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    for name in ("COMPILER_TYPE", "STDLIB", "BUILD_ABI"):  # share torch's pybind11 ABI (its tensor casters)
        value = getattr(torch._C, f"_PYBIND11_{name}", None)
        if value is not None:
            defines.append(f'-DPYBIND11_{name}="{value}"')
    return ([cxx or compiler(), "-O2", "-std=c++17", "-fPIC", "-shared", "-fvisibility=hidden", *defines]
            + [f for p in includes for f in ("-isystem", p)]
            + [str(src), "-o", str(out)]
            + [f"-L{p}" for p in libs] + [f"-Wl,-rpath,{p}" for p in libs]
            + ["-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python", "-ldl"])


def build_key(src: Path, cxx: str) -> str:
    """The cache folder's name: the source, torch (version, build, location), the Python ABI, the command."""
    h = hashlib.sha256(src.read_bytes())
    h.update(header_path().read_bytes() if header_path().is_file() else b"")   # csrc/callpath.h, which it includes
    for part in (torch.__version__, str(torch.version.cuda), sys.implementation.cache_tag,
                 sysconfig.get_config_var("EXT_SUFFIX") or "", *build_command(src, Path("OUT"), cxx)):
        h.update(b"\0" + str(part).encode())
    return h.hexdigest()[:20]


def build(src: Optional[Path] = None, cache_dir: Optional[str] = None, module: str = MODULE) -> Path:
    """The extension ``module`` built from ``src`` (default csrc/callpath.cpp), compiled now unless the
    cache has it."""
    global build_seconds
    src = src or source_path()
    if not src.is_file():
        raise RuntimeError(f"{src} is missing")
    cxx = compiler()
    folder = Path(cache_dir or env.callpath_cache_dir()) / build_key(src, cxx)
    target = folder / (module + (sysconfig.get_config_var("EXT_SUFFIX") or ".so"))
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # one rank builds, the others wait and take its result
        if target.is_file():
            return target
        tmp = folder / f"{module}.{os.getpid()}.partial.so"
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(build_command(src, tmp, cxx), capture_output=True, text=True,
                                  timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"{cxx} did not finish within {BUILD_TIMEOUT_S} s") from None
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            err = (proc.stderr or proc.stdout).strip().splitlines()
            first = next((ln for ln in err if "error" in ln), err[-1] if err else "")
            raise RuntimeError(f"{cxx} failed with code {proc.returncode}: {first.strip()[:400]}")
        os.replace(tmp, target)
        build_seconds = time.perf_counter() - t0
    return target


def import_built(path: Path, module: str = MODULE):
    """Import the extension ``module`` at ``path`` and hand it the Python objects it works with."""
    spec = importlib.util.spec_from_file_location(module, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod._setup({
        "loader": K.__dict__, "launch_error": KernelLaunchError, "overlap": EventOverlap,
        "handle": DispatchHandle, "config": Config,
        "event_base": getattr(torch._C, "_CudaEventBase", None),
        "raw_stream": getattr(torch._C, "_cuda_getCurrentRawStream", None),
        "capturing": getattr(torch._C, "_cuda_isCurrentStreamCapturing", None),
        "host_counts": dict(K.HOST_COUNTS)})
    return mod


def load():
    """The extension, or None for the Python call path (COMMLIB_CALLPATH=python, or, with auto, a
    build or import that failed: then one RuntimeWarning says why). Tried once per process."""
    if _module is None:
        _load("_module", MODULE, SOURCE_NAME)
    return _module or None


def phases(on: bool, raw: bool = False) -> dict:
    """Opt-in per-phase host timing of the C++ calls (benchmarks.bench_host, bench_internode --host): turn
    it on or off in every loaded module (the NVLink engine's, the internode engine's); returns {"op.phase":
    median microseconds per call} of the calls made since the last phases() call (the internode engine's
    ops are named in_cached and in_combine); ``raw``: {"op.phase": [microseconds, one per call]} instead.
    Builds nothing."""
    out = {}
    for mod in (_module, _internode):
        if mod:
            for k, v in mod._phases(on).items():
                out[k] = [ns / 1e3 for ns in v] if raw else statistics.median(v) / 1e3
    return out


def load_internode():
    """The internode engine's extension (csrc/callpath_internode.cpp), as ``load``."""
    if _internode is None:
        _load("_internode", INTERNODE_MODULE, INTERNODE_SOURCE_NAME)
    return _internode or None


def _load(slot: str, module: str, source: str) -> None:
    global why_unavailable
    with _lock:
        if globals()[slot] is not None:
            return
        mode = env.callpath()
        if mode == "python":
            why_unavailable, globals()[slot] = "COMMLIB_CALLPATH=python", False
            return
        try:
            globals()[slot] = import_built(build(source_path(source), module=module), module)
        except Exception as e:  # noqa: BLE001 - any failure means the Python path
            why_unavailable, globals()[slot] = f"{type(e).__name__}: {e}", False
            if mode == "cpp":
                raise RuntimeError(f"COMMLIB_CALLPATH=cpp, but the C++ call path (csrc/{source}) "
                                   f"is unavailable: {why_unavailable}") from e
            warnings.warn(f"commlib: the C++ call path (csrc/{source}) is unavailable, the Python "
                          f"call path runs instead (COMMLIB_CALLPATH=python silences this): "
                          f"{why_unavailable}", RuntimeWarning, stacklevel=3)


def reset() -> None:
    """Forget what load() found (tests: COMMLIB_CALLPATH or the compiler changed)."""
    global _module, _internode, why_unavailable
    with _lock:
        _module, _internode, why_unavailable = None, None, ""


# ------------------------------------------------------------------------------------------------
# Twins of the backend's kept launches (commlib.cuda.loader.Replay)
# ------------------------------------------------------------------------------------------------

def launch_of(replay, mod=None):
    """The C++ twin of a ``loader.Replay``: its kernel, grid, block, shared memory and packed arguments,
    the parameter names and offsets from the kernel's C signature, the build it was made under.
    ``mod``: the extension whose Launch it is (default: the NVLink engine's)."""
    lau = replay.lau
    return (mod or load()).Launch(lau.handle, replay.grid, replay.block, replay.shared_mem, lau.codes, list(lau.names),
                         list(lau.offsets), lau.fmt.pack(*replay.args), replay.variant, replay.plain)


def cached_plan(owner, replay, kind: str, dtype, shape, second_shape, outputs, config_key, channels: int,
                handle_tensors, local_rows: int, remote_rows: int):
    """The twin of a cached dispatch's (``kind`` "dispatch") or a combine's kept launch (engine.py
    CachedPlan): what a call must match to replay it, and its outputs' (shape, dtype)."""
    (shape1, dtype1), spec2 = outputs
    return load().CachedPlan(owner, launch_of(replay), kind, dtype, list(shape),
                             None if second_shape is None else list(second_shape), list(shape1), dtype1,
                             None if spec2 is None else list(spec2[0]), list(config_key), channels,
                             [(f, t) for f, t in handle_tensors], local_rows, remote_rows)


def plan_set():
    """The container of a handle's twins (``handle.extra["cpp_plans"]``)."""
    return load().PlanSet()


def layout_plan(replay):
    return load().LayoutPlan(launch_of(replay))


def full_twin(notify, dispatch, sig: list, local_experts: int, channels: int, num_experts: int):
    """The twin of a non-cached dispatch's two kept launches (engine.py FullPlan)."""
    return load().FullTwin(launch_of(notify), launch_of(dispatch), list(sig), local_experts, channels, num_experts)


# ------------------------------------------------------------------------------------------------
# The internode engine's twins (backends/internode/twins.py twin_on)
# ------------------------------------------------------------------------------------------------

# where a per-call slot of an internode twin's launch takes its value (csrc/callpath_internode.cpp Source)
IN_X, IN_SECOND, IN_OUT0, IN_OUT1, IN_SCRATCH, IN_AREA = range(6)


def in_step(replay, fixed: list, per_call: list, grid=None) -> tuple:
    """One launch of an internode twin: ``replay``'s twin with ``fixed`` [(position, value)] set for good
    and ``per_call`` [(position, IN_* source, byte offset)] set by every call; ``grid``: its own."""
    return (launch_of(replay, load_internode()), list(fixed), list(per_call), grid)


def in_plan(fields: dict):
    """The internode twin of a kept cached dispatch or combine (csrc/callpath_internode.cpp InPlan)."""
    return load_internode().InPlan(fields)


def in_full(fields: dict, meta, digest, pack, land, recv_chan, barrier=None, forward=None):
    """The twin of a non-cached internode dispatch (csrc/callpath_internode.cpp InFull): its kept launches
    (the forwarder's barrier and forward where a node has several ranks) and ``fields``
    (backends/internode/twins.py full_twin: the scratch, the shapes, the hooks)."""
    mod = load_internode()
    named = (("meta", meta), ("digest", digest), ("pack", pack), ("land", land), ("recv_chan", recv_chan),
             ("barrier", barrier), ("forward", forward))
    return mod.InFull({**fields, **{k: launch_of(r, mod) for k, r in named if r is not None}})


def in_plan_set():
    """The container of an internode handle's twins (``handle.extra["cpp_internode"]``)."""
    return load_internode().InPlanSet()


def engine(*, buffer_type, comm_stream, entry_event, device_index: int, rank: int, num_ranks: int,
           timeout_ns: int, test: bool = False, comm_raw: int = 0, make_twin=None):
    """A Buffer's C++ engine: its comm stream, the kept entry event (recorded once here so that it
    exists), exit events made on demand. ``test``: no device (tests/test_callpath.py), a recorder
    takes the device operations and ``comm_stream`` is a stand-in. ``make_twin``: the internode
    backend's ``cpp_twin`` (then the engine is csrc/callpath_internode.cpp's)."""
    global why_unavailable
    mod = load() if make_twin is None else load_internode()
    if mod is None:
        return None
    try:
        return _engine(mod, buffer_type, comm_stream, entry_event, device_index, rank, num_ranks, timeout_ns, test,
                       comm_raw, make_twin)
    except Exception as e:  # noqa: BLE001 - as a failed build: the Python path (auto) or an error (cpp)
        why_unavailable = f"{type(e).__name__}: {e}"
        if env.callpath() == "cpp":
            raise RuntimeError(f"COMMLIB_CALLPATH=cpp, but the C++ call path could not start: {why_unavailable}") from e
        warnings.warn(f"commlib: the C++ call path could not start, the Python call path runs instead: "
                      f"{why_unavailable}", RuntimeWarning, stacklevel=2)
        return None


def _engine(mod, buffer_type, comm_stream, entry_event, device_index, rank, num_ranks, timeout_ns, test, comm_raw,
            make_twin):
    if test:
        def new_event():
            ev = object()
            return ev, id(ev)
        entry = entry_event
    else:
        entry_event.record(comm_stream)
        entry = entry_event.cuda_event

        def new_event():
            ev = torch.cuda.Event()
            ev.record(comm_stream)   # its cudaEvent_t exists from its first record
            return ev, ev.cuda_event
    return mod.Engine({"test": test, "device_index": device_index, "rank": rank, "num_ranks": num_ranks,
                       "timeout_ns": int(timeout_ns), "buffer_type": buffer_type, "new_event": new_event,
                       "comm_stream": comm_stream, "entry_event": int(entry), "comm_raw": comm_raw,
                       "make_twin": make_twin})
