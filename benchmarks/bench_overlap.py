"""Dual pipeline vs sequential: a MoE layer (attention + routed experts + shared expert) on two
micro-batches, expert-parallel over the ranks.

Three phases, each timed both ways (CUDA events, median of --iters after --warmup, ranks
barrier-aligned before every iteration):
  forward            F(mb0), F(mb1)           vs  dual_forward
  forward+backward   F0, F1, B0, B1           vs  dual_forward + dual_backward
  fwd(mb0)+bwd(mb1)  F(mb0), then B(mb1)      vs  overlapped_forward_backward (DualPipe's hook)
"sequential" runs the same stages with synchronous communication. comm and compute are the sums
of the comm-stream and compute-stream step spans of the sequential run (recorded with CUDA
events); the figure of merit is time(dual) / max(comm, compute) (1.0 = perfect overlap; target
<= 1.15) and the speedup over sequential (target >= 1.3 where comm ~ compute).

Shapes: ``--preset v3`` is DeepSeek-V3's MoE layer scaled to 2 GPUs (hidden 7168, 256 experts =
128 per GPU, top-8 in 4 of 8 groups, expert intermediate 2048, one shared expert, 4096 tokens per
micro-batch, attention stand-in: 56 heads x 128). Compute dominates there, so overlap can hide
the communication but cannot give much speedup. ``--preset balanced`` keeps the token rows
(4096 x 7168 bf16) and cuts the work per row (16 experts, top-2, expert intermediate 256, no
shared expert, 4 heads x 128) to bring compute towards comm. ``--preset balanced_fb`` aims
at forward+backward comm ~ compute: the MoE layer alone (``heads 0``: no attention,
whose norms and projections alone outweigh the all-to-alls), V3's traffic pattern at EP2 (every
token reaches both GPUs: top-2 of 2 experts, 8192 rows received per GPU per micro-batch) and the
expert intermediate size *calibrated* on the spot: before timing, the sequential forward+backward
is measured for expert_hidden in 64 .. 4096 and the size whose compute / comm is nearest 1 is
kept (``--no-calibrate`` or an explicit ``--expert-hidden`` skips it; the trials are in the JSON).
Where even the smallest size leaves compute above comm, the calibration stops at its first size
(what compute remains is mostly routing and row gathers and scatters; docs/notes/2026-11-30_pipeline_log.md).

Communication SMs (``--comm-sms N``): DeepSeek's design point turns the other knob. Every dispatch
and combine of the benchmark (forward and backward, sequential and dual) is passed
``Config(num_sms=N, ...)`` (N CTAs, N / 2 channels; the Buffer's default chunk sizes, the receive
capacity raised to ceil(tokens / channels) when one channel must hold more), instead of the
Buffer's own choice (``Buffer.num_sms``, 20, or a tuned config from the tuning cache). Fewer SMs
make each all-to-all slower, and leave more SMs to the GEMMs and elementwise kernels running
beside it in the dual pipeline; the sequential run, which never overlaps the two, only sees the
slower communication. The point is to spend no more SMs on communication than it takes for it
to last about as long as the compute it hides behind; the speedup target (>= 1.3x) applies where
comm ~ compute. ``--preset balanced_sms`` is balanced_fb's shapes with expert intermediate 256
(a small GEMM beside the elementwise work, as in ``balanced``) and the comm SMs *calibrated*: the
same sequential forward+backward is measured for N in 4 .. 24 (fewest first, stopping once comm
<= compute; not 2, a single channel: see COMM_SMS_CALIBRATION) and the N whose comm / compute is
nearest 1 (log distance) is kept
(``--calibrate-comm-sms`` on any preset; ``--comm-sms N`` or ``--no-calibrate`` skips it; one
calibration per run). On the reference backend (CPU) N is recorded and reaches the calls, but
moves nothing in time. The JSON records ``comm_sms`` (and where it came from) for every run.
Every shape flag overrides the preset. The JSON records comm / compute per phase, the best speedup
any overlap could give ((comm + compute) / max), and verdicts against the issue's targets.

A network hop (``--preset network --ce-staging host``): DeepSeek's comm ~ compute comes from the
inter-node link, ~50 GB/s per GPU, beside GEMM-bound compute. ``--ce-staging host`` moves every
dispatch and combine through the copy engines with the staging in pinned host memory
(COMMLIB_CE_BYTES / COMMLIB_CE_STAGING=host, docs/environment.md): the rows cross PCIe out of one
GPU and into the other, the path a NIC's DMA takes, with no SM on the wire. ``network`` keeps
``balanced``'s routing at 16384 tokens and makes the compute GEMM-bound (16 heads, expert
intermediate 3072), which puts each phase's comm / compute inside the "about equal" band.

Before timing, every measured phase's dual schedule is checked against its sequential run (outputs
and parameter gradients; CPU: bit for bit, GPUs: 1e-2 relative): a wrong result prints WRONG and
the run exits 1. What is not compared says so: "compute_dense_checked": false in the JSON (the compute-dense
reference, whose replayed rows make its outputs meaningless), N/A in the table.

Writes JSON (device, git commit, command, figures, step spans) and a timeline PNG of the two
streams to --out-dir (default benchmarks/results/). The pieces live in benchmarks/overlap/.

Run (from the repository root):
  torchrun --nproc-per-node 2 -m benchmarks.bench_overlap --preset v3          # GPUs
  python -m benchmarks.bench_overlap --preset balanced_fb                      # GPUs (spawns 2 ranks)
  python -m benchmarks.bench_overlap --preset balanced_sms --tokens 8192       # GPUs, comm SMs calibrated
  ... --comm-sms 8                                                             # 8 SMs for every all-to-all
  python -m benchmarks.bench_overlap --preset network --ce-staging host --comm-sms 8 --ce-sms 8 --layers 6
  python -m benchmarks.bench_overlap --ranks 2 --preset tiny                   # CPU smoke test
  ... --issue-order compute_first                                              # the old issue order
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

from commlib import Buffer
from commlib.bench.clocks import ClockMonitor, clock_ratio
from commlib.bench.main import git_commit
from commlib.cuda import loader as K
from commlib.training import pipeline as P
from commlib.training.pipeline import schedule as pipeline_schedule
from commlib.utils import env
from commlib.utils.dist import init_distributed
from commlib.utils.launch import RankContext, exit_rank, parallel_launch
from commlib.utils.timing import slowest

from benchmarks.overlap import calibrate as cal
from benchmarks.overlap.analysis import (
    BALANCED_RANGE, COMM_TRACE_SLOTS, COMM_TRACE_SUMMARY, TARGET_DUAL_OVER_MAX, TARGET_SPEEDUP, comm_trace_steps,
    comm_trace_summary, figures, gap_split, halves_floor_ms, sum_spans)
from benchmarks.overlap.check import NOT_CHECKED, compare, exit_code, summarize
from benchmarks.overlap.options import calibration_plan, parse_args, resolve_shapes, transport_env
from benchmarks.overlap.profiling import chrome_trace, kernel_profile
from benchmarks.overlap.replay import ReplayComm
from benchmarks.overlap.report import plot_timeline, print_table


def _git_commit() -> str | None:
    commit = git_commit()["commit"]
    return None if commit == "unknown" else commit


def _carveout_sms(model, on_gpu: bool, carveout) -> int:
    """The SM count the dual schedules kept GEMMs off (0 on CPU: the setting is CUDA-only)."""
    if not on_gpu:
        return 0
    return P.resolve_sm_carveout(carveout, model.stages())


def _buffer_default_sms(buffer):
    """num_sms of the Buffer's own choice (config=None): a tuned config's, where the tuning cache had
    one for these shapes (one value, or [dispatch, combine] ones), else Buffer.num_sms."""
    tuned = sorted({c.num_sms for c in getattr(buffer, "_tuned", {}).values() if c is not None})
    if not tuned:
        return type(buffer).num_sms, "Buffer.num_sms"
    return (tuned[0] if len(tuned) == 1 else tuned), "tuned config (tuning cache)"


def run(ctx, args) -> dict:
    """Run the benchmark on this rank (all ranks call it).

    Returns rank 0: the result dict (also written as JSON); other ranks: {"check": the check}, which
    is the same on every rank (``exit_code`` reads it).
    """
    device = ctx.device
    on_gpu = device.type == "cuda"
    sh = resolve_shapes(args, on_gpu)
    dtype = torch.bfloat16
    R = ctx.world_size
    calibrate, calibrate_sms = calibration_plan(args, sh["preset"])
    if args.comm_trace and not on_gpu:
        raise SystemExit("[overlap] --comm-trace needs the GPUs (the nvlink backend records the trace)")
    if args.kernel_variant or args.comm_trace:
        variant = K.parse_variant(args.kernel_variant)
        if args.comm_trace:  # every launch of a timeline run keeps its own trace slot (trace_history)
            variant["COMM_TRACE"] = 1
            os.environ["COMMLIB_DEBUG_SMID"] = "1"
            os.environ["COMMLIB_DEBUG_SMID_SLOTS"] = str(COMM_TRACE_SLOTS)
        K.set_variant(variant)
    comm_configs = cal.comm_configs(R, args.comm_sms, sh["tokens"], args.send_chunk)
    # The Buffer holds every config this run may use: the default, --comm-sms's or the candidates'.
    configs = [Buffer.get_dispatch_config(R)] + [c for c in comm_configs if c is not None]
    if calibrate_sms:
        configs += [c for n in cal.COMM_SMS_CALIBRATION for c in cal.comm_configs(R, n, sh["tokens"])]
    hidden_bytes = sh["hidden"] * 2
    buffer = Buffer(ctx.group,
                    num_nvl_bytes=max(c.get_nvl_buffer_size_hint(hidden_bytes, ctx.ranks_per_node) for c in configs),
                    num_rdma_bytes=(max(c.get_rdma_buffer_size_hint(hidden_bytes, R) for c in configs)
                                    if ctx.ranks_per_node < R else 0),
                    backend=args.backend)
    if args.comm_priority is not None and on_gpu:
        buffer.comm_stream = torch.cuda.Stream(device=device, priority=args.comm_priority)
    g = torch.Generator(device="cpu").manual_seed(args.seed * 1000 + ctx.rank)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    h0, h1 = rnd(1, sh["tokens"], sh["hidden"]), rnd(1, sh["tokens"], sh["hidden"])
    g0, g1 = rnd(1, sh["tokens"], sh["hidden"]), rnd(1, sh["tokens"], sh["hidden"])
    clock = cal.Clock(device)
    order = args.issue_order
    carveout = args.sm_carveout
    carveout_bwd = args.sm_carveout_backward if args.sm_carveout_backward is not None else carveout
    pipeline_schedule.TURN_KEEPS_WGRAD = not args.turn_defer
    defer = args.defer_wgrad

    calibration = None
    comm_sms, comm_sms_source = args.comm_sms, "--comm-sms"
    if calibrate:
        size, trials = cal.calibrate(ctx, args, sh, buffer, (h0, h1, g0, g1), clock, comm_configs)
        sh["expert_hidden"] = size
        calibration = {"knob": "expert_hidden",
                       "what": "expert_hidden whose sequential forward+backward compute / comm is nearest 1",
                       "chosen": size, "trials": trials}
    model = cal.build_model(args, sh, buffer, device, comm_configs)
    if calibrate_sms:
        comm_sms, trials = cal.calibrate_comm_sms(ctx, model, (h0, h1, g0, g1), clock, sh["tokens"])
        comm_sms_source = "calibrated"
        calibration = {"knob": "comm_sms",
                       "what": "comm SMs whose sequential forward+backward comm / compute is nearest 1 "
                               "(fewest first, stopping once comm <= compute)",
                       "candidates": list(cal.COMM_SMS_CALIBRATION), "chosen": comm_sms, "trials": trials}

    def fwd(overlap, timeline=None):
        """Two forwards (no autograd); returns the two outputs."""
        with torch.no_grad():
            return P.dual_forward(model, (h0,), (h1,), timeline=timeline, overlap=overlap, issue_order=order,
                           sm_carveout=carveout)

    def fwd_bwd(overlap, timeline=None):
        """Two forwards then two backwards (--fb-schedule); returns the two outputs."""
        model.zero_grad(set_to_none=True)
        return P.dual_forward_backward(model, (h0,), (h1,), grads0=g0, grads1=g1, timeline=timeline,
                                       overlap=overlap, issue_order=order, sm_carveout=(carveout, carveout_bwd),
                                       defer_weight_grads=defer, schedule=args.fb_schedule)

    def f_and_b(o1, overlap, timeline=None):
        """Micro-batch 0's forward with micro-batch 1's backward (o1: its forward's outputs)."""
        return P.overlapped_forward_backward(model, [h0], None, None, model, None, [o1], [g1], timeline=timeline,
                                             overlap=overlap, issue_order=order, sm_carveout=carveout,
                                             defer_weight_grads=defer)

    def timed_f_and_b(overlap, timeline, before_last=None, before_each=None):
        """DualPipe's steady state: micro-batch 1's forward ran earlier (untimed); time micro-batch
        0's forward together with micro-batch 1's backward. before_last(): called right before the
        last (recorded) iteration's timed part; before_each(): at the start of every iteration."""
        times = []
        for it in range(args.warmup + args.iters):
            if before_each is not None:
                before_each()
            model.zero_grad(set_to_none=True)
            o1 = model(h1)
            last = it == args.warmup + args.iters - 1
            if last and before_last is not None:
                before_last()
            t = clock.time_ms(lambda: f_and_b(o1, overlap, timeline if last else None))
            if it >= args.warmup:
                times.append(t)
        return statistics.median(times)

    def fwd0_bwd1(overlap):
        """Micro-batch 1's forward, then micro-batch 0's forward with micro-batch 1's backward."""
        return f_and_b(model(h1), overlap)[0]

    # Every measured phase's dual schedule against its sequential run (outputs and gradients).
    check = summarize({name: compare(model, fn, device, name)
                       for name, fn in (("forward", fwd), ("forward_backward", fwd_bwd), ("fwd0_bwd1", fwd0_bwd1))
                       if name in args.phases})

    backend = buffer.backend if args.comm_trace else None
    traces: dict = {}  # phase -> schedule -> {kernel kind: [per launch: per CTA (start, own done, end)]}

    def trace_reset():
        if backend is not None:
            backend.reset_trace_history()

    def trace_keep(name, sched):
        if backend is not None:
            traces.setdefault(name, {})[sched] = {k: backend.trace_history(k) for k in ("dispatch", "combine")}

    # SM clock / power while each measured loop runs (rank 0 samples every GPU of the host): a dual
    # schedule dense enough to reach the power cap runs its kernels at a lower clock
    monitor = ClockMonitor() if on_gpu and ctx.rank == 0 and not args.no_clocks else None
    if monitor is not None and not monitor.start():
        monitor = None
    windows = monitor.window if monitor is not None else (lambda name: contextlib.nullcontext())

    phases = {}
    for name, fn in (("forward", fwd), ("forward_backward", fwd_bwd)):
        if name not in args.phases:
            continue
        with windows(f"{name}.sequential"):
            seq_ms = cal.median_ms(clock, lambda: fn(False), args.warmup, args.iters)
        with windows(f"{name}.dual"):
            dual_ms = cal.median_ms(clock, lambda: fn(True), args.warmup, args.iters)
        tl_seq, tl_dual = P.Timeline(), P.Timeline()
        for sched, overlap, tl in (("sequential", False, tl_seq), ("dual", True, tl_dual)):
            trace_reset()
            clock.time_ms(lambda: fn(overlap, tl))
            trace_keep(name, sched)
        phases[name] = (seq_ms, dual_ms, tl_seq.spans(), tl_dual.spans())
    if "fwd0_bwd1" in args.phases:
        tl_seq, tl_dual = P.Timeline(), P.Timeline()
        with windows("fwd0_bwd1.sequential"):
            seq_ms = timed_f_and_b(False, tl_seq, before_last=trace_reset)
        trace_keep("fwd0_bwd1", "sequential")
        with windows("fwd0_bwd1.dual"):
            dual_ms = timed_f_and_b(True, tl_dual, before_last=trace_reset)
        trace_keep("fwd0_bwd1", "dual")
        phases["fwd0_bwd1"] = (seq_ms, dual_ms, tl_seq.spans(), tl_dual.spans())
    # The compute-dense reference: every phase's dual schedule again, its transfers replayed from a
    # recorded run (ReplayComm), so the compute stream runs without a gap at the clock that allows
    dense = {}
    replay = ReplayComm(buffer)
    real_buffer, model.buffer = model.buffer, replay
    try:
        for name, fn in () if args.no_dense else (("forward", fwd), ("forward_backward", fwd_bwd), ("fwd0_bwd1", None)):
            if name not in args.phases:
                continue
            replay.record()
            if fn is not None:
                fn(True)
                replay.mode = "replay"

                def once(fn=fn):
                    replay.rewind()
                    fn(True)
                with windows(f"{name}.dense"):
                    dense[name] = cal.median_ms(clock, once, args.warmup, args.iters)
            else:
                model.zero_grad(set_to_none=True)
                f_and_b(model(h1), True)
                replay.mode = "replay"
                with windows(f"{name}.dense"):
                    dense[name] = timed_f_and_b(True, None, before_each=replay.rewind)
    finally:
        model.buffer = real_buffer
        replay.record()  # drops the last recording's handles and index tensors

    kernels = None
    if args.kernel_profile and on_gpu:
        def profiled(overlap):
            model.zero_grad(set_to_none=True)
            o1 = model(h1)
            torch.cuda.synchronize()
            dist.barrier()
            return lambda: f_and_b(o1, overlap)
        kernels = {sched: kernel_profile(profiled(sched == "dual")) for sched in ("sequential", "dual")}

    if args.trace_dir and on_gpu:
        for sched in ("sequential", "dual"):
            chrome_trace(lambda: fwd_bwd(sched == "dual"), args.trace_dir,
                         f"{args.tag or 'overlap'}_{sched}_rank{ctx.rank}")

    figs = {}
    for name, (seq_ms, dual_ms, spans_seq, spans_dual) in phases.items():
        comm_ms, compute_ms = sum_spans(spans_seq, "comm"), sum_spans(spans_seq, "compute")
        seq_ms, dual_ms, comm_ms, compute_ms, dense_ms = slowest([seq_ms, dual_ms, comm_ms, compute_ms,
                                                                  dense.get(name, 0.0)])
        figs[name] = figures(seq_ms, dual_ms, comm_ms, compute_ms)
        figs[name]["checked"] = check["phases"].get(name, NOT_CHECKED)["checked"]
        if name in dense:  # against the compute as it runs without gaps (ReplayComm): the overlap's own
            # cost, with what a dense schedule's clock does to the compute taken out of it
            # "compute" as the compute alone, back to back: the targets against it too (verdict_dense)
            alt = figures(seq_ms, dual_ms, comm_ms, dense_ms)
            figs[name].update(compute_dense_ms=dense_ms,
                              compute_dense_over_sequential=dense_ms / max(compute_ms, 1e-9),
                              dual_over_max_comm_compute_dense=alt["dual_over_max_comm_compute"],
                              comm_over_compute_dense=alt["comm_over_compute"], verdict_dense=alt["verdict"],
                              compute_dense_checked=False)  # replayed rows: the outputs mean nothing
        figs[name].update(gap_split(spans_seq, spans_dual, max(comm_ms, compute_ms)))
        if name == "forward_backward":  # the halves cannot overlap each other (halves_floor_ms)
            figs[name]["halves_floor_over_max"] = halves_floor_ms(spans_seq) / max(comm_ms, compute_ms, 1e-9)
        figs[name].update(spans_sequential=spans_seq, spans_dual=spans_dual)
        if name in traces:
            ranks = [None] * R  # every rank's steps: a late kernel on one rank stalls its peers
            dist.all_gather_object(ranks, {sched: comm_trace_steps(sp, traces[name][sched])
                                           for sched, sp in (("sequential", spans_seq), ("dual", spans_dual))})
            figs[name]["comm_trace"] = {"ranks": ranks, "summary": [comm_trace_summary(r) for r in ranks]}
    gpu_clocks = None
    if monitor is not None:
        monitor.stop()
        gpu_clocks = monitor.summary()
        for name in figs:
            figs[name]["sm_clock_dual_over_sequential"] = clock_ratio(gpu_clocks, name)
    if ctx.rank != 0:
        return {"check": check}

    device_name = torch.cuda.get_device_name(device) if on_gpu else "cpu"
    if comm_sms is None:
        comm_sms, comm_sms_source = _buffer_default_sms(buffer)
    result = {
        "benchmark": "bench_overlap",
        "device": device_name, "num_ranks": R, "ranks_per_node": ctx.ranks_per_node,
        "backend": buffer.backend_name, "git_commit": _git_commit(),
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "shapes": dict(sh, layers=args.layers, fp8=args.fp8, dtype="bf16"),
        "issue_order": order,
        "phases": args.phases,
        # forward+backward's dual schedule: joint (dual_forward_backward) or split (dual_forward, dual_backward)
        "fb_schedule": args.fb_schedule,
        "turn_keeps_wgrad": pipeline_schedule.TURN_KEEPS_WGRAD,
        # SMs the dual schedules kept GEMMs off (torch's SM carveout; sequential runs: none)
        "sm_carveout": {"requested": carveout if carveout is not None else "$COMMLIB_SM_CARVEOUT or auto",
                        "sms": _carveout_sms(model, on_gpu, carveout),
                        "backward_requested": carveout_bwd if carveout_bwd is not None else "as the forward",
                        "backward_sms": _carveout_sms(model, on_gpu, carveout_bwd)},
        "comm_stream_priority": args.comm_priority,
        "kernel_variant": args.kernel_variant or "default",
        "defer_weight_grads": P.resolve_defer_weight_grads(defer),
        # the expert stage's slot sums: one-pass kernel (csrc/moe_rows.cu) or torch's index_add ($COMMLIB_MOE_ROW_KERNEL)
        "moe_row_kernel": env.moe_row_kernel(),
        "ce_bytes": env.ce_bytes(),  # > 0: the nvlink backend's copy-engine data path (csrc/ce.cu)
        "ce_sms": env.ce_sms(),
        "ce_prepack": env.ce_prepack() if env.ce_bytes() else None,  # packing on the compute stream
        "ce_defer_sum": env.ce_defer_sum() if env.ce_bytes() else None,  # combine's sum there too
        "ce_staging": env.ce_staging() if env.ce_bytes() else None,  # host: rows cross PCIe via pinned host memory
        # SMs of every dispatch / combine; source: --comm-sms, calibrated, Buffer.num_sms or a tuned config.
        # Timing effect on the GPU engines only (nvlink): the reference backend ignores it.
        "comm_sms": comm_sms,
        "comm_sms_source": comm_sms_source,
        "comm_configs": {kind: (dataclasses.asdict(c) if c is not None else None)
                         for kind, c in zip(("dispatch", "combine"), model.comm_configs)},
        "calibration": calibration,
        "timing": {"warmup": args.warmup, "iters": args.iters, "statistic": "median, slowest rank"},
        "targets": {"dual_over_max_comm_compute": f"<= {TARGET_DUAL_OVER_MAX}",
                    "speedup_over_sequential": f">= {TARGET_SPEEDUP} where comm ~ compute",
                    "comm_about_equal_compute": f"{BALANCED_RANGE[0]:.2f} <= comm / compute <= "
                                                f"{BALANCED_RANGE[1]:.2f}"},
        "check": check,
        "kernel_profile": kernels,
        # per "<phase>.<schedule>" measured loop, per GPU: SM clock, power, power-cap share (commlib.bench.clocks)
        "gpu_clocks": gpu_clocks,
        "figures": figs,
    }
    print_table(result)
    for name, fig in figs.items():
        for rank, summ in enumerate(fig.get("comm_trace", {}).get("summary", [])):
            print(f"# {name:>18} comm trace rank {rank}, sequential -> dual: " + "; ".join(
                f"{k} {summ['sequential'][k]:.2f} -> {summ['dual'][k]:.2f}" for k in COMM_TRACE_SUMMARY))
    if kernels:
        for sched, kp in kernels.items():
            print(f"[overlap] kernels F(0)+B(1) {sched}: " + ", ".join(
                f"{c} {v['ms']:.2f} ms ({v['kernels']})" for c, v in sorted(kp["categories"].items())))
    os.makedirs(args.out_dir, exist_ok=True)
    tag = args.tag or (f"{device_name.replace(' ', '_')}_{sh['preset']}{'_fp8' if args.fp8 else ''}"
                       f"{f'_sms{args.comm_sms}' if args.comm_sms is not None else ''}")
    json_path = os.path.join(args.out_dir, f"overlap_{tag}.json")
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)
    result["json_path"] = json_path
    print(f"[overlap] wrote {json_path}")
    if not args.no_plot:
        png = os.path.join(args.out_dir, f"overlap_{tag}.png")
        plot_timeline(result, png)
        print(f"[overlap] wrote {png}")
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "figures"}, indent=1))
    return result


def _worker(ctx, args):
    return run(ctx, args)


def main(argv=None) -> int:
    """Run the benchmark (under torchrun: this rank; else spawn ``--ranks`` local ranks).

    Returns the exit code: 1 where a compared result was wrong (``check.exit_code``), else 0.
    """
    args = parse_args(argv)
    transport_env(args)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        group = init_distributed()
        rank, world = dist.get_rank(), dist.get_world_size()
        device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                  else torch.device("cpu"))
        rpn = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        result = run(RankContext(rank, world, rpn, device, group), args)
        dist.destroy_process_group()
    else:
        result = parallel_launch(args.ranks, _worker, args, use_gpu=True)
    code = exit_code(result)
    if code:
        print("[overlap] a dual schedule's results differ from the sequential run's: exit 1", file=sys.stderr)
    return code


if __name__ == "__main__":
    exit_rank(main())  # under torchrun this process is a rank: leave without the interpreter's finalization
