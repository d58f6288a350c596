"""Auto-tuning of Config (num_sms and chunk sizes), cached on disk per machine and shape.

What is tuned: for one call shape (ranks, ranks per node, hidden, dtype, token bucket), separately
for dispatch and combine, the fields of ``commlib.config.Config``: num_sms (even) and the NVLink /
network chunk sizes and capacities. Every candidate respects Config's validation and the call's
needs (``max_tokens_per_call() >= tokens``; the buffer-size hint fits the Buffer when known).

How: ``search(space, time_fn)`` where ``time_fn(config) -> [sample times]`` (one batch of
repetitions). The "smart" strategy goes coarse-to-fine: every other value of num_sms x send
chunk, then a hill-climb over both at once (diagonal steps follow the valley where a bigger SM
count wants a smaller chunk), then the network chunk and the capacities, one batch per point;
it ends with successive halving on repetitions among the best 8. "exhaustive" times every
candidate with the full repetitions. The default config is kept unless the winner beats it by
more than the noise: the larger spread (max - min) of the two configs' batch medians, from fresh
batches of both timed in turn.

Cache: one JSON file (``COMMLIB_TUNING_CACHE``, else ``~/.cache/commlib/tuning.json``), keyed by
GPU model, NVLink topology, world shape, hidden, dtype and power-of-two token bucket. Writers take a
file lock, re-read, merge and atomically replace the file; a corrupt or foreign file is reported
with a warning, ignored (configs are re-tuned) and moved aside on the next write.

Usage:
    cfg = tune.cached_config("dispatch", num_ranks, ranks_per_node, hidden, torch.bfloat16, T, device)
    result = tune.autotune(buffer, "dispatch", x.shape, x.dtype)      # collective over buffer.group
    python -m commlib.tune --hidden 7168 --tokens 4096                 # one rank per GPU
    python -m commlib.tune --cpu --world 2 --hidden 256 --tokens 64    # gloo smoke test
    python benchmarks/bench_tune.py --simulate                         # smart vs exhaustive, cost model

Legend: T tokens on this rank, H hidden, R ranks, P ranks per node, C channels (= num_sms / 2).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import hashlib
import itertools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any, Callable, Iterable, Optional, Sequence

import torch

from . import env
from .config import Config, default_combine_config, default_dispatch_config

SCHEMA = "commlib.tuning"
VERSION = 1
KINDS = ("dispatch", "combine")
FIELDS = tuple(f.name for f in dataclasses.fields(Config))  # DeepEP's positional order

# Default candidates. Capacities are filtered per shape (they must hold the token bucket).
DEFAULT_SMS = tuple(range(8, 49, 4))
DEFAULT_NVL_SEND = (4, 6, 8, 12, 16, 20, 24, 32, 40, 48, 64)
DEFAULT_NVL_RECV = (256, 512, 1024, 2048, 4096)
DEFAULT_RDMA_SEND = (8, 16, 32, 64, 128)
DEFAULT_RDMA_RECV = (256, 512, 1024, 2048, 4096)

TimeFn = Callable[[Config], Sequence[float]]


def _tup(config: Config) -> tuple:
    """Config -> its fields in order (dataclasses.astuple deep-copies: too slow for 10^4 candidates)."""
    return tuple(getattr(config, name) for name in FIELDS)


class TuningCacheWarning(UserWarning):
    """The tuning cache could not be read or written; commlib carries on with defaults / re-tuning."""


# ---------------------------------------------------------------------------------------- keys
_DTYPE_ALIASES = {
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float8_e4m3fn": "float8_e4m3fn", "fp8": "float8_e4m3fn", "e4m3": "float8_e4m3fn",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "float32": "float32", "fp32": "float32", "float": "float32",
}
_DTYPE_BYTES = {"bfloat16": 2, "float8_e4m3fn": 1, "float16": 2, "float32": 4}


def dtype_name(dtype: Any) -> str:
    """torch.bfloat16 / "bf16" / "bfloat16" -> "bfloat16" (the spelling stored in cache keys)."""
    raw = str(dtype).lower().removeprefix("torch.")
    if raw not in _DTYPE_ALIASES:
        raise ValueError(f"unsupported dtype {dtype!r}: expected one of {sorted(_DTYPE_ALIASES)}")
    return _DTYPE_ALIASES[raw]


def dtype_bytes(dtype: Any) -> int:
    return _DTYPE_BYTES[dtype_name(dtype)]


def token_bucket(num_tokens: int) -> int:
    """Smallest power of two >= num_tokens (1 for 0): the token count a cached config serves."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return 1 << max(0, int(num_tokens) - 1).bit_length()


def parse_topology(text: str) -> Optional[str]:
    """``nvidia-smi topo -m`` output -> "<n>gpu:<link kinds>:<hash of the GPU-GPU matrix>", or None."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)  # colour codes
    # GPU rows name themselves first and hold "X" on the diagonal (the header row holds no "X").
    rows = [line.split() for line in text.splitlines() if re.match(r"\s*GPU\d+\s", line + " ")]
    rows = [r for r in rows if "X" in r]
    n = len(rows)
    if n == 0 or any(len(r) < n + 1 for r in rows):
        return None
    matrix = [r[1:n + 1] for r in rows]
    kinds = sorted({link for row in matrix for link in row if link != "X"}) or ["none"]
    return f"{n}gpu:{'/'.join(kinds)}:{hashlib.sha1(json.dumps(matrix).encode()).hexdigest()[:8]}"


@functools.lru_cache(maxsize=None)
def _nvlink_topology() -> str:
    """This machine's NVLink topology (``nvidia-smi topo -m``, once per process); "<n>gpu" without it."""
    try:
        out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    return parse_topology(out) or f"{torch.cuda.device_count()}gpu"


@functools.lru_cache(maxsize=None)
def _gpu_name(index: int) -> str:
    return " ".join(torch.cuda.get_device_name(index).split())


def machine(device: Any = None) -> tuple[str, str]:
    """(GPU model, NVLink topology) of ``device``; ("cpu", "cpu") off the GPU."""
    if device is None or torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return "cpu", "cpu"
    dev = torch.device(device)
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return _gpu_name(index), _nvlink_topology()


@dataclasses.dataclass(frozen=True)
class TuneKey:
    """What a cached config is valid for (besides the kind, dispatch or combine)."""
    gpu: str
    topology: str
    num_ranks: int
    ranks_per_node: int
    hidden: int
    dtype: str
    token_bucket: int

    @property
    def id(self) -> str:
        return (f"gpu={self.gpu};topo={self.topology};ranks={self.num_ranks};rpn={self.ranks_per_node};"
                f"hidden={self.hidden};dtype={self.dtype};tokens={self.token_bucket}")


def make_key(num_ranks: int, ranks_per_node: int, hidden: int, dtype: Any, num_tokens: int,
             device: Any = None, *, gpu: Optional[str] = None, topology: Optional[str] = None) -> TuneKey:
    """The cache key of a call shape on this machine (``gpu`` / ``topology`` override detection)."""
    if gpu is None or topology is None:
        detected = machine(device)
        gpu = detected[0] if gpu is None else gpu
        topology = detected[1] if topology is None else topology
    return TuneKey(gpu, topology, int(num_ranks), int(ranks_per_node), int(hidden), dtype_name(dtype),
                   token_bucket(num_tokens))


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind must be 'dispatch' or 'combine', got {kind!r}")


# --------------------------------------------------------------------------------------- cache
def cache_path(path: Optional[str] = None) -> str:
    """``path``, else COMMLIB_TUNING_CACHE, else <user cache folder>/commlib/tuning.json."""
    if path:
        return os.path.abspath(os.path.expanduser(path))
    configured = env.tuning_cache()
    if configured:
        return os.path.abspath(os.path.expanduser(configured))
    base = os.environ.get("XDG_CACHE_HOME") or (os.environ.get("LOCALAPPDATA") if os.name == "nt" else None)
    base = base or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "commlib", "tuning.json")


def _parse(path: str) -> tuple[dict, Optional[str]]:
    """(entries, problem): entries of a valid cache file, or ({}, why it is unusable)."""
    try:
        with open(path, "r", encoding="utf-8") as f:
            doc = json.load(f)
    except FileNotFoundError:
        return {}, None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return {}, f"unreadable or corrupt ({type(e).__name__}: {e})"
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        return {}, f"not a commlib tuning cache (no schema {SCHEMA!r})"
    if doc.get("version") != VERSION:
        return {}, f"cache version {doc.get('version')!r}, this commlib reads version {VERSION}"
    entries = doc.get("entries")
    if not isinstance(entries, dict):
        return {}, "malformed: 'entries' is not an object"
    return entries, None


# Parsed file per path, checked against (mtime, size, inode) so the per-call lookup the Buffer
# makes costs one stat, and a bad file warns once, not on every dispatch.
_MEMO: dict[str, tuple[tuple, dict]] = {}


def _load(path: str) -> Optional[dict]:
    """Entries of the cache file at ``path``; None when there is no file."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    sig = (st.st_mtime_ns, st.st_size, st.st_ino)
    memo = _MEMO.get(path)
    if memo is not None and memo[0] == sig:
        return memo[1]
    entries, problem = _parse(path)
    if problem:
        warnings.warn(f"[tuning] cache {path} is {problem}; ignoring it, configs will be re-tuned",
                      TuningCacheWarning, stacklevel=3)
    _MEMO[path] = (sig, entries)
    return entries


@contextlib.contextmanager
def _locked(path: str, timeout_s: float):
    """Exclusive flock on ``path + '.lock'`` (the lock file stays: unlinking it would race)."""
    try:
        import fcntl
    except ImportError:  # no flock (Windows): os.replace still keeps the file whole
        yield
        return
    fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"could not lock {path}.lock within {timeout_s:.0f} s") from None
                time.sleep(0.005)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _atomic_write(path: str, doc: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tuning.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _entry_name(kind: str, key: TuneKey) -> str:
    return f"{kind}:{key.id}"


def lookup(kind: str, key: TuneKey, path: Optional[str] = None) -> Optional[Config]:
    """The cached config for (kind, key), or None (no file, no entry, or an invalid entry)."""
    _check_kind(kind)
    path = cache_path(path)
    entries = _load(path)
    if not entries:
        return None
    entry = entries.get(_entry_name(kind, key))
    if entry is None:
        return None
    try:
        return Config(**{name: entry["config"][name] for name in FIELDS})
    except (KeyError, TypeError, ValueError) as e:
        warnings.warn(f"[tuning] cache {path}: entry {_entry_name(kind, key)!r} is invalid ({e}); ignoring it",
                      TuningCacheWarning, stacklevel=2)
        return None


def store(kind: str, key: TuneKey, config: Config, path: Optional[str] = None, **meta: Any) -> bool:
    """Add (kind, key) -> config to the cache; ``meta`` (times, strategy) is stored alongside.

    Safe against concurrent writers: lock, re-read, merge, write a temporary file, os.replace.
    A corrupt or foreign file is moved to ``<path>.bad`` first. Returns False (with a warning)
    when the file cannot be written; never raises for I/O problems.
    """
    _check_kind(kind)
    if not isinstance(config, Config):
        raise TypeError(f"store: config must be a commlib.Config, got {type(config).__name__}")
    path = cache_path(path)
    entry = {"kind": kind, "key": dataclasses.asdict(key), "config": dataclasses.asdict(config),
             "created": time.strftime("%Y-%m-%dT%H:%M:%S"), **meta}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with _locked(path, env.timeout_s()):
            entries, problem = _parse(path)
            if problem:
                os.replace(path, path + ".bad")
                warnings.warn(f"[tuning] cache {path} was {problem}; moved it to {path}.bad and started a new one",
                              TuningCacheWarning, stacklevel=2)
            entries[_entry_name(kind, key)] = entry
            _atomic_write(path, {"schema": SCHEMA, "version": VERSION, "entries": entries})
        return True
    except (OSError, TimeoutError) as e:
        warnings.warn(f"[tuning] could not write the tuning cache {path}: {e}", TuningCacheWarning, stacklevel=2)
        return False


def _fits(config: Config, num_tokens: int, num_ranks: int, ranks_per_node: int, hidden_bytes: int,
          num_nvl_bytes: Optional[int], num_rdma_bytes: Optional[int]) -> bool:
    """Can a call of ``num_tokens`` rows of ``hidden_bytes`` run with ``config`` on this Buffer?"""
    if config.max_tokens_per_call() < num_tokens:
        return False
    multi_node = num_ranks > ranks_per_node
    if multi_node and config.num_channels * config.num_max_rdma_chunked_recv_tokens < num_tokens:
        return False
    if num_nvl_bytes is not None and config.get_nvl_buffer_size_hint(hidden_bytes, ranks_per_node) > num_nvl_bytes:
        return False
    if (multi_node and num_rdma_bytes is not None
            and config.get_rdma_buffer_size_hint(hidden_bytes, num_ranks) > num_rdma_bytes):
        return False
    return True


def cached_config(kind: str, num_ranks: int, ranks_per_node: int, hidden: int, dtype: Any, num_tokens: int,
                  device: Any = None, *, group: Any = None, path: Optional[str] = None,
                  num_nvl_bytes: Optional[int] = None, num_rdma_bytes: Optional[int] = None) -> Optional[Config]:
    """The tuned config for this call shape on this machine, or None when nothing (usable) is cached.

    A config is usable when it holds ``num_tokens`` and, if ``num_nvl_bytes`` / ``num_rdma_bytes``
    are given, fits those buffers. Without ``group`` this is a local file lookup (one stat when
    nothing changed). With ``group`` it is collective: the ranks agree on the largest num_tokens,
    rank 0 looks up, and every rank returns rank 0's answer. Never raises for cache problems.
    """
    world, rank = _world(group)
    if world > 1:
        num_tokens = max(_all_gather(int(num_tokens), group))
        found = _cached_local(kind, num_ranks, ranks_per_node, hidden, dtype, num_tokens, device, path,
                              num_nvl_bytes, num_rdma_bytes) if rank == 0 else None
        fields = _broadcast(_tup(found) if found is not None else None, group)
        return Config(*fields) if fields is not None else None
    return _cached_local(kind, num_ranks, ranks_per_node, hidden, dtype, num_tokens, device, path,
                         num_nvl_bytes, num_rdma_bytes)


def _cached_local(kind, num_ranks, ranks_per_node, hidden, dtype, num_tokens, device, path,
                  num_nvl_bytes, num_rdma_bytes) -> Optional[Config]:
    _check_kind(kind)
    try:
        path = cache_path(path)
        if _load(path) is None:  # no file: skip the machine fingerprint (nvidia-smi) entirely
            return None
        key = make_key(num_ranks, ranks_per_node, hidden, dtype, num_tokens, device)
        found = lookup(kind, key, path)
        if found is None:
            return None
        hidden_bytes = hidden * (2 if kind == "combine" else dtype_bytes(dtype))
        ok = _fits(found, num_tokens, num_ranks, ranks_per_node, hidden_bytes, num_nvl_bytes, num_rdma_bytes)
        return found if ok else None
    except Exception as e:  # noqa: BLE001 - a tuning problem must never break a dispatch
        warnings.warn(f"[tuning] cached config lookup failed ({type(e).__name__}: {e}); using the default",
                      TuningCacheWarning, stacklevel=3)
        return None


# ------------------------------------------------------------------------------ torch.distributed
def _world(group: Any) -> tuple[int, int]:
    import torch.distributed as dist
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _all_gather(obj: Any, group: Any) -> list:
    import torch.distributed as dist
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _broadcast(obj: Any, group: Any) -> Any:
    """Rank 0's ``obj`` on every rank of ``group``."""
    import torch.distributed as dist
    try:
        src = dist.get_global_rank(group, 0)
    except (AttributeError, ValueError, RuntimeError):
        src = 0
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


# -------------------------------------------------------------------------------- search space
@dataclasses.dataclass(frozen=True)
class SearchSpace:
    """Candidate values per Config field, and what every candidate must satisfy.

    ``num_tokens``: the capacity every config must have (a token bucket's upper end).
    ``hidden_bytes``: row bytes for the buffer-size checks against num_nvl_bytes / num_rdma_bytes.
    """
    num_sms: tuple = DEFAULT_SMS
    nvl_send: tuple = DEFAULT_NVL_SEND
    nvl_recv: tuple = DEFAULT_NVL_RECV
    rdma_send: tuple = (64,)
    rdma_recv: tuple = (1024,)
    num_tokens: int = 1
    num_ranks: int = 1
    ranks_per_node: int = 1
    hidden_bytes: int = 0
    num_nvl_bytes: Optional[int] = None
    num_rdma_bytes: Optional[int] = None

    def is_valid(self, config: Config) -> bool:
        return _fits(config, self.num_tokens, self.num_ranks, self.ranks_per_node, max(self.hidden_bytes, 1),
                     self.num_nvl_bytes if self.hidden_bytes else None,
                     self.num_rdma_bytes if self.hidden_bytes else None)

    def configs(self) -> list[Config]:
        out = []
        for values in itertools.product(self.num_sms, self.nvl_send, self.nvl_recv, self.rdma_send, self.rdma_recv):
            try:
                config = Config(*values)
            except (TypeError, ValueError):  # odd num_sms, send chunk above capacity, ...
                continue
            if self.is_valid(config):
                out.append(config)
        return out


def default_space(kind: str, num_ranks: int, ranks_per_node: int, hidden: int, dtype: Any, num_tokens: int, *,
                  num_nvl_bytes: Optional[int] = None, num_rdma_bytes: Optional[int] = None,
                  num_sms: Sequence[int] = DEFAULT_SMS, nvl_send: Sequence[int] = DEFAULT_NVL_SEND,
                  nvl_recv: Sequence[int] = DEFAULT_NVL_RECV, rdma_send: Sequence[int] = DEFAULT_RDMA_SEND,
                  rdma_recv: Sequence[int] = DEFAULT_RDMA_RECV, max_num_sms: Optional[int] = None) -> SearchSpace:
    """The space tuned for a call shape; capacities must hold ``token_bucket(num_tokens)`` tokens.

    On one node the network fields do not matter and stay at the default (64, 1024).
    """
    _check_kind(kind)
    if num_ranks <= 0 or ranks_per_node <= 0 or num_ranks % ranks_per_node:
        raise ValueError(f"ranks_per_node ({ranks_per_node}) must divide num_ranks ({num_ranks})")
    sms = tuple(s for s in num_sms if s % 2 == 0 and s > 0 and (max_num_sms is None or s <= max_num_sms))
    multi_node = num_ranks > ranks_per_node
    return SearchSpace(
        num_sms=sms, nvl_send=tuple(nvl_send), nvl_recv=tuple(nvl_recv),
        rdma_send=tuple(rdma_send) if multi_node else (64,), rdma_recv=tuple(rdma_recv) if multi_node else (1024,),
        num_tokens=token_bucket(num_tokens), num_ranks=num_ranks, ranks_per_node=ranks_per_node,
        hidden_bytes=hidden * (2 if kind == "combine" else dtype_bytes(dtype)),
        num_nvl_bytes=num_nvl_bytes, num_rdma_bytes=num_rdma_bytes if multi_node else None)


# ------------------------------------------------------------------------------------- search
@dataclasses.dataclass
class Trial:
    """The samples of one config; ``batch_medians`` has one entry per batch (one repeated timing)."""
    config: Config
    samples: list = dataclasses.field(default_factory=list)
    batch_medians: list = dataclasses.field(default_factory=list)
    error: Optional[str] = None

    @property
    def batches(self) -> int:
        return len(self.batch_medians)

    @property
    def median(self) -> float:
        return statistics.median(self.samples) if self.samples and self.error is None else math.inf

    @property
    def noise(self) -> float:
        """Spread of repeated timings: max - min of the batch medians (0 with one batch). Batch
        medians, not single calls: a bimodal call time (a late host sync, say) would make a
        per-call spread far wider than how much a measurement of the config moves when repeated."""
        return max(self.batch_medians) - min(self.batch_medians) if self.batches > 1 else 0.0


@dataclasses.dataclass
class SearchResult:
    config: Config                   # what to use: the winner, or the default when the gain is within noise
    best: Config                     # fastest candidate measured
    best_time: float
    default: Optional[Config]
    default_time: Optional[float]
    margin: float                    # gain needed to replace the default
    replaced: bool
    strategy: str
    trials: list                     # [Trial], in evaluation order
    num_batches: int
    num_samples: int
    spent: float                     # sum of all sample times (the time the search measured)
    wall_s: float
    finals: list = dataclasses.field(default_factory=list)  # [winner, default] re-timed in turn: the decision

    @property
    def speedup(self) -> Optional[float]:
        if self.default_time is None or not math.isfinite(self.default_time):
            return None
        chosen = self.best_time if self.replaced else self.default_time
        return self.default_time / chosen

    def to_json(self) -> dict:
        def row(t: Trial) -> dict:
            return {"config": dataclasses.asdict(t.config), "median": t.median if t.error is None else None,
                    "noise": t.noise if t.batches > 1 else None, "samples": len(t.samples), "error": t.error}
        return {"config": dataclasses.asdict(self.config), "best": dataclasses.asdict(self.best),
                "best_time": self.best_time,
                "default": dataclasses.asdict(self.default) if self.default else None,
                "default_time": self.default_time, "margin": self.margin, "replaced": self.replaced,
                "speedup": self.speedup, "strategy": self.strategy, "num_batches": self.num_batches,
                "num_samples": self.num_samples, "num_configs": len(self.trials), "spent": self.spent,
                "wall_s": self.wall_s, "trials": [row(t) for t in self.trials],
                "finals": [row(t) for t in self.finals]}

    def table(self, top: Optional[int] = 10, unit: str = "us") -> str:
        return format_table(self.to_json(), top=top, unit=unit)


def _num(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}"


def format_table(result: dict, top: Optional[int] = 10, unit: str = "us") -> str:
    """Text table of a SearchResult's JSON: the fastest ``top`` trials (all with None) and the default."""
    rows = [t for t in result["trials"] if t["median"] is not None]
    rows.sort(key=lambda t: t["median"])
    default = result["default"]
    shown = rows if top is None else rows[:top]
    if default and not any(t["config"] == default for t in shown):
        shown += [t for t in rows if t["config"] == default]
    lines = [f"{'num_sms':>8} {'nvl_send':>9} {'nvl_recv':>9} {'rdma_send':>10} {'rdma_recv':>10} "
             f"{'median_' + unit:>11} {'noise_' + unit:>10} {'samples':>8}"]
    for t in shown:
        c = t["config"]
        mark = "  <- winner" if c == result["config"] else ""
        if c == default:
            mark += "  (default)"
        lines.append(f"{c['num_sms']:>8} {c['num_max_nvl_chunked_send_tokens']:>9} "
                     f"{c['num_max_nvl_chunked_recv_tokens']:>9} {c['num_max_rdma_chunked_send_tokens']:>10} "
                     f"{c['num_max_rdma_chunked_recv_tokens']:>10} {t['median']:>11.2f} {_num(t['noise']):>10} "
                     f"{t['samples']:>8}{mark}")
    failed = sum(1 for t in result["trials"] if t["median"] is None)
    if failed:
        lines.append(f"({failed} configs failed to run)")
    for name, t in zip(("winner", "default"), result.get("finals", [])):
        if t["median"] is not None:
            lines.append(f"final, timed in turn: {name} {'/'.join(str(v) for v in t['config'].values())} "
                         f"{t['median']:.2f} {unit} (noise {_num(t['noise'])}, {t['samples']} samples)")
    return "\n".join(lines)


def _every_other(n: int) -> list:
    """Indices of a coarse pass over n sorted values: every other one, both ends (all when n <= 4)."""
    idx = list(range(0, n, 2 if n > 4 else 1))
    return idx if not idx or idx[-1] == n - 1 else idx + [n - 1]


class _Searcher:
    """Bookkeeping shared by both strategies: trials by config tuple, batches run, axis values."""

    def __init__(self, configs: Sequence[tuple], time_fn: TimeFn, progress: Optional[Callable], total: int):
        self.configs = list(configs)
        self.axes = [sorted({c[i] for c in self.configs}) for i in range(len(FIELDS))]
        self.logs = [tuple(math.log2(v) for v in c) for c in self.configs]
        self.by_value = [{} for _ in FIELDS]  # axis -> value -> indices of configs with that value
        for i, c in enumerate(self.configs):
            for a, v in enumerate(c):
                self.by_value[a].setdefault(v, set()).add(i)
        self.time_fn = time_fn
        self.trials: dict[tuple, Trial] = {}
        self.num_batches = 0
        self.progress = progress
        self.total = total

    def run(self, cfg: tuple, batches: int) -> float:
        """Top the trial of ``cfg`` up to ``batches`` batches; returns its median."""
        trial = self.trials.setdefault(cfg, Trial(Config(*cfg)))
        while trial.batches < batches and trial.error is None:
            self.top_up(trial)
        return trial.median

    def top_up(self, trial: Trial) -> None:
        """One more batch for ``trial``; a failure marks it (skipped from then on), never raises."""
        if trial.error is not None:
            return
        try:
            samples = [float(v) for v in self.time_fn(trial.config)]
            if not samples:
                raise RuntimeError("time_fn returned no samples")
        except Exception as e:  # noqa: BLE001 - a config that cannot run is skipped, not fatal
            trial.error = f"{type(e).__name__}: {e}"
            warnings.warn(f"[tuning] {trial.config} failed: {trial.error}", RuntimeWarning, stacklevel=4)
            return
        trial.samples.extend(samples)
        trial.batch_medians.append(statistics.median(samples))
        self.num_batches += 1
        if self.progress is not None:
            self.progress(self.num_batches, max(self.total, self.num_batches), self.best_median())

    def score(self, cfg: tuple) -> tuple:
        trial = self.trials.get(cfg)
        return (trial.median if trial else math.inf, cfg)

    def best_median(self) -> float:
        return min((t.median for t in self.trials.values()), default=math.inf)

    def project(self, target: tuple, fixed: dict) -> Optional[tuple]:
        """The candidate nearest ``target`` (log distance per field) among those matching ``fixed``."""
        if fixed:
            subsets = sorted((self.by_value[a].get(v, set()) for a, v in fixed.items()), key=len)
            candidates = sorted(set.intersection(*subsets))
        else:
            candidates = range(len(self.configs))
        want = [math.log2(v) for v in target]
        best, best_d = None, math.inf
        for i in candidates:
            d = sum(abs(x - y) for x, y in zip(self.logs[i], want))
            if d < best_d:
                best, best_d = self.configs[i], d
        return best

    def line(self, axis: int, base: tuple, keep: Iterable[int]) -> list:
        """Line search along ``axis`` from ``base`` (fields in ``keep`` held): every other value, then
        hill-climb to better neighbours. Returns the points timed, fastest first."""
        points = []
        for v in self.axes[axis]:
            p = self.project(base[:axis] + (v,) + base[axis + 1:], {**{k: base[k] for k in keep}, axis: v})
            if p is not None and p not in points:
                points.append(p)
        if not points:
            return [base]
        for i in _every_other(len(points)):
            self.run(points[i], 1)
        evaluated = [i for i, p in enumerate(points) if p in self.trials]
        i = min(evaluated, key=lambda j: self.score(points[j]))
        while True:  # hill-climb: step towards a better neighbour until none is better
            for j in (i - 1, i + 1):
                if 0 <= j < len(points):
                    self.run(points[j], 1)
            j = min((k for k in (i - 1, i, i + 1) if 0 <= k < len(points)), key=lambda k: self.score(points[k]))
            if j == i:
                break
            i = j
        return sorted((p for p in points if p in self.trials), key=self.score)

    def pattern(self, axes: Sequence[int], base: tuple, max_steps: int = 8) -> tuple:
        """Hill-climb over ``axes`` jointly, diagonals included: follows valleys where the best chunk
        size shrinks as the SM count grows, which one-axis-at-a-time searches miss."""
        index = [{v: i for i, v in enumerate(self.axes[a])} for a in range(len(FIELDS))]
        current = base
        self.run(current, 1)
        for _ in range(max_steps):
            moves = []
            for offsets in itertools.product((-1, 0, 1), repeat=len(axes)):
                if not any(offsets):
                    continue
                target, fixed = list(current), {}
                for a, o in zip(axes, offsets):
                    i = index[a][current[a]] + o
                    if not 0 <= i < len(self.axes[a]):
                        break
                    target[a] = fixed[a] = self.axes[a][i]
                else:
                    fixed.update({a: current[a] for a in range(len(FIELDS)) if a not in axes and a not in (2, 4)})
                    p = self.project(tuple(target), fixed)
                    if p is not None and p != current and p not in moves:
                        moves.append(p)
            for p in moves:
                self.run(p, 1)
            nxt = min(moves + [current], key=self.score)
            if nxt == current:
                break
            current = nxt
        return current

    def grid(self, axes: Sequence[int], base: tuple) -> tuple:
        """Every other value of each of ``axes`` (ends included), other fields nearest ``base``."""
        picks = [[self.axes[a][i] for i in _every_other(len(self.axes[a]))] for a in axes]
        for values in itertools.product(*picks):
            target, fixed = list(base), {}
            for a, v in zip(axes, values):
                target[a] = fixed[a] = v
            p = self.project(tuple(target), fixed)
            if p is not None:
                self.run(p, 1)
        return min(self.trials, key=self.score)

    def smart(self, start: tuple, full: int) -> tuple:
        best = self.pattern((0, 1), self.grid((0, 1), start))
        if len(self.axes[3]) > 1:
            best = self.line(3, best, keep=(0, 1))[0]
            best = self.pattern((0, 1, 3), best)
        for axis, keep in ((2, (0, 1, 3)), (4, (0, 1, 2, 3))):
            if len(self.axes[axis]) > 1:
                best = self.line(axis, best, keep=keep)[0]
        return self.halving(full)

    def halving(self, full: int, keep_top: int = 8) -> tuple:
        """Successive halving on repetitions: the best few get 2x the batches, the better half goes on."""
        cands = sorted((c for c, t in self.trials.items() if t.error is None), key=self.score)[:keep_top]
        if not cands:
            raise RuntimeError("tuning: no candidate config could be timed")
        batches = 1
        while True:
            batches = min(full, batches * 2)
            for c in cands:
                self.run(c, batches)
            cands = sorted((c for c in cands if self.trials[c].error is None), key=self.score)
            if batches >= full or len(cands) <= 1:
                break
            cands = cands[:max(1, (len(cands) + 1) // 2)]
        self.run(cands[0], full)
        return cands[0]

    def exhaustive(self, full: int) -> tuple:
        for c in self.configs:
            self.run(c, full)
        ok = [c for c in self.configs if self.trials[c].error is None]
        if not ok:
            raise RuntimeError("tuning: no candidate config could be timed")
        return min(ok, key=self.score)


def search(space: SearchSpace | Sequence[Config], time_fn: TimeFn, *, default: Optional[Config] = None,
           strategy: str = "smart", batches: int = 4, progress: Optional[Callable] = None,
           min_gain: float = 0.0) -> SearchResult:
    """Find the fastest config of ``space``; keep ``default`` unless the winner beats it by more than noise.

    ``time_fn(config)`` returns one batch of sample times (any unit; smaller is better). Winners
    and the default are measured with ``batches`` batches. The default is replaced only if
    median(default) - median(winner) > max(noise(default), noise(winner)) + min_gain * median(default),
    from fresh batches of the two timed in turn; noise = max - min of a config's batch medians.
    ``progress(done_batches, total_batches_estimate, best_median)`` is called after every batch.
    """
    if strategy not in ("smart", "exhaustive"):
        raise ValueError(f"strategy must be 'smart' or 'exhaustive', got {strategy!r}")
    if batches < 1:
        raise ValueError(f"batches must be >= 1, got {batches}")
    configs = space.configs() if isinstance(space, SearchSpace) else list(space)
    configs = list(dict.fromkeys(_tup(c) for c in configs))  # as tuples: Config is unhashable
    if not configs:
        raise ValueError("tuning: the search space is empty (no candidate satisfies the token count / buffer size)")
    runnable_default = default is not None and (
        _tup(default) in configs or (isinstance(space, SearchSpace) and space.is_valid(default)))
    if strategy == "exhaustive":
        total = len(configs) * batches
    else:  # estimate: the same search on a flat landscape (no timing, pure bookkeeping)
        dry = _Searcher(configs, lambda c: [1.0], None, 0)
        dry.smart(_start(dry, default), batches)
        total = dry.num_batches
    total += 2 * batches if runnable_default else 0
    s = _Searcher(configs, time_fn, progress, total)
    t0 = time.perf_counter()
    best = s.exhaustive(batches) if strategy == "exhaustive" else s.smart(_start(s, default), batches)
    best_trial = s.trials[best]
    best_time, default_time, margin, replaced = best_trial.median, None, 0.0, True
    finals = []
    if runnable_default and best != _tup(default):
        # The decision uses fresh samples of the two, batch by batch in turn: a drift over the search
        # (clocks, temperature, other tenants) then hits both alike.
        finals = [Trial(best_trial.config), Trial(default)]
        for _ in range(batches):
            for trial in finals:
                s.top_up(trial)
        fin_best, fin_default = finals
        if fin_default.error is None and fin_best.error is None:
            best_time, default_time = fin_best.median, fin_default.median
            margin = max(fin_default.noise, fin_best.noise) + min_gain * default_time
            replaced = default_time - best_time > margin
        else:
            replaced = fin_default.error is not None
            default_time = None if fin_default.error else fin_default.median
    elif runnable_default:  # the winner is the default
        default_time, replaced = best_time, False
    chosen = best_trial.config if replaced or default is None else default
    trials = list(s.trials.values())
    measured = trials + finals
    return SearchResult(config=chosen, best=best_trial.config, best_time=best_time, default=default,
                        default_time=default_time, margin=margin, replaced=chosen != default, strategy=strategy,
                        trials=trials, num_batches=s.num_batches,
                        num_samples=sum(len(t.samples) for t in measured),
                        spent=sum(sum(t.samples) for t in measured), wall_s=time.perf_counter() - t0,
                        finals=finals)


def _start(s: _Searcher, default: Optional[Config]) -> tuple:
    if default is not None:
        return s.project(_tup(default), {})
    return s.project(tuple(axis[len(axis) // 2] for axis in s.axes), {})


class TextProgress:
    """``[tuning] dispatch [#####-----] 12/40 best 215.3 us`` redrawn in place on stderr."""

    def __init__(self, label: str, unit: str = "us", width: int = 30, stream=None) -> None:
        self.label, self.unit, self.width = label, unit, width
        self.stream = stream if stream is not None else sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last = 0.0

    def __call__(self, done: int, total: int, best: float) -> None:
        now = time.monotonic()
        if not self.tty and done < total and now - self._last < 2.0:
            return  # logs get a line every 2 s, a terminal every batch
        self._last = now
        filled = int(self.width * min(done, total) / max(total, 1))
        bar = "#" * filled + "-" * (self.width - filled)
        best_text = f"best {best:.1f} {self.unit}" if math.isfinite(best) else "best -"
        line = f"[tuning] {self.label} [{bar}] {done}/{total} {best_text}"
        self.stream.write(("\r" + line) if self.tty else (line + "\n"))
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


# --------------------------------------------------------------------------- Buffer integration
class BufferTimer:
    """Built-in ``time_fn``: times ``buffer.dispatch`` or ``buffer.combine`` with a candidate config.

    Inputs follow the V3 workload: x ~ N(0, 1) [T, H] (FP8 via per_token_cast_to_fp8), group-limited
    top-k routing. Dispatch is the full call (layout given, counts exchanged, host sync). Combine
    reuses one handle: the handle fixes the channel split combine walks (its CTA pairs loop over
    the dispatch's channels), so it is dispatched with ``dispatch_config`` (what the Buffer will
    use for dispatch; every rank must pass the same) or, when None, with each candidate's num_sms.
    Samples are CUDA-event times with an L2 flush on the GPU (commlib.timing.bench_cuda),
    perf_counter on CPU, in microseconds.
    """

    def __init__(self, buffer, kind: str, num_tokens: int, hidden: int, dtype: Any = "bfloat16", *,
                 num_experts: int = 256, topk: int = 8, num_groups: int = 8, topk_groups: int = 4,
                 reps: int = 5, warmup: int = 2, flush_l2: bool = True, seed: int = 0,
                 dispatch_config: Optional[Config] = None, settle_s: Optional[float] = None) -> None:
        from .fp8 import per_token_cast_to_fp8
        from .routing import group_limited_topk, random_scores
        _check_kind(kind)
        self.buffer, self.kind, self.reps, self.warmup, self.flush_l2 = buffer, kind, reps, warmup, flush_l2
        self.device = torch.device(getattr(buffer, "device", "cpu"))
        rank = getattr(buffer, "rank", 0)
        gen = torch.Generator().manual_seed(seed * 1000003 + rank)
        num_groups = min(num_groups, num_experts)
        scores = random_scores(num_tokens, num_experts, gen)
        idx, weights = group_limited_topk(scores, num_groups, min(topk_groups, num_groups), topk)
        self.topk_idx, self.topk_weights = idx.to(self.device), weights.to(self.device)
        x = torch.randn(num_tokens, hidden, generator=gen).to(self.device, torch.bfloat16)
        self.x_bf16 = x
        self.x = per_token_cast_to_fp8(x) if dtype_name(dtype) == "float8_e4m3fn" else x
        per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(self.topk_idx, num_experts)
        self.layout = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
                           num_tokens_per_expert=per_expert, is_token_in_rank=in_rank,
                           topk_idx=self.topk_idx, topk_weights=self.topk_weights)
        self.dispatch_config = dispatch_config
        # Untimed calls before the first sample, so the first configs timed do not pay for clocks
        # ramping up from idle, first-use allocations and kernel compilation.
        self.settle_s = (1.0 if self.device.type == "cuda" else 0.0) if settle_s is None else settle_s
        self._handle: tuple = (None, None)  # (num_sms it was dispatched with, (recv_x, recv_w, handle))

    def _dispatch(self, x, config: Config):
        return self.buffer.dispatch(x, config=config, **self.layout)

    def _combine_inputs(self, config: Config) -> tuple:
        d_config = self.dispatch_config or config
        if self._handle[0] != d_config.num_sms:
            recv_x, _, recv_w, _, handle, _ = self._dispatch(self.x_bf16, d_config)
            self._handle = (d_config.num_sms, (recv_x, recv_w, handle))
        return self._handle[1]

    def _settle(self, fn: Callable) -> None:
        """Call ``fn`` for settle_s seconds, in rounds of 20; rank 0's clock decides for every rank
        (the calls are collective: all ranks must make the same number)."""
        group = getattr(self.buffer, "group", None)
        start = time.perf_counter()
        while True:
            for _ in range(20):
                fn()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            more = time.perf_counter() - start < self.settle_s
            if _world(group)[0] > 1:
                more = _broadcast(more, group)
            if not more:
                break
        self.settle_s = 0.0

    def __call__(self, config: Config) -> list:
        from .timing import bench_cuda
        if self.kind == "dispatch":
            fn = lambda: self._dispatch(self.x, config)  # noqa: E731
        else:
            recv_x, recv_w, handle = self._combine_inputs(config)
            fn = lambda: self.buffer.combine(recv_x, handle, topk_weights=recv_w, config=config)  # noqa: E731
        if self.settle_s > 0:
            self._settle(fn)
        res = bench_cuda(fn, warmup=self.warmup, iters=self.reps, flush_l2=self.flush_l2, device=self.device)
        return res["samples"]


def combine_space(space, dispatch_config: Optional[Config]):
    """``space`` without num_sms above the dispatch's: combine's CTA pairs loop over the handle's
    channels (csrc/combine.cu), so CTAs beyond two per dispatch channel would only idle."""
    if dispatch_config is None or not isinstance(space, SearchSpace):
        return space
    sms = tuple(s for s in space.num_sms if s <= dispatch_config.num_sms)
    return dataclasses.replace(space, num_sms=sms) if sms else space


def _agreeing(time_fn: TimeFn, group: Any) -> TimeFn:
    """Wrap ``time_fn`` so every rank sees the same samples (the slowest rank's, element-wise).

    With identical samples the search takes identical decisions on every rank, so a time_fn that
    runs collectives (dispatch/combine) stays in lockstep. A failure on any rank fails everywhere.
    """
    def fn(config: Config) -> list:
        try:
            mine: Any = [float(v) for v in time_fn(config)]
        except Exception as e:  # noqa: BLE001 - shared with the other ranks below
            mine = f"{type(e).__name__}: {e}"
        everyone = _all_gather(mine, group)
        errors = [f"rank {r}: {v}" for r, v in enumerate(everyone) if isinstance(v, str) or not v]
        if errors:
            raise RuntimeError("; ".join(errors))
        n = min(len(v) for v in everyone)
        return [max(v[i] for v in everyone) for i in range(n)]
    return fn


def _buffer_shape(buffer, group) -> tuple[int, int]:
    world, rank = _world(group)
    num_ranks = getattr(buffer, "num_ranks", world)
    topology = getattr(buffer, "topology", None)
    if topology is not None:
        return num_ranks, topology.ranks_per_node
    from .topology import Topology
    return num_ranks, Topology.detect(rank, num_ranks).ranks_per_node


def autotune(buffer, kind: str, x_shape: Sequence[int], dtype: Any = "bfloat16", *,
             time_fn: Optional[TimeFn] = None, space: Optional[SearchSpace | Sequence[Config]] = None,
             strategy: str = "smart", batches: int = 4, group: Any = "buffer", save: bool = True,
             path: Optional[str] = None, progress: Optional[Callable] = None, default: Optional[Config] = None,
             max_num_sms: Optional[int] = None, min_gain: float = 0.0, **timer_kwargs: Any) -> SearchResult:
    """Tune ``kind`` ("dispatch" | "combine") for calls of ``x_shape`` = (T, H) on ``buffer``; cache the result.

    Collective over ``group`` (default: ``buffer.group``): every rank must call it. ``time_fn``
    defaults to ``BufferTimer(buffer, kind, T, H, dtype, **timer_kwargs)``. Samples are shared
    between ranks (slowest rank's), rank 0's decision is broadcast, and rank 0 stores it in the cache
    (``save``) for the token bucket of T. Returns the SearchResult (``.config`` is what to use).
    """
    _check_kind(kind)
    num_tokens, hidden = int(x_shape[0]), int(x_shape[1])
    group = getattr(buffer, "group", None) if group == "buffer" else group
    world, rank = _world(group)
    num_ranks, rpn = _buffer_shape(buffer, group)
    num_sms = getattr(buffer, "num_sms", env.num_sms())
    # The cache entry and the capacities serve the largest token count of any rank.
    bucket_tokens = max(_all_gather(num_tokens, group)) if world > 1 else num_tokens
    if default is None:
        default = (default_dispatch_config if kind == "dispatch" else default_combine_config)(num_ranks, num_sms)
    nvl, rdma = getattr(buffer, "num_nvl_bytes", None), getattr(buffer, "num_rdma_bytes", None)
    if space is None:
        space = default_space(kind, num_ranks, rpn, hidden, dtype, bucket_tokens, num_nvl_bytes=nvl,
                              num_rdma_bytes=rdma, max_num_sms=max_num_sms)
    if time_fn is None:
        if kind == "combine" and "dispatch_config" not in timer_kwargs:  # the dispatch config in use
            d_config = cached_config("dispatch", num_ranks, rpn, hidden, dtype, bucket_tokens,
                                     getattr(buffer, "device", None), group=group, path=path, num_nvl_bytes=nvl,
                                     num_rdma_bytes=rdma) or default_dispatch_config(num_ranks, num_sms)
            if not _fits(d_config, bucket_tokens, num_ranks, rpn, hidden * 2, nvl, rdma):
                d_config = None
            timer_kwargs["dispatch_config"] = d_config
            space = combine_space(space, d_config)
        time_fn = BufferTimer(buffer, kind, num_tokens, hidden, dtype, **timer_kwargs)
    if world > 1:
        time_fn = _agreeing(time_fn, group)
    result = search(space, time_fn, default=default, strategy=strategy, batches=batches,
                    progress=progress if rank == 0 else None, min_gain=min_gain)
    if world > 1:  # the searches agree already; the broadcast makes it a guarantee
        result.config = Config(*_broadcast(_tup(result.config), group))
    if save and rank == 0:
        key = make_key(num_ranks, rpn, hidden, dtype, bucket_tokens, getattr(buffer, "device", None))
        store(kind, key, result.config, path=path, time=result.best_time if result.replaced else result.default_time,
              best_time=result.best_time, default_time=result.default_time, margin=result.margin,
              strategy=strategy, tuned_num_tokens=num_tokens, num_configs=len(result.trials))
    return result


def get_config(buffer, kind: str, x_shape: Sequence[int], dtype: Any = "bfloat16", *,
               path: Optional[str] = None, **autotune_kwargs: Any) -> Optional[Config]:
    """Cached config for this call, else (COMMLIB_AUTOTUNE=1) tune now, else None (use the default).

    Collective over ``buffer.group`` (lookup agreement and tuning): call it on every rank.
    """
    num_ranks, rpn = _buffer_shape(buffer, getattr(buffer, "group", None))
    found = cached_config(kind, num_ranks, rpn, int(x_shape[1]), dtype, int(x_shape[0]),
                          getattr(buffer, "device", None), group=getattr(buffer, "group", None), path=path,
                          num_nvl_bytes=getattr(buffer, "num_nvl_bytes", None),
                          num_rdma_bytes=getattr(buffer, "num_rdma_bytes", None))
    if found is not None or not env.autotune():
        return found
    return autotune(buffer, kind, x_shape, dtype, path=path, **autotune_kwargs).config


# ------------------------------------------------------------------------------------------ CLI
def _ints(text: str) -> tuple:
    """"8,12,16" or "8:48:4" (start:stop:step, stop included) -> tuple of ints."""
    if ":" in text:
        start, stop, step = (int(v) for v in text.split(":"))
        return tuple(range(start, stop + 1, step))
    return tuple(int(v) for v in text.split(","))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m commlib.tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=None, help="ranks (default: GPUs, or 2 on CPU)")
    p.add_argument("--ranks-per-node", type=int, default=None, help="emulated ranks per node (default: world)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--tokens", type=_ints, default=(4096,), help="tokens per rank, e.g. 128,4096")
    p.add_argument("--dtype", default="bf16", help="dispatch dtype: bf16 or fp8 (combine is bf16)")
    p.add_argument("--kind", choices=("dispatch", "combine", "both"), default="both")
    p.add_argument("--num-experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--strategy", choices=("smart", "exhaustive"), default="smart")
    p.add_argument("--batches", type=int, default=4, help="batches a winner is timed with")
    p.add_argument("--reps", type=int, default=5, help="timed calls per batch")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per batch")
    p.add_argument("--settle-s", type=float, default=None, help="untimed calls first (default: 1 s on GPU)")
    p.add_argument("--sms", type=_ints, default=DEFAULT_SMS, help="num_sms candidates, e.g. 8:48:4")
    p.add_argument("--nvl-send", type=_ints, default=DEFAULT_NVL_SEND)
    p.add_argument("--nvl-recv", type=_ints, default=DEFAULT_NVL_RECV)
    p.add_argument("--rdma-send", type=_ints, default=DEFAULT_RDMA_SEND)
    p.add_argument("--rdma-recv", type=_ints, default=DEFAULT_RDMA_RECV)
    p.add_argument("--num-nvl-bytes", type=int, default=2 << 30, help="largest NVLink buffer a config may need")
    p.add_argument("--num-rdma-bytes", type=int, default=2 << 30)
    p.add_argument("--cache", default=None, help="tuning cache file (default: COMMLIB_TUNING_CACHE or ~/.cache)")
    p.add_argument("--no-store", action="store_true", help="do not write the cache")
    p.add_argument("--cpu", action="store_true", help="gloo ranks on CPU (smoke test)")
    p.add_argument("--top", type=int, default=10, help="rows of the table (0: all)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--seed", type=int, default=0)
    return p


def _cli_spaces(args, world: int, rpn: int) -> dict:
    spaces = {}
    kinds = KINDS if args.kind == "both" else (args.kind,)
    for T in args.tokens:
        for kind in kinds:
            dtype = args.dtype if kind == "dispatch" else "bf16"
            spaces[(kind, T)] = default_space(
                kind, world, rpn, args.hidden, dtype, T, num_nvl_bytes=args.num_nvl_bytes,
                num_rdma_bytes=args.num_rdma_bytes, num_sms=args.sms, nvl_send=args.nvl_send,
                nvl_recv=args.nvl_recv, rdma_send=args.rdma_send, rdma_recv=args.rdma_recv)
    return spaces


def buffer_sizes(spaces: dict, num_sms: Optional[int] = None) -> tuple[int, int]:
    """(num_nvl_bytes, num_rdma_bytes) of one Buffer that runs every candidate of ``spaces``
    ({(kind, T): SearchSpace}) and each kind's default config (``num_sms``: Buffer.num_sms)."""
    nvl = rdma = 0
    for (kind, _), space in spaces.items():
        default = (default_dispatch_config if kind == "dispatch" else default_combine_config)(
            space.num_ranks, num_sms or env.num_sms())
        unbounded = dataclasses.replace(space, num_nvl_bytes=None, num_rdma_bytes=None)
        for c in space.configs() + ([default] if unbounded.is_valid(default) else []):
            nvl = max(nvl, c.get_nvl_buffer_size_hint(space.hidden_bytes, space.ranks_per_node))
            if space.num_ranks > space.ranks_per_node:
                rdma = max(rdma, c.get_rdma_buffer_size_hint(space.hidden_bytes, space.num_ranks))
    return nvl, rdma


def _cli_worker(ctx, args) -> list:
    from .buffer import Buffer
    spaces = _cli_spaces(args, ctx.world_size, ctx.ranks_per_node)
    nvl, rdma = buffer_sizes(spaces, Buffer.num_sms)
    buffer = Buffer(ctx.group, nvl, rdma, ranks_per_node=ctx.ranks_per_node)
    out = []
    try:
        for (kind, T), space in spaces.items():
            dtype = args.dtype if kind == "dispatch" else "bf16"
            progress = TextProgress(f"{kind} T={T}") if ctx.rank == 0 else None
            res = autotune(buffer, kind, (T, args.hidden), dtype, space=space, strategy=args.strategy,
                           batches=args.batches, save=not args.no_store, path=args.cache, progress=progress,
                           num_experts=args.num_experts, topk=args.topk, reps=args.reps, warmup=args.warmup,
                           seed=args.seed, flush_l2=ctx.device.type == "cuda", settle_s=args.settle_s)
            if progress is not None:
                progress.close()
            out.append({"kind": kind, "num_tokens": T, "dtype": dtype, **res.to_json()})
    finally:
        buffer.destroy()
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    from .launch import parallel_launch
    args = _parser().parse_args(argv)
    use_gpu = not args.cpu and torch.cuda.is_available()
    world = args.world or (torch.cuda.device_count() if use_gpu else 2)
    rpn = args.ranks_per_node or world
    results = parallel_launch(world, _cli_worker, args, ranks_per_node=rpn, use_gpu=use_gpu, timeout_s=3600.0)
    gpu, topo = machine("cuda") if use_gpu else ("cpu", "cpu")
    for r in results:
        print(f"\n[tuning] {r['kind']} tokens={r['num_tokens']} hidden={args.hidden} dtype={dtype_name(r['dtype'])} "
              f"ranks={world} per node={rpn} gpu={gpu} topology={topo} strategy={r['strategy']}: "
              f"{r['num_configs']} configs, {r['num_batches']} batches, {r['wall_s']:.2f} s")
        print(format_table(r, top=args.top or None))
        default_t = f"{r['default_time']:.2f} us" if r["default_time"] is not None else "n/a"
        verdict = "replaces the default" if r["replaced"] else "keeps the default (gain within noise)"
        gain = f", {r['speedup']:.3f}x" if r["speedup"] else ""
        print(f"[tuning] Best {r['kind']}: Config{tuple(r['best'].values())} {r['best_time']:.2f} us; default "
              f"{default_t}; margin {r['margin']:.2f} us; {verdict}{gain}")
    print(f"[tuning] cache: {'not written (--no-store)' if args.no_store else cache_path(args.cache)}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"hidden": args.hidden, "world": world, "ranks_per_node": rpn, "gpu": gpu, "topology": topo,
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
