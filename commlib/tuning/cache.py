"""The tuned-config cache: one JSON file per machine, read below the Buffer (no search here).

Cache: one JSON file (``COMMLIB_TUNING_CACHE``, else ``~/.cache/commlib/tuning.json``), keyed by
GPU model, NVLink topology, world shape, hidden, dtype and power-of-two token bucket. Writers take a
file lock, re-read, merge and atomically replace the file; a corrupt or foreign file is reported
with a warning, ignored (configs are re-tuned) and moved aside on the next write.

Usage:
    cfg = cached_config("dispatch", num_ranks, ranks_per_node, hidden, torch.bfloat16, T, device)

Legend: T tokens on this rank.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import re
import subprocess
import tempfile
import time
import warnings
from typing import Any, Optional

import torch

from commlib.utils import env
from commlib.config import Config
from commlib.tuning.search import FIELDS, check_kind, config_fields, dtype_bytes, dtype_name, fits, token_bucket

SCHEMA = "commlib.tuning"
VERSION = 1


class TuningCacheWarning(UserWarning):
    """The tuning cache could not be read or written; commlib carries on with defaults / re-tuning."""


# ---------------------------------------------------------------------------------------- keys


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
    check_kind(kind)
    path = cache_path(path)
    entries = _load(path)
    if not entries:
        return None
    entry = entries.get(_entry_name(kind, key))
    if entry is None:
        return None
    try:
        return Config(**{name: entry["config"][name] for name in FIELDS}).check_runnable()
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
    check_kind(kind)
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


def cached_config(kind: str, num_ranks: int, ranks_per_node: int, hidden: int, dtype: Any, num_tokens: int,
                  device: Any = None, *, group: Any = None, path: Optional[str] = None,
                  num_nvl_bytes: Optional[int] = None, num_rdma_bytes: Optional[int] = None) -> Optional[Config]:
    """The tuned config for this call shape on this machine, or None when nothing (usable) is cached.

    A config is usable when it holds ``num_tokens`` and, if ``num_nvl_bytes`` / ``num_rdma_bytes``
    are given, fits those buffers. Without ``group`` this is a local file lookup (one stat when
    nothing changed). With ``group`` it is collective: the ranks agree on the largest num_tokens,
    rank 0 looks up, and every rank returns rank 0's answer. Never raises for cache problems.
    """
    world, rank = world_of(group)
    if world > 1:
        num_tokens = max(all_gather_objects(int(num_tokens), group))
        found = _cached_local(kind, num_ranks, ranks_per_node, hidden, dtype, num_tokens, device, path,
                              num_nvl_bytes, num_rdma_bytes) if rank == 0 else None
        fields = broadcast_object(config_fields(found) if found is not None else None, group)
        return Config(*fields) if fields is not None else None
    return _cached_local(kind, num_ranks, ranks_per_node, hidden, dtype, num_tokens, device, path,
                         num_nvl_bytes, num_rdma_bytes)


def _cached_local(kind, num_ranks, ranks_per_node, hidden, dtype, num_tokens, device, path,
                  num_nvl_bytes, num_rdma_bytes) -> Optional[Config]:
    check_kind(kind)
    try:
        path = cache_path(path)
        if _load(path) is None:  # no file: skip the machine fingerprint (nvidia-smi) entirely
            return None
        key = make_key(num_ranks, ranks_per_node, hidden, dtype, num_tokens, device)
        found = lookup(kind, key, path)
        if found is None:
            return None
        hidden_bytes = hidden * (2 if kind == "combine" else dtype_bytes(dtype))
        ok = fits(found, num_tokens, num_ranks, ranks_per_node, hidden_bytes, num_nvl_bytes, num_rdma_bytes)
        return found if ok else None
    except Exception as e:  # noqa: BLE001 - a tuning problem must never break a dispatch
        warnings.warn(f"[tuning] cached config lookup failed ({type(e).__name__}: {e}); using the default",
                      TuningCacheWarning, stacklevel=3)
        return None


# ------------------------------------------------------------------------------ torch.distributed
def world_of(group: Any) -> tuple[int, int]:
    import torch.distributed as dist
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def all_gather_objects(obj: Any, group: Any) -> list:
    import torch.distributed as dist
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, group: Any) -> Any:
    """Rank 0's ``obj`` on every rank of ``group``."""
    import torch.distributed as dist
    try:
        src = dist.get_global_rank(group, 0)
    except (AttributeError, ValueError, RuntimeError):
        src = 0
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]
