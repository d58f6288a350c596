"""The internode engine's device path (backends/internode/device.py) run on the CPU in one process,
for its host cost: the launches (commlib.cuda.loader.launch) and torch.distributed's collectives
are fakes that do nothing but the little the host must see (the digest the count read returns, the
gathered rows), and they time themselves, so what is left of a call's wall time is the engine's own
Python and torch work. The forwarder (2 x 2) runs over a fake NodeFanout in host memory.

    PYTHONPATH=tests python -m internode_host [--nodes 2] [--per-node 1] [--tokens 4096] [--reps 200]

Per op it prints the median us per call of the engine (backend.dispatch / combine, fakes excluded)
and its Python and C calls (sys.setprofile). Outputs are not meaningful (no kernel runs);
tests/gpu/test_internode_gpu.py checks them on a device.

Legend: M nodes, P ranks per node, R = M P ranks, T tokens, H hidden, E experts, K top-k.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import statistics
import sys
import time
import types

import torch
import torch.distributed as dist

from commlib import layout as L
from commlib import routing
from commlib.backends.base import Backend, CombineRequest, DispatchRequest
from commlib.backends.internode import device, fanout, node
from commlib.backends.internode import engine as E_
from commlib.backends.internode.exchange import N_SIG, exchange_digest, exchange_row, head_words
from commlib.backends.internode.network import RailStep
from commlib.backends.internode.wiring import Wiring
from commlib.backends.probe import NULL_PROBE, Probe
from commlib.config import Config
from commlib.cuda import loader
from commlib.topology import Topology


class Fakes:
    """The patched launches and collectives, and the seconds spent in them (``spent``). ``trace``
    (a list, or None): each launch (name, grid, block, args, shared memory) and network chunk
    ("a2a", out address, send address, out splits, in splits) as issued."""

    def __init__(self, g: torch.Tensor, digest: torch.Tensor) -> None:
        self.g, self.digest, self.spent, self.launches, self.collectives = g, digest, 0.0, 0, 0
        self.trace = None

    def launch(self, family, name, grid, block, args, shared_mem=0, variant_key=None):
        t0 = time.perf_counter()
        self.launches += 1
        if self.trace is not None:
            self.trace.append((name, grid, block, tuple(args), shared_mem))
        if name == "inter_digest_kernel":   # the one launch whose result the host reads
            ctypes.memmove(args[-1], self.digest.data_ptr(), self.digest.numel() * 8)
        self.spent += time.perf_counter() - t0

    def all_gather(self, out, row, group=None, async_op=False):
        t0 = time.perf_counter()
        self.collectives += 1
        out.view(-1)[:self.g.numel()].copy_(self.g.view(-1))
        self.spent += time.perf_counter() - t0
        return _Work(self)

    def all_to_all(self, out, send, out_splits=None, in_splits=None, group=None, async_op=False):
        self.collectives += 1
        if self.trace is not None:
            self.trace.append(("a2a", out.data_ptr(), send.data_ptr(), tuple(out_splits), tuple(in_splits)))
        return _Work(self)


class _Work:
    __slots__ = ("fakes",)

    def __init__(self, fakes) -> None:
        self.fakes = fakes

    def wait(self, *a, **k):
        return True


class _HostFan(fanout.NodeFanout):
    """NodeFanout over a host buffer: the real checks and launch arguments, no CUDA."""

    def __init__(self, P: int, loc: int) -> None:
        self.group, self.local_rank, self.num_local = None, loc, P
        self.device, self.num_ctas, self.timeout_ns = torch.device("cpu"), 8, 10**9
        self.capacity = 64 << 20
        self.area = torch.zeros(fanout.DATA_OFFSET + self.capacity, dtype=torch.uint8)
        self.mem = types.SimpleNamespace(base=self.area.data_ptr(), close=lambda: None)
        self.settled = (self.capacity, self.mem.base + fanout.DATA_OFFSET)
        self.peer_bases = torch.zeros(P, dtype=torch.int64)

    def rows(self, n, row_bytes):
        return self.area[fanout.DATA_OFFSET:fanout.DATA_OFFSET + n * row_bytes].view(n, row_bytes)


def world_rows(M: int, P: int, T: int, H: int, E: int, K: int, cfg: Config, Kc: int, max_nodes: int,
               seed: int = 100) -> list:
    """Every rank's routing and layout (group-limited routings of T tokens, drawn from ``seed``)."""
    R = M * P
    rows, inputs = [], []
    for r in range(R):
        gen = torch.Generator().manual_seed(seed + r)
        idx, w = routing.group_limited_topk(torch.sigmoid(torch.randn(T, E, generator=gen)), M, min(M, max_nodes), K)
        topo = Topology(rank=r, num_ranks=R, ranks_per_node=P)
        lay = L.dispatch_layout(idx, E, topo)
        rows.append(lay)
        inputs.append((idx, w, lay))
    return inputs


def build(M: int, P: int, T: int, H: int, E: int, K: int, max_chunks: int = 1, cfg: Config = None, seed: int = 100):
    """(engine, fakes, rank 0's inputs, Config): an InternodeBackend on the device path with fake groups."""
    R = M * P
    topo = Topology(rank=0, num_ranks=R, ranks_per_node=P)
    cfg = cfg or Config(20, 6, 256, 6, 128)
    ctx = types.SimpleNamespace(topology=topo, group=None, timeout_s=60.0, max_nodes_per_token=M, probe=NULL_PROBE,
                                device=torch.device("cpu"), num_sms=lambda: 20, comm_stream=None)
    be = object.__new__(E_.InternodeBackend)
    Backend.__init__(be, ctx)
    be.group, be.nccl, be.comm_device, be.probe = None, True, torch.device("cpu"), NULL_PROBE
    be.calls, be.failed, be._phase, be._last_num_experts, be.max_chunks = 0, None, "", 0, max_chunks
    be.replayed, be._gather_direct = 0, None
    be._full_twins, be.last_full_plan = False, None
    be.rail_group = be.node_group = None
    be.network = RailStep(None, be._wait_for, NULL_PROBE, True, 0)
    if P == 1:
        be.node = node.LocalNode(None, 0, 1, be.comm_device, be._wait_for)
    else:
        be.node = object.__new__(node.ForwarderNode)
        be.node.fan, be.node.P, be.node.device, be.node.probe, be.node.Wd = _HostFan(P, 0), P, be.comm_device, NULL_PROBE, 0
        be.node.budget, be.node._told, be.node.window_rows = 1 << 40, False, 0
    be.device_steps = True
    # (gather_into where the engine has it: the harness also times the engine as it was before)
    extra = {"gather_into": be._gather_into} if "gather_into" in Wiring.__dataclass_fields__ else {}
    be.wiring = Wiring(topology=topo, device=be.comm_device, nccl=True, network=be.network, node=be.node,
                       probe=NULL_PROBE, counters=be.counters, max_chunks=max_chunks, max_nodes=M,
                       gather=be._gather, phase=be._set_phase, **extra)
    be.head = device.HeadRow()
    be.scratch = device.Scratch() if hasattr(device, "Scratch") else None
    inputs = world_rows(M, P, T, H, E, K, cfg, max_chunks, M, seed)
    ring = max(1, cfg.num_channels * cfg.num_max_rdma_chunked_recv_tokens // 2)
    sig = be.signature(1, H, E, False, K, True, cfg)
    rows = []
    for r, (idx, w, lay) in enumerate(inputs):
        row, *_ = exchange_row(torch.tensor(head_words(sig), dtype=torch.int64), lay.is_token_in_rank, idx, None,
                               M=M, P=P, E=E, Kc=max_chunks, ring=ring, max_nodes=M)
        rows.append(row)
    g = torch.stack(rows)
    dig = exchange_digest(g, n_sig=N_SIG, me=0, node=0, loc=0, M=M, P=P, Kc=max_chunks, ring=ring, Lx=E // R)
    fakes = Fakes(g, dig)
    be._all_gather = fakes.all_gather   # the engine picks its all-gather once, in __init__
    return be, fakes, inputs[0], cfg


@contextlib.contextmanager
def patched(fakes: Fakes):
    saved = (loader.launch, dist.all_gather_into_tensor, dist.all_to_all_single, dist.get_world_size,
             getattr(dist, "all_gather_single", None), torch.Tensor.pin_memory)
    loader.launch = fakes.launch
    dist.all_gather_into_tensor = fakes.all_gather
    if saved[4] is not None:
        dist.all_gather_single = fakes.all_gather
    dist.all_to_all_single = fakes.all_to_all
    dist.get_world_size = lambda group=None: fakes.g.shape[0]
    torch.Tensor.pin_memory = lambda self: self   # no CUDA: plain host memory
    try:
        yield
    finally:
        loader.launch, dist.all_gather_into_tensor, dist.all_to_all_single, dist.get_world_size = saved[:4]
        if saved[4] is not None:
            dist.all_gather_single = saved[4]
        torch.Tensor.pin_memory = saved[5]


def calls_of(be, H: int, inp, cfg: Config, fp8: bool = False) -> dict:
    """The engine calls of one rank: dispatch (BF16 or FP8), its cached dispatch, combine, and the
    Buffer's replays of the last two (``plan_for`` / ``run_plan``, as Buffer._replay calls them)."""
    from commlib.fp8 import per_token_cast_to_fp8
    idx, w, lay = inp
    T = idx.shape[0]
    E = lay.num_tokens_per_expert.numel()
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    xq, sq = per_token_cast_to_fp8(x) if fp8 else (x, None)
    req = lambda xx, ss: DispatchRequest(xx, ss, idx, w, lay, None, E, 1, 0, cfg)
    res = be.dispatch(req(xq, sq))
    h = res.handle
    y = torch.zeros(h.num_recv_tokens, H, dtype=torch.bfloat16)
    wts = res.recv_topk_weights
    cached = lambda: be.dispatch(DispatchRequest(xq, sq, None, None, None, h, 0, 1, 0, cfg))
    combine = lambda: be.combine(CombineRequest(y, h, wts, [], cfg))
    cached()
    combine()   # the kept calls the replays below find

    def replay(key, a, b):
        def run():
            kept = be.plan_for(h, key, a, cfg, b)
            assert kept is not None, f"no kept call for {key}"
            return be.run_plan(kept, a, b, 0)
        return run
    return {"dispatch": lambda: be.dispatch(req(xq, sq)), "cached": cached, "combine": combine,
            "cached_replay": replay(("dispatch", xq.dtype), xq, sq),
            "combine_replay": replay(("combine", wts.shape[1]), y, wts)}


class _Counter:
    def __init__(self) -> None:
        self.py = self.c = 0

    def __call__(self, frame, event, arg) -> None:
        if event == "call":
            self.py += 1
        elif event == "c_call":
            self.c += 1


def measure(fn, fakes: Fakes, reps: int) -> dict:
    """Median engine us per call (the fakes' time taken out) and one call's Python / C calls."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        s0 = fakes.spent
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0 - (fakes.spent - s0)) * 1e6)
    counter = _Counter()
    sys.setprofile(counter)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return {"us": statistics.median(times), "python_calls": counter.py, "c_calls": counter.c}


COLD_BYTES = 128 << 20   # more than the host's last-level cache


class StepProbe(Probe):
    """A probe that records only the engine's step marks: (step, the thread's CPU ns, the fakes' seconds).
    CPU time rather than wall time: on a shared host, time the thread spent preempted is not the step's."""

    recording = True

    def __init__(self, fakes: Fakes) -> None:
        self.fakes, self.marks = fakes, []

    def mark(self, step: str) -> None:
        self.marks.append((step, time.thread_time_ns(), self.fakes.spent))


def steps(M: int, P: int, T: int, H: int, E: int, K: int, reps: int, fp8: bool = False, op: str = "dispatch",
          cold: bool = False) -> dict:
    """Median CPU us per step of one op (the fakes' time taken out; 'buffer': the engine's entry up to
    its first mark, 'return': after its last mark until it returns). ``cold``: the caches flushed
    before each call (as on a GPU host whose NCCL threads just moved the last call's rows)."""
    flush = torch.empty(COLD_BYTES, dtype=torch.uint8) if cold else None
    be, fakes, inp, cfg = build(M, P, T, H, E, K)
    probe = StepProbe(fakes)
    be.set_probe(probe)
    with patched(fakes):
        fn = calls_of(be, H, inp, cfg, fp8)[op]
        per: dict = {}
        for i in range(reps + 5):
            if flush is not None:
                flush.add_(1)
            probe.marks = [("call", time.thread_time_ns(), fakes.spent)]
            res = fn()
            probe.mark("return")
            del res   # (its tensors freed outside the timed call)
            if i < 5:
                continue
            for (_, t0, s0), (step, t1, s1) in zip(probe.marks, probe.marks[1:]):
                per.setdefault(step, []).append((t1 - t0) / 1e3 - (s1 - s0) * 1e6)
    out = {step: statistics.median(v) for step, v in per.items()}
    out["total"] = sum(out.values())
    return out


def run(M: int, P: int, T: int, H: int, E: int, K: int, reps: int, fp8: bool = False, chunks: int = 1) -> dict:
    be, fakes, inp, cfg = build(M, P, T, H, E, K, chunks)
    with patched(fakes):
        ops = calls_of(be, H, inp, cfg, fp8)
        return {name: measure(fn, fakes, reps) for name, fn in ops.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--per-node", type=int, default=1)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--chunks", type=int, default=1)
    p.add_argument("--steps", action="store_true", help="a non-cached dispatch's us per step (BF16, FP8)")
    p.add_argument("--cold", action="store_true", help="with --steps: the caches flushed before each call")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    if a.steps:
        got = [steps(a.nodes, a.per_node, a.tokens, a.hidden, a.experts, 8, a.reps, fp8, cold=a.cold)
               for fp8 in (False, True)]
        print(f"# non-cached dispatch, CPU us per step (median of {a.reps}{', caches flushed' if a.cold else ''}): "
              f"{a.nodes} x {a.per_node}, {a.tokens} tokens")
        print(f"# {'step':>10} {'bf16':>8} {'fp8':>8}")
        for step in got[0]:
            print(f"  {step:>10} {got[0][step]:>8.1f} {got[1].get(step, 0.0):>8.1f}")
        return 0
    print(f"# internode device path on the CPU, fakes for launches and collectives: {a.nodes} x {a.per_node}, "
          f"{a.tokens} tokens, hidden {a.hidden}, {a.experts} experts, chunk cap {a.chunks}")
    print(f"# {'op':>22} {'us/call':>9} {'python':>7} {'C':>6}")
    for fp8 in (False, True):
        out = run(a.nodes, a.per_node, a.tokens, a.hidden, a.experts, 8, a.reps, fp8, a.chunks)
        for name, r in out.items():
            print(f"  {name + ('_fp8' if fp8 else '_bf16'):>22} {r['us']:>9.1f} {r['python_calls']:>7} {r['c_calls']:>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
