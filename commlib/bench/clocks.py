"""GPU clock and power telemetry for benchmarks: what the SMs ran at while a measured loop ran.

An H200 holds 700 W. A schedule that keeps the tensor cores busy without gaps (the dual pipeline's
compute stream) can hit that cap where the same work run with gaps (the sequential baseline, idle
while it communicates) does not: the driver then lowers the SM clock, and every kernel runs
slower for reasons that are not the schedule's. ``ClockMonitor`` lets a benchmark show it.

    mon = ClockMonitor()
    mon.start()                      # False (and a no-op) where nvidia-smi is missing
    with mon.window("forward.dual"):
        ...                          # the measured loop
    mon.stop()
    mon.summary()  # {"forward.dual": {"0": {"samples", "sm_mhz_mean", "sm_mhz_min", "power_w_mean",
                   #                        "power_cap_share", "thermal_share", "hw_slowdown_share"}}}

One ``nvidia-smi --query-gpu ... -lms N`` process samples every GPU of the host; a thread stamps
each line as it arrives (time.monotonic), and a window keeps the samples stamped inside it. GPUs
are named by nvidia-smi's index (NVML's order, not CUDA_VISIBLE_DEVICES').
"""
from __future__ import annotations

import contextlib
import shutil
import subprocess
import threading
import time
from typing import Optional, Sequence

# clocks_event_reasons.active bits (nvidia-smi --help-query-gpu)
REASON_SW_POWER_CAP = 0x4
REASON_HW_SLOWDOWN = 0x8 | 0x80          # HW slowdown, HW power brake
REASON_THERMAL = 0x20 | 0x40             # SW / HW thermal slowdown
_FIELDS = "index,clocks.sm,{power},clocks_event_reasons.active"


def parse_line(line: str) -> Optional[tuple]:
    """(gpu index, SM MHz, watts or None, reason bits) of one ``csv,noheader,nounits`` line, or
    None for a line that is not a sample (a warning, a blank line)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != 4:
        return None
    try:
        gpu, mhz = int(parts[0]), float(parts[1])
        reasons = int(parts[3], 16) if parts[3].lower().startswith("0x") else int(parts[3])
    except ValueError:
        return None
    try:
        watts = float(parts[2])
    except ValueError:  # "[N/A]"
        watts = None
    return gpu, mhz, watts, reasons


def summarize_samples(samples: Sequence[tuple]) -> dict:
    """Per GPU (str index): samples, mean and least SM MHz, mean power, and the share of samples
    whose reasons carry the SW power cap, a thermal slowdown, a HW slowdown / power brake."""
    by_gpu: dict = {}
    for gpu, mhz, watts, reasons in samples:
        by_gpu.setdefault(gpu, []).append((mhz, watts, reasons))
    out = {}
    for gpu, rows in sorted(by_gpu.items()):
        n = len(rows)
        watts = [w for _, w, _ in rows if w is not None]
        out[str(gpu)] = {
            "samples": n,
            "sm_mhz_mean": sum(m for m, _, _ in rows) / n,
            "sm_mhz_min": min(m for m, _, _ in rows),
            "power_w_mean": sum(watts) / len(watts) if watts else None,
            "power_cap_share": sum(1 for _, _, r in rows if r & REASON_SW_POWER_CAP) / n,
            "thermal_share": sum(1 for _, _, r in rows if r & REASON_THERMAL) / n,
            "hw_slowdown_share": sum(1 for _, _, r in rows if r & REASON_HW_SLOWDOWN) / n,
        }
    return out


class ClockMonitor:
    """Background sampler of every GPU's SM clock, power and clock-event reasons (module doc).
    ``command``: the sampler's argv (tests pass a fake); default nvidia-smi every ``interval_ms``."""

    def __init__(self, interval_ms: int = 50, command: Optional[Sequence[str]] = None) -> None:
        self.interval_ms = int(interval_ms)
        self.command = list(command) if command is not None else None
        self.samples: list = []  # (monotonic time, gpu, MHz, W, reasons)
        self.windows: list = []  # (name, t0, t1)
        self._proc: Optional[subprocess.Popen] = None
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def _default_command(self) -> Optional[list]:
        smi = shutil.which("nvidia-smi")
        if smi is None:
            return None
        for power in ("power.draw.instant", "power.draw"):  # instant: newer drivers; else 1 s average
            query = [smi, f"--query-gpu={_FIELDS.format(power=power)}", "--format=csv,noheader,nounits"]
            try:
                probe = subprocess.run(query, capture_output=True, text=True, timeout=20)
            except (OSError, subprocess.TimeoutExpired):
                return None
            if probe.returncode == 0 and any(parse_line(l) for l in probe.stdout.splitlines()):
                return query + [f"-lms={self.interval_ms}"]
        return None

    def start(self) -> bool:
        """Start sampling; False where no sampler can run (no nvidia-smi, no GPU)."""
        cmd = self.command if self.command is not None else self._default_command()
        if cmd is None:
            return False
        try:
            self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                          bufsize=1)
        except OSError:
            return False
        self._thread = threading.Thread(target=self._read, name="commlib-clocks", daemon=True)
        self._thread.start()
        return True

    def _read(self) -> None:
        for line in self._proc.stdout:
            s = parse_line(line)
            if s is not None:
                with self._lock:
                    self.samples.append((time.monotonic(),) + s)

    @contextlib.contextmanager
    def window(self, name: str):
        """Samples stamped while the block runs belong to window ``name`` (several blocks with one
        name add up)."""
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.windows.append((name, t0, time.monotonic()))

    def stop(self) -> None:
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._proc = self._thread = None

    def summary(self) -> dict:
        """{window name: summarize_samples(its samples)}; windows without a sample are left out."""
        with self._lock:
            samples = list(self.samples)
        names: dict = {}
        for name, t0, t1 in self.windows:
            names.setdefault(name, []).extend(s[1:] for s in samples if t0 <= s[0] <= t1)
        return {name: summarize_samples(rows) for name, rows in names.items() if rows}


def clock_ratio(summary: dict, phase: str) -> Optional[float]:
    """Mean SM clock of ``phase``.dual over ``phase``.sequential, averaged over the GPUs both
    windows sampled (None where either window has no sample)."""
    seq, dual = summary.get(f"{phase}.sequential"), summary.get(f"{phase}.dual")
    if not seq or not dual:
        return None
    gpus = sorted(set(seq) & set(dual))
    if not gpus:
        return None
    return sum(dual[g]["sm_mhz_mean"] / seq[g]["sm_mhz_mean"] for g in gpus) / len(gpus)
