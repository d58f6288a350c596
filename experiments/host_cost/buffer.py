"""Host time of what a Buffer call pays besides its collectives, one piece at a time, on one GPU.

``bench_internode --profile`` puts 150-280 us of a call before the backend's first step (the Buffer's
checks, its stream handling) and 70-200 us after its last (the handle, the outputs' stream records).
This times those pieces and the torch / launch primitives the internode engine's device path is
made of, each back to back (median of ``--reps`` batches of 50 calls, the device kept busy so no
call pays a first-launch-after-idle cost):

  buffer_dispatch / buffer_cached / buffer_combine   Buffer.dispatch / combine around a backend stub
      that returns prepared outputs at once: the Buffer's own share of a call
  run_cuda        Buffer._run_cuda around a no-op (stream wait, set_stream, event)
  prepare         Buffer._prepare_dispatch (argument checks, config, capacity)
  record_stream   one tensor's record_stream; tensors_of: finding a result's tensors
  event           torch.cuda.Event() + record + wait_event
  config          a default Config (default_dispatch_config)
  empty_small / empty_large   torch.empty on the GPU (256 B / 64 MB)
  view            a slice + dtype view + reshape of a byte tensor
  h2d_pinned      torch.tensor(16 ints).pin_memory().to(cuda, non_blocking=True)
  h2d_reuse       16 ints written into a kept pinned tensor, copied into a kept device tensor
  launch          one small kernel through commlib's loader (csrc/internode.cu's recv_chan)
  tolist          a [2, 300] int64 host tensor to lists
  handle          a DispatchHandle built from existing tensors

Run: python -m experiments.host_cost.buffer [--reps 20] [--json PATH]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from experiments import write_json


def _batch_us(fn, reps: int, per: int = 50, keep_busy=None) -> float:
    """Median over ``reps`` batches of the mean host us of ``per`` back-to-back calls."""
    out = []
    for _ in range(reps):
        if keep_busy is not None:
            keep_busy()
        t0 = time.perf_counter()
        for _ in range(per):
            fn()
        out.append((time.perf_counter() - t0) * 1e6 / per)
    return statistics.median(out)


def main(argv=None) -> int:
    import torch
    import torch.distributed as dist

    from commlib.backends.internode import kernels as IK
    from commlib.backends.base import CombineResult, DispatchResult
    from commlib.buffer import Buffer, _tensors_of
    from commlib.config import default_dispatch_config
    from commlib.handle import DispatchHandle

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--json", nargs="?", const="auto", default=None, metavar="PATH")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("host_cost_buffer needs a GPU")
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    store = tempfile.mktemp(prefix="commlib_hostcost_")
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
    T, H, E, K, R = a.tokens, a.hidden, 256, 8, 1
    buf = Buffer(dist.group.WORLD, 1 << 30, 0, backend="reference")
    x = torch.randn(T, H, device=dev).to(torch.bfloat16)
    idx = torch.randint(0, E, (T, K), device=dev)
    w = torch.rand(T, K, device=dev)
    ntr, _, nte, tir, _ = buf.get_dispatch_layout(idx, E)
    recv_x, _, recv_w, _, handle, _ = buf.dispatch(x, num_tokens_per_rank=ntr, is_token_in_rank=tir,
                                                    num_tokens_per_expert=nte, topk_idx=idx, topk_weights=w)
    N = recv_x.shape[0]
    # the backend answers at once with outputs like the internode engine's (5 outputs + 6 handle tensors)
    made = DispatchResult(recv_x, None, idx[:N], recv_w, [0] * (E // R), handle)
    cached = DispatchResult(recv_x, None, None, None, None, handle)
    combined = CombineResult(x, w)
    backend = buf.backend
    backend.dispatch = lambda req: cached if req.handle is not None else made
    backend.combine = lambda req: combined
    busy = lambda: torch.cuda._sleep(2_000_000)   # noqa: E731  (the device never idles between batches)
    rows = {}

    def timed(name, fn):
        fn()
        torch.cuda.synchronize()
        rows[name] = round(_batch_us(fn, a.reps, keep_busy=busy), 2)
        torch.cuda.synchronize()
        print(f"{name:>16} {rows[name]:>9.2f} us")

    timed("buffer_dispatch", lambda: buf.dispatch(x, num_tokens_per_rank=ntr, is_token_in_rank=tir,
                                                  num_tokens_per_expert=nte, topk_idx=idx, topk_weights=w))
    timed("buffer_cached", lambda: buf.dispatch(x, handle=handle))
    timed("buffer_combine", lambda: buf.combine(recv_x, handle, topk_weights=recv_w))
    timed("run_cuda", lambda: buf._run_cuda(lambda: None, [x], None, False))
    timed("prepare", lambda: buf._prepare_dispatch(x, None, ntr, None, tir, nte, idx, w, 1, 0, None))
    timed("record_stream", lambda: recv_x.record_stream(torch.cuda.current_stream()))
    timed("tensors_of", lambda: _tensors_of(made, skip=[x, None, idx, w, tir, None]))

    def event():
        e = torch.cuda.Event()
        e.record(buf.comm_stream)
        torch.cuda.current_stream().wait_event(e)
    timed("event", event)
    timed("config", lambda: default_dispatch_config(8, 24))
    timed("empty_small", lambda: torch.empty(64, dtype=torch.int32, device=dev))
    timed("empty_large", lambda: torch.empty(64 << 20, dtype=torch.uint8, device=dev))
    arena = torch.empty(1 << 20, dtype=torch.uint8, device=dev)
    timed("view", lambda: arena[4096:4096 + 4 * T * 2].view(torch.int32).view(T, 2))
    vals = list(range(16))
    timed("h2d_pinned", lambda: torch.tensor(vals, dtype=torch.int64).pin_memory().to(dev, non_blocking=True))
    pinned = torch.empty(16, dtype=torch.int64, pin_memory=True)
    on_dev = torch.empty(16, dtype=torch.int64, device=dev)
    view = pinned.numpy()

    def h2d_reuse():
        view[:] = vals
        on_dev.copy_(pinned, non_blocking=True)
    timed("h2d_reuse", h2d_reuse)
    g = torch.zeros(1, 300, dtype=torch.int64, device=dev)
    chan = torch.empty(1, 4, dtype=torch.int32, device=dev)
    src = torch.zeros(16, dtype=torch.int32, device=dev)
    timed("launch", lambda: IK.recv_chan(src, g, chan, n_sig=1, me=0))
    host = torch.zeros(2, 300, dtype=torch.int64)
    timed("tolist", lambda: host.tolist())
    timed("handle", lambda: DispatchHandle(handle.rank_prefix_matrix, handle.channel_prefix_matrix,
                                           handle.recv_channel_prefix_matrix, handle.recv_src_idx,
                                           handle.is_token_in_rank, handle.send_head, topology=handle.topology,
                                           num_tokens=T, hidden=H, num_experts=E, num_channels=4,
                                           num_recv_tokens=N, backend="x", extra={}))
    buf.destroy()
    dist.destroy_process_group()
    os.unlink(store) if os.path.exists(store) else None
    if a.json:
        write_json("host_cost_buffer", argv, [{"op": k, "host_us": v} for k, v in rows.items()], 1, a.json, module="experiments.host_cost.buffer",
                   tokens=T, hidden=H)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
