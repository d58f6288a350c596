"""Auto-tuning of Config (num_sms and chunk sizes), cached on disk per machine and shape.

What is tuned: for one call shape (ranks, ranks per node, hidden, dtype, token bucket), separately
for dispatch and combine, the fields of ``commlib.config.Config``: num_sms (even) and the NVLink /
network chunk sizes and ring sizes. Every candidate respects Config's validation, and its rings
fit the Buffer when its sizes are known (the size hints); rows stream through them, any token count.

How: ``search(space, time_fn)`` where ``time_fn(config) -> [sample times]`` (one batch of
repetitions). The "smart" strategy goes coarse-to-fine: every other value of num_sms x send
chunk, then a hill-climb over both at once (diagonal steps follow the valley where a bigger SM
count wants a smaller chunk), then the network chunk and the capacities, one batch per point;
it ends with successive halving on repetitions among the best 8. "exhaustive" times every
candidate with the full repetitions. The default config is kept unless the winner beats it by
more than the noise: the larger spread (max - min) of the two configs' batch medians, from fresh
batches of both timed in turn.

The cache lives in ``commlib.tuning.cache`` (below the Buffer); this module sits above it.

Usage:
    from commlib.tuning import autotune
    cfg = autotune.cached_config("dispatch", num_ranks, ranks_per_node, hidden, torch.bfloat16, T, device)
    result = autotune.autotune(buffer, "dispatch", x.shape, x.dtype)  # collective over buffer.group
    python -m commlib.tuning --hidden 7168 --tokens 4096                 # one rank per GPU
    python -m commlib.tuning --cpu --world 2 --hidden 256 --tokens 64    # gloo smoke test
    python -m benchmarks.bench_tune --simulate                           # smart vs exhaustive, cost model

Legend: T tokens on this rank, H hidden, R ranks, P ranks per node, C channels (= num_sms / 2).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any, Callable, Optional, Sequence

import torch

from commlib.buffer import Buffer
from commlib.config import Config, default_combine_config, default_dispatch_config
from commlib.fp8 import per_token_cast_to_fp8
from commlib.routing import group_limited_topk, random_scores
from commlib.topology import Topology
from commlib.tuning.cache import (  # noqa: F401 - re-exported: the tuning API in one place
    SCHEMA, VERSION, TuningCacheWarning, TuneKey, all_gather_objects, broadcast_object, cache_path,
    cached_config, lookup, machine, make_key, parse_topology, store, world_of)
from commlib.tuning.search import (  # noqa: F401 - re-exported
    KINDS, FIELDS, DEFAULT_SMS, DEFAULT_NVL_SEND, DEFAULT_NVL_RECV, DEFAULT_RDMA_SEND, DEFAULT_RDMA_RECV,
    TimeFn, config_fields, dtype_name, dtype_bytes, token_bucket, check_kind, fits, SearchSpace,
    default_space, Trial, SearchResult, format_table, search, TextProgress)
from commlib.utils import env
from commlib.utils.launch import parallel_launch
from commlib.utils.timing import bench_cuda

# --------------------------------------------------------------------------- Buffer integration
class BufferTimer:
    """Built-in ``time_fn``: times ``buffer.dispatch`` or ``buffer.combine`` with a candidate config.

    Inputs follow the V3 workload: x ~ N(0, 1) [T, H] (FP8 via per_token_cast_to_fp8), group-limited
    top-k routing. Dispatch is the full call (layout given, counts exchanged, host sync). Combine
    reuses one handle: the handle fixes the channel split combine walks (its CTA pairs loop over
    the dispatch's channels), so it is dispatched with ``dispatch_config`` (what the Buffer will
    use for dispatch; every rank must pass the same) or, when None, with each candidate's num_sms.
    Samples are CUDA-event times with an L2 flush on the GPU (commlib.utils.timing.bench_cuda),
    perf_counter on CPU, in microseconds.
    """

    def __init__(self, buffer, kind: str, num_tokens: int, hidden: int, dtype: Any = "bfloat16", *,
                 num_experts: int = 256, topk: int = 8, num_groups: int = 8, topk_groups: int = 4,
                 reps: int = 5, warmup: int = 2, flush_l2: bool = True, seed: int = 0,
                 dispatch_config: Optional[Config] = None, settle_s: Optional[float] = None) -> None:
        check_kind(kind)
        self.buffer, self.kind, self.reps, self.warmup, self.flush_l2 = buffer, kind, reps, warmup, flush_l2
        self.device = torch.device(getattr(buffer, "device", "cpu"))
        rank = getattr(buffer, "rank", 0)
        gen = torch.Generator().manual_seed(seed * 1000003 + rank)
        num_groups = min(num_groups, num_experts)
        scores = random_scores(num_tokens, num_experts, gen)
        idx, weights = group_limited_topk(scores, num_groups, min(topk_groups, num_groups), topk)
        self.topk_idx, self.topk_weights = idx.to(self.device), weights.to(self.device)
        x = torch.randn(num_tokens, hidden, generator=gen, device="cpu", dtype=torch.float32).to(self.device, torch.bfloat16)
        self.x_bf16 = x
        self.x = per_token_cast_to_fp8(x) if dtype_name(dtype) == "float8_e4m3fn" else x
        per_rank, per_rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(self.topk_idx, num_experts)
        self.layout = dict(num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
                           num_tokens_per_expert=per_expert, is_token_in_rank=in_rank,
                           topk_idx=self.topk_idx, topk_weights=self.topk_weights)
        self.dispatch_config = dispatch_config
        # Untimed calls before the first sample, so the first configs timed do not pay for clocks
        # ramping up from idle, first-use allocations and kernel compilation.
        self.settle_s = (1.0 if self.device.type == "cuda" else 0.0) if settle_s is None else settle_s
        self._handle: tuple = (None, None)  # (num_sms it was dispatched with, (recv_x, recv_w, handle))

    def _dispatch(self, x, config: Config):
        return self.buffer.dispatch(x, config=config, **self.layout)

    def _combine_inputs(self, config: Config) -> tuple:
        d_config = self.dispatch_config or config
        if self._handle[0] != d_config.num_sms:
            recv_x, _, recv_w, _, handle, _ = self._dispatch(self.x_bf16, d_config)
            self._handle = (d_config.num_sms, (recv_x, recv_w, handle))
        return self._handle[1]

    def _settle(self, fn: Callable) -> None:
        """Call ``fn`` for settle_s seconds, in rounds of 20; rank 0's clock decides for every rank
        (the calls are collective: all ranks must make the same number)."""
        group = getattr(self.buffer, "group", None)
        start = time.perf_counter()
        while True:
            for _ in range(20):
                fn()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            more = time.perf_counter() - start < self.settle_s
            if world_of(group)[0] > 1:
                more = broadcast_object(more, group)
            if not more:
                break
        self.settle_s = 0.0

    def __call__(self, config: Config) -> list:
        if self.kind == "dispatch":
            fn = lambda: self._dispatch(self.x, config)  # noqa: E731
        else:
            recv_x, recv_w, handle = self._combine_inputs(config)
            fn = lambda: self.buffer.combine(recv_x, handle, topk_weights=recv_w, config=config)  # noqa: E731
        if self.settle_s > 0:
            self._settle(fn)
        res = bench_cuda(fn, warmup=self.warmup, iters=self.reps, flush_l2=self.flush_l2, device=self.device)
        return res["samples"]


def combine_space(space, dispatch_config: Optional[Config]):
    """``space`` without num_sms above the dispatch's: combine's CTA pairs loop over the handle's
    channels (csrc/combine.cu), so CTAs beyond two per dispatch channel would only idle."""
    if dispatch_config is None or not isinstance(space, SearchSpace):
        return space
    sms = tuple(s for s in space.num_sms if s <= dispatch_config.num_sms)
    return dataclasses.replace(space, num_sms=sms) if sms else space


def _agreeing(time_fn: TimeFn, group: Any) -> TimeFn:
    """Wrap ``time_fn`` so every rank sees the same samples (the slowest rank's, element-wise).

    With identical samples the search takes identical decisions on every rank, so a time_fn that
    runs collectives (dispatch/combine) stays in lockstep. A failure on any rank fails everywhere.
    """
    def fn(config: Config) -> list:
        try:
            mine: Any = [float(v) for v in time_fn(config)]
        except Exception as e:  # noqa: BLE001 - shared with the other ranks below
            mine = f"{type(e).__name__}: {e}"
        everyone = all_gather_objects(mine, group)
        errors = [f"rank {r}: {v}" for r, v in enumerate(everyone) if isinstance(v, str) or not v]
        if errors:
            raise RuntimeError("; ".join(errors))
        n = min(len(v) for v in everyone)
        return [max(v[i] for v in everyone) for i in range(n)]
    return fn


def _buffer_shape(buffer, group) -> tuple[int, int]:
    world, rank = world_of(group)
    num_ranks = getattr(buffer, "num_ranks", world)
    topology = getattr(buffer, "topology", None)
    if topology is not None:
        return num_ranks, topology.ranks_per_node
    return num_ranks, Topology.detect(rank, num_ranks).ranks_per_node


def autotune(buffer, kind: str, x_shape: Sequence[int], dtype: Any = "bfloat16", *,
             time_fn: Optional[TimeFn] = None, space: Optional[SearchSpace | Sequence[Config]] = None,
             strategy: str = "smart", batches: int = 4, group: Any = "buffer", save: bool = True,
             path: Optional[str] = None, progress: Optional[Callable] = None, default: Optional[Config] = None,
             max_num_sms: Optional[int] = None, min_gain: float = 0.0, **timer_kwargs: Any) -> SearchResult:
    """Tune ``kind`` ("dispatch" | "combine") for calls of ``x_shape`` = (T, H) on ``buffer``; cache the result.

    Collective over ``group`` (default: ``buffer.group``): every rank must call it. ``time_fn``
    defaults to ``BufferTimer(buffer, kind, T, H, dtype, **timer_kwargs)``. Samples are shared
    between ranks (slowest rank's), rank 0's decision is broadcast, and rank 0 stores it in the cache
    (``save``) for the token bucket of T. Returns the SearchResult (``.config`` is what to use).
    """
    check_kind(kind)
    num_tokens, hidden = int(x_shape[0]), int(x_shape[1])
    group = getattr(buffer, "group", None) if group == "buffer" else group
    world, rank = world_of(group)
    num_ranks, rpn = _buffer_shape(buffer, group)
    num_sms = getattr(buffer, "num_sms", env.num_sms())
    # The cache entry and the capacities serve the largest token count of any rank.
    bucket_tokens = max(all_gather_objects(num_tokens, group)) if world > 1 else num_tokens
    if default is None:
        default = (default_dispatch_config if kind == "dispatch" else default_combine_config)(num_ranks, num_sms)
    nvl, rdma = getattr(buffer, "num_nvl_bytes", None), getattr(buffer, "num_rdma_bytes", None)
    if space is None:
        space = default_space(kind, num_ranks, rpn, hidden, dtype, bucket_tokens, num_nvl_bytes=nvl,
                              num_rdma_bytes=rdma, max_num_sms=max_num_sms)
    if time_fn is None:
        if kind == "combine" and "dispatch_config" not in timer_kwargs:  # the dispatch config in use
            d_config = cached_config("dispatch", num_ranks, rpn, hidden, dtype, bucket_tokens,
                                     getattr(buffer, "device", None), group=group, path=path, num_nvl_bytes=nvl,
                                     num_rdma_bytes=rdma) or default_dispatch_config(num_ranks, num_sms)
            if not fits(d_config, bucket_tokens, num_ranks, rpn, hidden * 2, nvl, rdma):
                d_config = None
            timer_kwargs["dispatch_config"] = d_config
            space = combine_space(space, d_config)
        time_fn = BufferTimer(buffer, kind, num_tokens, hidden, dtype, **timer_kwargs)
    if world > 1:
        time_fn = _agreeing(time_fn, group)
    result = search(space, time_fn, default=default, strategy=strategy, batches=batches,
                    progress=progress if rank == 0 else None, min_gain=min_gain)
    if world > 1:  # the searches agree already; the broadcast makes it a guarantee
        result.config = Config(*broadcast_object(config_fields(result.config), group))
    if save and rank == 0:
        key = make_key(num_ranks, rpn, hidden, dtype, bucket_tokens, getattr(buffer, "device", None))
        store(kind, key, result.config, path=path, time=result.best_time if result.replaced else result.default_time,
              best_time=result.best_time, default_time=result.default_time, margin=result.margin,
              strategy=strategy, tuned_num_tokens=num_tokens, num_configs=len(result.trials))
    return result


def get_config(buffer, kind: str, x_shape: Sequence[int], dtype: Any = "bfloat16", *,
               path: Optional[str] = None, **autotune_kwargs: Any) -> Optional[Config]:
    """Cached config for this call, else (COMMLIB_AUTOTUNE=1) tune now, else None (use the default).

    Collective over ``buffer.group`` (lookup agreement and tuning): call it on every rank.
    """
    num_ranks, rpn = _buffer_shape(buffer, getattr(buffer, "group", None))
    found = cached_config(kind, num_ranks, rpn, int(x_shape[1]), dtype, int(x_shape[0]),
                          getattr(buffer, "device", None), group=getattr(buffer, "group", None), path=path,
                          num_nvl_bytes=getattr(buffer, "num_nvl_bytes", None),
                          num_rdma_bytes=getattr(buffer, "num_rdma_bytes", None))
    if found is not None or not env.autotune():
        return found
    return autotune(buffer, kind, x_shape, dtype, path=path, **autotune_kwargs).config


# ------------------------------------------------------------------------------------------ CLI
def _ints(text: str) -> tuple:
    """"8,12,16" or "8:48:4" (start:stop:step, stop included) -> tuple of ints."""
    if ":" in text:
        start, stop, step = (int(v) for v in text.split(":"))
        return tuple(range(start, stop + 1, step))
    return tuple(int(v) for v in text.split(","))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m commlib.tuning", description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=None, help="ranks (default: GPUs, or 2 on CPU)")
    p.add_argument("--ranks-per-node", type=int, default=None, help="emulated ranks per node (default: world)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--tokens", type=_ints, default=(4096,), help="tokens per rank, e.g. 128,4096")
    p.add_argument("--dtype", default="bf16", help="dispatch dtype: bf16 or fp8 (combine is bf16)")
    p.add_argument("--kind", choices=("dispatch", "combine", "both"), default="both")
    p.add_argument("--num-experts", type=int, default=256)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--strategy", choices=("smart", "exhaustive"), default="smart")
    p.add_argument("--batches", type=int, default=4, help="batches a winner is timed with")
    p.add_argument("--reps", type=int, default=5, help="timed calls per batch")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls per batch")
    p.add_argument("--settle-s", type=float, default=None, help="untimed calls first (default: 1 s on GPU)")
    p.add_argument("--sms", type=_ints, default=DEFAULT_SMS, help="num_sms candidates, e.g. 8:48:4")
    p.add_argument("--nvl-send", type=_ints, default=DEFAULT_NVL_SEND)
    p.add_argument("--nvl-recv", type=_ints, default=DEFAULT_NVL_RECV)
    p.add_argument("--rdma-send", type=_ints, default=DEFAULT_RDMA_SEND)
    p.add_argument("--rdma-recv", type=_ints, default=DEFAULT_RDMA_RECV)
    p.add_argument("--num-nvl-bytes", type=int, default=2 << 30, help="largest NVLink buffer a config may need")
    p.add_argument("--num-rdma-bytes", type=int, default=2 << 30)
    p.add_argument("--cache", default=None, help="tuning cache file (default: COMMLIB_TUNING_CACHE or ~/.cache)")
    p.add_argument("--no-store", action="store_true", help="do not write the cache")
    p.add_argument("--cpu", action="store_true", help="gloo ranks on CPU (smoke test)")
    p.add_argument("--top", type=int, default=10, help="rows of the table (0: all)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--seed", type=int, default=0)
    return p


def _cli_spaces(args, world: int, rpn: int) -> dict:
    spaces = {}
    kinds = KINDS if args.kind == "both" else (args.kind,)
    for T in args.tokens:
        for kind in kinds:
            dtype = args.dtype if kind == "dispatch" else "bf16"
            spaces[(kind, T)] = default_space(
                kind, world, rpn, args.hidden, dtype, T, num_nvl_bytes=args.num_nvl_bytes,
                num_rdma_bytes=args.num_rdma_bytes, num_sms=args.sms, nvl_send=args.nvl_send,
                nvl_recv=args.nvl_recv, rdma_send=args.rdma_send, rdma_recv=args.rdma_recv)
    return spaces


def buffer_sizes(spaces: dict, num_sms: Optional[int] = None) -> tuple[int, int]:
    """(num_nvl_bytes, num_rdma_bytes) of one Buffer that runs every candidate of ``spaces``
    ({(kind, T): SearchSpace}) and each kind's default config (``num_sms``: Buffer.num_sms)."""
    nvl = rdma = 0
    for (kind, _), space in spaces.items():
        default = (default_dispatch_config if kind == "dispatch" else default_combine_config)(
            space.num_ranks, num_sms or env.num_sms())
        unbounded = dataclasses.replace(space, num_nvl_bytes=None, num_rdma_bytes=None)
        for c in space.configs() + ([default] if unbounded.is_valid(default) else []):
            nvl = max(nvl, c.get_nvl_buffer_size_hint(space.hidden_bytes, space.ranks_per_node))
            if space.num_ranks > space.ranks_per_node:
                rdma = max(rdma, c.get_rdma_buffer_size_hint(space.hidden_bytes, space.num_ranks,
                                                             ranks_per_node=space.ranks_per_node))
    return nvl, rdma


def _cli_worker(ctx, args) -> list:
    spaces = _cli_spaces(args, ctx.world_size, ctx.ranks_per_node)
    nvl, rdma = buffer_sizes(spaces, Buffer.num_sms)
    buffer = Buffer(ctx.group, nvl, rdma, ranks_per_node=ctx.ranks_per_node)
    out = []
    try:
        for (kind, T), space in spaces.items():
            dtype = args.dtype if kind == "dispatch" else "bf16"
            progress = TextProgress(f"{kind} T={T}") if ctx.rank == 0 else None
            res = autotune(buffer, kind, (T, args.hidden), dtype, space=space, strategy=args.strategy,
                           batches=args.batches, save=not args.no_store, path=args.cache, progress=progress,
                           num_experts=args.num_experts, topk=args.topk, reps=args.reps, warmup=args.warmup,
                           seed=args.seed, flush_l2=ctx.device.type == "cuda", settle_s=args.settle_s)
            if progress is not None:
                progress.close()
            out.append({"kind": kind, "num_tokens": T, "dtype": dtype, **res.to_json()})
    finally:
        buffer.destroy()
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    use_gpu = not args.cpu and torch.cuda.is_available()
    world = args.world or (torch.cuda.device_count() if use_gpu else 2)
    rpn = args.ranks_per_node or world
    results = parallel_launch(world, _cli_worker, args, ranks_per_node=rpn, use_gpu=use_gpu, timeout_s=3600.0)
    gpu, topo = machine("cuda") if use_gpu else ("cpu", "cpu")
    for r in results:
        print(f"\n[tuning] {r['kind']} tokens={r['num_tokens']} hidden={args.hidden} dtype={dtype_name(r['dtype'])} "
              f"ranks={world} per node={rpn} gpu={gpu} topology={topo} strategy={r['strategy']}: "
              f"{r['num_configs']} configs, {r['num_batches']} batches, {r['wall_s']:.2f} s")
        print(format_table(r, top=args.top or None))
        default_t = f"{r['default_time']:.2f} us" if r["default_time"] is not None else "n/a"
        verdict = "replaces the default" if r["replaced"] else "keeps the default (gain within noise)"
        gain = f", {r['speedup']:.3f}x" if r["speedup"] else ""
        print(f"[tuning] Best {r['kind']}: Config{tuple(r['best'].values())} {r['best_time']:.2f} us; default "
              f"{default_t}; margin {r['margin']:.2f} us; {verdict}{gain}")
    print(f"[tuning] cache: {'not written (--no-store)' if args.no_store else cache_path(args.cache)}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"hidden": args.hidden, "world": world, "ranks_per_node": rpn, "gpu": gpu, "topology": topo,
                       "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
