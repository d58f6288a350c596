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
micro-batch, attention stand-in: 56 heads x 128). On 2 x H200 compute dominates there (forward
~15 ms per micro-batch against ~1.3 ms of dispatch + combine), so overlap can hide the
communication (dual / max ~1.0) but cannot give much speedup. ``--preset balanced`` keeps the
token rows (4096 x 7168 bf16) and cuts the work per row (16 experts, top-2, expert intermediate
256, no shared expert, 4 heads x 128) to bring compute towards comm; measured on 2 x H200 its
forward is comm : compute ~ 1 : 3 and its forward+backward too (4.4 vs 13.6 ms), where no schedule
can beat sequential by more than (comm + compute) / compute ~ 1.3x. ``--preset balanced_fb`` aims
at forward+backward comm ~ compute: the MoE layer alone (``heads 0``: no attention,
whose norms and projections alone outweigh the all-to-alls), V3's traffic pattern at EP2 (every
token reaches both GPUs: top-2 of 2 experts, 8192 rows received per GPU per micro-batch) and the
expert intermediate size *calibrated* on the spot: before timing, the sequential forward+backward
is measured for expert_hidden in 64 .. 4096 and the size whose compute / comm is nearest 1 is
kept (``--no-calibrate`` or an explicit ``--expert-hidden`` skips it; the trials are in the JSON).
On 2 x H200 even the floor (64) leaves forward+backward compute ~2.5-3x the communication
(benchmarks/results/overlap_NVIDIA_H200_balanced_fb*.json; the calibration stops at its first
size): the NVLink engine with its default 20 SMs is simply fast there, and what compute remains
at 64 is mostly work that does not depend on expert_hidden (routing, row gathers and scatters).

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
(COMMLIB_CE_BYTES / COMMLIB_CE_STAGING=host, docs/pipeline.md): the rows cross PCIe out of one
GPU and into the other, the path a NIC's DMA takes, with no SM on the wire. ``network`` keeps
``balanced``'s routing at 16384 tokens and makes the compute GEMM-bound (16 heads, expert
intermediate 3072), which puts each phase's comm / compute inside the "about equal" band.

Writes JSON (device, git commit, command, figures, step spans) and a timeline PNG of the two
streams to --out-dir (default benchmarks/results/).

Run:
  torchrun --nproc-per-node 2 benchmarks/bench_overlap.py --preset v3       # GPUs
  python3 benchmarks/bench_overlap.py --preset balanced_fb                  # GPUs (spawns 2 ranks)
  python3 benchmarks/bench_overlap.py --preset balanced_sms --tokens 8192   # GPUs, comm SMs calibrated
  ... --comm-sms 8                                                          # 8 SMs for every all-to-all
  python3 benchmarks/bench_overlap.py --preset network --ce-staging host --comm-sms 8 --ce-sms 8 --layers 6
  python benchmarks/bench_overlap.py --ranks 2 --preset tiny                # CPU smoke test
  ... --issue-order compute_first                                           # the old issue order
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from commlib.bench.clocks import ClockMonitor, clock_ratio  # noqa: E402  (after the checkout is on sys.path)
from commlib.backends.base import PendingCombine  # noqa: E402
from commlib.utils.event import EventOverlap  # noqa: E402
from commlib.utils.timing import slowest  # noqa: E402

PRESETS = {
    #           tokens hidden experts topk groups topk_groups expert_hidden shared heads head_dim
    "v3":       (4096, 7168, 256, 8, 8, 4, 2048, 1, 56, 128),
    "balanced": (4096, 7168, 16, 2, 2, 2, 256, 0, 4, 128),
    "balanced_fb": (4096, 7168, 2, 2, 1, 1, 256, 0, 0, 128),   # expert_hidden calibrated (see above)
    "balanced_sms": (4096, 7168, 2, 2, 1, 1, 256, 0, 0, 128),  # comm SMs calibrated (see above)
    "network": (16384, 7168, 16, 2, 2, 2, 3072, 0, 16, 128),  # with --ce-staging host (see above)
    "tiny":     (32, 64, 8, 2, 2, 2, 32, 1, 4, 16),
}
CALIBRATED = {"balanced_fb"}           # presets whose expert_hidden is calibrated to compute ~ comm
CALIBRATION_SIZES = (64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)   # ~1.5x steps past 256
CALIBRATED_SMS = {"balanced_sms"}      # presets whose comm SMs are calibrated to comm ~ compute
# Fewest first (even: two CTAs per channel). Not 2 (one channel): the nvlink engine's GPU tests never
# run a single channel.
COMM_SMS_CALIBRATION = (4, 6, 8, 12, 16, 20, 24)
BALANCED_RANGE = (0.75, 4 / 3)          # "comm ~ compute": comm / compute within this range
TARGET_DUAL_OVER_MAX, TARGET_SPEEDUP = 1.15, 1.3
PHASES = ("forward", "forward_backward", "fwd0_bwd1")
_FIELDS = ("tokens", "hidden", "experts", "topk", "groups", "topk_groups", "expert_hidden", "shared", "heads",
           "head_dim")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="shape preset (default: v3 on GPUs, tiny on CPU)")
    p.add_argument("--tokens", type=int, help="tokens per micro-batch per rank (one sequence)")
    p.add_argument("--hidden", type=int)
    p.add_argument("--experts", type=int)
    p.add_argument("--topk", type=int)
    p.add_argument("--groups", type=int)
    p.add_argument("--topk-groups", type=int)
    p.add_argument("--expert-hidden", type=int)
    p.add_argument("--shared", type=int, help="shared experts (0 = none)")
    p.add_argument("--shared-stage", choices=("attn", "experts"), default="attn",
                   help="pipeline stage of the shared experts (MoEConfig.shared_stage): attn = beside the other "
                        "micro-batch's dispatch in the attention step (default), experts = with the routed experts")
    p.add_argument("--heads", type=int, help="attention heads (0 = no attention: the MoE layer alone)")
    p.add_argument("--head-dim", type=int, help="attention head size (q/k/v project to heads * head_dim)")
    p.add_argument("--comm-sms", type=int, default=None, metavar="N",
                   help="SMs (CTAs; N / 2 channels; even) of every dispatch and combine, forward and backward, "
                        "sequential and dual: passed per call as Config(num_sms=N, ...) (default: the Buffer's "
                        "choice, Buffer.num_sms or a tuned config). Fewer SMs: slower communication, more SMs "
                        "left to the compute it overlaps (DeepSeek's trade-off). GPU engines only: on the "
                        "reference backend (the CPU path) N is recorded and passed but changes no timing")
    p.add_argument("--send-chunk", type=int, default=None, metavar="T",
                   help="with --comm-sms: num_max_nvl_chunked_send_tokens of those configs (tokens per "
                        "published round; default: the Buffer's)")
    p.add_argument("--comm-priority", type=int, default=None,
                   help="replace the Buffer's comm stream by one of this CUDA priority (-1 = high); experiment")
    p.add_argument("--sm-carveout", default=None, metavar="auto|off|N",
                   help="SMs the dual schedules keep GEMMs off while they overlap (commlib.training.pipeline.schedule.sm_carveout; "
                        "default: $COMMLIB_SM_CARVEOUT, else auto = the comm SMs); the sequential runs never set it")
    p.add_argument("--sm-carveout-backward", default=None, metavar="auto|off|N",
                   help="forward+backward (two forwards, two backwards): the carveout from micro-batch 0's backward on "
                        "(default: --sm-carveout's)")
    p.add_argument("--fb-schedule", choices=("split", "joint"), default="split",
                   help="forward+backward, dual (commlib.training.pipeline.schedule.dual_forward_backward's schedule): split = "
                        "dual_forward then dual_backward (default), joint = one interleaving, micro-batch 0's "
                        "backward starting beside micro-batch 1's last forward steps")
    p.add_argument("--turn-defer", action="store_true",
                   help="joint forward+backward: micro-batch 0's first expert backward defers its weight gradients "
                        "too (commlib.training.pipeline.schedule.TURN_KEEPS_WGRAD = False; default: in place, beside two comm steps)")
    p.add_argument("--phases", default="forward,forward_backward,fwd0_bwd1", metavar="P,...",
                   help="phases to measure (forward, forward_backward, fwd0_bwd1; default all)")
    p.add_argument("--defer-wgrad", dest="defer_wgrad", action="store_true", default=None,
                   help="dual backward schedules defer the expert GEMMs' weight gradients (B / W split, "
                        "commlib.training.wgrad; default: $COMMLIB_DEFER_WGRAD, on); --no-defer-wgrad: in place")
    p.add_argument("--no-defer-wgrad", dest="defer_wgrad", action="store_false")
    p.add_argument("--kernel-variant", default="", metavar="KEY=V,...",
                   help="NVLink kernel build variant (commlib.cuda.loader.DEFAULT_VARIANT keys, e.g. "
                        "DISPATCH_THREADS=512,COMBINE_THREADS=512) for every rank; experiment")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--issue-order", choices=("auto", "comm_first", "compute_first"), default="auto",
                   help="which step of a (compute, comm) pair the host issues first (commlib.training.pipeline.schedule); "
                        "auto: comm first unless it waits on the host (non-cached dispatch)")
    p.add_argument("--calibrate", dest="calibrate", action="store_true", default=None,
                   help="pick expert_hidden so that forward+backward compute ~ comm (default: on for "
                        f"{', '.join(sorted(CALIBRATED))} unless --expert-hidden is given)")
    p.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                   help="skip the calibration the preset would run (expert_hidden or comm SMs)")
    p.add_argument("--calibrate-comm-sms", dest="calibrate_comm_sms", action="store_true", default=None,
                   help="pick the comm SMs (from " + ", ".join(map(str, COMM_SMS_CALIBRATION)) + ") so that "
                        "forward+backward comm ~ compute (default: on for "
                        f"{', '.join(sorted(CALIBRATED_SMS))} unless --comm-sms or --no-calibrate is given)")
    p.add_argument("--no-calibrate-comm-sms", dest="calibrate_comm_sms", action="store_false")
    p.add_argument("--ce-staging", choices=("device", "host"), default=None,
                   help="move dispatch / combine rows with the copy engines (sets COMMLIB_CE_STAGING for the ranks, "
                        "and COMMLIB_CE_BYTES to 600 MB unless set): device = CUDA IPC over NVLink, host = pinned host "
                        "memory over PCIe (a network-like hop)")
    p.add_argument("--ce-sms", type=int, default=None, metavar="N",
                   help="CTAs of the copy-engine path's packing and sum (sets COMMLIB_CE_SMS for the ranks)")
    p.add_argument("--no-ce-prepack", action="store_true",
                   help="copy-engine path: every dispatch packs its rows on the comm stream (sets COMMLIB_CE_PREPACK=0 "
                        "for the ranks; default: the pipeline packs them on the compute stream, Buffer.prepack)")
    p.add_argument("--ce-defer-sum", action="store_true",
                   help="copy-engine path, host staging: the pipeline's combines sum on the compute stream "
                        "(sets COMMLIB_CE_DEFER_SUM=1; default: on the comm stream, measured the same)")
    p.add_argument("--fp8", action="store_true", help="FP8 dispatch (E4M3 + scales), bf16 combine")
    p.add_argument("--backend", default=None, help="Buffer backend (auto | reference | nvlink)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--ranks", type=int, default=2, help="ranks to spawn when not under torchrun")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default=os.path.join(ROOT, "benchmarks", "results"))
    p.add_argument("--tag", default=None, help="name of the output files (default: device + preset)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-dense", action="store_true",
                   help="skip the compute-dense reference (each dual schedule replayed without transfers)")
    p.add_argument("--no-clocks", action="store_true",
                   help="do not sample the GPUs' SM clock and power (nvidia-smi) during the measured loops")
    p.add_argument("--kernel-profile", action="store_true",
                   help="GPUs: after timing, run F(0)+B(1) once sequential and once dual under torch.profiler and "
                        "record the kernel time per category (comm, GEMM, attention, other) in both, to attribute "
                        "the interference (JSON: kernel_profile)")
    p.add_argument("--trace-dir", default=None, metavar="DIR",
                   help="GPUs: after timing, run forward+backward (two forwards, then two backwards) once "
                        "sequential and once dual under torch.profiler (host API calls and kernels) and write "
                        "each rank's chrome trace to DIR/<tag>_<schedule>_rank<r>.json.gz")
    p.add_argument("--comm-trace", action="store_true",
                   help="GPUs (nvlink backend): build the comm kernels with COMM_TRACE=1 and record every CTA's "
                        "%%globaltimer points in the timeline runs; per comm step, the kernel's own time, the "
                        "spread of its CTAs' starts and its start after the step's span began (JSON: comm_trace)")
    p.add_argument("--json", action="store_true", help="also print the JSON to stdout")
    args = p.parse_args(argv)
    args.phases = [x.strip() for x in args.phases.split(",") if x.strip()]
    bad = sorted(set(args.phases) - set(PHASES))
    if bad or not args.phases:
        p.error(f"--phases: pick from {', '.join(PHASES)}, got {args.phases}")
    if args.comm_sms is not None and (args.comm_sms <= 0 or args.comm_sms % 2):
        p.error(f"--comm-sms must be a positive even number (two CTAs per channel), got {args.comm_sms}")
    if args.ce_sms is not None and args.ce_sms <= 0:
        p.error(f"--ce-sms must be positive, got {args.ce_sms}")
    if args.send_chunk is not None and (args.comm_sms is None or args.send_chunk <= 0):
        p.error("--send-chunk needs --comm-sms and a positive token count")
    if args.calibrate_comm_sms and args.comm_sms is not None:
        p.error("--calibrate-comm-sms picks the comm SMs itself: drop --comm-sms")
    if args.calibrate_comm_sms and args.calibrate:
        p.error("calibrate one knob per run: --calibrate (expert_hidden) or --calibrate-comm-sms")
    return args


def _resolve_shapes(args, on_gpu: bool) -> dict:
    preset = args.preset or ("v3" if on_gpu else "tiny")
    shapes = dict(zip(_FIELDS, PRESETS[preset]))
    for f in _FIELDS:
        v = getattr(args, f.replace("-", "_"), None)
        if v is not None:
            shapes[f] = v
    shapes["preset"] = preset
    shapes["shared_stage"] = args.shared_stage
    return shapes


def _calibration_plan(args, preset: str) -> tuple:
    """(calibrate expert_hidden, calibrate comm SMs): explicit flags first, then the preset's default;
    at most one of the two (parse_args refuses both explicitly)."""
    sizes, sms = args.calibrate, args.calibrate_comm_sms
    if sizes is None:
        sizes = preset in CALIBRATED and args.expert_hidden is None and not sms
    if sms is None:
        sms = (preset in CALIBRATED_SMS and args.comm_sms is None and not sizes
               and args.calibrate is not False)
    return bool(sizes), bool(sms)


def _comm_configs(num_ranks: int, num_sms, tokens: int, send_chunk=None) -> tuple:
    """(dispatch Config, combine Config) with ``num_sms`` SMs, or (None, None) for the Buffer's own
    choice. The Buffer's default chunk sizes (the send chunk ``send_chunk`` when given); the receive
    capacity per channel is raised to ceil(tokens / channels) when fewer channels must hold the call
    (the Buffer checks it)."""
    if num_sms is None:
        return None, None
    from commlib import Buffer
    out = []
    for default in (Buffer.get_dispatch_config(num_ranks), Buffer.get_combine_config(num_ranks)):
        channels = num_sms // 2
        recv = max(default.num_max_nvl_chunked_recv_tokens, math.ceil(tokens / channels))
        send = send_chunk or default.num_max_nvl_chunked_send_tokens
        out.append(dataclasses.replace(default, num_sms=num_sms, num_max_nvl_chunked_recv_tokens=max(recv, send),
                                       num_max_nvl_chunked_send_tokens=send))
    return tuple(out)


def _git_commit() -> str | None:
    from commlib.bench.main import git_commit
    commit = git_commit()["commit"]
    return None if commit == "unknown" else commit


_ROW_DTYPES = (torch.bfloat16, torch.float16) + tuple(
    getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
_Rows = collections.namedtuple("_Rows", "shape dtype device")  # a recorded row tensor, kept as its shape


class ReplayComm:
    """A Buffer stand-in for the compute-dense reference (``compute_dense_ms``).

    In ``record`` mode every call (get_dispatch_layout, dispatch, combine) goes to the real Buffer,
    and the stand-in keeps what the compute needs of its outputs: index and weight tensors, counts,
    handles; the rows (bf16 / fp16 / fp8 tensors) only as shape and dtype. In ``replay`` mode each
    call returns the next recorded outputs (``rewind()`` before each run) with the rows made anew on
    the comm stream, and moves nothing. A schedule replayed this way runs the same kernels on the
    compute stream with nothing to wait for: the time the compute alone takes when it runs densely,
    at whatever clock the power cap then allows. The rows are copies of random normal values (one
    source tensor per dtype), not zeros: a GEMM on zeros toggles fewer bits and draws
    less power, so under the cap it may run at a higher clock than on activations (the zero-filled
    rows before 2026-12-01 read 0.98-1.02x the sequential compute at ~1810 MHz; docs/pipeline.md)."""

    def __init__(self, buffer) -> None:
        self._buffer = buffer
        self._log: list = []
        self._pos = 0
        self.mode = "record"
        self._sources: dict = {}  # (shape, dtype, device) -> random rows the replayed rows copy

    def __getattr__(self, name):  # everything else (comm_stream, rank, num_sms, ...) is the real Buffer's
        return getattr(self._buffer, name)

    def rewind(self) -> None:
        self._pos = 0

    def record(self) -> None:
        """Forget the recorded calls; the next calls pass through and are recorded anew."""
        self._log, self._pos, self.mode = [], 0, "record"
        self._sources = {}

    @staticmethod
    def _template(obj):
        if isinstance(obj, torch.Tensor) and obj.dtype in _ROW_DTYPES:
            return _Rows(tuple(obj.shape), obj.dtype, obj.device)
        if isinstance(obj, tuple):
            return tuple(ReplayComm._template(o) for o in obj)
        return obj

    def _source(self, tmpl: _Rows) -> torch.Tensor:
        """Random normal values of the template's shape: a view of one flat tensor per dtype and
        device (grown to the largest rows asked for)."""
        numel = math.prod(tmpl.shape)
        key = (tmpl.dtype, tmpl.device)
        src = self._sources.get(key)
        if src is None or src.numel() < numel:
            g = torch.Generator(device=tmpl.device).manual_seed(numel)
            src = torch.randn(numel, generator=g, device=tmpl.device, dtype=torch.float32).to(tmpl.dtype)
            self._sources[key] = src
        return src[:numel].view(tmpl.shape)

    def _build(self, tmpl, made: list):
        if isinstance(tmpl, _Rows):
            t = self._source(tmpl).clone()
            made.append(t)
            return t
        if isinstance(tmpl, tuple):
            return tuple(self._build(o, made) for o in tmpl)
        return tmpl

    def _call(self, kind: str, event_index: int, real, previous_event, async_finish: bool):
        if self.mode == "record":
            out = real()
            tmpl = list(out)
            tmpl[event_index] = None
            self._log.append((kind, tuple(self._template(o) for o in tmpl)))
            return out
        if self._pos >= len(self._log) or self._log[self._pos][0] != kind:
            raise RuntimeError(f"ReplayComm: call {self._pos} is a {kind}, the recorded run "
                               f"{'had no more calls' if self._pos >= len(self._log) else 'made a ' + self._log[self._pos][0]}")
        tmpl = self._log[self._pos][1]
        self._pos += 1
        comm = getattr(self._buffer, "comm_stream", None)
        made: list = []
        if comm is None:  # CPU: no streams
            out = list(self._build(tmpl, made))
            out[event_index] = EventOverlap(None)
            return tuple(out)
        cur = torch.cuda.current_stream()
        if previous_event is not None and previous_event.event is not None:
            comm.wait_event(previous_event.event)
        else:
            comm.wait_stream(cur)
        with torch.cuda.stream(comm):
            out = list(self._build(tmpl, made))
            event = torch.cuda.Event()
            event.record(comm)
        for t in made:
            t.record_stream(cur)
        if not async_finish:
            cur.wait_event(event)
        out[event_index] = EventOverlap(event)
        return tuple(out)

    def prepack(self, *args, **kw):
        """None: the recorded and the replayed runs make the same calls (layout, dispatch), and the
        replay leaves out the packing (transfer work; ~0.2 ms per dispatch on the compute stream)."""
        return None

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False, **kw):
        return self._call("layout", 4, lambda: self._buffer.get_dispatch_layout(
            topk_idx, num_experts, previous_event=previous_event, async_finish=async_finish, **kw),
            previous_event, async_finish)

    def dispatch(self, x, *args, previous_event=None, async_finish=False, **kw):
        return self._call("dispatch", 5, lambda: self._buffer.dispatch(
            x, *args, previous_event=previous_event, async_finish=async_finish, **kw), previous_event, async_finish)

    def combine(self, x, handle, *args, previous_event=None, async_finish=False, finish_later=False, **kw):
        """finish_later: the recorded run sums on the comm stream; both hand a finished PendingCombine."""
        out = self._call("combine", 2, lambda: self._buffer.combine(
            x, handle, *args, previous_event=previous_event, async_finish=async_finish, **kw),
            previous_event, async_finish)
        if finish_later:
            return PendingCombine(result=(out[0], out[1])), None, out[2]
        return out


class _Clock:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def time_ms(self, fn) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        dist.barrier()
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3


def _median_ms(clock, fn, warmup, iters) -> float:
    for _ in range(warmup):
        clock.time_ms(fn)
    return statistics.median(clock.time_ms(fn) for _ in range(iters))


def _sum_spans(spans, stream) -> float:
    return sum(s["end_ms"] - s["start_ms"] for s in spans if s["stream"] == stream)


def _check(model, fb, device) -> dict:
    """Dual vs sequential forward+backward once (fb(overlap) -> the two outputs): outputs and every
    gradient, relative L2 error.

    CPU: bit-identical (error 0). GPUs: index_add uses atomics, so float sums vary in order and
    bf16 results can differ in the last bit; the check allows 1e-2 relative (a wrong schedule,
    e.g. a missing wait, gives errors of order 1)."""
    def once(overlap):
        model.zero_grad(set_to_none=True)
        o0, o1 = fb(overlap)
        out = {"out0": o0.detach().clone(), "out1": o1.detach().clone()}
        out.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        model.zero_grad(set_to_none=True)
        return out

    ref, dual = once(False), once(True)
    worst, worst_name = 0.0, None
    for name, r in ref.items():
        d = dual.get(name)
        if d is None:
            worst, worst_name = float("inf"), name
            break
        err = ((d.float() - r.float()).norm() / r.float().norm().clamp_min(1e-30)).item()
        if err > worst:
            worst, worst_name = err, name
    tol = 0.0 if device.type == "cpu" else 1e-2
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (worst, worst_name))
    worst, worst_name = max(everyone, key=lambda x: x[0])
    ok = worst <= tol
    if dist.get_rank() == 0:
        print(f"[overlap] check dual vs sequential (outputs + {len(ref) - 2} gradients): max relative error "
              f"{worst:.3e} ({worst_name}) {'ok' if ok else 'WRONG'} (tolerance {tol})")
    return {"max_relative_error": worst, "worst": worst_name, "tolerance": tol, "ok": ok}


def _build_model(args, sh, buffer, device, comm_configs=(None, None)):
    from commlib.training.moe.layer import MoEConfig, MoEModel
    dtype = torch.bfloat16
    cfg = MoEConfig(hidden=sh["hidden"], num_experts=sh["experts"], topk=sh["topk"],
                    expert_hidden=sh["expert_hidden"], num_groups=sh["groups"], topk_groups=sh["topk_groups"],
                    num_shared_experts=sh["shared"], expert_dtype=dtype, fp8_dispatch=args.fp8,
                    shared_stage=sh.get("shared_stage", "attn"))
    torch.manual_seed(args.seed)  # replicated (attention, router, shared) parameters agree across ranks
    model = MoEModel(cfg, args.layers, sh["heads"], buffer=buffer, full_init=False, device=device,
                     attn_dtype=dtype, head_dim=sh["head_dim"]).to(dtype)
    model.comm_configs = tuple(comm_configs)   # per call: Buffer.num_sms (class-wide) stays as it is
    return model


def _sequential_fb_split(P, model, h0, h1, g0, g1, clock, warmup=2, reps=3) -> tuple:
    """Summed comm and compute stream spans of the sequential forward+backward (median, slowest rank)."""
    def once(tl=None):
        model.zero_grad(set_to_none=True)
        o0, o1 = P.dual_forward(model, (h0,), (h1,), timeline=tl, overlap=False)
        P.dual_backward(o0, g0, o1, g1, timeline=tl, overlap=False)

    for _ in range(warmup):
        clock.time_ms(once)
    comm, compute = [], []
    for _ in range(reps):
        tl = P.Timeline()
        clock.time_ms(lambda: once(tl))
        spans = tl.spans()
        comm.append(_sum_spans(spans, "comm"))
        compute.append(_sum_spans(spans, "compute"))
    model.zero_grad(set_to_none=True)
    return tuple(slowest([statistics.median(comm), statistics.median(compute)]))


def _calibrate(ctx, args, sh, buffer, inputs, clock, comm_configs=(None, None)) -> tuple:
    """expert_hidden whose sequential forward+backward compute / comm is nearest 1 (same on every
    rank: the figures are gathered). Compute grows with expert_hidden, comm does not."""
    from commlib.training.pipeline import schedule as P
    trials = []
    for size in CALIBRATION_SIZES:
        model = _build_model(args, dict(sh, expert_hidden=size), buffer, ctx.device, comm_configs)
        comm_ms, compute_ms = _sequential_fb_split(P, model, *inputs, clock)
        del model
        ratio = compute_ms / max(comm_ms, 1e-9)
        trials.append({"expert_hidden": size, "comm_ms": comm_ms, "compute_ms": compute_ms,
                       "compute_over_comm": ratio})
        if ctx.rank == 0:
            print(f"[overlap] calibrate expert_hidden={size}: sequential forward+backward comm {comm_ms:.3f} ms, "
                  f"compute {compute_ms:.3f} ms (compute / comm {ratio:.2f})")
        if ratio >= 1.0:
            break
    best = min(trials, key=lambda t: abs(math.log(max(t["compute_over_comm"], 1e-9))))
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()
    return best["expert_hidden"], trials


def _calibrate_comm_sms(ctx, model, inputs, clock, tokens) -> tuple:
    """Comm SMs whose sequential forward+backward comm / compute is nearest 1 (log distance; same on
    every rank: the figures are gathered). Communication slows down with fewer SMs; compute does
    not change (the sequential run never overlaps the two). Fewest SMs first, stopping once comm <=
    compute. Leaves the chosen configs on ``model``."""
    from commlib.training.pipeline import schedule as P
    trials = []
    for sms in COMM_SMS_CALIBRATION:
        model.comm_configs = _comm_configs(ctx.world_size, sms, tokens)
        comm_ms, compute_ms = _sequential_fb_split(P, model, *inputs, clock)
        ratio = comm_ms / max(compute_ms, 1e-9)
        trials.append({"comm_sms": sms, "comm_ms": comm_ms, "compute_ms": compute_ms, "comm_over_compute": ratio})
        if ctx.rank == 0:
            print(f"[overlap] calibrate comm_sms={sms}: sequential forward+backward comm {comm_ms:.3f} ms, "
                  f"compute {compute_ms:.3f} ms (comm / compute {ratio:.2f})")
        if ratio <= 1.0:
            break
    best = min(trials, key=lambda t: abs(math.log(max(t["comm_over_compute"], 1e-9))))
    model.comm_configs = _comm_configs(ctx.world_size, best["comm_sms"], tokens)
    return best["comm_sms"], trials


def _carveout_sms(P, model, on_gpu, carveout) -> int:
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
    """Run the benchmark on this rank (all ranks call it); rank 0 returns the result dict."""
    from commlib import Buffer
    from commlib.utils import env
    from commlib.training.pipeline import schedule as P

    device = ctx.device
    on_gpu = device.type == "cuda"
    sh = _resolve_shapes(args, on_gpu)
    dtype = torch.bfloat16
    R = ctx.world_size
    calibrate, calibrate_sms = _calibration_plan(args, sh["preset"])
    if args.comm_trace and not on_gpu:
        raise SystemExit("[overlap] --comm-trace needs the GPUs (the nvlink backend records the trace)")
    if args.kernel_variant or args.comm_trace:
        from commlib.cuda import loader as K
        variant = K.parse_variant(args.kernel_variant)
        if args.comm_trace:  # every launch of a timeline run keeps its own trace slot (trace_history)
            variant["COMM_TRACE"] = 1
            os.environ["COMMLIB_DEBUG_SMID"] = "1"
            os.environ["COMMLIB_DEBUG_SMID_SLOTS"] = str(COMM_TRACE_SLOTS)
        K.set_variant(variant)
    comm_configs = _comm_configs(R, args.comm_sms, sh["tokens"], args.send_chunk)
    # The Buffer holds every config this run may use: the default, --comm-sms's or the candidates'.
    configs = [Buffer.get_dispatch_config(R)] + [c for c in comm_configs if c is not None]
    if calibrate_sms:
        configs += [c for n in COMM_SMS_CALIBRATION for c in _comm_configs(R, n, sh["tokens"])]
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
    clock = _Clock(device)
    order = args.issue_order
    carveout = args.sm_carveout
    carveout_bwd = args.sm_carveout_backward if args.sm_carveout_backward is not None else carveout
    P.TURN_KEEPS_WGRAD = not args.turn_defer
    defer = args.defer_wgrad

    calibration = None
    comm_sms, comm_sms_source = args.comm_sms, "--comm-sms"
    if calibrate:
        size, trials = _calibrate(ctx, args, sh, buffer, (h0, h1, g0, g1), clock, comm_configs)
        sh["expert_hidden"] = size
        calibration = {"knob": "expert_hidden",
                       "what": "expert_hidden whose sequential forward+backward compute / comm is nearest 1",
                       "chosen": size, "trials": trials}
    model = _build_model(args, sh, buffer, device, comm_configs)
    if calibrate_sms:
        comm_sms, trials = _calibrate_comm_sms(ctx, model, (h0, h1, g0, g1), clock, sh["tokens"])
        comm_sms_source = "calibrated"
        calibration = {"knob": "comm_sms",
                       "what": "comm SMs whose sequential forward+backward comm / compute is nearest 1 "
                               "(fewest first, stopping once comm <= compute)",
                       "candidates": list(COMM_SMS_CALIBRATION), "chosen": comm_sms, "trials": trials}

    def fwd(overlap, timeline=None):
        with torch.no_grad():
            P.dual_forward(model, (h0,), (h1,), timeline=timeline, overlap=overlap, issue_order=order,
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

    check = _check(model, fwd_bwd, device)

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
            seq_ms = _median_ms(clock, lambda: fn(False), args.warmup, args.iters)
        with windows(f"{name}.dual"):
            dual_ms = _median_ms(clock, lambda: fn(True), args.warmup, args.iters)
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
                    dense[name] = _median_ms(clock, once, args.warmup, args.iters)
            else:
                model.zero_grad(set_to_none=True)
                f_and_b(model(h1), True)
                replay.mode = "replay"
                with windows(f"{name}.dense"):
                    dense[name] = timed_f_and_b(True, None, before_each=replay.rewind)
    finally:
        model.buffer = real_buffer
        replay.record()  # drops the last recording's handles and index tensors

    kernel_profile = None
    if args.kernel_profile and on_gpu:
        def profiled(overlap):
            model.zero_grad(set_to_none=True)
            o1 = model(h1)
            torch.cuda.synchronize()
            dist.barrier()
            return lambda: f_and_b(o1, overlap)
        kernel_profile = {sched: _kernel_profile(profiled(sched == "dual"))
                          for sched in ("sequential", "dual")}

    if args.trace_dir and on_gpu:
        for sched in ("sequential", "dual"):
            _chrome_trace(lambda: fwd_bwd(sched == "dual"), args.trace_dir,
                          f"{args.tag or 'overlap'}_{sched}_rank{ctx.rank}")

    figures = {}
    for name, (seq_ms, dual_ms, spans_seq, spans_dual) in phases.items():
        comm_ms, compute_ms = _sum_spans(spans_seq, "comm"), _sum_spans(spans_seq, "compute")
        seq_ms, dual_ms, comm_ms, compute_ms, dense_ms = slowest([seq_ms, dual_ms, comm_ms, compute_ms,
                                                                  dense.get(name, 0.0)])
        figures[name] = _figures(seq_ms, dual_ms, comm_ms, compute_ms)
        if name in dense:  # against the compute as it runs without gaps (ReplayComm): the overlap's own
            # cost, with what a dense schedule's clock does to the compute taken out of it
            # "compute" as the compute alone, back to back: the targets against it too (verdict_dense)
            alt = _figures(seq_ms, dual_ms, comm_ms, dense_ms)
            figures[name].update(compute_dense_ms=dense_ms,
                                 compute_dense_over_sequential=dense_ms / max(compute_ms, 1e-9),
                                 dual_over_max_comm_compute_dense=alt["dual_over_max_comm_compute"],
                                 comm_over_compute_dense=alt["comm_over_compute"], verdict_dense=alt["verdict"])
        figures[name].update(gap_split(spans_seq, spans_dual, max(comm_ms, compute_ms)))
        if name == "forward_backward":  # the halves cannot overlap each other (halves_floor_ms)
            figures[name]["halves_floor_over_max"] = halves_floor_ms(spans_seq) / max(comm_ms, compute_ms, 1e-9)
        figures[name].update(spans_sequential=spans_seq, spans_dual=spans_dual)
        if name in traces:
            ranks = [None] * R  # every rank's steps: a late kernel on one rank stalls its peers
            dist.all_gather_object(ranks, {sched: comm_trace_steps(sp, traces[name][sched])
                                           for sched, sp in (("sequential", spans_seq), ("dual", spans_dual))})
            figures[name]["comm_trace"] = {"ranks": ranks, "summary": [comm_trace_summary(r) for r in ranks]}
    gpu_clocks = None
    if monitor is not None:
        monitor.stop()
        gpu_clocks = monitor.summary()
        for name in figures:
            figures[name]["sm_clock_dual_over_sequential"] = clock_ratio(gpu_clocks, name)
    if ctx.rank != 0:
        return {}

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
        "turn_keeps_wgrad": P.TURN_KEEPS_WGRAD,
        # SMs the dual schedules kept GEMMs off (torch's SM carveout; sequential runs: none)
        "sm_carveout": {"requested": carveout if carveout is not None else "$COMMLIB_SM_CARVEOUT or auto",
                        "sms": _carveout_sms(P, model, on_gpu, carveout),
                        "backward_requested": carveout_bwd if carveout_bwd is not None else "as the forward",
                        "backward_sms": _carveout_sms(P, model, on_gpu, carveout_bwd)},
        "comm_stream_priority": args.comm_priority,
        "kernel_variant": args.kernel_variant or "default",
        "defer_weight_grads": P._defer_weight_grads(defer),
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
        "kernel_profile": kernel_profile,
        # per "<phase>.<schedule>" measured loop, per GPU: SM clock, power, power-cap share (commlib.bench.clocks)
        "gpu_clocks": gpu_clocks,
        "figures": figures,
    }
    _print_table(result)
    for name, fig in figures.items():
        for rank, summ in enumerate(fig.get("comm_trace", {}).get("summary", [])):
            print(f"# {name:>18} comm trace rank {rank}, sequential -> dual: " + "; ".join(
                f"{k} {summ['sequential'][k]:.2f} -> {summ['dual'][k]:.2f}" for k in COMM_TRACE_SUMMARY))
    if kernel_profile:
        for sched, kp in kernel_profile.items():
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


def schedule_bound_ms(spans_seq: list, spans_dual: list) -> float:
    """The dual run replayed with every step at its sequential duration: each step starts when the
    step before it on its stream (the dual run's order) and the step before it in its micro-batch
    (label prefix "0." / "1.", the dual run's order) have ended. No interference, no host delay:
    what the schedule's pairing alone costs (two micro-batches in lockstep pay max(comm, compute)
    per pair, not per run)."""
    seq = {(s["label"], s["stream"]): s["end_ms"] - s["start_ms"] for s in spans_seq}
    last_stream: dict = {}
    last_chain: dict = {}
    end = 0.0
    for s in sorted(spans_dual, key=lambda s: s["start_ms"]):
        chain = s["label"].split(".", 1)[0]
        t0 = max(last_stream.get(s["stream"], 0.0), last_chain.get(chain, 0.0))
        t1 = t0 + seq.get((s["label"], s["stream"]), s["end_ms"] - s["start_ms"])
        last_stream[s["stream"]] = last_chain[chain] = t1
        end = max(end, t1)
    return end


def stage_means_ms(spans: list) -> dict:
    """Mean span per stage kind: the label without its micro-batch and layer number ("0.F.attn1"
    -> "F.attn", "1.B.experts0" -> "B.experts"): the sizes of the steps the dual schedule pairs."""
    import re
    by_kind: dict = {}
    for s in spans:
        kind = re.sub(r"\d+$", "", s["label"].split(".", 1)[-1])
        by_kind.setdefault(kind, []).append(s["end_ms"] - s["start_ms"])
    return {k: sum(v) / len(v) for k, v in sorted(by_kind.items())}


def halves_floor_ms(spans_seq: list) -> float:
    """Two forwards, then two backwards: no backward step can start before the forwards' last steps,
    so the dual run takes at least max(comm, compute) of the forward half plus the same of the
    backward half (sequential spans; labels "m.F.*" / "m.B.*"). Approximate by one step: micro-batch
    0's backward may start while micro-batch 1's last forward step runs."""
    def half(tag: str) -> float:
        part = [s for s in spans_seq if f".{tag}." in s["label"]]
        return max(_sum_spans(part, "comm"), _sum_spans(part, "compute"))
    return half("F") + half("B")


def gap_split(spans_seq: list, spans_dual: list, busiest_ms: float) -> dict:
    """Where dual / max(comm, compute) goes, from one rank's recorded spans: the schedule's own
    bound (``schedule_bound_ms``), each stream's busy time in the dual run against the sequential
    one (interference: the same steps take longer while the other stream runs), and each stream's
    idle share of the dual run."""
    busy = {w: {k: _sum_spans(spans, k) for k in ("comm", "compute")}
            for w, spans in (("seq", spans_seq), ("dual", spans_dual))}
    span = (max(s["end_ms"] for s in spans_dual) - min(s["start_ms"] for s in spans_dual)) if spans_dual else 0.0
    bound = schedule_bound_ms(spans_seq, spans_dual)
    return {
        "schedule_bound_ms": bound,
        "schedule_bound_over_max": bound / max(busiest_ms, 1e-9),
        "dual_busy_over_sequential": {k: busy["dual"][k] / max(busy["seq"][k], 1e-9) for k in ("comm", "compute")},
        "dual_idle_share": {k: 1 - busy["dual"][k] / max(span, 1e-9) for k in ("comm", "compute")},
        "sequential_stage_ms": stage_means_ms(spans_seq),
    }


COMM_TRACE_SLOTS = 512  # trace slots per kernel kind: more than the comm launches of one timeline run
COMM_TRACE_SUMMARY = {  # summary key -> what it is (ms, summed over the comm steps of a run)
    "span_ms": "comm steps' spans (CUDA events on the comm stream)",
    "kernel_ms": "data kernels' own time: first CTA start to last CTA end",
    "lead_ms": "span start to the kernel's first CTA (notify, host wait, launch, SMs), least step as 0",
    "skew_ms": "first to last CTA start inside each kernel (SMs taken late)",
}


def _comm_kernel_kind(label: str) -> str:
    """The data kernel a comm step runs: forward dispatch and combine' (a cached dispatch of the
    gradients) the dispatch kernel; forward combine and dispatch' (a combine) the combine kernel."""
    fwd = ".F." in label
    if "dispatch" in label.rsplit(".", 1)[-1]:
        return "dispatch" if fwd else "combine"
    return "combine" if fwd else "dispatch"


def comm_trace_steps(spans: list, history: dict) -> list:
    """Match a timeline run's comm steps (in comm-stream order) with its data kernels' traces (launch
    order per kind; ``backend.trace_history``) and time each step: its span, the kernel's own time,
    how far its CTAs' starts spread, and when its first CTA started after the span began. The last
    compares %globaltimer with CUDA events, so it is relative: the step whose kernel started soonest
    after its span began counts 0."""
    steps, used = [], {k: 0 for k in history}
    for s in sorted((s for s in spans if s["stream"] == "comm"), key=lambda s: s["start_ms"]):
        kind = _comm_kernel_kind(s["label"])
        if used[kind] >= len(history[kind]):
            raise RuntimeError(f"comm trace: no {kind} launch left for step {s['label']}")
        ctas = history[kind][used[kind]]
        used[kind] += 1
        starts, ends = [c[0] for c in ctas], [c[2] for c in ctas]
        steps.append({"label": s["label"], "kernel": kind, "span_ms": s["end_ms"] - s["start_ms"],
                      "kernel_ms": (max(ends) - min(starts)) / 1e6, "skew_ms": (max(starts) - min(starts)) / 1e6,
                      "_offset_ms": min(starts) / 1e6 - s["start_ms"]})
    extra = {k: len(history[k]) - n for k, n in used.items() if len(history[k]) != n}
    if extra:
        raise RuntimeError(f"comm trace: launches without a comm step: {extra}")
    base = min((st["_offset_ms"] for st in steps), default=0.0)
    for st in steps:
        st["lead_ms"] = st.pop("_offset_ms") - base
    return steps


def comm_trace_summary(rank_steps: dict) -> dict:
    """Per schedule: COMM_TRACE_SUMMARY's sums over the comm steps."""
    return {sched: {k: sum(st[k] for st in steps) for k in COMM_TRACE_SUMMARY} for sched, steps in rank_steps.items()}


KERNEL_CATEGORIES = (  # (category, substrings of the kernel name), first match wins
    ("comm", ("dispatch_kernel", "combine_kernel", "notify_kernel", "layout_kernel")),
    ("gemm", ("gemm", "cutlass", "xmma", "nvjet", "cublas")),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
)


def _kernel_category(name: str) -> str:
    low = name.lower()
    return next((cat for cat, keys in KERNEL_CATEGORIES if any(k in low for k in keys)), "other")


def _kernel_profile(fn) -> dict:
    """Run fn once under torch.profiler (CUDA activity): kernel time per category (sum of kernel
    durations, ms), kernel count, and the 20 kernels with the most time (ms, launches). This rank's figures."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    cats: dict = {}
    names: dict = {}
    for e in prof.events():
        if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        ms = (e.time_range.end - e.time_range.start) / 1e3
        c = cats.setdefault(_kernel_category(e.name), {"ms": 0.0, "kernels": 0})
        c["ms"] += ms
        c["kernels"] += 1
        ms0, n0 = names.get(e.name, (0.0, 0))
        names[e.name] = (ms0 + ms, n0 + 1)
    top = sorted(names.items(), key=lambda kv: -kv[1][0])[:20]
    return {"categories": cats, "top": [{"name": n[:120], "ms": ms, "launches": k} for n, (ms, k) in top]}


def _chrome_trace(fn, out_dir: str, name: str) -> str:
    """Run fn once (after a synchronised start) under torch.profiler with host and CUDA activity and
    write the chrome trace, gzipped, to out_dir/name.json.gz: where the host waited, what each stream
    ran and when. Returns the path."""
    import gzip
    import shutil
    from torch.profiler import ProfilerActivity, profile
    os.makedirs(out_dir, exist_ok=True)
    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    raw = os.path.join(out_dir, name + ".json")
    prof.export_chrome_trace(raw)
    with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.remove(raw)
    return raw + ".gz"


def _figures(seq_ms: float, dual_ms: float, comm_ms: float, compute_ms: float) -> dict:
    """One phase's figures and its verdicts against the issue's targets."""
    busiest = max(comm_ms, compute_ms, 1e-9)
    ratio = comm_ms / max(compute_ms, 1e-9)
    dual_over_max = dual_ms / busiest
    speedup = seq_ms / max(dual_ms, 1e-9)
    balanced = BALANCED_RANGE[0] <= ratio <= BALANCED_RANGE[1]
    return {
        "sequential_ms": seq_ms, "dual_ms": dual_ms, "comm_ms": comm_ms, "compute_ms": compute_ms,
        "comm_over_compute": ratio,
        "dual_over_max_comm_compute": dual_over_max,
        "speedup_over_sequential": speedup,
        # What a perfect overlap gives against a sequential run without gaps: (comm + compute) / max.
        "speedup_bound_comm_plus_compute_over_max": (comm_ms + compute_ms) / busiest,
        "verdict": {
            "dual_over_max_ok": dual_over_max <= TARGET_DUAL_OVER_MAX,
            "comm_about_equal_compute": balanced,
            "speedup_target_applies": balanced,
            "speedup_ok": speedup >= TARGET_SPEEDUP,
        },
    }


def _verdict_text(v: dict) -> str:
    return (f"dual/max {'ok' if v['dual_over_max_ok'] else 'MISSED'}; speedup "
            + (("ok" if v["speedup_ok"] else "MISSED") if v["speedup_target_applies"] else "n/a (comm !~ compute)"))


def _print_table(result: dict) -> None:
    sh = result["shapes"]
    print(f"[overlap] device={result['device']} ranks={result['num_ranks']} backend={result['backend']} "
          f"tokens/micro-batch={sh['tokens']} hidden={sh['hidden']} experts={sh['experts']} "
          f"({sh['experts'] // result['num_ranks']}/rank) top-{sh['topk']} expert_hidden={sh['expert_hidden']} "
          f"heads={sh['heads']}x{sh['head_dim']} layers={sh['layers']} fp8={sh['fp8']} "
          f"issue_order={result['issue_order']} comm_priority={result['comm_stream_priority']} "
          f"sm_carveout={result['sm_carveout']['sms']} defer_wgrad={result['defer_weight_grads']} "
          f"moe_row_kernel={result.get('moe_row_kernel')} ce_bytes={result.get('ce_bytes')} ce_staging={result.get('ce_staging')} comm_sms={result['comm_sms']} ({result['comm_sms_source']})")
    print(f"#{'phase':>18} {'sequential':>11} {'dual':>9} {'comm':>9} {'compute':>9} {'comm/comp':>9} "
          f"{'dual/max':>9} {'speedup':>8} {'bound':>6}  verdict")
    print(f"#{'':>18} {'(ms)':>11} {'(ms)':>9} {'(ms)':>9} {'(ms)':>9} {'':>9} {'':>9} {'':>8} {'':>6}")
    for name, f in result["figures"].items():
        verdict = _verdict_text(f["verdict"])
        print(f" {name:>18} {f['sequential_ms']:11.3f} {f['dual_ms']:9.3f} {f['comm_ms']:9.3f} "
              f"{f['compute_ms']:9.3f} {f['comm_over_compute']:9.2f} {f['dual_over_max_comm_compute']:9.3f} "
              f"{f['speedup_over_sequential']:8.3f} {f['speedup_bound_comm_plus_compute_over_max']:6.2f}  {verdict}")
    for name, f in result["figures"].items():
        if "schedule_bound_over_max" in f:
            b, i = f["dual_busy_over_sequential"], f["dual_idle_share"]
            halves = (f"; forward half + backward half {f['halves_floor_over_max']:.3f} x max"
                      if "halves_floor_over_max" in f else "")
            print(f"# {name:>18}: schedule bound {f['schedule_bound_over_max']:.3f} x max{halves}; dual busy / "
                  f"sequential: comm {b['comm']:.2f}, compute {b['compute']:.2f}; idle share: comm {i['comm']:.2f}, "
                  f"compute {i['compute']:.2f}")
            if "compute_dense_ms" in f:
                print(f"# {name:>18}: compute dense (transfers replayed) {f['compute_dense_ms']:.3f} ms = "
                      f"{f['compute_dense_over_sequential']:.3f} x sequential compute; dual / max(comm, dense "
                      f"compute) {f['dual_over_max_comm_compute_dense']:.3f}, comm / dense compute "
                      f"{f['comm_over_compute_dense']:.2f}: {_verdict_text(f['verdict_dense'])}")
            print(f"# {name:>18}: sequential step means (ms): "
                  + ", ".join(f"{k} {v:.2f}" for k, v in f.get("sequential_stage_ms", {}).items()))
    for window, gpus in (result.get("gpu_clocks") or {}).items():
        print(f"# clocks {window:>29}: " + "; ".join(
            f"gpu{g} {c['sm_mhz_mean']:.0f} MHz (min {c['sm_mhz_min']:.0f}), "
            + (f"{c['power_w_mean']:.0f} W, " if c["power_w_mean"] is not None else "")
            + f"power cap {100 * c['power_cap_share']:.0f}% of {c['samples']} samples" for g, c in gpus.items()))
    print(f"# targets: dual/max(comm, compute) <= {TARGET_DUAL_OVER_MAX}; speedup >= {TARGET_SPEEDUP} where comm ~ "
          f"compute ({BALANCED_RANGE[0]:.2f} <= comm/compute <= {BALANCED_RANGE[1]:.2f}); bound = (comm + compute) / max")


def plot_timeline(result: dict, path: str) -> None:
    """One panel per phase and schedule; two rows (compute, comm); colour = micro-batch."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(name, sched, f[f"spans_{sched}"], f) for name, f in result["figures"].items()
              for sched in ("sequential", "dual")]
    fig, axes = plt.subplots(len(panels), 1, figsize=(14, 1.6 * len(panels)), squeeze=False)
    colours = {"0": "tab:blue", "1": "tab:orange"}
    for ax, (name, sched, spans, fig_) in zip(axes[:, 0], panels):
        for s in spans:
            row = 1 if s["stream"] == "compute" else 0
            mb = s["label"].split(".")[0]
            width = max(s["end_ms"] - s["start_ms"], 1e-6)
            ax.broken_barh([(s["start_ms"], width)], (row - 0.4, 0.8), facecolors=colours.get(mb, "grey"),
                           edgecolor="black", linewidth=0.3, alpha=0.85 if ".B." in s["label"] else 1.0,
                           hatch="//" if ".B." in s["label"] else None)
            if width > 0.04 * max(x["end_ms"] for x in spans):
                ax.text(s["start_ms"] + width / 2, row, s["label"].split(".", 1)[1], ha="center", va="center",
                        fontsize=6)
        ax.set_yticks([0, 1], ["comm", "compute"])
        ms = fig_[f"{sched}_ms"]
        extra = (f"  (comm {fig_['comm_ms']:.2f} / compute {fig_['compute_ms']:.2f} ms = "
                 f"{fig_['comm_over_compute']:.2f})" if sched == "sequential" else
                 f"  (dual / max {fig_['dual_over_max_comm_compute']:.3f}, speedup "
                 f"{fig_['speedup_over_sequential']:.3f}"
                 + (f"; compute alone, back to back: {fig_['compute_dense_ms']:.2f} ms, dual / max "
                    f"{fig_['dual_over_max_comm_compute_dense']:.3f}" if "compute_dense_ms" in fig_ else "") + ")")
        ax.set_title(f"{name}: {sched}, {ms:.2f} ms{extra}", fontsize=8, loc="left")
        ax.set_xlabel("ms", fontsize=7)
    fig.suptitle(f"commlib dual pipeline on {result['device']} x{result['num_ranks']}, preset "
                 f"{result['shapes']['preset']}, issue order {result.get('issue_order', 'auto')}, "
                 f"comm SMs {result.get('comm_sms')} "
                 "(blue: micro-batch 0, orange: 1, hatched: backward)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def _worker(ctx, args):
    return run(ctx, args)


def _transport_env(args) -> None:
    """--ce-staging / --ce-sms: the environment the ranks' Buffers read (set before any is created)."""
    if args.ce_staging is not None:
        os.environ["COMMLIB_CE_STAGING"] = args.ce_staging
        os.environ.setdefault("COMMLIB_CE_BYTES", str(600 << 20))
    if args.ce_sms is not None:
        os.environ["COMMLIB_CE_SMS"] = str(args.ce_sms)
    if args.no_ce_prepack:
        os.environ["COMMLIB_CE_PREPACK"] = "0"
    if args.ce_defer_sum:
        os.environ["COMMLIB_CE_DEFER_SUM"] = "1"


def main(argv=None) -> None:
    args = parse_args(argv)
    _transport_env(args)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        from commlib.utils.dist import init_distributed
        from commlib.utils.launch import RankContext
        group = init_distributed()
        rank, world = dist.get_rank(), dist.get_world_size()
        device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
                  else torch.device("cpu"))
        rpn = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        run(RankContext(rank, world, rpn, device, group), args)
        dist.destroy_process_group()
    else:
        from commlib.utils.launch import parallel_launch
        parallel_launch(args.ranks, _worker, args, use_gpu=True)


if __name__ == "__main__":
    from commlib.utils.launch import exit_rank
    main()
    exit_rank(0)  # under torchrun this process is a rank: leave without the interpreter's finalization
