"""The search half of commlib.tuning.autotune: the space of valid Configs for a call shape and the search
over it (smart: coarse grid, diagonal hill-climb, successive halving; or exhaustive), independent of
GPUs: ``search(space, time_fn)`` only needs ``time_fn(config) -> [sample times]``.
commlib.tuning.autotune re-exports everything here; import from there.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
import sys
import time
import warnings
from typing import Any, Callable, Iterable, Optional, Sequence

from commlib.config import Config

KINDS = ("dispatch", "combine")

FIELDS = tuple(f.name for f in dataclasses.fields(Config))  # DeepEP's positional order

# Default candidates. Staging is a ring per (source, channel), so any token count runs with any ring:
# the ring sizes trade buffer bytes for slack against the receiver's head updates, the send chunks
# trade publish frequency against pipeline fill. Rings must fit the Buffer (the size hints).
DEFAULT_SMS = tuple(range(8, 49, 4))
DEFAULT_NVL_SEND = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48)
DEFAULT_NVL_RECV = (64, 128, 256, 512, 1024)
DEFAULT_RDMA_SEND = (4, 8, 16, 32, 64)
DEFAULT_RDMA_RECV = (64, 128, 256, 512)
SINGLE_NODE_RDMA = (6, 128)  # the network fields on one node: unused, DeepEP's defaults

TimeFn = Callable[[Config], Sequence[float]]


def config_fields(config: Config) -> tuple:
    """Config -> its fields in order (dataclasses.astuple deep-copies: too slow for 10^4 candidates)."""
    return tuple(getattr(config, name) for name in FIELDS)


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


def check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind must be 'dispatch' or 'combine', got {kind!r}")


def fits(config: Config, num_tokens: int, num_ranks: int, ranks_per_node: int, hidden_bytes: int,
          num_nvl_bytes: Optional[int], num_rdma_bytes: Optional[int]) -> bool:
    """Can a call of rows of ``hidden_bytes`` run with ``config`` on this Buffer? Rows stream through
    the rings, so ``num_tokens`` does not matter: the rings must fit the buffers."""
    if num_nvl_bytes is not None and config.get_nvl_buffer_size_hint(hidden_bytes, ranks_per_node) > num_nvl_bytes:
        return False
    multi_node = num_ranks > ranks_per_node
    if (multi_node and num_rdma_bytes is not None
            and config.get_rdma_buffer_size_hint(hidden_bytes, num_ranks, ranks_per_node=ranks_per_node)
            > num_rdma_bytes):
        return False
    return True


# -------------------------------------------------------------------------------- search space
@dataclasses.dataclass(frozen=True)
class SearchSpace:
    """Candidate values per Config field, and what every candidate must satisfy.

    ``num_tokens``: the token bucket tuned for (its upper end).
    ``hidden_bytes``: row bytes for the buffer-size checks against num_nvl_bytes / num_rdma_bytes.
    """
    num_sms: tuple = DEFAULT_SMS
    nvl_send: tuple = DEFAULT_NVL_SEND
    nvl_recv: tuple = DEFAULT_NVL_RECV
    rdma_send: tuple = (SINGLE_NODE_RDMA[0],)
    rdma_recv: tuple = (SINGLE_NODE_RDMA[1],)
    num_tokens: int = 1
    num_ranks: int = 1
    ranks_per_node: int = 1
    hidden_bytes: int = 0
    num_nvl_bytes: Optional[int] = None
    num_rdma_bytes: Optional[int] = None

    def is_valid(self, config: Config) -> bool:
        return fits(config, self.num_tokens, self.num_ranks, self.ranks_per_node, max(self.hidden_bytes, 1),
                     self.num_nvl_bytes if self.hidden_bytes else None,
                     self.num_rdma_bytes if self.hidden_bytes else None)

    def configs(self) -> list[Config]:
        out = []
        for values in itertools.product(self.num_sms, self.nvl_send, self.nvl_recv, self.rdma_send, self.rdma_recv):
            try:
                config = Config(*values).check_runnable()
            except (TypeError, ValueError):  # odd num_sms, send chunk not below the ring, ...
                continue
            if self.is_valid(config):
                out.append(config)
        return out


def default_space(kind: str, num_ranks: int, ranks_per_node: int, hidden: int, dtype: Any, num_tokens: int, *,
                  num_nvl_bytes: Optional[int] = None, num_rdma_bytes: Optional[int] = None,
                  num_sms: Sequence[int] = DEFAULT_SMS, nvl_send: Sequence[int] = DEFAULT_NVL_SEND,
                  nvl_recv: Sequence[int] = DEFAULT_NVL_RECV, rdma_send: Sequence[int] = DEFAULT_RDMA_SEND,
                  rdma_recv: Sequence[int] = DEFAULT_RDMA_RECV, max_num_sms: Optional[int] = None) -> SearchSpace:
    """The space tuned for a call shape (``token_bucket(num_tokens)`` tokens); rings must fit the buffers.

    On one node the network fields do not matter and stay at SINGLE_NODE_RDMA.
    """
    check_kind(kind)
    if num_ranks <= 0 or ranks_per_node <= 0 or num_ranks % ranks_per_node:
        raise ValueError(f"ranks_per_node ({ranks_per_node}) must divide num_ranks ({num_ranks})")
    sms = tuple(s for s in num_sms if s % 2 == 0 and s > 0 and (max_num_sms is None or s <= max_num_sms))
    multi_node = num_ranks > ranks_per_node
    return SearchSpace(
        num_sms=sms, nvl_send=tuple(nvl_send), nvl_recv=tuple(nvl_recv),
        rdma_send=tuple(rdma_send) if multi_node else (SINGLE_NODE_RDMA[0],),
        rdma_recv=tuple(rdma_recv) if multi_node else (SINGLE_NODE_RDMA[1],),
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
    configs = list(dict.fromkeys(config_fields(c) for c in configs))  # as tuples: Config is unhashable
    if not configs:
        raise ValueError("tuning: the search space is empty (no candidate satisfies the token count / buffer size)")
    runnable_default = default is not None and (
        config_fields(default) in configs or (isinstance(space, SearchSpace) and space.is_valid(default)))
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
    if runnable_default and best != config_fields(default):
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
        return s.project(config_fields(default), {})
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
