"""The calls bench_peers makes on one engine's Buffer (DeepEP v1's API), each checked against the
oracle, and the tuned setting's sweep over send chunks.

Legend: T tokens of a rank, H hidden, E experts; cfgs maps "bf16" / "fp8" (dispatch) and "combine"
to a Config (None: the engine's own pick).
"""
from __future__ import annotations

from benchmarks.peers.checks import wrong_combined, wrong_rows
from commlib.bench import results
from commlib.utils.timing import bench_cuda, slowest


def best_index(times: list, wrong: list) -> int:
    """The sweep's pick: the fastest candidate whose outputs were right (the fastest of all when none was)."""
    right = [i for i, bad in enumerate(wrong) if not bad]
    return min(right or range(len(times)), key=lambda i: times[i])


class Calls:
    """One engine's Buffer and the calls bench_peers times, on one rank's inputs."""

    def __init__(self, buf, x, xq, idx_e, w, num_experts: int, rank: int, group, oracle):
        self.buf, self.x, self.xq, self.idx_e, self.w = buf, x, xq, idx_e, w
        self.rank, self.group, self.oracle = rank, group, oracle
        self.ntpr, _, self.ntpe, self.tir, _ = buf.get_dispatch_layout(idx_e, num_experts)

    def full(self, xx, cfg):
        return self.buf.dispatch(xx, num_tokens_per_rank=self.ntpr, is_token_in_rank=self.tir,
                                 num_tokens_per_expert=self.ntpe, topk_idx=self.idx_e, topk_weights=self.w, config=cfg)

    def ops(self, cfgs: dict) -> tuple:
        """(handle, recv_x, {op: fn}) under ``cfgs`` ({"bf16", "fp8", "combine"} -> Config or None)."""
        buf, x, xq = self.buf, self.x, self.xq
        recv_x, _, _, _, handle, _ = self.full(x, cfgs["bf16"])
        return handle, recv_x, {
            "full_bf16": lambda: self.full(x, cfgs["bf16"]),
            "full_fp8": lambda: self.full(xq, cfgs["fp8"]),
            "cached_bf16": lambda: buf.dispatch(x, handle=handle, config=cfgs["bf16"]),
            "cached_fp8": lambda: buf.dispatch(xq, handle=handle, config=cfgs["fp8"]),
            "combine": lambda: buf.combine(recv_x, handle, config=cfgs["combine"])}

    def wrong(self, op: str, out, handle) -> int:
        """This rank's wrong elements of ``op``'s output ``out`` against the oracle."""
        if op == "combine":
            return wrong_combined(out[0], self.oracle["combine"], self.x, self.tir)
        return wrong_rows(out[0], out[4] if op.startswith("full") else handle, self.rank,
                          self.oracle["fp8" if op.endswith("fp8") else "bf16"])


def sweep(eng, calls: Calls, args) -> tuple:
    """The tuned setting's Configs: per op (cached dispatch BF16, FP8; combine) each send chunk of the
    grid at --tune-sms SMs and ring --tune-ring, timed (the slowest rank's median) and checked; the
    fastest right one wins. Returns ({"bf16", "fp8", "combine"} -> Config, [record per candidate])."""
    best, records = {}, []

    def measure(op: str, chunks: list, make) -> None:
        """``make(cfg)`` -> (the call to time, the handle its output is checked through)."""
        times, wrong = [], []
        for chunk in chunks:
            fn, handle = make(eng.candidate(args.tune_sms, chunk, args.tune_ring))
            t = bench_cuda(fn, warmup=2, iters=args.tune_iters, flush_l2=True)["median_us"]
            times.append(slowest([t], calls.group)[0])
            wrong.append(results.reduce_wrong([calls.wrong(op, fn(), handle)], calls.group)[0])
        pick = best_index(times, wrong)
        best["combine" if op == "combine" else op.split("_")[1]] = eng.candidate(args.tune_sms, chunks[pick],
                                                                                 args.tune_ring)
        records.extend({"engine": eng.name, "op": op, "num_sms": args.tune_sms, "chunk": c, "ring": args.tune_ring,
                        "gpu_us": t, "wrong": bad, "best": i == pick}
                       for i, (c, t, bad) in enumerate(zip(chunks, times, wrong)))

    def cached(xx):
        def make(cfg):
            handle = calls.full(xx, cfg)[4]   # a full dispatch under this Config: a handle of its channels
            return (lambda: calls.buf.dispatch(xx, handle=handle, config=cfg)), handle
        return make

    measure("cached_bf16", args.tune_chunk_list, cached(calls.x))
    measure("cached_fp8", args.tune_chunk_list, cached(calls.xq))
    recv_x, _, _, _, handle, _ = calls.full(calls.x, best["bf16"])
    measure("combine", args.tune_combine_list,
            lambda cfg: ((lambda: calls.buf.combine(recv_x, handle, config=cfg)), handle))
    return best, records
