"""What every benchmark shares about its results: the checked / #wrong bookkeeping and the JSON.

Checks. A row that was compared with an oracle carries ``checked: True`` and ``wrong`` (elements or
bytes that differ, summed over every rank); a row nobody compared carries ``checked: False`` and no
count, and its ``#wrong`` cell reads ``N/A``. A benchmark exits non-zero when any compared row is
wrong (``exit_status``).

Files. ``benchmarks/results/<tool>_<gpu>x<n>_<yyyymmdd>_<commit>.json`` (e.g.
``alltoall_perf_H200x2_20261201_1e9003c.json``; CPU runs ``..._CPUx4_...``), holding the device, the
git commit, the command line, the figures (rows) and the ratios (``result_document``).
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from commlib.utils import env
from commlib.version import __version__

NOT_CHECKED = "N/A"


# ------------------------------------------------------------------------------ checks
def checked_fields(wrong: Optional[int]) -> dict:
    """The check fields of one row: ``{"checked": False}`` when nothing was compared (``wrong`` is
    None), else ``{"checked": True, "wrong": wrong}``."""
    if wrong is None:
        return {"checked": False}
    return {"checked": True, "wrong": int(wrong)}


def wrong_cell(row: dict) -> str:
    """The ``#wrong`` cell of a row: its count when compared, ``N/A`` otherwise."""
    return str(int(row["wrong"])) if row.get("checked") else NOT_CHECKED


def _comm_device(group) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def reduce_wrong(counts: Sequence[Optional[int]], group=None) -> list[Optional[int]]:
    """Sum each compared count over the ranks (all_reduce SUM); None (not compared) stays None.
    Every rank must pass the same pattern of None."""
    t = torch.tensor([0 if c is None else int(c) for c in counts], dtype=torch.int64, device=_comm_device(group))
    if t.numel():
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return [None if c is None else int(v) for c, v in zip(counts, t.tolist())]


def total_wrong(rows: Sequence[dict]) -> int:
    return sum(int(r["wrong"]) for r in rows if r.get("checked"))


def exit_status(rows: Sequence[dict]) -> int:
    """1 when any compared row is wrong, else 0."""
    return 1 if total_wrong(rows) else 0


def check_footer(rows: Sequence[dict]) -> str:
    """nccl-tests' footer line: '# Out of bounds values : 0 OK' / 'N FAILED' / 'N/A (not checked)',
    naming the rows that were not compared."""
    compared = [r for r in rows if r.get("checked")]
    if not compared:
        return f"# Out of bounds values : {NOT_CHECKED} (not checked)"
    n = total_wrong(compared)
    line = f"# Out of bounds values : {n} {'OK' if n == 0 else 'FAILED'}"
    skipped = len(rows) - len(compared)
    return line + (f" ({skipped} row{'s' if skipped > 1 else ''} not checked)" if skipped else "")


# ------------------------------------------------------------------------------ provenance
def repo_root() -> Optional[Path]:
    """The checkout this package runs from (None for an installed copy)."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "commlib").is_dir() and (root / "benchmarks").is_dir() else None


def git_commit() -> dict:
    """{"commit", "dirty"} of the checkout, or COMMLIB_GIT_COMMIT when set (the device machine gets the
    working tree without this checkout's .git). Every benchmark records this."""
    root = repo_root()
    info = {"commit": env.git_commit() or "unknown", "dirty": None}
    if env.git_commit() or root is None or not (root / ".git").exists():
        return info   # an explicit COMMLIB_GIT_COMMIT wins over a .git the machine may hold
    try:
        info["commit"] = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                                        text=True, timeout=10, check=True).stdout.strip() or "unknown"
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10).stdout
        info["dirty"] = bool(status.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def device_info() -> dict:
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        return {"kind": "cuda", "name": torch.cuda.get_device_name(0), "count": n,
                "description": f"{n} x {torch.cuda.get_device_name(0)}"}
    return {"kind": "cpu", "name": platform.processor() or platform.machine(), "count": os.cpu_count(),
            "description": f"CPU ({os.cpu_count()} cores, {platform.machine()})"}


def gpu_short_name(name: str) -> str:
    """'NVIDIA H200' -> 'H200', 'NVIDIA H100 80GB HBM3' -> 'H100', 'Tesla V100-SXM2-16GB' -> 'V100':
    the first word with a digit in it, up to a dash."""
    words = name.replace("NVIDIA", " ").split()
    for w in words:
        if any(ch.isdigit() for ch in w):
            return re.sub(r"[^A-Za-z0-9]", "", w.split("-")[0]) or "gpu"
    return re.sub(r"[^A-Za-z0-9]", "", "".join(words)) or "gpu"


def result_name(tool: str, device: dict, world_size: int, commit: str, when: Optional[datetime.date] = None) -> str:
    """``<tool>_<GPU>x<n>_<yyyymmdd>_<commit>.json``: n = the GPUs the run used (ranks sharing a GPU count
    it once; at most the device's ``count``), or the ranks on CPU, named ``CPU``."""
    cuda = device.get("kind") == "cuda"
    dev = gpu_short_name(device.get("name", "")) if cuda else "CPU"
    if cuda and device.get("count"):
        world_size = min(int(world_size), int(device["count"]))
    when = when or datetime.date.today()
    short = re.sub(r"[^0-9A-Za-z]", "", commit or "unknown")[:7] or "unknown"
    return f"{tool}_{dev}x{int(world_size)}_{when:%Y%m%d}_{short}.json"


def result_path(path: Optional[str], tool: str, world_size: int, device: Optional[dict] = None,
                commit: Optional[str] = None) -> Path:
    """Where a result goes: ``path`` itself when it names a .json file; else the folder ``path``
    (default, or 'auto': benchmarks/results/ of the checkout, or of the CWD) with the standard name."""
    if path not in (None, "", "auto") and str(path).endswith(".json"):
        return Path(path)
    folder = Path(path) if path not in (None, "", "auto") else (repo_root() or Path.cwd()) / "benchmarks" / "results"
    device = device or device_info()
    commit = commit or git_commit()["commit"]
    return folder / result_name(tool, device, world_size, commit)


def result_document(tool: str, command: str, rows: list, world_size: Optional[int] = None, **extra) -> dict:
    """The JSON every result file holds: tool, time, command line, device, git commit, versions,
    the figures (rows) and the ratios (rows with ``speedup`` against a baseline, unless given)."""
    ratios = extra.pop("ratios", None)
    if ratios is None:
        ratios = [{"op": r["op"], "tokens": r.get("tokens"), "baseline_op": r["baseline_op"],
                   "speedup": round(r["speedup"], 4)} for r in rows if "speedup" in r and "baseline_op" in r]
    return {
        "tool": tool,
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "device": device_info(),
        "git": git_commit(),
        "versions": {"commlib": __version__, "torch": torch.__version__, "python": platform.python_version()},
        "world_size": world_size,
        **extra,
        "rows": rows,
        "ratios": ratios,
    }


def write_result(doc: dict, path: Optional[str] = None, name: Optional[str] = None) -> Path:
    """Write ``doc`` (from ``result_document``) to ``result_path(path, name or doc["tool"], ...)``;
    returns the file."""
    out = result_path(path, name or doc["tool"], doc.get("world_size") or 1, doc.get("device"),
                      (doc.get("git") or {}).get("commit"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return out
