"""Trapping fault-injection worlds for the NVLink engine: ``python reliability_faults.py CASE``.

Each case is one short 2-rank world, one rank per GPU, on a gloo group (NCCL never meets a dead
context); tests/gpu/test_gpu_reliability.py runs them one at a time. A trap
ends the CUDA context, so a world runs exactly one fault. Every rank prints

    [fault] rank R: RAISED|OK|SKIPPED after S s: <exception type>: <message>
    [fault] rank R after: <exception type>: <message>     (the next call on the same Buffer)
    [fault] rank R again: <exception type>: <message>     (and the one after)

then flushes C stdio (the device's '[commlib] rank ...' lines) and leaves with os._exit(0):
destructors on a dead context can abort the process, and the launcher accepts exit code 0.

Cases (COMMLIB_TIMEOUT_S from the environment):
  sig_cached_dispatch   both dispatch; then a cached dispatch, rank 0 bf16, rank 1 FP8 (same hidden,
                        so the handle accepts both): the receivers' signature checks trap.
  sig_combine           both dispatch; rank 0 combines with topk_weights, rank 1 without: the slot
                        layouts differ, the combine receivers' signature checks trap.
  skip_combine          both dispatch; rank 1 never combines: rank 0's combine times out.
  dispatch_twice        both dispatch; rank 0 dispatches again, rank 1 combines: rank 0's count
                        exchange and rank 1's combine both time out.
  exit_before_dispatch  rank 1 exits right after creating the Buffer: rank 0's dispatch times out.
  ring_stall            both dispatch through rings of 2 rows (Config(8, 1, 2)); rank 0 dispatches again
                        (cached), rank 1 never does: rank 0's ring waits (head of a full ring, or
                        the peer's tail) time out naming rank, channel and counter. Only rank 0
                        traps, so this world also runs with both ranks on one GPU.
  ll_bad_expert_id      low-latency mode: rank 0's topk_idx holds an expert id >= num_experts; its
                        dispatch kernel names it and traps, rank 1's receiver times out.
"""
from __future__ import annotations

import ctypes
import os
import sys
import time

import torch
import torch.distributed as dist

from commlib.utils.launch import parallel_launch

E, K, T, H = 8, 2, 64, 256


def _flush_and_exit() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        ctypes.CDLL(None).fflush(None)  # device printf output buffered in C stdio
    except Exception:  # noqa: BLE001
        pass
    os._exit(0)


def _report(rank: int, tag: str, fn) -> bool:
    """Run fn, print '[fault] rank R: TAG ...'; True when it raised."""
    t0 = time.monotonic()
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - the outcome is what the test reads
        msg = " ".join(str(e).split())[:600]
        if tag:
            print(f"[fault] rank {rank} {tag}: {type(e).__name__}: {msg}", flush=True)
        else:
            print(f"[fault] rank {rank}: RAISED after {time.monotonic() - t0:.1f} s: {type(e).__name__}: {msg}",
                  flush=True)
        return True
    if tag:
        print(f"[fault] rank {rank} {tag}: no error", flush=True)
    else:
        print(f"[fault] rank {rank}: OK after {time.monotonic() - t0:.1f} s: no error", flush=True)
    return False


def worker(ctx, case: str):
    from commlib.buffer import Buffer
    from commlib.config import Config
    from commlib.fp8 import per_token_cast_to_fp8

    me, dev = ctx.rank, ctx.device
    timeout = float(os.environ.get("COMMLIB_TIMEOUT_S", "4"))
    if case == "ll_bad_expert_id":
        _ll_bad_expert_id(ctx)
    cfg = Config(8, 1, 2) if case == "ring_stall" else Config(8, 16, 64, 64, 1024)
    buf = Buffer(ctx.group, cfg.get_nvl_buffer_size_hint(H * 2, ctx.world_size), backend="nvlink",
                 explicitly_destroy=True)
    assert buf.backend.name == "nvlink", buf.backend.name
    g = torch.Generator(device=dev).manual_seed(7 + me)
    idx = torch.rand(T, E, generator=g, device=dev).topk(K, dim=1).indices
    w = torch.rand(T, K, generator=g, device=dev)
    x = torch.randn(T, H, generator=g, device=dev).to(torch.bfloat16)
    ntpr, _, ntpe, tir, _ = buf.get_dispatch_layout(idx, E)

    def dispatch():
        return buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=tir, num_tokens_per_expert=ntpe,
                            topk_idx=idx, topk_weights=w, config=cfg)

    def sync_after(fn):
        def run():
            fn()
            torch.cuda.synchronize()
        return run

    if case == "exit_before_dispatch":
        dist.barrier()
        if me == 1:
            print("[fault] rank 1: SKIPPED after 0.0 s: exits before dispatch", flush=True)
            _flush_and_exit()
        time.sleep(0.5)  # rank 1 is gone
        fault = dispatch
        follow = dispatch
    else:
        rx, _, rw, _, h, _ = dispatch()
        torch.cuda.synchronize()
        dist.barrier()
        follow = lambda: buf.dispatch(x, handle=h, config=cfg)  # noqa: E731
        if case == "sig_cached_dispatch":
            xin = x if me == 0 else per_token_cast_to_fp8(x)
            fault = sync_after(lambda: buf.dispatch(xin, handle=h, config=cfg))
        elif case == "sig_combine":
            fault = sync_after(lambda: buf.combine(rx, h, topk_weights=rw if me == 0 else None, config=cfg))
        elif case == "skip_combine":
            if me == 1:
                time.sleep(timeout + 4)  # never combines; the peer must not hang meanwhile
                print("[fault] rank 1: SKIPPED after 0.0 s: skipped the combine", flush=True)
                _flush_and_exit()
            fault = sync_after(lambda: buf.combine(rx, h, topk_weights=rw, config=cfg))
        elif case == "ring_stall":
            if me == 1:
                time.sleep(timeout + 4)  # never dispatches again; the peer must not hang meanwhile
                print("[fault] rank 1: SKIPPED after 0.0 s: skipped the cached dispatch", flush=True)
                _flush_and_exit()
            fault = sync_after(lambda: buf.dispatch(x, handle=h, config=cfg))
        elif case == "dispatch_twice":
            if me == 0:
                fault = sync_after(dispatch)
            else:
                fault = sync_after(lambda: buf.combine(rx, h, topk_weights=rw, config=cfg))
        else:
            raise SystemExit(f"unknown case {case!r}")
    if _report(me, "", fault):
        _report(me, "after", follow)
        _report(me, "again", follow)
    _flush_and_exit()


def _ll_bad_expert_id(ctx):
    from commlib.buffer import Buffer

    me, dev, M = ctx.rank, ctx.device, 16
    nbytes = Buffer.get_low_latency_rdma_size_hint(M, H, ctx.world_size, E)
    buf = Buffer(ctx.group, 0, nbytes, low_latency_mode=True, backend="nvlink", explicitly_destroy=True)
    x = torch.randn(M, H, device=dev).to(torch.bfloat16)
    idx = torch.rand(M, E, device=dev).topk(K, dim=1).indices
    if me == 0:
        idx[3, 1] = E  # one past the last expert

    def dispatch():
        buf.low_latency_dispatch(x, idx, M, E, use_fp8=True)
        torch.cuda.synchronize()

    dist.barrier()
    if _report(me, "", dispatch):
        _report(me, "after", dispatch)
        _report(me, "again", dispatch)
    _flush_and_exit()


if __name__ == "__main__":
    name = sys.argv[1]
    print(f"[fault] world {name}: COMMLIB_TIMEOUT_S={os.environ.get('COMMLIB_TIMEOUT_S')} "
          f"CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}", flush=True)
    parallel_launch(2, worker, name, use_gpu=True, timeout_s=100, allow_exit=True, group_backend="gloo")
    print(f"[fault] world {name}: done", flush=True)
