"""Auto-tuner benchmark: the smart search against the exhaustive sweep, and tuned against default.

    python -m benchmarks.bench_tune                        # real engine: one rank per GPU, V3 workload
    python -m benchmarks.bench_tune --simulate             # synthetic cost model with noise (CPU, seconds)
    python -m benchmarks.bench_tune --simulate --world 16 --ranks-per-node 8 --seeds 5 --check

For each kind (dispatch, combine) and token count (default 128, 1024, 4096 per rank; hidden 7168,
top-8 of 256 experts, group-limited routing) both strategies of ``commlib.tuning.autotune.search`` run on the
same search space, then the two winners and the default config are timed again, interleaved,
with fresh samples ("verify"). Claims, checked on the V3 rows (4096 tokens; --check turns a miss
into exit status 1) and reported for all rows:
  quality   smart winner's time <= 1.03 x exhaustive winner's time
  cost      smart tuning time <= 0.25 x exhaustive tuning time
Columns:
  configs   candidates timed; batches: batches of --reps calls (plus --warmup untimed ones) run
  tune      tuning time: wall seconds on the GPU; simulated GPU seconds with --simulate (all calls,
            warm-ups included)
  best      the strategy's fastest config as num_sms/nvl_send/nvl_recv/rdma_send/rdma_recv
  time_us   verified median of that config (slowest rank); vs_exh = time / exhaustive's time
  default   verified median of the default config (commlib.config defaults, Buffer.num_sms)
  speedup   default / tuned, where tuned is what the search returns (the default itself when the
            winner's gain is within the noise)
With --simulate the times are the cost model's noise-free times (the truth the search estimates).
JSON goes to benchmarks/results/ (--json: a file or a folder).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import random
import shlex
import statistics
import sys
from typing import Any, Optional

from commlib.bench import results
from commlib.tuning import autotune as tune
from commlib.config import Config, default_combine_config, default_dispatch_config
QUALITY_LIMIT = 1.03
COST_LIMIT = 0.25
V3_TOKENS = 4096


class SimulatedWorkload:
    """A synthetic, noisy cost model of one dispatch or combine call (per rank, microseconds).

    With H200-like constants (docs/launch.md, "The performance method"): launch + count exchange;
    rows over NVLink at bw(num_sms) (saturating near 330 GB/s, losing a little past 24 CTAs to
    contention); a pipeline fill of one send chunk per channel; a flag round trip per chunk, half
    hidden behind the copies; a fixed cost per channel. Several nodes add the network hop with its
    own chunk, overlapped with the NVLink part; combine adds the reduction of rows by the receiving
    CTAs. Capacities above what a call needs cost 0.3% per doubling (buffer footprint), a ring the
    call wraps stalls the sender when ring - send chunk rows cannot cover a head round trip, and a
    fixed +-0.75% ripple per config keeps the landscape from being perfectly smooth. The optimum
    chunk shrinks as num_sms grows:
    a diagonal valley, as on the real engine.
    Samples: lognormal noise (``noise``), a per-batch drift, 3% outliers of +5..30%.
    ``elapsed`` accumulates every simulated call, warm-ups included: the tuning time.
    """

    NVL_PEAK = 360e3        # bytes / us per direction with SM stores
    NET_PEAK = 45e3         # bytes / us per GPU (400 Gb/s class NIC)
    SYNC_US = 1.0           # publish + acquire of a chunk's tail over NVLink
    NET_SYNC_US = 4.0
    CHANNEL_US = 0.5
    REDUCE_PER_US = 2.5e5   # bf16 elements a CTA accumulates per us

    def __init__(self, kind: str, num_tokens: int, hidden: int, *, num_ranks: int = 2,
                 ranks_per_node: Optional[int] = None, dtype: Any = "bfloat16", num_experts: int = 256,
                 topk: int = 8, reps: int = 5, warmup: int = 2, noise: float = 0.02, seed: int = 0,
                 noise_seed: Optional[int] = None) -> None:
        self.kind, self.num_tokens, self.hidden = kind, num_tokens, hidden
        self.num_ranks, self.ranks_per_node = num_ranks, ranks_per_node or num_ranks
        elem = 2 if kind == "combine" else tune.dtype_bytes(dtype)
        self.row_bytes = hidden * elem + (hidden // 128 * 4 if elem == 1 else 0)
        self.reps, self.warmup, self.noise, self.seed = reps, warmup, noise, seed
        self.rng = random.Random(seed if noise_seed is None else noise_seed)
        self.elapsed = 0.0
        self.calls = 0
        self.num_nodes = self.num_ranks // self.ranks_per_node
        miss = lambda owned: math.comb(num_experts - owned, topk) / math.comb(num_experts, topk)  # noqa: E731
        self.p_rank = 1.0 - miss(num_experts // num_ranks)     # a token reaches a given rank
        self.p_node = (min(1.0 - miss(num_experts // self.num_nodes), 4.0 / self.num_nodes)
                       if self.num_nodes > 1 else 0.0)          # ... a given node (<= 4 nodes a token)

    def true_time(self, config: Config) -> float:
        T, c, s = self.num_tokens, config.num_channels, config.num_sms
        P, M = self.ranks_per_node, self.num_nodes
        per_channel = math.ceil(T / c)
        fan_nvl = self.p_rank * max(P - 1, 1)          # NVLink rows per token
        bw = self.NVL_PEAK * s / (s + 1.5) * (1.0 - 0.004 * max(0, s - 24))
        k = config.num_max_nvl_chunked_send_tokens
        # ring: at most ring - k rows in flight per channel, slots freed a head round trip after a
        # chunk landed; a ring the call wraps slows the bytes when that window cannot keep up
        ring = config.num_max_nvl_chunked_recv_tokens
        need_rate = bw / (c * max(fan_nvl, 1e-9) * self.row_bytes)             # rows / us per channel
        cycle = 2 * self.SYNC_US + k * max(fan_nvl, 1e-9) * self.row_bytes * c / bw
        stall = max(1.0, need_rate * cycle / max(ring - k, 1)) if per_channel > ring else 1.0
        t = (stall * T * fan_nvl * self.row_bytes / bw           # the bytes
             + k * fan_nvl * self.row_bytes * c / bw             # pipeline fill: one chunk per channel
             + math.ceil(per_channel / k) * self.SYNC_US * 0.5   # a flag round trip per chunk
             + c * self.CHANNEL_US)
        if M > 1:
            kr = config.num_max_rdma_chunked_send_tokens
            net_bw = self.NET_PEAK * min(1.0, s / 16) ** 0.5
            fan_net = self.p_node * (M - 1)
            t_net = (T * fan_net * self.row_bytes / net_bw + kr * fan_net * self.row_bytes * c / net_bw
                     + math.ceil(per_channel / kr) * self.NET_SYNC_US * 0.5)
            t = max(t, t_net) + 0.15 * min(t, t_net)
            need = tune.token_bucket(per_channel)
            t *= 1.0 + 0.003 * max(0.0, math.log2(config.num_max_rdma_chunked_recv_tokens / need))
        if self.kind == "combine":
            reduce = T * (1 + fan_nvl) * self.hidden / (c * self.REDUCE_PER_US)
            t = max(t, reduce) + 0.2 * min(t, reduce)
        need = tune.token_bucket(per_channel)
        t *= 1.0 + 0.003 * max(0.0, math.log2(config.num_max_nvl_chunked_recv_tokens / need))
        t += 8.0 + 1.5 * math.log2(max(self.num_ranks, 2))       # launch + count exchange
        fields = tuple(getattr(config, f) for f in tune.FIELDS)
        ripple = random.Random(hash((self.seed,) + fields)).uniform(-0.0075, 0.0075)
        return t * (1.0 + ripple)

    def __call__(self, config: Config) -> list:
        base = self.true_time(config) * math.exp(self.rng.gauss(0.0, self.noise / 3))  # per-batch drift
        samples = []
        for _ in range(self.reps):
            v = base * math.exp(self.rng.gauss(0.0, self.noise))
            if self.rng.random() < 0.03:
                v *= 1.0 + self.rng.uniform(0.05, 0.3)
            samples.append(v)
        self.elapsed += sum(samples) + self.warmup * base
        self.calls += 1
        return samples


def _cfg(d: dict) -> str:
    return "/".join(str(d[f]) for f in tune.FIELDS)


def _default(kind: str, world: int, num_sms: int) -> Config:
    return (default_dispatch_config if kind == "dispatch" else default_combine_config)(world, num_sms)


def _verify(time_fn, configs: list, rounds: int) -> list:
    """Median of fresh samples per config, the configs timed in turn ``rounds`` times (drift cancels)."""
    samples: list = [[] for _ in configs]
    for _ in range(rounds):
        for i, c in enumerate(configs):
            samples[i].extend(time_fn(c))
    return [statistics.median(s) for s in samples]


def _rows(kind: str, T: int, exh, smart, exh_cost: float, smart_cost: float, times: list, seed: int) -> list:
    """Two result rows (exhaustive, smart) from searches and verified [exh best, smart best, default, tuned]."""
    t_exh, t_smart, t_default, t_tuned = times
    out = []
    for name, res, cost, t in (("exhaustive", exh, exh_cost, t_exh), ("smart", smart, smart_cost, t_smart)):
        out.append({"kind": kind, "num_tokens": T, "seed": seed, "strategy": name, "configs": len(res.trials),
                    "batches": res.num_batches, "tune_s": cost, "best": dataclasses.asdict(res.best),
                    "chosen": dataclasses.asdict(res.config), "replaced": res.replaced, "time_us": t,
                    "vs_exh": t / t_exh, "default_us": t_default, "final_best": res.best_time,
                    "final_default": res.default_time, "margin": res.margin,
                    "speedup": (t_default / (t if res.replaced else t_default)) if t_default else None})
    out[1]["cost_ratio"] = smart_cost / exh_cost
    out[1]["quality"] = t_smart / t_exh
    out[1]["tuned_us"] = t_tuned
    return out


def run_simulated(args) -> list:
    rows = []
    for seed in range(args.seed, args.seed + args.seeds):
        for T in args.tokens:
            for kind in args.kinds:
                dtype = args.dtype if kind == "dispatch" else "bf16"
                space = tune.default_space(kind, args.world, args.ranks_per_node, args.hidden, dtype, T,
                                           num_nvl_bytes=args.num_nvl_bytes, num_rdma_bytes=args.num_nvl_bytes)
                model = lambda noise_seed: SimulatedWorkload(  # noqa: E731
                    kind, T, args.hidden, num_ranks=args.world, ranks_per_node=args.ranks_per_node, dtype=dtype,
                    reps=args.reps, warmup=args.warmup, seed=seed, noise_seed=noise_seed)
                default = _default(kind, args.world, args.num_sms)
                m_exh, m_smart = model(2 * seed + 1), model(2 * seed + 2)
                exh = tune.search(space, m_exh, default=default, strategy="exhaustive", batches=args.batches)
                smart = tune.search(space, m_smart, default=default, strategy="smart", batches=args.batches)
                truth = model(0)
                times = [truth.true_time(c) for c in (exh.best, smart.best, default, smart.config)]
                rows += _rows(kind, T, exh, smart, m_exh.elapsed * 1e-6, m_smart.elapsed * 1e-6, times, seed)
    return rows


def _gpu_worker(ctx, args) -> list:
    from commlib.buffer import Buffer
    world, rpn = ctx.world_size, ctx.ranks_per_node
    spaces = {}
    for T in args.tokens:
        for kind in args.kinds:
            dtype = args.dtype if kind == "dispatch" else "bf16"
            spaces[(kind, T)] = (dtype, tune.default_space(kind, world, rpn, args.hidden, dtype, T,
                                                           num_nvl_bytes=args.num_nvl_bytes,
                                                           num_rdma_bytes=args.num_nvl_bytes))
    nvl, rdma = tune.buffer_sizes({k: space for k, (_, space) in spaces.items()}, Buffer.num_sms)
    buffer = Buffer(ctx.group, nvl, rdma, ranks_per_node=rpn)
    rows = []
    try:
        for (kind, T), (dtype, space) in spaces.items():
            # combine runs on a handle from the default dispatch config, as the Buffer does untuned
            d_config = _default("dispatch", world, Buffer.num_sms) if kind == "combine" else None
            space = tune.combine_space(space, d_config)
            timer = tune.BufferTimer(buffer, kind, T, args.hidden, dtype, reps=args.reps, warmup=args.warmup,
                                     flush_l2=ctx.device.type == "cuda", seed=args.seed, dispatch_config=d_config)
            time_fn = tune._agreeing(timer, ctx.group) if world > 1 else timer
            default = _default(kind, world, Buffer.num_sms)
            progress = {s: (tune.TextProgress(f"{kind} T={T} {s}") if ctx.rank == 0 else None)
                        for s in ("exhaustive", "smart")}
            exh = tune.search(space, time_fn, default=default, strategy="exhaustive", batches=args.batches,
                              progress=progress["exhaustive"])
            smart = tune.search(space, time_fn, default=default, strategy="smart", batches=args.batches,
                                progress=progress["smart"])
            for p in progress.values():
                if p is not None:
                    p.close()
            configs = [exh.best, smart.best, default, smart.config]
            times = _verify(time_fn, configs, args.verify_rounds)
            new = _rows(kind, T, exh, smart, exh.wall_s, smart.wall_s, times, args.seed)
            rows += new
            if ctx.rank == 0:  # as it goes: a run cut short still shows what it measured
                print_table(new, "(s)", header=False)
                sys.stdout.flush()
    finally:
        buffer.destroy()
    return rows


def print_table(rows: list, unit: str, header: bool = True) -> None:
    if header:
        print(f"#{'tokens':>7} {'kind':>9} {'strategy':>11} {'configs':>8} {'batches':>8} {'tune':>10} "
              f"{'best':>22} {'time_us':>9} {'vs_exh':>7} {'default':>9} {'speedup':>8}")
        print(f"#{'':>7} {'':>9} {'':>11} {'':>8} {'':>8} {unit:>10} {'':>22} {'(us)':>9} {'':>7} {'(us)':>9} {'':>8}")
    for r in rows:
        speed = f"{r['speedup']:.3f}" if r["speedup"] else "n/a"
        print(f"{r['num_tokens']:>8} {r['kind']:>9} {r['strategy']:>11} {r['configs']:>8} {r['batches']:>8} "
              f"{r['tune_s']:>10.3f} {_cfg(r['best']):>22} {r['time_us']:>9.2f} {r['vs_exh']:>7.3f} "
              f"{r['default_us']:>9.2f} {speed:>8}")


def summary(rows: list) -> dict:
    """Worst quality and cost over all rows and over the V3 rows (4096 tokens), which the claims are about."""
    smart = [r for r in rows if r["strategy"] == "smart"]
    v3 = [r for r in smart if r["num_tokens"] == V3_TOKENS] or smart
    out = {"worst_quality": max(r["quality"] for r in smart), "worst_cost_ratio": max(r["cost_ratio"] for r in smart),
           "mean_quality": statistics.fmean(r["quality"] for r in smart),
           "v3_worst_quality": max(r["quality"] for r in v3), "v3_worst_cost_ratio": max(r["cost_ratio"] for r in v3)}
    out["ok"] = out["v3_worst_quality"] <= QUALITY_LIMIT and out["v3_worst_cost_ratio"] <= COST_LIMIT
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--simulate", action="store_true", help="synthetic cost model instead of the GPU engine")
    p.add_argument("--world", type=int, default=None, help="ranks (default: GPUs; 2 with --simulate)")
    p.add_argument("--ranks-per-node", type=int, default=None)
    p.add_argument("--tokens", type=lambda s: [int(v) for v in s.split(",")], default=[128, 1024, 4096])
    p.add_argument("--kinds", type=lambda s: s.split(","), default=["dispatch", "combine"])
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--batches", type=int, default=4, help="batches a winner is timed with")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--verify-rounds", type=int, default=16, help="interleaved re-timing of the winners")
    p.add_argument("--num-sms", type=int, default=20, help="num_sms of the default config")
    p.add_argument("--num-nvl-bytes", type=int, default=2 << 30, help="largest buffer a candidate may need")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int, default=1, help="--simulate: repeat over this many seeds")
    p.add_argument("--json", default=None, help="a .json file, or a folder for the standard name (default: "
                   "benchmarks/results/bench_tune_<gpu>x<n>_<yyyymmdd>_<commit>.json)")
    p.add_argument("--check", action="store_true", help="exit 1 unless the 3%% / 25%% claims hold")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.simulate:
        args.world = args.world or 2
        args.ranks_per_node = args.ranks_per_node or args.world
        gpu = "simulated"
        rows = run_simulated(args)
        unit = "(sim s)"
    else:
        import torch
        from commlib.utils.launch import parallel_launch
        if not torch.cuda.is_available():
            print("bench_tune: no CUDA GPU; use --simulate for the cost model", file=sys.stderr)
            return 2
        args.world = args.world or torch.cuda.device_count()
        args.ranks_per_node = args.ranks_per_node or args.world
        gpu = tune.machine("cuda")[0]
        rows = parallel_launch(args.world, _gpu_worker, args, ranks_per_node=args.ranks_per_node, use_gpu=True,
                               timeout_s=7200.0)
        unit = "(s)"
    print(f"# commlib tuner: smart vs exhaustive on {gpu}, {args.world} ranks ({args.ranks_per_node} per node), "
          f"hidden {args.hidden}, {args.dtype} dispatch, {args.batches} x {args.reps} samples per winner")
    print_table(rows, unit)
    s = summary(rows)
    verdict = "ok" if s["ok"] else "MISSED"
    print(f"# smart vs exhaustive, all rows: tuning time <= {s['worst_cost_ratio'] * 100:.1f}%, result within "
          f"{(s['worst_quality'] - 1) * 100:+.2f}% worst, {(s['mean_quality'] - 1) * 100:+.2f}% mean")
    print(f"# V3 ({V3_TOKENS} tokens): tuning time <= {s['v3_worst_cost_ratio'] * 100:.1f}% (limit "
          f"{COST_LIMIT * 100:.0f}%), result within {(s['v3_worst_quality'] - 1) * 100:+.2f}% (limit "
          f"+{(QUALITY_LIMIT - 1) * 100:.0f}%): {verdict}")
    command = "python -m benchmarks.bench_tune " + " ".join(shlex.quote(v) for v in (sys.argv[1:] if argv is None else argv))
    doc = results.result_document("bench_tune", command.strip(), rows, world_size=args.world, gpu=gpu,
                                  ranks_per_node=args.ranks_per_node, hidden=args.hidden, dtype=args.dtype,
                                  batches=args.batches, reps=args.reps, warmup=args.warmup, simulated=args.simulate,
                                  summary=s, ratios=[{"kind": r.get("kind"), "tokens": r.get("num_tokens"),
                                                      "strategy": r.get("strategy"), "speedup": r.get("speedup")}
                                                     for r in rows])
    out = results.write_result(doc, args.json, name="bench_tune_simulated" if args.simulate else "bench_tune")
    print(f"# wrote {out}")
    return 1 if args.check and not s["ok"] else 0


if __name__ == "__main__":
    sys.exit(main())
