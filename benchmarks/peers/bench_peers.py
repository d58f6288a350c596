"""Same-run peers: DeepEP v1 beside commlib at HEAD and at the pre-rings commit, same inputs, same world.

    python -m benchmarks.peers.bench_peers --world 2,4 --json benchmarks/results

Engines (benchmarks/peers/engines.py; every one loaded by path in each rank, run in turn on the
same tensors): `head` (commlib of this checkout), `917fdc0` (commlib before the streaming rings,
exported to --old by prepare.sh), `deepep` (DeepEP v1: its Python package from --deepep, its
extension from --deepep-so; built on the GPU machine by .peers/build_deepep.sh, a recipe kept out
of the repository: docs/peers.md).

Workload V3: --tokens per rank (4096), hidden 7168, top-8 of 256 experts, group-limited routing
(8 groups, top 4). Settings: sms20, sms24 (commlib HEAD and DeepEP with one Config: the chunk and
ring sizes of DeepEP's tables for the world size at that SM count; 917fdc0 with rings holding a
channel's whole share, as its benchmark did) and tuned (DeepEP and commlib HEAD: each one's fastest
Config per op of a sweep at --tune-sms SMs over send chunks, ring --tune-ring, on the cached
dispatch BF16 / FP8 and the combine, outputs checked, as DeepEP's tests tune; 917fdc0: config=None,
its own pick). Ops:
  full_bf16 / full_fp8   dispatch with the layout's counts (count exchange, host read, kernel)
  cached_bf16 / _fp8     dispatch with the handle reused (no count exchange, no host read)
  combine                BF16, the rows of the BF16 dispatch
Columns: gpu_us = CUDA events around the call, 256 MB L2 flush before each, median of --iters
(commlib.utils.timing.bench_cuda), the slowest rank's; algbw = logical bytes (received rows x row
bytes, local rows included, FP8 rows (1 + 4/128) / 2 of BF16) / gpu_us; host_us / cpu_us = wall and
thread CPU time per call with the host ahead of the device (benchmarks.host_timing.host_times; the
full dispatch reads its counts, so its host time includes waiting for the device);
x_deepep = DeepEP's gpu_us / this engine's (> 1: faster than DeepEP), the same for host_us;
x_old = 917fdc0's gpu_us / HEAD's. #wrong: elements that differ from the NCCL all-to-all oracle
(commlib.bench.baseline): received rows ordered by (source rank, source token) bit for bit (data and
FP8 scales), combine within BF16 rounding; exit status 1 when any row is wrong or a world failed.
Ranks sharing one GPU under CUDA MPS move the peers' rows through HBM: every device figure is
"HBM loopback under MPS", never NVLink. DeepEP's low-latency kernels need NVSHMEM, which the build
leaves out: they are not run. The JSON is rewritten after each world, so a later world that runs
out of time leaves the earlier ones' figures.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.host_timing import host_times
from benchmarks.peers import engines as peer_engines
from benchmarks.peers.calls import Calls, sweep
from commlib.bench import baseline, results
from commlib.utils import launch
from commlib.utils.timing import bench_cuda, slowest

ROOT = Path(__file__).resolve().parents[2]
OLD_COMMIT = "917fdc0"
ENGINES = ("head", OLD_COMMIT, "deepep")
OPS = ("full_bf16", "full_fp8", "cached_bf16", "cached_fp8", "combine")
FP8_ROW = (1 + 4 / 128) / 2
LOW_LATENCY = ("not run: DeepEP v1's low-latency kernels need NVSHMEM (one process per GPU); its build here "
               "compiles the intranode kernels only")
DEEPEP_SO_PLACES = (ROOT / ".peers_build" / "DeepEP", ROOT / ".peers" / "prebuilt")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", default="2,4", help="comma list of world sizes, one spawned world each")
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma list of {', '.join(ENGINES)}")
    p.add_argument("--deepep", default=str(ROOT / ".peers" / "DeepEP"),
                   help="folder holding DeepEP's Python package deep_ep/ (its source or build tree)")
    p.add_argument("--deepep-so", default="auto", metavar="PATH",
                   help="DeepEP's built extension deep_ep_cpp*.so, or a folder holding it; auto: "
                        f"the first found in {', '.join(str(d.relative_to(ROOT)) for d in DEEPEP_SO_PLACES)}")
    p.add_argument("--old", default=str(ROOT / ".peers" / f"commlib_{OLD_COMMIT}"),
                   help=f"exported tree of commlib at {OLD_COMMIT} (commlib/ and csrc/)")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--topk-groups", type=int, default=4)
    p.add_argument("--sms", default="20,24", help="comma list of SM budgets (one setting each, plus tuned)")
    p.add_argument("--tune-sms", type=int, default=24, help="SMs of the tuned setting's sweep")
    p.add_argument("--tune-chunks", default="4,8,12,16,20,24,28,32", help="dispatch send chunks swept")
    p.add_argument("--tune-combine-chunks", default="1,2,4,6,8,10,12,16", help="combine send chunks swept")
    p.add_argument("--tune-ring", type=int, default=256, help="ring (recv buffer) tokens of the sweep's Configs")
    p.add_argument("--tune-iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--host-iters", type=int, default=50)
    p.add_argument("--timeout-s", type=float, default=240.0, help="per world")
    p.add_argument("--json", nargs="?", const="auto", default=None, metavar="PATH",
                   help="a .json file, or a folder for the standard name (bench_peers_<gpu>x<n>_<yyyymmdd>_<commit>.json)")
    args = p.parse_args(argv)
    args.world_sizes = [int(w) for w in args.world.split(",") if w.strip()]
    args.sms_list = [int(s) for s in args.sms.split(",") if s.strip()]
    args.engine_names = [e.strip() for e in args.engines.split(",") if e.strip()]
    args.tune_chunk_list = [int(c) for c in args.tune_chunks.split(",") if c.strip()]
    args.tune_combine_list = [int(c) for c in args.tune_combine_chunks.split(",") if c.strip()]
    args.deepep_so_places = ([str(d) for d in DEEPEP_SO_PLACES] if args.deepep_so == "auto" else [args.deepep_so])
    bad = [e for e in args.engine_names if e not in ENGINES]
    if bad or not args.engine_names:
        p.error(f"--engines: unknown {bad or 'none given'}; choose from {', '.join(ENGINES)}")
    if not args.world_sizes or any(w < 1 for w in args.world_sizes):
        p.error(f"--world: positive world sizes, got {args.world!r}")
    if not args.sms_list or any(s <= 0 or s % 2 for s in args.sms_list):
        p.error(f"--sms: positive even SM counts, got {args.sms!r}")
    if args.tune_sms <= 0 or args.tune_sms % 2:
        p.error(f"--tune-sms: a positive even SM count, got {args.tune_sms}")
    chunks = args.tune_chunk_list + args.tune_combine_list
    if not args.tune_chunk_list or not args.tune_combine_list or any(not 0 < c < args.tune_ring for c in chunks):
        p.error(f"--tune-chunks / --tune-combine-chunks: send chunks between 1 and --tune-ring - 1 "
                f"({args.tune_ring - 1}), got {args.tune_chunks!r} / {args.tune_combine_chunks!r}")
    return args


# ------------------------------------------------------------------------------------------------
# the worker (one per rank; every engine in turn)
# ------------------------------------------------------------------------------------------------

def _inputs(args, rank: int, dev: torch.device):
    from commlib import routing
    from commlib.fp8 import per_token_cast_to_fp8

    g = torch.Generator().manual_seed(1000 + 7 * rank + args.tokens)
    scores = torch.sigmoid(torch.randn(args.tokens, args.experts, generator=g))
    idx, w = routing.group_limited_topk(scores, args.groups, args.topk_groups, args.topk)
    x = torch.randn(args.tokens, args.hidden, generator=g).to(torch.bfloat16)
    x, idx, w = x.to(dev), idx.to(dev), w.to(dev)
    return x, per_token_cast_to_fp8(x), idx, w


def _load(name: str, args, R: int) -> peer_engines.Engine:
    if name == "head":
        return peer_engines.commlib_engine(R)
    if name == OLD_COMMIT:
        return peer_engines.old_commlib_engine(args.old, OLD_COMMIT)
    return peer_engines.deepep_engine(args.deepep, args.deepep_so_places, R)


def _source(name: str, args) -> str:
    """The commit an engine was built from (DeepEP: the COMMIT file prepare.sh writes beside its source)."""
    if name == "head":
        return results.git_commit()["commit"]
    if name == OLD_COMMIT:
        return OLD_COMMIT
    stamp = Path(args.deepep) / "COMMIT"
    return stamp.read_text().strip() if stamp.is_file() else "unknown"


def _agree(ok: bool, note: str, group) -> list:
    """Every rank's (ok, note), so all ranks skip an engine together."""
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, (ok, note), group=group)
    return out


def run_engine(eng: peer_engines.Engine, args, ctx, x, xq, idx, w, oracle) -> tuple:
    """One engine's rows (every setting x op, timed, host-timed, checked) and its sweep's records."""
    R, me, group = ctx.world_size, ctx.rank, ctx.group
    H, E, T = args.hidden, args.experts, args.tokens
    Buffer = eng.module.Buffer
    settings = {f"sms{n}": {"bf16": eng.config("dispatch", n, T), "combine": eng.config("combine", n, T)}
                for n in args.sms_list}
    for cfgs in settings.values():
        cfgs["fp8"] = cfgs["bf16"]
    grid = []
    if eng.candidate is not None:
        grid = [eng.candidate(args.tune_sms, c, args.tune_ring) for c in args.tune_chunk_list + args.tune_combine_list]
    sized = [c for cfgs in settings.values() for c in cfgs.values()] + grid
    sized += [Buffer.get_dispatch_config(R), Buffer.get_combine_config(R)]
    nbytes = max(int(c.get_nvl_buffer_size_hint(H * 2, R)) for c in sized)
    buf = Buffer(group, nbytes, 0, explicitly_destroy=True)
    rows, records = [], []
    try:
        calls = Calls(buf, x, xq, idx.to(getattr(eng.module, "topk_idx_t", torch.int64)), w, E, me, group, oracle)
        if eng.candidate is not None:
            settings["tuned"], records = sweep(eng, calls, args)
        else:
            settings["tuned"] = {"bf16": None, "fp8": None, "combine": None}
        for setting, cfgs in settings.items():
            handle, recv_x, ops = calls.ops(cfgs)
            N = int(recv_x.shape[0])
            for op, fn in ops.items():
                gpu = bench_cuda(fn, warmup=args.warmup, iters=args.iters, flush_l2=True)["median_us"]
                host = host_times(fn, args.host_iters, ahead=not op.startswith("full"), group=group)
                wrong = calls.wrong(op, fn(), handle)
                gpu, host_us, cpu_us = slowest([gpu, host["host_us"], host["cpu_us"]], group)
                wrong = results.reduce_wrong([wrong], group)[0]
                sizes = torch.tensor([float(N)], dtype=torch.float64,
                                     device=torch.device("cuda", torch.cuda.current_device())
                                     if dist.get_backend(group) == "nccl" else torch.device("cpu"))
                dist.all_reduce(sizes, group=group)
                size = float(sizes.item()) / R * 2 * H * (FP8_ROW if op.endswith("fp8") else 1.0)
                fields = peer_engines.config_fields(cfgs["combine" if op == "combine" else op.split("_")[1]])
                rows.append({"engine": eng.name, "label": eng.label, "world": R, "setting": setting, "op": op,
                             "tokens": T, "num_sms": fields["num_sms"] if fields else None,
                             "config": fields, "size_bytes": size, "gpu_us": gpu,
                             "algbw": size / gpu / 1e3, "host_us": host_us, "cpu_us": cpu_us,
                             **results.checked_fields(wrong)})
    finally:
        buf.destroy()
    return rows, [{**r, "world": R} for r in records]


def worker(ctx, a: dict):
    args = argparse.Namespace(**a)
    R, me, dev, group = ctx.world_size, ctx.rank, ctx.device, ctx.group
    x, xq, idx, w = _inputs(args, me, dev)
    b_recv, state = baseline.a2a_dispatch(x, idx, args.experts, group)
    (bq, bs), _ = baseline.a2a_dispatch(xq, idx, args.experts, group)
    oracle = {"bf16": b_recv, "fp8": (bq, bs), "combine": baseline.a2a_combine(b_recv, state, group)}
    rows, tuning, errors, info = [], [], {}, {}
    for name in args.engine_names:
        try:
            eng, note = _load(name, args, R), ""
        except Exception as exc:  # noqa: BLE001 - an engine that does not load is reported and skipped
            eng, note = None, f"load: {exc!r}"
        notes = _agree(eng is not None, note, group)
        if not all(ok for ok, _ in notes):
            errors[name] = next(n for ok, n in notes if not ok)
            continue
        info[name] = {"label": eng.label, "file": str(getattr(eng.module, "__file__", "")), "source": _source(name, args)}
        if name == "deepep":
            info[name]["extension"] = str(getattr(sys.modules.get(peer_engines.DEEPEP_EXTENSION), "__file__", ""))
        try:
            (got, swept), note = run_engine(eng, args, ctx, x, xq, idx, w, oracle), ""
        except Exception:  # noqa: BLE001 - the same failure on every rank: report it, go on with the next engine
            got, swept, note = [], [], traceback.format_exc(limit=6)
        notes = _agree(not note, note, group)
        if not all(ok for ok, _ in notes):
            errors[name] = next(n for ok, n in notes if not ok)
            continue
        rows += got
        tuning += swept
        if me == 0 and args.partial:
            with open(args.partial, "a") as f:
                f.write(json.dumps({"rows": got, "tuning": swept, "engine": {name: info[name]}}) + "\n")
    return {"rows": rows, "tuning": tuning, "errors": errors, "engines": info,
            "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"}


# ------------------------------------------------------------------------------------------------
# ratios, output
# ------------------------------------------------------------------------------------------------

def mode_label(world: int, gpus: int, env=None) -> str:
    """What the device figures of a world are: ranks sharing a GPU under MPS move the peers' rows
    through HBM ("HBM loopback under MPS"); without MPS they time-slice."""
    env = os.environ if env is None else env
    if not gpus:
        return "CPU ranks (reference backends; no device figures)"
    if world > gpus:
        return ("HBM loopback under MPS" if env.get("CUDA_MPS_PIPE_DIRECTORY")
                else "ranks time-sliced on a shared GPU (no MPS): device times not comparable")
    return "one process per GPU"


def ratios(rows: list) -> list:
    """Per (world, setting, op): each engine against DeepEP (x_deepep = DeepEP's time / the engine's,
    gpu and host) and HEAD against the old commit (x_old = old's gpu time / HEAD's)."""
    by = {(r["world"], r["setting"], r["op"], r["engine"]): r for r in rows}
    out = []
    for (world, setting, op, engine), r in by.items():
        if engine == "deepep":
            continue
        d, old = by.get((world, setting, op, "deepep")), by.get((world, setting, op, OLD_COMMIT))
        entry = {"world": world, "setting": setting, "op": op, "engine": engine, "mode": r["mode"],
                 "x_deepep": d["gpu_us"] / r["gpu_us"] if d else None,
                 "x_deepep_host": d["host_us"] / r["host_us"] if d else None}
        if engine == "head":
            entry["x_old"] = old["gpu_us"] / r["gpu_us"] if old else None
        out.append(entry)
    return out


def _f(v, fmt="8.1f"):
    if isinstance(v, (int, float)) and v == v:
        return format(v, fmt)
    return " " * (int(fmt.split(".")[0]) - 1) + "-"


def print_report(result: dict) -> None:
    x = {(q["world"], q["setting"], q["op"], q["engine"]): q for q in result["ratios"]}
    for world in sorted({r["world"] for r in result["rows"]}):
        rows = [r for r in result["rows"] if r["world"] == world]
        print(f"# bench_peers EP{world}: {rows[0]['mode']}; {result['args']['tokens']} tokens, hidden "
              f"{result['args']['hidden']}, top-{result['args']['topk']} of {result['args']['experts']} experts; "
              "times in us, GB/s logical")
        print(f"#{'engine':>15} {'setting':>7} {'sms':>4} {'chunk':>5} {'op':>11} {'size(B)':>11} {'gpu':>8} "
              f"{'algbw':>7} {'host':>8} {'cpu':>8} {'x_deepep':>8} {'x_host':>6} {'x_old':>6} {'#wrong':>6}")
        for r in rows:
            q = x.get((world, r["setting"], r["op"], r["engine"]), {})
            chunk = (r["config"] or {}).get("num_max_nvl_chunked_send_tokens")
            print(f" {r['label']:>15} {r['setting']:>7} {_f(r['num_sms'], '4.0f')} {_f(chunk, '5.0f')} {r['op']:>11} "
                  f"{r['size_bytes']:>11.0f} {_f(r['gpu_us'])} {_f(r['algbw'], '7.1f')} {_f(r['host_us'])} "
                  f"{_f(r['cpu_us'])} {_f(q.get('x_deepep'), '8.2f')} {_f(q.get('x_deepep_host'), '6.2f')} "
                  f"{_f(q.get('x_old'), '6.2f')} {results.wrong_cell(r):>6}")
        for (engine, op), recs in _group_tuning(result.get("tuning", []), world).items():
            grid = " ".join(f"{t['chunk']}:{t['gpu_us']:.1f}{'*' if t['best'] else ''}{'!' if t['wrong'] else ''}"
                            for t in recs)
            print(f"# [sweep] EP{world} {engine} {op} at {recs[0]['num_sms']} SMs, ring {recs[0]['ring']} "
                  f"(chunk:gpu us, * picked, ! wrong): {grid}")
    for world, errors in result["errors"].items():
        for name, note in errors.items():
            print(f"# [failed] EP{world} {name}: {note.strip().splitlines()[-1] if note.strip() else note}")
    print(f"# [low-latency] {LOW_LATENCY}")
    print(results.check_footer(result["rows"]))


def _group_tuning(tuning: list, world: int) -> dict:
    out = {}
    for t in tuning:
        if t["world"] == world:
            out.setdefault((t["engine"], t["op"]), []).append(t)
    return out


def write_json(result: dict, target: str, argv=None) -> Path:
    """The result document (commlib.bench.results) at ``target`` (a .json file or a folder)."""
    command = "python -m benchmarks.peers.bench_peers " + shlex.join(sys.argv[1:] if argv is None else argv)
    doc = results.result_document("bench_peers", command.strip(), result["rows"],
                                  world_size=max([r["world"] for r in result["rows"]] or [1]),
                                  ratios=result["ratios"], tuning=result.get("tuning", []),
                                  engines=result["engines"], errors=result["errors"], modes=result["modes"],
                                  low_latency=LOW_LATENCY, args=result["args"])
    return results.write_result(doc, None if target == "auto" else target)


def _read_partial(path: str) -> dict:
    """What a world's rank 0 recorded engine by engine before the world died or hung."""
    got = {"rows": [], "tuning": [], "engines": {}}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                entry = json.loads(line)
                got["rows"] += entry["rows"]
                got["tuning"] += entry["tuning"]
                got["engines"].update(entry["engine"])
    return got


def run(args, after_world=None) -> dict:
    """Every world of --world in turn; ``after_world(result so far)`` after each."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    out = {"rows": [], "tuning": [], "errors": {}, "engines": {}, "modes": {}, "device": "cpu", "ratios": [],
           "args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, list))}}
    for world in args.world_sizes:
        mode = out["modes"][world] = mode_label(world, gpus)
        fd, partial = tempfile.mkstemp(prefix="bench_peers_", suffix=".jsonl")
        os.close(fd)
        try:
            got = launch.parallel_launch(world, worker, {**vars(args), "partial": partial}, use_gpu=gpus > 0,
                                  timeout_s=args.timeout_s)
            out["errors"][world] = got["errors"]
            out["device"] = got["device"]
        except RuntimeError as exc:   # a world that died or hung: keep the engines it finished
            got = _read_partial(partial)
            out["errors"][world] = {"world": str(exc)[-2000:]}
        finally:
            os.unlink(partial)
        out["engines"].update(got["engines"])
        out["rows"] += [{**r, "mode": mode} for r in got["rows"]]
        out["tuning"] += [{**t, "mode": mode} for t in got["tuning"]]
        out["ratios"] = ratios(out["rows"])
        if after_world is not None:
            after_world(out)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    written = []

    def save(result):
        if args.json is not None:
            written[:] = [write_json(result, args.json, argv)]
    result = run(args, save)
    print_report(result)
    if written:
        print(f"# [json] {written[0]}")
    failed = any(result["errors"].values()) or not result["rows"]
    return 1 if failed else results.exit_status(result["rows"])


if __name__ == "__main__":
    sys.exit(main())
