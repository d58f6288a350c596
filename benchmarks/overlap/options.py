"""bench_overlap's command line: shape presets, flags, and the environment the ranks read."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from benchmarks.overlap.calibrate import COMM_SMS_CALIBRATION

ROOT = str(Path(__file__).resolve().parents[2])
DESCRIPTION = "Dual pipeline vs sequential: a MoE layer on two micro-batches, expert-parallel over the ranks."

PRESETS = {
    #           tokens hidden experts topk groups topk_groups expert_hidden shared heads head_dim
    "v3":       (4096, 7168, 256, 8, 8, 4, 2048, 1, 56, 128),
    "balanced": (4096, 7168, 16, 2, 2, 2, 256, 0, 4, 128),
    "balanced_fb": (4096, 7168, 2, 2, 1, 1, 256, 0, 0, 128),   # expert_hidden calibrated (see bench_overlap)
    "balanced_sms": (4096, 7168, 2, 2, 1, 1, 256, 0, 0, 128),  # comm SMs calibrated (see bench_overlap)
    "network": (16384, 7168, 16, 2, 2, 2, 3072, 0, 16, 128),  # with --ce-staging host (see bench_overlap)
    "tiny":     (32, 64, 8, 2, 2, 2, 32, 1, 4, 16),
}
CALIBRATED = {"balanced_fb"}           # presets whose expert_hidden is calibrated to compute ~ comm
CALIBRATED_SMS = {"balanced_sms"}      # presets whose comm SMs are calibrated to comm ~ compute
PHASES = ("forward", "forward_backward", "fwd0_bwd1")
FIELDS = ("tokens", "hidden", "experts", "topk", "groups", "topk_groups", "expert_hidden", "shared", "heads",
          "head_dim")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=DESCRIPTION)
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
                   help="SMs the dual schedules keep GEMMs off while they overlap (commlib.training.pipeline.sm_carveout; "
                        "default: $COMMLIB_SM_CARVEOUT, else auto = the comm SMs); the sequential runs never set it")
    p.add_argument("--sm-carveout-backward", default=None, metavar="auto|off|N",
                   help="forward+backward (two forwards, two backwards): the carveout from micro-batch 0's backward on "
                        "(default: --sm-carveout's)")
    p.add_argument("--fb-schedule", choices=("split", "joint"), default="split",
                   help="forward+backward, dual (commlib.training.pipeline.dual_forward_backward's schedule): split = "
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
                   help="which step of a (compute, comm) pair the host issues first (commlib.training.pipeline.interleave); "
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


def resolve_shapes(args, on_gpu: bool) -> dict:
    """The run's shapes: the preset's (default v3 on GPUs, tiny on CPU), each overridden by its flag."""
    preset = args.preset or ("v3" if on_gpu else "tiny")
    shapes = dict(zip(FIELDS, PRESETS[preset]))
    for f in FIELDS:
        v = getattr(args, f.replace("-", "_"), None)
        if v is not None:
            shapes[f] = v
    shapes["preset"] = preset
    shapes["shared_stage"] = args.shared_stage
    return shapes


def calibration_plan(args, preset: str) -> tuple:
    """(calibrate expert_hidden, calibrate comm SMs): explicit flags first, then the preset's default;
    at most one of the two (parse_args refuses both explicitly)."""
    sizes, sms = args.calibrate, args.calibrate_comm_sms
    if sizes is None:
        sizes = preset in CALIBRATED and args.expert_hidden is None and not sms
    if sms is None:
        sms = (preset in CALIBRATED_SMS and args.comm_sms is None and not sizes
               and args.calibrate is not False)
    return bool(sizes), bool(sms)


def transport_env(args) -> None:
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

