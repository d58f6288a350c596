"""The benchmark's model and its timing, and the calibrations that bring comm and compute to about
the same size (expert_hidden, or the comm SMs)."""
from __future__ import annotations

import dataclasses
import math
import statistics
import time

import torch
import torch.distributed as dist

from commlib import Buffer
from commlib.training import pipeline as P
from commlib.training.moe import MoEConfig, MoEModel
from commlib.utils.timing import slowest

from benchmarks.overlap.analysis import sum_spans

CALIBRATION_SIZES = (64, 128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)   # ~1.5x steps past 256
# Fewest first (even: two CTAs per channel). Not 2 (one channel): the nvlink engine's GPU tests never
# run a single channel.
COMM_SMS_CALIBRATION = (4, 6, 8, 12, 16, 20, 24)


def comm_configs(num_ranks: int, num_sms, tokens: int, send_chunk=None) -> tuple:
    """(dispatch Config, combine Config) with ``num_sms`` SMs, or (None, None) for the Buffer's own
    choice. The Buffer's default chunk sizes (the send chunk ``send_chunk`` when given); the receive
    capacity per channel is raised to ceil(tokens / channels) when fewer channels must hold the call
    (the Buffer checks it)."""
    if num_sms is None:
        return None, None
    out = []
    for default in (Buffer.get_dispatch_config(num_ranks), Buffer.get_combine_config(num_ranks)):
        channels = num_sms // 2
        recv = max(default.num_max_nvl_chunked_recv_tokens, math.ceil(tokens / channels))
        send = send_chunk or default.num_max_nvl_chunked_send_tokens
        out.append(dataclasses.replace(default, num_sms=num_sms, num_max_nvl_chunked_recv_tokens=max(recv, send),
                                       num_max_nvl_chunked_send_tokens=send))
    return tuple(out)


class Clock:
    """Times one call on every rank together: a barrier first, then CUDA events (GPU) or the wall clock."""

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


def median_ms(clock, fn, warmup, iters) -> float:
    for _ in range(warmup):
        clock.time_ms(fn)
    return statistics.median(clock.time_ms(fn) for _ in range(iters))


def build_model(args, sh, buffer, device, comm_configs=(None, None)):
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


def sequential_fb_split(model, h0, h1, g0, g1, clock, warmup=2, reps=3) -> tuple:
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
        comm.append(sum_spans(spans, "comm"))
        compute.append(sum_spans(spans, "compute"))
    model.zero_grad(set_to_none=True)
    return tuple(slowest([statistics.median(comm), statistics.median(compute)]))


def calibrate(ctx, args, sh, buffer, inputs, clock, comm_configs=(None, None)) -> tuple:
    """expert_hidden whose sequential forward+backward compute / comm is nearest 1 (same on every
    rank: the figures are gathered). Compute grows with expert_hidden, comm does not."""
    trials = []
    for size in CALIBRATION_SIZES:
        model = build_model(args, dict(sh, expert_hidden=size), buffer, ctx.device, comm_configs)
        comm_ms, compute_ms = sequential_fb_split(model, *inputs, clock)
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


def calibrate_comm_sms(ctx, model, inputs, clock, tokens) -> tuple:
    """Comm SMs whose sequential forward+backward comm / compute is nearest 1 (log distance; same on
    every rank: the figures are gathered). Communication slows down with fewer SMs; compute does
    not change (the sequential run never overlaps the two). Fewest SMs first, stopping once comm <=
    compute. Leaves the chosen configs on ``model``."""
    trials = []
    for sms in COMM_SMS_CALIBRATION:
        model.comm_configs = comm_configs(ctx.world_size, sms, tokens)
        comm_ms, compute_ms = sequential_fb_split(model, *inputs, clock)
        ratio = comm_ms / max(compute_ms, 1e-9)
        trials.append({"comm_sms": sms, "comm_ms": comm_ms, "compute_ms": compute_ms, "comm_over_compute": ratio})
        if ctx.rank == 0:
            print(f"[overlap] calibrate comm_sms={sms}: sequential forward+backward comm {comm_ms:.3f} ms, "
                  f"compute {compute_ms:.3f} ms (comm / compute {ratio:.2f})")
        if ratio <= 1.0:
            break
    best = min(trials, key=lambda t: abs(math.log(max(t["comm_over_compute"], 1e-9))))
    model.comm_configs = comm_configs(ctx.world_size, best["comm_sms"], tokens)
    return best["comm_sms"], trials

