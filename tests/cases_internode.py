"""The internode engine against the reference backend, bit for bit: outputs, handles, cached
dispatch, combine (weights, biases), on every multi-node topology of the world; chunk boundaries,
zero rows, random stalls in the chunk protocol, many random routings, host reads, timeouts.

Runs on CPU ranks (gloo, tests/test_internode.py) and on the device (NCCL, tests/gpu/
test_internode_gpu.py: processes sharing one GPU as emulated hosts). Each case builds a reference
Buffer and internode Buffers beside it and compares every call.
"""
from __future__ import annotations

import os
import random
import time

import oracle as O
import torch

import commlib
from commlib import Config
from commlib.backends.internode.kernels import digest_len
from commlib.backends.probe import Probe, RecordingProbe
from commlib.fp8 import per_token_cast_to_fp8
from commlib.validate import CommlibError

E_PER_RANK, H, K = 8, 256, 4
NVL = 1 << 26   # the engines under test do not use it; the Buffer checks the NVLink rings fit
HANDLE_FIELDS = ("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix", "recv_src_idx",
                 "is_token_in_rank", "send_head")
# a ring of 1 row per chunk slot: chunk rows = ceil(rows / COMMLIB_NETWORK_CHUNKS), so chunks fall
# anywhere inside a stream (the default Config's ring holds these calls in one chunk)
TINY = Config(2, 4, 8, 1, 2)


def topologies(R: int) -> list[int]:
    """Ranks per node of every multi-node layout of R ranks (one GPU: NCCL needs one rank per host)."""
    return [p for p in (1, 2, 4, 8) if R % p == 0 and R // p > 1]


def _bytes(t):
    return t.contiguous().view(torch.uint8) if t.dtype != torch.bool else t


def same(a, b, what: str) -> None:
    if isinstance(a, (tuple, list)) and not isinstance(a, torch.Tensor):
        assert isinstance(b, (tuple, list)) and len(a) == len(b), f"{what}: {a} != {b}"
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{what}[{i}]")
        return
    if a is None or b is None or not isinstance(a, torch.Tensor):
        assert a == b if not isinstance(a, torch.Tensor) else False, f"{what}: {a} != {b}"
        return
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape} {a.dtype} != {b.shape} {b.dtype}"
    assert torch.equal(_bytes(a), _bytes(b)), f"{what} differs"


class _ReadSizes(Probe):
    """A probe that keeps the size of every host read."""

    def __init__(self) -> None:
        self.sizes = []

    def read(self, t):
        self.sizes.append(t.numel())
        return t.cpu()


def make_inputs(seed: int, rank: int, R: int, nodes: int, T: int, routing: str, device):
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    E = E_PER_RANK * R
    x = (torch.randn(T, H, generator=g) * (1 + rank)).to(torch.bfloat16)
    scores = torch.rand(T, E, generator=g)
    if routing == "group_limited":
        idx, w = commlib.routing.group_limited_topk(scores, nodes, min(2, nodes), K)
    else:
        w, idx = scores.topk(K, dim=1)
        if routing == "holes":       # -1 slots
            idx = torch.where(torch.rand(T, K, generator=g) < 0.3, torch.full_like(idx, -1), idx)
        elif routing == "one_node":  # every token to node 0 only
            idx = idx % (E // nodes)
            idx = torch.stack([torch.randperm(E // nodes, generator=g)[:K] for _ in range(T)]) if T else idx
        elif routing == "own_node":  # rows never leave the node
            per = E // nodes
            node = rank // (R // nodes)
            idx = torch.stack([torch.randperm(per, generator=g)[:K] + node * per for _ in range(T)]) if T else idx
        w = torch.rand(T, K, generator=g)
    return x.to(device), idx.to(torch.int64).to(device), w.to(torch.float32).to(device)


def compare_round(ctx, ref, eng, seed: int, T: int, routing: str, fp8: bool, config, nodes: int,
                  check_reads: bool = True, worst: int = 0) -> None:
    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    E = E_PER_RANK * R
    tag = f"[seed {seed} T {T} {routing} fp8={fp8} nodes={nodes} worst={worst}]"
    x, idx, w = make_inputs(seed, me, R, nodes, T, routing, dev)
    xin = per_token_cast_to_fp8(x) if fp8 else x
    outs = {}
    reads = []
    for name, buf in (("ref", ref), ("eng", eng)):
        ntr, nrr, nte, tir, _ = buf.get_dispatch_layout(idx, E)
        r0 = getattr(buf.backend, "host_reads", 0)
        rx, ri, rw, lst, h, _ = buf.dispatch(xin, num_tokens_per_rank=ntr, num_tokens_per_rdma_rank=nrr,
                                             is_token_in_rank=tir, num_tokens_per_expert=nte, topk_idx=idx,
                                             topk_weights=w, config=config, num_worst_tokens=worst)
        r1 = getattr(buf.backend, "host_reads", 0)
        cached = buf.dispatch(xin, handle=h, config=config)[0]
        # half the elements +-2^26 (oracle.spread): the order of the sums (biases first) shows in the bits
        y = O.spread(((rx[0].float() if fp8 else rx.float()) * (1.5 + me)).to(torch.bfloat16), seed * 13 + me)
        gb = torch.Generator().manual_seed(seed + 31 * me)
        bias = tuple(O.spread(torch.randn(T, H, generator=gb).to(torch.bfloat16), seed * 17 + 2 * me + i).to(dev)
                     for i in range(2))
        cx, cw, _ = buf.combine(y, h, rw, bias=bias, config=config)
        cx0, cw0, _ = buf.combine(y, h, config=config)
        again = (cached, cx0)
        if name == "eng" and dev.type == "cuda" and not worst:
            again = _replays(buf, h, xin, y, config)
        r2 = getattr(buf.backend, "host_reads", 0)
        reads.append((r1 - r0, r2 - r1))
        outs[name] = {"recv_x": rx, "recv_topk_idx": ri, "recv_topk_weights": rw, "per_expert": lst,
                      "cached": cached, "combined_x": cx, "combined_w": cw, "combined_x_no_w": cx0,
                      "combined_w_none": cw0, "num_recv": h.num_recv_tokens, "cached_again": again[0],
                      "combined_again": again[1], **{f: getattr(h, f) for f in HANDLE_FIELDS}}
    for key, val in outs["ref"].items():
        same(outs["eng"][key], val, f"{tag} {key}")
    if check_reads:
        want = (0 if worst else 1, 0)
        assert reads[1] == want, f"{tag} host reads (dispatch, cached + combines) = {reads[1]}, expected {want}"


def _replays(buf, h, xin, y, config) -> tuple:
    """The Buffer's kept replays (device): the handle's cached dispatch and combine (no weights) again,
    on copies of x and y while the originals are zeroed, so a replay that read or wrote the first
    call's tensors would differ. Returns (recv_x, combined_x) of the replays."""
    def moved(t):
        c = t.clone()
        t.view(torch.uint8).zero_()
        return c
    xb = tuple(moved(t) for t in xin) if isinstance(xin, tuple) else moved(xin)
    yb = moved(y)
    before = buf.backend.replayed
    cached = buf.dispatch(xb, handle=h, config=config)[0]
    combined = buf.combine(yb, h, config=config)[0]
    assert buf.backend.replayed == before + 2, f"{buf.backend.replayed - before} of 2 calls replayed"
    return cached, combined


def _buffers(ctx, rpn: int, chunks: int):
    os.environ["COMMLIB_NETWORK_CHUNKS"] = str(chunks)
    try:
        ref = commlib.Buffer(ctx.group, NVL, 0, ranks_per_node=rpn, backend="reference")
        eng = commlib.Buffer(ctx.group, NVL, 0, ranks_per_node=rpn, backend="internode")
    finally:
        del os.environ["COMMLIB_NETWORK_CHUNKS"]
    # one rank per node: one chunk (nothing to overlap it with)
    assert eng.backend.name == "internode" and eng.backend.max_chunks == (chunks if rpn > 1 else 1)
    return ref, eng


ROUTINGS = ("random", "group_limited", "holes", "one_node", "own_node")


def _one_call_setup(ctx, chunks: int, seed: int, T: int, routing: str):
    """Buffers on the multi-node topology with the most ranks per node (on the device, the forwarder
    kernel's path where a node has several), this rank's inputs and their layout."""
    R = ctx.world_size
    rpn = topologies(R)[-1]
    ref, eng = _buffers(ctx, rpn, chunks)
    x, idx, w = make_inputs(seed, ctx.rank, R, R // rpn, T, routing, ctx.device)
    return ref, eng, x, idx, w, eng.get_dispatch_layout(idx, E_PER_RANK * R)


def case_callpath(ctx):
    """The C++ call path (csrc/callpath_internode.cpp) against the Python path and the reference: per
    topology, one chunk and three, BF16 / FP8, a handle's cached dispatch and combine (weights and
    none) replayed in C++ (every call counted as served there) equal the Python replays and the
    reference bit for bit, on copies of the inputs with the originals zeroed."""
    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    for i, rpn in enumerate(topologies(R)):
        for chunks, config in ((1, None), (3, TINY)):
            ref, eng = _buffers(ctx, rpn, chunks)
            why = commlib.cuda.callpath.why_unavailable
            assert eng.call_path == "cpp", f"the internode C++ call path did not load: {why}"
            for fp8 in (False, True):
                seed = 700 + 10 * i + chunks + fp8
                x, idx, w = make_inputs(seed, me, R, R // rpn, 24, "random", dev)
                xin = per_token_cast_to_fp8(x) if fp8 else x
                outs = {}
                for name, buf in (("ref", ref), ("eng", eng)):
                    ntr, nrr, nte, tir, _ = buf.get_dispatch_layout(idx, E_PER_RANK * R)
                    rx, _, rw, _, h, _ = buf.dispatch(xin, num_tokens_per_rank=ntr, num_tokens_per_rdma_rank=nrr,
                                                      is_token_in_rank=tir, num_tokens_per_expert=nte, topk_idx=idx,
                                                      topk_weights=w, config=config)
                    y = ((rx[0].float() if fp8 else rx.float()) * (1.5 + me)).to(torch.bfloat16)
                    calls = [lambda: buf.dispatch(xin, handle=h, config=config)[0],
                             lambda: buf.combine(y, h, rw, config=config)[:2],
                             lambda: buf.combine(y, h, config=config)[0]]
                    outs[name] = [c() for c in calls]   # the full paths (kept calls made)
                    if name == "eng":
                        for path in ("python", "cpp", "cpp"):   # the second cpp call: on the twins it made
                            buf.set_call_path(path)
                            served = dict(buf._cpp.served)
                            outs[f"{path} again"] = [c() for c in calls]
                            got = {k: buf._cpp.served[k] - served[k] for k in served}
                            want = {"cached": 1, "combine": 2} if path == "cpp" else {"cached": 0, "combine": 0}
                            assert got == {**want, "dispatch": 0}, \
                                f"[rpn={rpn} chunks={chunks} fp8={fp8}] {path}: served {got}"
                        torch.cuda.synchronize()
                for key in ("eng", "python again", "cpp again"):
                    same(outs[key], outs["ref"], f"[rpn={rpn} chunks={chunks} fp8={fp8}] {key}")
            ref.destroy()
            eng.destroy()


def case_callpath_dispatch(ctx):
    """COMMLIB_CALLPATH_INTERNODE_DISPATCH on: non-cached dispatches served whole by the C++ call path
    (csrc/callpath_internode.cpp InEngine::dispatch; counted as served there) at every multi-node
    layout, one rank per node and the forwarder (one network chunk, and several: a ring of two rows),
    BF16 and FP8, equal the reference bit for bit (outputs, handle fields, per-expert list, one host
    read) as the Python path's do, and so do the cached dispatch and combines (Python and C++ replays)
    on the handle the C++ path made."""
    R = ctx.world_size
    before = os.environ.get("COMMLIB_CALLPATH_INTERNODE_DISPATCH")
    os.environ["COMMLIB_CALLPATH_INTERNODE_DISPATCH"] = "1"   # (the default; a run may have turned it off)
    try:
        _callpath_dispatch_rounds(ctx, R)
    finally:   # as it was, for the cases after this one
        if before is None:
            del os.environ["COMMLIB_CALLPATH_INTERNODE_DISPATCH"]
        else:
            os.environ["COMMLIB_CALLPATH_INTERNODE_DISPATCH"] = before


def _callpath_dispatch_rounds(ctx, R: int) -> None:
    for i, rpn in enumerate(topologies(R)):
        for chunks, config in ((1, None), (4, TINY)) if rpn > 1 else ((1, None),):
            ref, eng = _buffers(ctx, rpn, chunks)
            why = commlib.cuda.callpath.why_unavailable
            assert eng.call_path == "cpp" and eng.backend._full_twins, f"the internode C++ dispatch is off: {why}"
            served = lambda: eng._cpp.served["dispatch"]
            where = f"rpn={rpn} chunks={chunks}"
            for fp8 in (False, True):
                T = 57
                s0 = served()
                seeds = [5000 + 1000 * fp8 + 100 * i + 10 * chunks + k for k in range(4)]
                compare_round(ctx, ref, eng, seeds[0], T, "random", fp8, config, R // rpn)   # Python, kept for C++
                assert served() == s0, f"[{where} fp8={fp8}] the first call of a signature is the Python path's"
                for k, seed in enumerate(seeds[1:]):
                    eng.set_call_path("python" if k == 1 else "cpp")   # the Python path between C++ calls
                    try:
                        compare_round(ctx, ref, eng, seed, T, "random", fp8, config, R // rpn)
                    finally:
                        eng.set_call_path("cpp")
                assert served() - s0 == 2, f"[{where} fp8={fp8}] C++ served {served() - s0} of 2 dispatches"
            torch.cuda.synchronize()
            ref.destroy()
            eng.destroy()


def case_matches_reference(ctx):
    """Every topology, routing, BF16 / FP8, one chunk and many (chunk rows 1, 2, 3, ...), zero rows.
    Every host read is the count exchange's digest, not the gathered rows (its size does not grow
    with ranks x experts). Eight ranks (three topologies, slow on a 2-core CI host) take two of the
    chunk settings: one chunk and 64 chunks of one row run at 2 and 4 ranks."""
    R = ctx.world_size
    settings = ((4, None), (1, TINY), (3, TINY), (64, TINY)) if R <= 4 else ((4, None), (3, TINY))
    for i, rpn in enumerate(topologies(R)):
        nodes = R // rpn
        for chunks, config in settings:
            ref, eng = _buffers(ctx, rpn, chunks)
            probe = _ReadSizes()
            eng.backend.set_probe(probe)
            sizes = probe.sizes
            for j, routing in enumerate(ROUTINGS):
                for T in (0, 1, 7, 24):
                    compare_round(ctx, ref, eng, 100 * i + 10 * j + T, T, routing, j % 2 == 1, config, nodes)
            # a silent rank: rank 1 sends nothing, the others do
            compare_round(ctx, ref, eng, 900 + i, 0 if ctx.rank == 1 else 9, "random", False, config, nodes)
            want = digest_len(nodes, rpn, eng.backend.max_chunks, E_PER_RANK)
            assert sizes and set(sizes) == {want}, f"[rpn={rpn} chunks={chunks}] host reads of {set(sizes)} " \
                f"elements, expected the digest's {want}"
            ref.destroy()
            eng.destroy()


def case_worst_no_read(ctx):
    """num_worst_tokens: no host read, outputs / handles / cached dispatch / combine equal the
    reference's with the same num_worst_tokens; cap = num_worst_tokens // R tokens per rank, met
    exactly, with room to spare, with zero tokens, in one chunk and in many (chunk rows 1, 3)."""
    R = ctx.world_size
    for i, rpn in enumerate(topologies(R)):
        nodes = R // rpn
        for chunks, config in ((4, None), (3, TINY), (64, Config(2, 4, 8, 1, 6))):
            ref, eng = _buffers(ctx, rpn, chunks)
            for j, (T, cap) in enumerate(((7, 7), (5, 9), (0, 4), (13, 13))):
                T = 0 if (ctx.rank == 1 and j == 1) else T            # a silent rank
                compare_round(ctx, ref, eng, 3000 + 100 * i + 10 * j + chunks, T, ROUTINGS[j % len(ROUTINGS)],
                              j % 2 == 1, config, nodes, worst=cap * R)
            ref.destroy()
            eng.destroy()


def case_worst_kernel_route(ctx):
    """CPU only: the num_worst_tokens kernel route (padded.py: pack at the slots, the forwarder into
    the areas, land straight into the outputs, the padding set in place; the rows kernel, the
    forwarder's sums, home) on CPU stand-ins of its kernels and forwarder (tests/padded_standins.py),
    against the reference bit for bit, the areas holding earlier calls' bytes. On a GPU the real
    kernels and forwarder run these calls in worst_no_read."""
    import padded_standins as S
    R = ctx.world_size
    rpn = topologies(R)[-1]
    if ctx.device.type != "cpu" or rpn == 1:
        return
    with S.installed():
        # window rows 0: one window per dispatch; 5: a few final rows per window, the areas' halves in turn
        for (chunks, config), window in zip(((4, None), (3, TINY), (64, Config(2, 4, 8, 1, 6)), (3, TINY)), (0, 0, 0, 5)):
            ref, eng = _buffers(ctx, rpn, chunks)
            fw = S.use_forwarder(eng, window)
            S.CALLS.clear()
            for j, (T, cap) in enumerate(((7, 7), (5, 9), (0, 4), (13, 13))):
                T = 0 if (ctx.rank == 1 and j == 1) else T            # a silent rank
                compare_round(ctx, ref, eng, 5000 + 10 * j + chunks + window, T, ROUTINGS[j % len(ROUTINGS)],
                              j % 2 == 1, config, R // rpn, worst=cap * R)
            assert S.CALLS.get("home", 0) == 8, S.CALLS   # the route ran
            # a dispatch and its cached dispatch per round: one land each, or one per window of 5 rows
            lands = 8 if not window else sum(2 * -(-cap * R // window) for cap in (7, 9, 4, 13))
            assert S.CALLS.get("land", 0) == lands, (S.CALLS, lands)
            ref.destroy()
            eng.destroy()


def case_worst_windows(ctx):
    """CUDA, a node of several ranks (the forwarder kernel): num_worst_tokens dispatches (and their
    cached dispatches) whose rows land a few final rows per window (COMMLIB_FANOUT_WINDOW_ROWS=5: many
    windows, the areas' two halves in turn; fanout.py, Windows) against the reference bit for bit,
    padded rows included, the areas holding earlier calls' bytes; combine of those handles too."""
    R = ctx.world_size
    rpn = topologies(R)[-1]
    if ctx.device.type != "cuda" or rpn == 1:
        return
    os.environ["COMMLIB_FANOUT_WINDOW_ROWS"] = "5"
    try:
        ref, eng = _buffers(ctx, rpn, 3)
    finally:
        del os.environ["COMMLIB_FANOUT_WINDOW_ROWS"]
    node = eng.backend.node
    if node.name != "kernel":   # no IPC between this node's processes: no forwarder to window
        return
    assert node.window_rows == 5, node.window_rows
    ats, forward = [], node.dispatch_window

    def counted(landed, W, lo, hi, at):
        ats.append(at)
        forward(landed, W, lo, hi, at)
    node.dispatch_window = counted
    for j, (T, cap) in enumerate(((7, 7), (5, 9), (0, 4), (13, 13), (3, 21))):
        T = 0 if (ctx.rank == 1 and j == 1) else T            # a silent rank
        compare_round(ctx, ref, eng, 7000 + 10 * j, T, ROUTINGS[j % len(ROUTINGS)], j % 2 == 1, TINY, R // rpn,
                      worst=cap * R)
    assert 0 in ats and 5 in ats, f"the windows used area rows {sorted(set(ats))}: expected both halves"
    ref.destroy()
    eng.destroy()


def case_worst_over_cap(ctx):
    """num_worst_tokens with more than num_worst_tokens // R tokens on one rank: that rank raises
    naming the cap, the others (CPU: they read the exchange) that it refused; the Buffer still works.
    CPU only: on a GPU the peers have no host read and stop on a device-side assert."""
    if ctx.device.type != "cpu":
        return
    R = ctx.world_size
    ref, eng, x, idx, w, lay = _one_call_setup(ctx, 4, 3, 6, "random")
    try:
        eng.dispatch(x, num_tokens_per_rank=lay[0], num_tokens_per_rdma_rank=lay[1], is_token_in_rank=lay[3],
                     num_tokens_per_expert=lay[2], topk_idx=idx, topk_weights=w,
                     num_worst_tokens=(5 if ctx.rank == R - 1 else 6) * R)
    except ValueError as e:
        text = str(e)
        if ctx.rank == R - 1:
            assert "num_worst_tokens" in text and "at most" in text and "has 6" in text, text
        else:
            assert f"rank(s) [{R - 1}] rejected" in text, text
    else:
        raise AssertionError("no error for more tokens than num_worst_tokens // R")
    compare_round(ctx, ref, eng, 78, 6, "random", False, None, R // topologies(R)[-1], worst=6 * R)
    ref.destroy()
    eng.destroy()


def case_worst_device_assert(ctx):
    """CUDA only, last in its world (the CUDA context is lost): num_worst_tokens with an expert id out
    of range on one rank. No host read means nothing to raise from; every rank must stop on the
    device-side assert instead of returning rows silently wrong. The process then ends with exit
    code 3 if the NCCL watchdog has not ended it first (a lost context cannot tear NCCL down
    cleanly): either way the launcher sees every rank stop, and never waits."""
    if ctx.device.type != "cuda":
        return
    R = ctx.world_size
    eng = commlib.Buffer(ctx.group, NVL, 0, ranks_per_node=topologies(R)[-1], backend="internode")
    x, idx, w = make_inputs(4, ctx.rank, R, 2, 8, "random", ctx.device)
    lay = eng.get_dispatch_layout(idx, E_PER_RANK * R)
    if ctx.rank == R - 1:
        idx = idx.clone()
        idx[3, 0] = E_PER_RANK * R + 5
    try:
        eng.dispatch(x, num_tokens_per_rank=lay[0], num_tokens_per_rdma_rank=lay[1], is_token_in_rank=lay[3],
                     num_tokens_per_expert=lay[2], topk_idx=idx, topk_weights=w, num_worst_tokens=8 * R)
        torch.cuda.synchronize()
    except (RuntimeError, ValueError) as e:   # the Buffer's host check may refuse the id on its rank first
        print(f"[worst_device_assert rank {ctx.rank}] stopped: {str(e)[:300]}", flush=True)
        os._exit(3)
    raise AssertionError("a bad expert id under num_worst_tokens returned without an error")


def case_chunk_boundaries(ctx):
    """Streams of k * chunk - 1, k * chunk and k * chunk + 1 rows (chunk rows = 3, ring of 1 row)."""
    R = ctx.world_size
    rpn = topologies(R)[0]
    ref, eng = _buffers(ctx, rpn, 64)
    cfg = Config(2, 4, 8, 1, 6)  # ring rows 3: chunk rows 3 while a stream has <= 192 rows
    for k, T in enumerate((2, 3, 4, 5, 6, 7, 8, 9, 10)):
        compare_round(ctx, ref, eng, 500 + k, T, "one_node", False, cfg, R // rpn)
        compare_round(ctx, ref, eng, 600 + k, T, "random", True, cfg, R // rpn)
    ref.destroy()
    eng.destroy()


def case_random_stalls(ctx):
    """Random 0-3 ms stalls before every chunk is posted and landed, different on every rank."""
    R = ctx.world_size
    for i, rpn in enumerate(topologies(R)):
        ref, eng = _buffers(ctx, rpn, 8)
        eng.backend.network.stall_ms = 3.0
        for k in range(4):
            compare_round(ctx, ref, eng, 700 + 10 * i + k, 13 + k, ROUTINGS[k % len(ROUTINGS)], k % 2 == 0,
                          TINY, R // rpn)
        ref.destroy()
        eng.destroy()


def case_random_routings(ctx, rounds: int = 0):
    """Many random routings (token count, routing, dtype, chunking, topology) in a row: no hang, equal."""
    R = ctx.world_size
    rounds = rounds or int(os.environ.get("INTERNODE_TEST_ROUNDS", "60"))
    rng = random.Random(4242)  # the same draws on every rank
    bufs = {rpn: _buffers(ctx, rpn, 5) for rpn in topologies(R)}
    for r in range(rounds):
        rpn = rng.choice(sorted(bufs))
        T = rng.choice((0, 1, 2, 5, 16, 33, 64))
        compare_round(ctx, *bufs[rpn], 10_000 + r, T, rng.choice(ROUTINGS), rng.random() < 0.3,
                      rng.choice((None, TINY, Config(4, 4, 8, 2, 6))), R // rpn)
    for ref, eng in bufs.values():
        ref.destroy()
        eng.destroy()


def case_network_timeout(ctx):
    """A rank that stalls past COMMLIB_TIMEOUT_S before its first network chunk: the peers raise, naming
    their rank, the op and the chunk they waited for. Last in its world (the group is left broken)."""
    R = ctx.world_size
    rpn = topologies(R)[0]
    os.environ["COMMLIB_TIMEOUT_S"] = "3"
    try:
        eng = commlib.Buffer(ctx.group, NVL, 0, ranks_per_node=rpn, backend="internode")
    finally:
        del os.environ["COMMLIB_TIMEOUT_S"]
    x, idx, w = make_inputs(1, ctx.rank, R, R // rpn, 8, "random", ctx.device)
    lay = eng.get_dispatch_layout(idx, E_PER_RANK * R)
    if ctx.rank == 1:
        eng.backend.network.stall_ms = 1.0   # stalls on (the step calls stall() only then), each 8 s
        eng.backend.network.stall = lambda: time.sleep(8)
    try:
        eng.dispatch(x, num_tokens_per_rank=lay[0], num_tokens_per_rdma_rank=lay[1], is_token_in_rank=lay[3],
                     num_tokens_per_expert=lay[2], topk_idx=idx, topk_weights=w)
    except CommlibError as e:
        text = str(e)
        if ctx.rank != 1:
            assert f"[commlib rank {ctx.rank}]" in text and "network chunk 0 of" in text and "timed out" in text, text
        return
    assert ctx.rank == 1, f"rank {ctx.rank}: no timeout raised"  # the staller may find its peers' rows sent


def case_without_topk(ctx):
    """DeepEP's dispatch without top-k (is_token_in_rank and the counts only): rows, handles, the
    per-expert list (the senders' num_tokens_per_expert, aligned) and combine equal the reference's."""
    R, me = ctx.world_size, ctx.rank
    E = E_PER_RANK * R
    for rpn in topologies(R):
        ref, eng = _buffers(ctx, rpn, 3)
        for seed, T in ((1, 0), (2, 5), (3, 19)):
            x, idx, _ = make_inputs(seed, me, R, R // rpn, T, "group_limited", ctx.device)
            outs = []
            for buf in (ref, eng):
                ntr, nrr, nte, tir, _ = buf.get_dispatch_layout(idx, E)
                rx, ri, rw, lst, h, _ = buf.dispatch(x, num_tokens_per_rank=ntr, num_tokens_per_rdma_rank=nrr,
                                                     is_token_in_rank=tir, num_tokens_per_expert=nte,
                                                     expert_alignment=4, config=TINY)
                cx = buf.combine((rx.float() * 2).to(torch.bfloat16), h, config=TINY)[0]
                outs.append((rx, ri, rw, lst, cx) + tuple(getattr(h, f) for f in HANDLE_FIELDS))
            same(outs[1], outs[0], f"[without top-k rpn={rpn} T={T}]")
        ref.destroy()
        eng.destroy()


def case_bad_expert_ids(ctx):
    """An expert id out of range on one rank: every rank raises, naming that rank; the Buffer still works."""
    R = ctx.world_size
    ref, eng, x, idx, w, lay = _one_call_setup(ctx, 4, 3, 6, "random")
    E = E_PER_RANK * R
    bad = idx.clone()
    if ctx.rank == R - 1:
        bad[2, 1] = E + 3
    try:
        eng.dispatch(x, num_tokens_per_rank=lay[0], num_tokens_per_rdma_rank=lay[1], is_token_in_rank=lay[3],
                     num_tokens_per_expert=lay[2], topk_idx=bad, topk_weights=w)
    except ValueError as e:
        # CPU: the Buffer's host check refuses it on that rank, the agreement tells the others;
        # CUDA: the engine counts the ids on the device and every rank raises after its count read
        text = str(e)
        assert any(f in text for f in (f"rank {R - 1}]", f"({R - 1}, ", f"[{R - 1}]")), text
        assert "outside" in text or "rejected" in text, text
    else:
        raise AssertionError("no error for an expert id out of range")
    compare_round(ctx, ref, eng, 77, 11, "random", False, None, R // topologies(R)[-1])
    ref.destroy()
    eng.destroy()


def case_no_host_sync(ctx):
    """CUDA only: a non-cached dispatch synchronises with the host once (its count read); cached
    dispatch and combine (weights, biases), and every call with num_worst_tokens, never
    (torch.cuda.set_sync_debug_mode)."""
    if ctx.device.type != "cuda":
        return
    import warnings
    ref, eng, x, idx, w, lay = _one_call_setup(ctx, 4, 5, 48, "group_limited")
    args = dict(num_tokens_per_rank=lay[0], num_tokens_per_rdma_rank=lay[1], is_token_in_rank=lay[3],
                num_tokens_per_expert=lay[2], topk_idx=idx, topk_weights=w)
    eng.dispatch(x, **args)  # warm: first-call allocations, NCCL communicators
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            rx, ri, rw, lst, h, _ = eng.dispatch(x, **args)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [str(s.message) for s in seen if "called a synchronizing" in str(s.message)]
    assert len(syncs) == 1, f"non-cached dispatch synchronised {len(syncs)} times: {syncs}"
    y = (rx.float() * 2).to(torch.bfloat16)
    bias = torch.ones(48, H, dtype=torch.bfloat16, device=ctx.device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eng.dispatch(x, handle=h)
        eng.dispatch(per_token_cast_to_fp8(x), handle=h)
        eng.combine(y, h, rw, bias=bias)
        eng.combine(y, h)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    # num_worst_tokens: the dispatch itself never synchronises either (padded streams)
    worst = 48 * ctx.world_size
    eng.dispatch(x, **args, num_worst_tokens=worst)   # warm: its buffers
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rx, ri, rw, lst, h, _ = eng.dispatch(x, **args, num_worst_tokens=worst)
        eng.dispatch(x, handle=h)
        eng.combine((rx.float() * 2).to(torch.bfloat16), h, rw, bias=bias)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert rx.shape[0] == worst and lst == []
    torch.cuda.synchronize()
    ref.destroy()
    eng.destroy()


def case_host_ahead_memory(ctx):
    """CUDA only: a host far ahead of the GPU (DeepEP's timing loops issue calls without a sync) holds
    about one call's memory at a time: the kernel paths allocate their outputs and transients on
    the caller's stream (Wiring.alloc), whose freed blocks are reused in stream order. Made on the
    comm stream and recorded for the caller's, each would stay until the GPU reached the call.
    Cached dispatch + combine (device path); with the forwarder (a node of several ranks) also
    num_worst_tokens dispatch + combine (the padded kernel route)."""
    if ctx.device.type != "cuda":
        return
    R, dev = ctx.world_size, ctx.device
    rpn = topologies(R)[-1]
    eng = commlib.Buffer(ctx.group, NVL, 0, ranks_per_node=rpn, backend="internode")
    T, HB, E = 512, 2048, E_PER_RANK * R
    g = torch.Generator().manual_seed(77 + ctx.rank)
    x = torch.randn(T, HB, generator=g).to(torch.bfloat16).to(dev)
    w, idx = torch.rand(T, E, generator=g).topk(K, dim=1)
    idx, w = idx.to(dev), w.to(dev)
    lay = eng.get_dispatch_layout(idx, E)
    args = dict(num_tokens_per_rank=lay[0], num_tokens_per_rdma_rank=lay[1], is_token_in_rank=lay[3],
                num_tokens_per_expert=lay[2], topk_idx=idx, topk_weights=w)
    _, _, _, _, h, _ = eng.dispatch(x, **args)
    rounds = [("cached dispatch + combine", lambda: eng.combine(eng.dispatch(x, handle=h)[0], h)[0])]
    if eng.backend.node.in_area:
        def worst_round():
            rx, _, rw, _, wh, _ = eng.dispatch(x, **args, num_worst_tokens=T * R)
            return eng.combine(rx, wh, rw)[0]
        rounds.append(("num_worst_tokens dispatch + combine", worst_round))
    calls = 16
    for what, call in rounds:
        call()   # warm: first-call growth (the forwarder's areas)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        call()
        torch.cuda.synchronize()
        per_call = torch.cuda.max_memory_allocated() - base
        torch.cuda.reset_peak_memory_stats()
        torch.cuda._sleep(int(4e8))               # the GPU ~0.2 s behind: every call below is issued ahead
        for _ in range(calls):
            call()
        held = torch.cuda.max_memory_allocated() - base
        torch.cuda.synchronize()
        assert held < 3 * per_call, (f"{what}: {calls} calls issued ahead held {held / 2**20:.1f} MiB at once, "
                                     f"{held / per_call:.1f} calls' worth (one call: {per_call / 2**20:.1f} MiB)")
    eng.destroy()


def case_graph_capture(ctx):
    """CUDA only: cached dispatch and combine captured in one CUDA graph replay to the eager results."""
    if ctx.device.type != "cuda":
        return
    ref, eng, x, idx, w, lay = _one_call_setup(ctx, 3, 9, 40, "random")
    rx, ri, rw, lst, h, _ = eng.dispatch(x, num_tokens_per_rank=lay[0], num_tokens_per_rdma_rank=lay[1],
                                         is_token_in_rank=lay[3], num_tokens_per_expert=lay[2], topk_idx=idx,
                                         topk_weights=w, config=TINY)
    y = (rx.float() * 3).to(torch.bfloat16)
    want_x = eng.dispatch(x, handle=h, config=TINY)[0]
    want_c = eng.combine(y, h, rw, config=TINY)[0]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            got_x = eng.dispatch(x, handle=h, config=TINY)[0]
            got_c = eng.combine(y, h, rw, config=TINY)[0]
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        got_x.zero_()
        got_c.zero_()
        graph.replay()
        torch.cuda.synchronize()
        same(got_x, want_x, "graph replay: cached dispatch")
        same(got_c, want_c, "graph replay: combine")
    ref.destroy()
    eng.destroy()


def _dispatch_args(buf, idx, w):
    ntr, nrr, nte, tir, _ = buf.get_dispatch_layout(idx, E_PER_RANK * buf.num_ranks)
    return dict(num_tokens_per_rank=ntr, num_tokens_per_rdma_rank=nrr, is_token_in_rank=tir,
                num_tokens_per_expert=nte, topk_idx=idx, topk_weights=w)


def case_mismatched_calls(ctx):
    """CPU ranks: one rank makes another call than its peers (combine against a cached dispatch,
    combine against a fresh dispatch): every rank raises, naming the op each side made, in the one
    collective the call starts with (the agreement is the count exchange's row, not a collective of
    its own); then the Buffer works on every rank."""
    if ctx.device.type != "cpu":
        return
    R, me = ctx.world_size, ctx.rank
    ref, eng, x, idx, w, lay = _one_call_setup(ctx, 3, 21, 9, "random")
    args = _dispatch_args(eng, idx, w)
    rx, _, rw, _, h, _ = eng.dispatch(x, **args)
    y = (rx.float() * 2).to(torch.bfloat16)
    odd = me == R - 1
    for other in ("cached dispatch", "dispatch"):
        try:
            if odd:
                eng.combine(y, h, rw)
            elif other == "cached dispatch":
                eng.dispatch(x, handle=h)
            else:
                eng.dispatch(x, **args)
        except ValueError as e:
            text = str(e)
            assert f"[commlib rank {me}] ranks disagree on the op" in text, text
            assert "combine" in text and other in text, text
        else:
            raise AssertionError(f"rank {me}: no error for {other} against a combine")
    compare_round(ctx, ref, eng, 79, 9, "random", False, None, R // topologies(R)[-1])
    ref.destroy()
    eng.destroy()


def _ops(probe, fn) -> dict:
    fn()
    return probe.last_ops()


def case_device_ops(ctx):
    """CPU ranks: the device operations one call issues (the probe's count: launches, copies,
    allocations, event ops, collectives) are the same call after call, and the collectives are the
    protocol's: the count exchange (or, for cached dispatch and combine, the agreement of the same
    size), then per network chunk one rail all-to-all and, with several ranks per node, one node
    all-to-all."""
    if ctx.device.type != "cpu":
        return
    R = ctx.world_size
    for rpn in topologies(R):
        ref, eng = _buffers(ctx, rpn, 3)
        x, idx, w = make_inputs(23, ctx.rank, R, R // rpn, 24, "random", ctx.device)
        args = _dispatch_args(eng, idx, w)
        probe = RecordingProbe(count_ops=True)
        eng.backend.set_probe(probe)
        calls = {"dispatch": lambda: eng.dispatch(x, **args, config=TINY)}
        rx, _, rw, _, h, _ = calls["dispatch"]()
        calls["cached dispatch"] = lambda: eng.dispatch(x, handle=h, config=TINY)
        calls["combine"] = lambda: eng.combine(rx, h, rw, config=TINY)
        K = h.extra["plan"].num_chunks
        per_chunk = 1 if rpn == 1 else 2
        for name, fn in calls.items():
            first, again = _ops(probe, fn), _ops(probe, fn)
            assert first == again, f"[rpn={rpn}] {name}: {first} then {again}"
            assert set(first) == {"launches", "copies", "allocations", "event_ops", "collectives", "total"}
            assert first["collectives"] == 1 + per_chunk * K, f"[rpn={rpn} K={K}] {name}: {first}"
            assert first["total"] > first["collectives"] and first["event_ops"] == 0, first   # gloo: host waits
        ref.destroy()
        eng.destroy()


def case_default_device_meta(ctx):
    """The engine under ``torch.set_default_device("meta")`` (a tensor made without naming its device
    lands on meta and fails at its first use; DeepEP's tests set a CUDA default): its dispatch
    (counted, padded, and on the device its kernels), cached dispatch and combine equal the
    reference's, computed under the usual default. Only the engine runs under meta: the test calls
    the backend directly, after a call under the usual default (the forwarder's areas are grown then)."""
    R = ctx.world_size
    rpn = topologies(R)[-1]
    for chunks in (1, 3):
        ref, eng = _buffers(ctx, rpn, chunks)
        for seed, worst in ((31, 0), (32, 24 * R)):
            x, idx, w = make_inputs(seed, ctx.rank, R, R // rpn, 24, "group_limited", ctx.device)
            want = _backend_round(ref, x, idx, w, worst)
            _backend_round(eng, x, idx, w, worst)
            torch.set_default_device("meta")
            try:
                got = _backend_round(eng, x, idx, w, worst)
            finally:
                torch.set_default_device(None)
            same(got, want, f"[default device meta, chunks {chunks}, worst {worst}]")
        ref.destroy()
        eng.destroy()


def _backend_round(buf, x, idx, w, worst: int) -> tuple:
    """dispatch, cached dispatch, combine on ``buf``'s backend (requests built here, not by the Buffer)."""
    from commlib.backends.base import CombineRequest, DispatchRequest
    be, E = buf.backend, E_PER_RANK * buf.num_ranks
    cfg, ccfg = buf.get_dispatch_config(buf.num_ranks), buf.get_combine_config(buf.num_ranks)
    lay = be.get_dispatch_layout(idx, E)
    res = be.dispatch(DispatchRequest(x, None, idx, w, lay, None, E, 1, worst, cfg))
    cached = be.dispatch(DispatchRequest(x, None, None, None, None, res.handle, 0, 1, worst, cfg))
    y = (res.recv_x.float() * 3).to(torch.bfloat16)
    bias = (torch.ones(x.shape[0], H, dtype=torch.bfloat16, device=x.device),)
    comb = be.combine(CombineRequest(y, res.handle, res.recv_topk_weights, bias, ccfg))
    h = res.handle
    return (res.recv_x, res.recv_topk_idx, res.recv_topk_weights, res.num_recv_tokens_per_expert_list, cached.recv_x,
            comb.combined_x, comb.combined_topk_weights) + tuple(getattr(h, f) for f in HANDLE_FIELDS)
