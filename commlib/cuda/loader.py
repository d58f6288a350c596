"""Loads csrc/*.cu with CuPy's NVRTC (compiled at first use, cached on disk) and launches them on
PyTorch's current stream.

Nothing here imports CuPy at module import time: CPU code can import commlib (and this module)
without CuPy installed. Kernel arguments are plain Python ints / floats in the kernel's parameter
order (a tensor's device address with ``ptr(t)``); ``launch`` packs them by the C types it reads
from the kernel's signature in ``csrc/`` (see "Launching" below).

Every family file includes ``common.cuh``; the header's text is pasted into the source here
rather than found through ``-I``, because CuPy's on-disk cache key covers the source text and the
options but not included files: an edited header must change the key.
"""
from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import NamedTuple, Optional, Sequence

import numpy as np

from commlib.config import CONTROL_BYTES
from commlib.utils import env
from commlib.utils.errors import KernelLaunchError


def _find_csrc() -> Path:
    """The CUDA sources: ``commlib/_csrc`` in an installed wheel (package data mapped from the
    top-level ``csrc/``), else the checkout's (or editable install's) top-level ``csrc/``."""
    package = Path(__file__).resolve().parents[1]
    candidates = (package / "_csrc", package.parent / "csrc")
    for folder in candidates:
        if (folder / "common.cuh").is_file():
            return folder
    return candidates[0]  # neither: reading a source names the missing file at the installed path


CSRC = _find_csrc()

# Limits and the control-region layout, shared with csrc/common.cuh (passed with -D, one source).
MAX_RANKS = 8
MAX_CHANNELS = 128
CONTROL_LAYOUT = {
    "CL_OFF_DISPATCH_TAIL": 0,
    "CL_OFF_DISPATCH_DONE": 8 * MAX_RANKS * MAX_CHANNELS,
    "CL_OFF_COMBINE_TAIL": 2 * 8 * MAX_RANKS * MAX_CHANNELS,
    "CL_OFF_COMBINE_DONE": 3 * 8 * MAX_RANKS * MAX_CHANNELS,
    "CL_OFF_NOTIFY_FLAG": 4 * 8 * MAX_RANKS * MAX_CHANNELS,
    # per-call signature words u64 [src][channel] (csrc/common.cuh call_signature), then the notify slots
    "CL_OFF_DISPATCH_SIG": 4 * 8 * MAX_RANKS * MAX_CHANNELS + 4096,
    "CL_OFF_COMBINE_SIG": 5 * 8 * MAX_RANKS * MAX_CHANNELS + 4096,
    # ring heads u64 [dst][channel]: rows the receiver dst consumed (csrc/common.cuh Ring)
    "CL_OFF_DISPATCH_HEAD": 6 * 8 * MAX_RANKS * MAX_CHANNELS + 4096,
    "CL_OFF_COMBINE_HEAD": 7 * 8 * MAX_RANKS * MAX_CHANNELS + 4096,
    "CL_OFF_NOTIFY_DATA": 8 * 8 * MAX_RANKS * MAX_CHANNELS + 4096,
}
NOTIFY_WORD_EXPERT = 16 + MAX_CHANNELS       # CL_NW_EXPERT
HOST_COUNTS = {"total": 0, "bad_me": 1, "bad_rank": 2, "bad_value": 3, "sent": 4, "recv": 12,
               "sig_rank": 20, "sig": 21, "expert": 28}  # sig: [NOTIFY_SIG_WORDS] of rank sig_rank
HOST_COUNTS_EXPERT = HOST_COUNTS["expert"]   # HC_* in notify.cu
NOTIFY_REJECTED = 0x40000000                 # REJECTED in notify.cu
NOTIFY_SIG_WORDS = 7                         # CL_NW_SIG_WORDS: what ranks must agree on (notify.cu)
NUM_SEQ_COUNTERS = 3 * 2 * MAX_CHANNELS      # [kind][role][channel]
TRACE_OFFSET_WORDS = 256                     # CL_TRACE_OFFSET_WORDS: int32 %smid words before the trace
TRACE_POINTS = 3                             # CL_TRACE_POINTS: u64 %globaltimer points per CTA
LAYOUT_THREADS = 256
NOTIFY_THREADS = 512
# Compile-time knobs of the kernels (each set is its own cached build), passed as -DCL_<KEY>. The
# defaults are what python -m benchmarks.bench_intranode --variants measured best (docs/nvlink_engine.md);
# set_variant() swaps them for A/B runs. Variants that lost their measurement left the kernels
# (docs/notes/2026-12_kernel_variants.md).
DEFAULT_VARIANT = {
    "DISPATCH_THREADS": 1024,     # 31 copy warps + 1 publisher warp
    "COMBINE_THREADS": 1024,
    "DISPATCH_MIN_BLOCKS": 1,     # __launch_bounds__ min CTAs per SM (2 with 512 threads: half an SM per comm CTA)
    "COMBINE_MIN_BLOCKS": 1,
    "DISPATCH_UNROLL": 4,         # 16-byte vectors in flight per lane
    "COMBINE_COPY_UNROLL": 4,
    "COMBINE_SUM_UNROLL": 2,      # per rank; two ranks' loads in flight together
    "LOCAL_IN_RECEIVER": 1,       # the receiver CTA copies the local half, the sender only pushes
    "DISPATCH_STREAM_SEND": 0,    # N > 0: dispatch sender warps stream tokens without round barriers; each releases
                                  # its progress word after every N of its tokens
    "DISPATCH_STREAM_MAX_SMS": 20,  # N > 0 (with DISPATCH_STREAM_SEND 0): dispatch calls of at most N SMs launch the
                                  # streaming sender's build (DISPATCH_STREAM_SEND 1), the others this one; 0: never
    "COMM_CLUSTER": 2,            # dispatch / combine launch as 2-CTA clusters: SM pairs of one GPC, so torch's
                                  # 2x1-cluster persistent GEMMs beside them keep their SMs (common.cuh; 1: plain)
    "SHARE_WORK": 1,              # a channel's sender, once done, takes the receiver's rows from a counter in the
                                  # cluster's shared memory (needs COMM_CLUSTER 2; common.cuh); 0: each CTA its own
    "COMM_TRACE": 0,              # 1: dispatch / combine record %globaltimer points per CTA (COMMLIB_DEBUG_SMID=1)
    "LL_TRACE": 0,                # 1: low-latency kernels record %globaltimer points (csrc/low_latency.cu)
    "LL_PARTS": 1,                # low-latency dispatch: CTAs sharing a token row
    "LL_FENCE": 1,                # low-latency dispatch: 1 fence.acq_rel.sys before its arrivals, 0 fence.sc.sys
}
MACRO_PREFIX = "CL_"  # kernel macros; environment variables keep COMMLIB_

# Every kernel family: csrc/<family>.cu -> {the name launch() and record_launches use: the kernel's
# C++ name}. One list for the library's builds (compile_all, launch) and the compile test
# (default_builds); it covers every csrc/*.cu and every __global__ in it. The kernels are namespaced
# C++ as DeepEP's are, so profilers show e.g. commlib::low_latency::dispatch (DeepEP's tests select
# kernels by "::dispatch" / "::combine" in that name); NVRTC lowers the names (name_expressions).
FAMILIES = {
    "layout": {"layout_kernel": "commlib::layout::count_tokens"},
    "notify": {"notify_kernel": "commlib::intranode::notify", "ring_drain_kernel": "commlib::intranode::ring_drain"},
    "dispatch": {"dispatch_kernel": "commlib::intranode::dispatch"},
    "combine": {"combine_kernel": "commlib::intranode::combine"},
    "low_latency": {"ll_dispatch_kernel": "commlib::low_latency::dispatch",
                    "ll_combine_kernel": "commlib::low_latency::combine"},
    "moe_rows": {"slot_sum_bf16": "commlib::moe::slot_sum_bf16"},  # commlib.training.moe's expert stage
    "ce": {"ce_sync_kernel": "commlib::copy_engine::sync", "ce_pack_kernel": "commlib::copy_engine::pack",
           "ce_reduce_kernel": "commlib::copy_engine::reduce"},  # the copy-engine data path
    "fanout": {"fanout_barrier_kernel": "commlib::fanout::notify", "fanout_forward_kernel": "commlib::fanout::dispatch",
               "fanout_reduce_kernel": "commlib::fanout::combine"},  # internode fan-out (IPC)
    "internode": {"inter_meta_kernel": "commlib::internode::meta", "inter_digest_kernel": "commlib::internode::digest",
                  "inter_pack_kernel": "commlib::internode::pack", "inter_land_kernel": "commlib::internode::land",
                  "inter_recv_chan_kernel": "commlib::internode::recv_chan",
                  "inter_rows_kernel": "commlib::internode::rows",
                  "inter_home_kernel": "commlib::internode::home"},  # the internode engine's per-token steps
}


def kernel_name(family: str, name: str) -> str:
    """The C++ name (``commlib::<namespace>::<kernel>``) of launch name ``name`` in csrc/<family>.cu."""
    try:
        return FAMILIES[family][name]
    except KeyError:
        raise ValueError(f"unknown kernel {family}/{name!r}; known: "
                         f"{sorted(f'{f}/{n}' for f, names in FAMILIES.items() for n in names)}") from None


_lock = threading.Lock()
_modules: dict = {}
_streams: dict = {}
_recording: Optional[list] = None
_sleep_cycles = 0
_variant: dict = dict(DEFAULT_VARIANT)


def cupy_available() -> bool:
    """Whether CuPy imports here (without it: no GPU kernels, the torch paths)."""
    try:
        import cupy  # noqa: F401
        return True
    except Exception:  # noqa: BLE001 - any import failure means no GPU kernels
        return False


def cupy():
    """The cupy module, imported on first use (raises ImportError with a hint when missing)."""
    try:
        import cupy as cp
    except ImportError as e:  # pragma: no cover - depends on the machine
        raise ImportError("commlib's GPU kernels need CuPy (pip install cupy-cuda13x or cupy-cuda12x)") from e
    return cp


def set_plain(plain: Optional[bool]) -> None:
    """Force plain loads/stores (True), the PTX-hinted ones (False), or follow COMMLIB_PLAIN_LDST (None,
    read again now).

    For A/B benchmarks; takes effect at the next launch (both builds stay cached).
    """
    global _plain_mode
    _plain_mode = env.plain_ldst() if plain is None else bool(plain)


# COMMLIB_PLAIN_LDST is read once (at import, or by set_plain(None)): every launch and replay asks,
# and an environment lookup costs microseconds of host time per call
_plain_mode: bool = env.plain_ldst()


def plain_mode() -> bool:
    return _plain_mode


def variant_value(key: str) -> int:
    """The current build variant's value of ``key`` (a DEFAULT_VARIANT key)."""
    return _variant[key]


# Half-SM CTAs: 512 threads, two CTAs per SM (at most 64 registers a thread). A world whose ranks share
# a GPU launches them when its ranks' CTAs would not all be resident one per SM (fit_shared_gpu).
HALF_SM_VARIANT = {"DISPATCH_THREADS": 512, "COMBINE_THREADS": 512, "DISPATCH_MIN_BLOCKS": 2, "COMBINE_MIN_BLOCKS": 2}
_variant_chosen = False  # set_variant was called with overrides: fit_shared_gpu leaves the build alone


def ctas_per_sm() -> int:
    """Dispatch / combine CTAs one SM holds under the current variant (their __launch_bounds__)."""
    return min(_variant["DISPATCH_MIN_BLOCKS"], _variant["COMBINE_MIN_BLOCKS"])


def fit_shared_gpu(share: int, num_sms: int, sm_count: int) -> bool:
    """Ranks sharing a GPU under CUDA MPS run their dispatch / combine kernels side by side, and each
    kernel's CTAs spin on its peers' CTAs: they must all be resident at once. When ``share`` ranks of
    ``num_sms`` CTAs each exceed ``sm_count`` one CTA per SM, switch this process to HALF_SM_VARIANT
    (twice the CTAs fit), unless set_variant chose a build. Every rank of the world computes the same
    ``share`` and so makes the same choice. Returns whether the build is now the half-SM one."""
    if _variant_chosen:
        return False
    if share > 1 and share * num_sms > sm_count * ctas_per_sm():
        _apply_variant(HALF_SM_VARIANT)
    return ctas_per_sm() > 1


def set_variant(overrides: Optional[dict] = None) -> dict:
    """Use DEFAULT_VARIANT updated with ``overrides`` for later launches (None: the defaults).

    For A/B benchmarks; every rank must use the same variant (it changes the block size).
    """
    global _variant_chosen
    out = _apply_variant(overrides)
    _variant_chosen = bool(overrides)
    return out


def _apply_variant(overrides: Optional[dict]) -> dict:
    global _variant
    unknown = set(overrides or {}) - set(DEFAULT_VARIANT)
    if unknown:
        raise ValueError(f"unknown kernel variant keys {sorted(unknown)}; known: {sorted(DEFAULT_VARIANT)}")
    global _variant_key, _streaming_key
    merged = dict(DEFAULT_VARIANT)
    merged.update({k: int(v) for k, v in (overrides or {}).items()})
    if merged["COMM_CLUSTER"] not in (1, 2):  # the grid (Config.num_sms) is only known to be even
        raise ValueError(f"COMM_CLUSTER must be 1 or 2, got {merged['COMM_CLUSTER']}")
    for key in ("SHARE_WORK", "COMM_TRACE", "LL_TRACE", "LOCAL_IN_RECEIVER"):
        if merged[key] not in (0, 1):
            raise ValueError(f"{key} must be 0 or 1, got {merged[key]}")
    if merged["COMM_CLUSTER"] != 2 and "SHARE_WORK" not in (overrides or {}):
        merged["SHARE_WORK"] = 0  # the default follows plain CTAs; asking for both is an error below
    if merged["SHARE_WORK"] and merged["COMM_CLUSTER"] != 2:
        raise ValueError("SHARE_WORK=1 needs COMM_CLUSTER=2 (the sender reaches the receiver's counter "
                         "through the cluster's shared memory)")
    for key, zero in (("DISPATCH_STREAM_MAX_SMS", "never"), ("DISPATCH_STREAM_SEND", "round barriers")):
        if merged[key] < 0:
            raise ValueError(f"{key} must be >= 0 (0: {zero}), got {merged[key]}")
    _variant = merged
    _variant_key = tuple(sorted(_variant.items()))
    _streaming_key = _streaming_variant_key(_variant)
    return dict(_variant)


def parse_variant(text: str) -> dict:
    """"KEY=V,KEY=V" (DEFAULT_VARIANT keys, int values) -> dict, for benchmark flags; "" -> {}."""
    out = {}
    for item in (kv.strip() for kv in (text or "").split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"kernel variant item {item!r} is not KEY=VALUE")
        try:
            out[key.strip()] = int(value)
        except ValueError:
            raise ValueError(f"kernel variant {key.strip()}={value!r}: the value must be an int") from None
    return out


def variant() -> dict:
    return dict(_variant)


def threads(family: str) -> int:
    """Threads per CTA of a data kernel family under the current variant."""
    return {"dispatch": _variant["DISPATCH_THREADS"], "combine": _variant["COMBINE_THREADS"],
            "layout": LAYOUT_THREADS, "notify": NOTIFY_THREADS}[family]


def source(family: str) -> str:
    """The full NVRTC source of one kernel family (common.cuh pasted in)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}; expected one of {sorted(FAMILIES)}")
    common = (CSRC / "common.cuh").read_text()
    text = (CSRC / f"{family}.cu").read_text()
    include = '#include "common.cuh"'
    if include not in text:
        raise RuntimeError(f"csrc/{family}.cu must include common.cuh")
    return text.replace(include, common, 1)


def options(plain: bool, knobs: Optional[dict] = None) -> tuple:
    defines = dict(CONTROL_LAYOUT)
    defines.update({
        "CL_PLAIN": int(plain),
        "CL_MAX_RANKS": MAX_RANKS,
        "CL_MAX_CHANNELS": MAX_CHANNELS,
        "CL_TRACE_OFFSET_WORDS": TRACE_OFFSET_WORDS,
        "CL_TRACE_POINTS": TRACE_POINTS,
    })
    defines.update({MACRO_PREFIX + k: v for k, v in (knobs if knobs is not None else _variant).items()})
    return ("-std=c++17", "--gpu-architecture=sm_90") + tuple(f"-D{k}={v}" for k, v in defines.items())


class KernelBuild(NamedTuple):
    """One NVRTC build the library makes: ``cupy.RawModule(code=source, options=options)``."""

    family: str          # csrc/<family>.cu
    names: tuple         # its kernels' launch names (FAMILIES[family] keys)
    plain: bool          # plain loads / stores (COMMLIB_PLAIN_LDST) or the PTX-hinted ones
    variant: str         # "default", or "streaming" (the dispatch build DISPATCH_STREAM_MAX_SMS picks)
    options: tuple       # -std, --gpu-architecture and every -D define
    source: str          # the family's text with common.cuh pasted in


def default_builds() -> list:
    """Every build the library compiles under DEFAULT_VARIANT: each family in both load / store
    modes, and the streaming sender's dispatch build where DISPATCH_STREAM_MAX_SMS picks it."""
    streaming = _streaming_variant_key(DEFAULT_VARIANT)
    builds = []
    for plain in (False, True):
        for family, names in FAMILIES.items():
            text = source(family)
            builds.append(KernelBuild(family, tuple(names), plain, "default", options(plain, DEFAULT_VARIANT), text))
            if family == "dispatch" and streaming is not None:
                builds.append(KernelBuild(family, tuple(names), plain, "streaming", options(plain, dict(streaming)),
                                          text))
    return builds


_functions: dict = {}  # (family, name, plain, variant, device) -> CuPy function: the launch hot path


def _streaming_variant_key(knobs: dict) -> Optional[tuple]:
    """The streaming sender's twin of ``knobs`` that DISPATCH_STREAM_MAX_SMS picks for small dispatch
    calls, or None where it never applies (limit 0, or already streaming)."""
    if knobs["DISPATCH_STREAM_MAX_SMS"] <= 0 or knobs["DISPATCH_STREAM_SEND"]:
        return None
    return tuple(sorted(dict(knobs, DISPATCH_STREAM_SEND=1).items()))


_variant_key: tuple = tuple(sorted(_variant.items()))
_streaming_key: Optional[tuple] = _streaming_variant_key(_variant)  # both set by set_variant


def dispatch_variant_key(num_sms: int, streaming_ok: bool = True) -> tuple:
    """The build a dispatch of ``num_sms`` SMs launches: the current variant, or, when
    DISPATCH_STREAM_MAX_SMS >= num_sms (and the variant's sender has round barriers),
    the same with DISPATCH_STREAM_SEND=1. Both builds speak the same protocol to the
    receivers (tails, done flags, sequence counters), so calls of either may follow each other;
    every rank of a call has the same num_sms, hence the same build. ``streaming_ok`` False (rings that
    wrap and are too small for the streaming sender, engine.py): the round-barrier build. Called per
    dispatch: both keys are computed once, by set_variant."""
    if _streaming_key is None or num_sms > _variant["DISPATCH_STREAM_MAX_SMS"] or not streaming_ok:
        if not streaming_ok and _variant["DISPATCH_STREAM_SEND"]:
            raise ValueError("kernel variant DISPATCH_STREAM_SEND > 0 cannot stream this call through its rings "
                             "(a ring smaller than a round and two 32-token blocks); use a larger "
                             "num_max_nvl_chunked_recv_tokens or DISPATCH_STREAM_SEND=0")
        return _variant_key
    return _streaming_key


def _function(family: str, name: str, plain: bool, device: Optional[int] = None, vkey: Optional[tuple] = None):
    cp = cupy()
    if device is None:
        device = cp.cuda.runtime.getDevice()
    vkey = _variant_key if vkey is None else vkey
    fkey = (family, name, plain, vkey, device)
    fn = _functions.get(fkey)
    if fn is not None:
        return fn
    key = (family, plain, vkey, device)
    with _lock:
        module = _modules.get(key)
        if module is None:
            module = cp.RawModule(code=source(family), options=options(plain, dict(vkey)),
                                  name_expressions=tuple(FAMILIES[family].values()))
            _modules[key] = module
        fn = _functions[fkey] = module.get_function(kernel_name(family, name))
        return fn


def compile_all(plain: Optional[bool] = None) -> dict:
    """Compile (or load from cache) every family for the current device, and the streaming
    sender's dispatch build when DISPATCH_STREAM_MAX_SMS picks it for some calls; returns
    {name: function} for the current variant."""
    modes = [plain_mode()] if plain is None else [plain]
    out = {}
    for mode in modes:
        for family, names in FAMILIES.items():
            for name in names:
                out[(name, mode)] = _function(family, name, mode)
                if family == "dispatch" and _streaming_key is not None:
                    _function(family, name, mode, None, _streaming_key)
    return out


# ---------------------------------------------------------------------------------------------
# Launching. The hot path packs the arguments with one struct.pack_into into a buffer whose
# per-argument addresses were computed once from the kernel's C signature, and calls the driver's
# cuLaunchKernel through ctypes on torch's raw current stream: a few microseconds per launch,
# where CuPy's generic argument conversion and stream context cost tens (python -m benchmarks.profile_host).
# ---------------------------------------------------------------------------------------------

# C parameter type -> struct code. Pointers are 'Q' (a device address as a Python int).
_C_TYPES = {"int": "i", "i32": "i", "unsigned": "I", "u32": "I", "unsigned int": "I",
            "u64": "Q", "i64": "q", "long long": "q", "unsigned long long": "Q", "size_t": "Q",
            "float": "f", "double": "d"}


def kernel_params(family: str, name: str) -> list:
    """(name, struct code) of each parameter of kernel ``name`` (a launch name) in csrc/<family>.cu: its
    ``__global__ void ... kernel(...)`` inside ``namespace commlib::<namespace> {``."""
    key = (family, name)
    hit = _params.get(key)
    if hit is not None:
        return list(hit)
    import re

    text = (CSRC / f"{family}.cu").read_text()
    namespace, _, short = kernel_name(family, name).rpartition("::")
    m = re.search(r"__global__\s+void\s+(?:CL_[A-Z_]+\s+)?(?:__launch_bounds__\s*\([^)]*\)\s*)?"
                  + re.escape(short) + r"\s*\(", text)
    opened = re.findall(r"^namespace\s+([\w:]+)\s*\{", text[:m.start()], flags=re.M) if m else []
    if m is None or not opened or opened[-1] != namespace:
        raise RuntimeError(f"csrc/{family}.cu has no __global__ kernel {short!r} inside namespace {namespace} "
                           f"(launch name {name!r})")
    depth, i = 1, m.end()
    while depth:
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        i += 1
    params = re.sub(r"//[^\n]*|/\*.*?\*/", " ", text[m.end():i - 1], flags=re.S)
    out = []
    for p in (q.strip() for q in params.split(",")):
        if not p:
            continue
        pname = re.findall(r"\w+", p)[-1]
        if "*" in p:
            out.append((pname, "Q"))
            continue
        words = [w for w in p.replace("const", " ").replace("__restrict__", " ").split()][:-1]
        ctype = " ".join(words)
        if ctype not in _C_TYPES:
            raise RuntimeError(f"csrc/{family}.cu {short}: parameter {p!r} has a type the loader cannot pass")
        out.append((pname, _C_TYPES[ctype]))
    _params[key] = tuple(out)
    return out


_params: dict = {}  # (family, launch name) -> its kernel's ((parameter name, struct code), ...)


def kernel_signature(family: str, name: str) -> str:
    """struct codes of the parameters of kernel ``name`` (a launch name) in csrc/<family>.cu."""
    return "".join(code for _, code in kernel_params(family, name))


def param_index(family: str, name: str, param: str) -> int:
    """Position of parameter ``param`` in kernel ``name``'s argument list (csrc/<family>.cu)."""
    for i, (pname, _) in enumerate(kernel_params(family, name)):
        if pname == param:
            return i
    raise ValueError(f"kernel {family}/{name} has no parameter {param!r}")


def param_offsets(codes: str) -> list:
    """Byte offset of each argument inside ``struct.pack("@" + codes, ...)`` (native alignment)."""
    import struct

    return [struct.calcsize("@" + codes[:k + 1]) - struct.calcsize("@" + codes[k]) for k in range(len(codes))]


def cu_function_handle(fn) -> int:
    """The CUfunction behind a CuPy function object, 0 if it has none we can see.

    Older CuPy returns a ``Function`` (``.ptr``) from ``RawModule.get_function``; CuPy 14 returns a
    ``RawKernel``, whose ``Function`` is its ``.kernel``. Without a handle every launch falls back to
    CuPy's own (slower) launch path.
    """
    for obj in (fn, getattr(fn, "kernel", None)):
        ptr = getattr(obj, "ptr", 0)
        if ptr:
            return int(ptr)
    return 0


class _Launcher:
    """One kernel on one device: its CUfunction, argument layout and a reusable argument buffer."""

    __slots__ = ("fn", "handle", "fmt", "count", "buf", "params", "np_types", "codes", "names", "offsets")

    def __init__(self, family: str, name: str, plain: bool, device: int, vkey: Optional[tuple] = None) -> None:
        import ctypes
        import struct

        self.fn = _function(family, name, plain, device, vkey)
        self.handle = cu_function_handle(self.fn)
        self.names = tuple(p for p, _ in kernel_params(family, name))
        self.codes = codes = kernel_signature(family, name)
        self.fmt = struct.Struct("@" + codes)
        self.count = len(codes)
        self.offsets = tuple(param_offsets(codes))
        self.buf = ctypes.create_string_buffer(max(self.fmt.size, 8))
        base = ctypes.addressof(self.buf)
        self.params = (ctypes.c_void_p * max(1, len(codes)))(*[base + o for o in self.offsets])
        self.np_types = [{"i": np.int32, "I": np.uint32, "q": np.int64, "Q": np.uint64, "f": np.float32,
                          "d": np.float64}[c] for c in codes]


_launchers: dict = {}
_driver = None  # (cuLaunchKernel, cuGetErrorName) from libcuda through ctypes, False when unavailable


def _driver_api():
    global _driver
    if _driver is None:
        try:
            import ctypes

            lib = ctypes.PyDLL("libcuda.so.1")  # PyDLL: the GIL stays held, the argument buffer is ours
            launch_fn = lib.cuLaunchKernel
            launch_fn.restype = ctypes.c_int
            launch_fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
            name_fn = lib.cuGetErrorName
            name_fn.restype = ctypes.c_int
            name_fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
            _driver = (launch_fn, name_fn)
        except (OSError, AttributeError):
            _driver = False
    return _driver


def _launcher(family: str, name: str, device: int, vkey: Optional[tuple] = None) -> _Launcher:
    key = (family, name, plain_mode(), _variant_key if vkey is None else vkey, device)
    lau = _launchers.get(key)
    if lau is None:
        lau = _launchers[key] = _Launcher(family, name, key[2], device, key[3])
    return lau


def _raw_stream(device: int) -> int:
    import torch

    return torch._C._cuda_getCurrentRawStream(device)


def _device() -> int:
    import torch

    return torch._C._cuda_getDevice()


def _issue(lau: _Launcher, grid: int, block: int, args: Sequence, shared_mem: int, device: int) -> None:
    if len(args) != lau.count:
        raise TypeError(f"kernel takes {lau.count} arguments, got {len(args)}")
    stream = _raw_stream(device)
    drv = _driver_api() if _fast_launch else False
    if drv and lau.handle:
        lau.fmt.pack_into(lau.buf, 0, *args)
        rc = drv[0](lau.handle, grid, 1, 1, block, 1, 1, shared_mem, stream, lau.params, None)
        if rc:
            _launch_failed(rc)
        return
    # CuPy's own launch (no libcuda through ctypes, or COMMLIB_FAST_LAUNCH=0): typed numpy scalars
    typed = tuple(t(v) for t, v in zip(lau.np_types, args))
    lau.fn((int(grid),), (int(block),), typed, shared_mem=int(shared_mem), stream=_cupy_stream(stream, device))


def _cupy_stream(raw: int, device: int):
    stream = _streams.get((raw, device))
    if stream is None:
        stream = _streams[(raw, device)] = cupy().cuda.ExternalStream(raw, device)
    return stream


_fast_launch = env.fast_launch()


def set_fast_launch(enabled: Optional[bool]) -> None:
    """Launch through the driver (True) or CuPy (False); None follows COMMLIB_FAST_LAUNCH. For tests/A-B."""
    global _fast_launch
    _fast_launch = env.fast_launch() if enabled is None else bool(enabled)


def launch(family: str, name: str, grid: int, block: int, args: Sequence, shared_mem: int = 0,
           variant_key: Optional[tuple] = None) -> None:
    """Launch ``name`` from ``csrc/<family>.cu`` on torch's current stream of the current device.

    ``args`` are Python ints / floats in the kernel's parameter order (device pointers as ints: ``ptr(t)``).
    ``variant_key``: the build to launch (``dispatch_variant_key``); None: the current variant's.
    """
    device = _device()
    lau = _launcher(family, name, device, variant_key)
    if _recording is None:
        _issue(lau, grid, block, args, shared_mem, device)
        return
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if _sleep_cycles:  # keep the device busy while the host issues the launch
        torch.cuda._sleep(_sleep_cycles)
    start.record()
    _issue(lau, grid, block, args, shared_mem, device)
    end.record()
    _recording.append((name, start, end))


class Replay:
    """One kernel launch that a repeated call makes again and again: the build, grid and argument
    list are fixed once, and a call sets only the slots that change (its tensors' addresses) before
    ``issue`` packs them and launches on a stream it names (no current-stream switch). Made only
    where the driver's launch path is there (``replay`` returns None otherwise)."""

    __slots__ = ("lau", "grid", "block", "args", "shared_mem", "variant", "plain")

    def __init__(self, lau: _Launcher, grid: int, block: int, args: list, shared_mem: int = 0) -> None:
        self.lau, self.grid, self.block, self.args = lau, int(grid), int(block), list(args)
        self.shared_mem = int(shared_mem)
        self.variant, self.plain = _variant_key, plain_mode()

    def current(self) -> bool:
        """Still what ``launch`` would run: same kernel variant and load / store mode, fast launch on,
        and no ``record_launches`` block around the call (that wants events around each launch)."""
        return self.variant is _variant_key and _recording is None and _fast_launch and self.plain == plain_mode()

    def issue(self, stream: int) -> None:
        lau = self.lau
        lau.fmt.pack_into(lau.buf, 0, *self.args)
        rc = _driver[0](lau.handle, self.grid, 1, 1, self.block, 1, 1, self.shared_mem, stream, lau.params, None)
        if rc:
            _launch_failed(rc)


def replay(family: str, name: str, grid: int, block: int, args: Sequence,
           variant_key: Optional[tuple] = None, shared_mem: int = 0) -> Optional[Replay]:
    """A Replay of ``launch(family, name, grid, block, args, shared_mem, variant_key)`` on the current
    device, or None where launches take CuPy's path."""
    if not (_fast_launch and _driver_api()):
        return None
    lau = _launcher(family, name, _device(), variant_key)
    if not lau.handle or len(args) != lau.count:
        return None
    lau.fmt.pack(*args)  # every value fits its C type now, so a replay fails only where an address does
    return Replay(lau, grid, block, list(args), shared_mem)


def _launch_failed(rc: int) -> None:
    import ctypes

    err = ctypes.c_char_p()
    _driver[1](rc, ctypes.byref(err))
    raise KernelLaunchError(f"cuLaunchKernel failed: {(err.value or b'?').decode()} ({rc})", rc)


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

def ptr(t) -> int:
    """Device address of a tensor (0 for None or an empty tensor)."""
    return 0 if t is None else t.data_ptr()


# An int argument (range-checked against the kernel's C type when packed): the builtin itself, so an
# argument costs no Python frame on the launch path.
i32 = int
u64 = int


def notify_slot_words(num_ranks: int) -> int:
    """int32 words of one notify slot: a fixed stride, so even a rank that rejected its input (and
    may not know num_experts) writes its slot where the peers read it."""

    free = CONTROL_BYTES - CONTROL_LAYOUT["CL_OFF_NOTIFY_DATA"]
    return free // (2 * num_ranks * 4) // 4 * 4
