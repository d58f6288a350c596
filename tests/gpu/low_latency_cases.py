"""Low-latency mode on the nvlink backend vs the reference backend, inside spawned GPU worlds.

Every case makes the same calls through two low-latency Buffers of the same world (nvlink kernels,
and the reference transport: the executable specification) on the same inputs and compares
bit for bit: recv_count, src_info, layout_range, the received rows (raw bytes: BF16 rows, E4M3
rows and their scales; rows past recv_count only with ``pad_zeros``, since the kernels leave them
as they are by default) and the combined output.
"""
from __future__ import annotations

import torch

from commlib.buffer import Buffer
from commlib.backends.low_latency.reference import unpack_ue8m0
from commlib.utils.timing import capture_graph
from nvlink_cases import check_same

_BUFFERS: dict = {}
SMALL = dict(M=24, H=512, E_PER_RANK=4, K=4)
DECODE = dict(M=128, H=7168, E=288, K=8)   # issue 8's decode workload
# more (expert, source) segments than the dispatch receiver keeps in shared memory (LL_SMEM_WANT)
MANY_EXPERTS = dict(M=16, H=256, E=1536, K=8)


def buffers(ctx):
    """(nvlink, reference) low-latency Buffers, sized for every shape the cases use."""
    if "ll" not in _BUFFERS:
        R = ctx.world_size
        shapes = [(SMALL["M"], SMALL["H"], R, SMALL["E_PER_RANK"] * R)]
        if R == 2:                 # the decode shape runs in the 2-rank world only (case_decode_shape)
            shapes.append((DECODE["M"], DECODE["H"], R, DECODE["E"]))
            shapes.append((MANY_EXPERTS["M"], MANY_EXPERTS["H"], R, MANY_EXPERTS["E"]))
        nbytes = max(Buffer.get_low_latency_rdma_size_hint(*s) for s in shapes)
        nv = Buffer(ctx.group, 0, nbytes, low_latency_mode=True, backend="nvlink", explicitly_destroy=True)
        ref = Buffer(ctx.group, 0, nbytes, low_latency_mode=True, backend="reference", explicitly_destroy=True)
        assert type(nv._low_latency).__name__ == "NVLinkLowLatency"
        _BUFFERS["ll"] = (nv, ref)
    return _BUFFERS["ll"]


def make_inputs(ctx, seed: int, M: int, H: int, E: int, K: int, T=None):
    """This rank's (x [T, H] bf16, topk_idx [T, K] int64, topk_weights [T, K] float32) on its GPU."""
    me = ctx.rank
    g = torch.Generator().manual_seed(seed * 1000 + me)
    if T is None:
        T = [M, 0, M // 3 + 1, 7][(me + seed) % 4]
    x = torch.randn(T, H, generator=g) * (1 + me)
    if T and seed % 3 == 0:        # an all-zero block (amax clamp) and tiny values (subnormal E4M3)
        x[0, :128] = 0
        x[min(1, T - 1), 128:256] *= 1e-6
    idx = torch.rand(T, E, generator=g).topk(K, dim=1).indices if T else torch.empty(0, K, dtype=torch.int64)
    if T:
        idx[torch.rand(T, K, generator=g) < 0.15] = -1
        if seed % 2 and K > 1:     # a repeated expert in one token: two rows, in slot order
            idx[T // 2, 1] = idx[T // 2, 0] if idx[T // 2, 0] >= 0 else 0
    w = torch.rand(T, K, generator=g)
    dev = ctx.device
    return x.to(torch.bfloat16).to(dev), idx.to(torch.int64).to(dev), w.to(dev)


def expert_fn(recv_x, me: int, L: int, H: int):
    """The 'expert': received rows (dequantised) x (1 + global expert / 16), in bf16 (torch ops only)."""
    if isinstance(recv_x, tuple):
        q, s = recv_x
        scales = unpack_ue8m0(s) if s.dtype == torch.int32 else s
        rows = (q.float().view(q.shape[0], q.shape[1], -1, 128) * scales.unsqueeze(-1)).view(q.shape)
    else:
        rows = recv_x.float()
    factors = 1 + (me * L + torch.arange(L, device=rows.device, dtype=torch.float32)) / 16
    out = (rows * factors.view(L, 1, 1)).to(torch.bfloat16)
    return torch.nan_to_num(out)   # padding rows may hold anything on the nvlink side


def compare_dispatch(nv_res, ref_res, tag: str, pad: bool) -> None:
    (nx, ncount, nh), (rx, rcount, rh) = nv_res, ref_res
    check_same(ncount, rcount, f"{tag} recv_count")
    check_same(nh.src_info, rh.src_info, f"{tag} src_info")
    check_same(nh.layout_range, rh.layout_range, f"{tag} layout_range")
    parts = list(zip(nx, rx)) if isinstance(rx, tuple) else [(nx, rx)]
    assert isinstance(nx, tuple) == isinstance(rx, tuple), f"{tag}: recv_x kinds differ"
    counts = rcount.cpu().tolist()
    for i, (a, b) in enumerate(parts):
        name = ("recv_x", "scales")[i]
        assert tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype, \
            f"{tag} {name}: {tuple(a.shape)} {a.dtype} vs reference {tuple(b.shape)} {b.dtype}"
        if pad:
            check_same(a, b, f"{tag} {name} (with padding)")
            continue
        a, b = a.cpu(), b.cpu()
        for e, n in enumerate(counts):
            if n:
                check_same(a[e, :n], b[e, :n], f"{tag} {name} expert {e}")


def run_pair(ctx, seed: int, *, fp8=False, round_scale=False, ue8m0=False, hook=False, zero_copy=False,
             pad=False, shape=None, T=None, logfmt=False, y_scale=1.0, stats=False):
    """One dispatch + combine through both Buffers; compare everything. ``logfmt``: the combine's
    partials cross as LogFMT-10; ``y_scale`` scales the expert outputs (below 1: LogFMT encodes most
    blocks). ``stats``: wait-time stats tensors are passed and checked (both engines add the same
    count of nanoseconds to every source's entry; the values differ)."""
    nv, ref = buffers(ctx)
    R, me = ctx.world_size, ctx.rank
    s = shape or dict(M=SMALL["M"], H=SMALL["H"], E=SMALL["E_PER_RANK"] * R, K=SMALL["K"])
    M, H, E, K = s["M"], s["H"], s["E"], s["K"]
    L = E // R
    x, idx, w = make_inputs(ctx, seed, M, H, E, K, T)
    tag = f"[seed {seed} T={x.shape[0]} H={H} E={E} fp8={fp8} round={round_scale} ue8m0={ue8m0} hook={hook}]"
    tag += f"[logfmt={logfmt} stats={stats}]"
    nv._low_latency.pad_zeros = pad
    waits = {}
    try:
        results = {}
        for name, buf in (("nvlink", nv), ("reference", ref)):
            waits[name] = [torch.zeros(R, dtype=torch.int64, device=ctx.device) if stats else None for _ in range(2)]
            rx, count, handle, _, recv_hook = buf.low_latency_dispatch(
                x, idx, M, E, dispatch_wait_recv_cost_stats=waits[name][0], use_fp8=fp8, round_scale=round_scale,
                use_ue8m0=ue8m0, return_recv_hook=hook)
            if hook:
                recv_hook()
            results[name] = (rx, count, handle)
        compare_dispatch(results["nvlink"], results["reference"], tag, pad)
        y = expert_fn(results["reference"][0], me, L, H)
        if y_scale != 1.0:
            y = (y.float() * y_scale).to(torch.bfloat16)
        combined = {}
        for name, buf in (("nvlink", nv), ("reference", ref)):
            handle = results[name][2]
            inp = y
            if zero_copy:
                inp = buf.get_next_low_latency_combine_buffer(handle)
                inp.copy_(y)
            out = torch.empty(x.shape[0], H, dtype=torch.bfloat16, device=ctx.device)
            cx, _, chook = buf.low_latency_combine(inp, idx, w, handle, use_logfmt=logfmt, zero_copy=zero_copy,
                                                   return_recv_hook=hook, out=out,
                                                   combine_wait_recv_cost_stats=waits[name][1])
            if hook:
                chook()
            assert cx is out
            combined[name] = cx
        check_same(combined["nvlink"], combined["reference"], f"{tag} combined")
        if stats:
            for name, (d, c) in waits.items():
                for kind, t in (("dispatch", d), ("combine", c)):
                    v = t.cpu()
                    assert bool((v > 0).all()) and bool((v == v[0]).all()), f"{tag} {name} {kind} wait stats {v}"
    finally:
        nv._low_latency.pad_zeros = False
    torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------------
# cases
# ------------------------------------------------------------------------------------------------

def case_bf16(ctx):
    run_pair(ctx, 1)
    run_pair(ctx, 2, pad=True)
    run_pair(ctx, 3, T=0)                      # no tokens anywhere: zero rows, zero counts
    run_pair(ctx, 4, T=SMALL["M"])             # every rank full


def case_fp8(ctx):
    run_pair(ctx, 5, fp8=True, pad=True)
    run_pair(ctx, 6, fp8=True, round_scale=True)
    run_pair(ctx, 7, fp8=True, round_scale=True, ue8m0=True, pad=True)
    run_pair(ctx, 9, fp8=True)                 # seed % 3 == 0: zero block and tiny values


def case_hooks_and_zero_copy(ctx):
    run_pair(ctx, 10, hook=True)
    run_pair(ctx, 11, fp8=True, hook=True, zero_copy=True)
    run_pair(ctx, 12, zero_copy=True)


def case_two_in_flight(ctx):
    """Two dispatches (then two combines) sent before either is received; the hooks in order."""
    nv, ref = buffers(ctx)
    R, me = ctx.world_size, ctx.rank
    M, H, K, E = SMALL["M"], SMALL["H"], SMALL["K"], SMALL["E_PER_RANK"] * R
    L = E // R
    ins = [make_inputs(ctx, 20 + i, M, H, E, K) for i in range(2)]
    modes = [dict(use_fp8=False), dict(use_fp8=True, round_scale=True)]
    refs = [ref.low_latency_dispatch(x, idx, M, E, **m)[:3] for (x, idx, _), m in zip(ins, modes)]
    got = [nv.low_latency_dispatch(x, idx, M, E, return_recv_hook=True, **m) for (x, idx, _), m in zip(ins, modes)]
    # host checks: a third call, a plain call while hooks are pending, hooks out of order
    for bad in (lambda: nv.low_latency_dispatch(ins[0][0], ins[0][1], M, E, return_recv_hook=True),
                lambda: nv.low_latency_dispatch(ins[0][0], ins[0][1], M, E),
                got[1][4]):
        try:
            bad()
        except ValueError:
            pass
        else:
            raise AssertionError("expected ValueError")
    got[0][4]()
    got[1][4]()
    for i in range(2):
        compare_dispatch(got[i][:3], refs[i], f"[in flight {i}]", pad=False)
    ys = [expert_fn(refs[i][0], me, L, H) for i in range(2)]
    want = [ref.low_latency_combine(ys[i], ins[i][1], ins[i][2], refs[i][2])[0] for i in range(2)]
    outs = [nv.low_latency_combine(ys[i], ins[i][1], ins[i][2], got[i][2], return_recv_hook=True) for i in range(2)]
    outs[0][2]()
    outs[1][2]()
    for i in range(2):
        check_same(outs[i][0], want[i], f"[in flight {i}] combined")
    run_pair(ctx, 22)                          # still in step


def case_cuda_graph(ctx):
    """dispatch + expert + combine captured once (plain and with hooks), replayed with fresh inputs."""
    nv, ref = buffers(ctx)
    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    M, H, K, E = SMALL["M"], SMALL["H"], SMALL["K"], SMALL["E_PER_RANK"] * R
    L = E // R
    T = M - me
    x_s = torch.zeros(T, H, dtype=torch.bfloat16, device=dev)
    idx_s = torch.full((T, K), -1, dtype=torch.int64, device=dev)
    w_s = torch.zeros(T, K, dtype=torch.float32, device=dev)

    def fill(seed):
        x, idx, w = make_inputs(ctx, seed, M, H, E, K, T=T)
        x_s.copy_(x)
        idx_s.copy_(idx)
        w_s.copy_(w)

    for fp8, hook in ((False, False), (True, True)):
        kw = dict(use_fp8=fp8, round_scale=fp8)

        def step(buf):
            rx, count, handle, _, rhook = buf.low_latency_dispatch(x_s, idx_s, M, E, return_recv_hook=hook, **kw)
            if hook:
                rhook()
            y = expert_fn(rx, me, L, H)
            cx, _, chook = buf.low_latency_combine(y, idx_s, w_s, handle, return_recv_hook=hook)
            if hook:
                chook()
            return rx, count, handle, cx

        fill(100)
        graph, static = capture_graph(lambda: step(nv), capture_error_mode="thread_local")
        for it in range(4):
            fill(101 + it)
            graph.replay()
            torch.cuda.synchronize()
            rx, count, handle, cx = step(ref)
            tag = f"[graph fp8={fp8} hook={hook} replay {it}]"
            compare_dispatch(static[:3], (rx, count, handle), tag, pad=False)
            check_same(static[3], cx, f"{tag} combined")
            if it == 1:                        # eager calls interleave with replays
                run_pair(ctx, 110 + it, fp8=fp8)
        del graph


def case_decode_shape(ctx):
    """Issue 8's decode workload: 128 tokens, hidden 7168, top-8 of 288 experts."""
    if ctx.world_size != 2:
        return
    shape = dict(DECODE)
    run_pair(ctx, 30, fp8=True, shape=shape, T=shape["M"])
    run_pair(ctx, 31, fp8=True, round_scale=True, ue8m0=True, hook=True, shape=shape)
    run_pair(ctx, 32, shape=shape, T=shape["M"] - 5)


def case_many_experts(ctx):
    """1536 experts: segments past the receiver's shared-memory targets (three calls: both halves, then a reuse)."""
    if ctx.world_size != 2:
        return
    shape = dict(MANY_EXPERTS)
    run_pair(ctx, 33, fp8=True, shape=shape, T=shape["M"])
    run_pair(ctx, 34, shape=shape)
    run_pair(ctx, 35, fp8=True, hook=True, shape=shape, T=shape["M"])


def case_logfmt(ctx):
    """use_logfmt=True: nvlink (min(R, K) launches around the kernel, the reference's codec) against the
    reference, bit for bit: encoded blocks (outputs scaled below 1), bf16 blocks, hooks, zero copy, FP8."""
    run_pair(ctx, 40, logfmt=True, y_scale=1 / 64)
    run_pair(ctx, 41, logfmt=True)                                  # mostly blocks with |v| >= 1: bf16
    run_pair(ctx, 42, logfmt=True, y_scale=1 / 256, hook=True, zero_copy=True)
    run_pair(ctx, 43, logfmt=True, y_scale=1 / 32, fp8=True, round_scale=True, T=SMALL["M"])
    run_pair(ctx, 44, logfmt=True, T=0)
    run_pair(ctx, 45)                                               # a plain combine after: still in step
    if ctx.world_size == 2:
        run_pair(ctx, 46, logfmt=True, y_scale=1 / 64, fp8=True, shape=dict(DECODE), T=DECODE["M"])


def case_wait_stats(ctx):
    """dispatch_wait_recv_cost_stats / combine_wait_recv_cost_stats on nvlink: nanoseconds added to
    every source's entry, plain and with hooks (checked in run_pair); refused inside a graph capture."""
    run_pair(ctx, 50, stats=True)
    run_pair(ctx, 51, stats=True, hook=True, fp8=True)
    run_pair(ctx, 52, stats=True, logfmt=True, y_scale=1 / 64)
    nv, _ = buffers(ctx)
    R, M, H, K, E = ctx.world_size, SMALL["M"], SMALL["H"], SMALL["K"], SMALL["E_PER_RANK"] * ctx.world_size
    x, idx, _w = make_inputs(ctx, 53, M, H, E, K)
    stats = torch.zeros(R, dtype=torch.int64, device=ctx.device)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            nv.low_latency_dispatch(x, idx, M, E, dispatch_wait_recv_cost_stats=stats)
    except ValueError as e:
        assert "capturing" in str(e), e
    else:
        raise AssertionError("wait-time stats inside a graph capture: expected ValueError")
    del graph
    run_pair(ctx, 54)                                               # still in step


def _masked_round(ctx, nv, ref, seed: int, masked: set, **kw) -> None:
    """One dispatch + combine with ``masked`` ranks masked on every rank: the live ranks call both
    Buffers and compare bit for bit; the masked ranks make no call (the reference's semantics)."""
    R, me = ctx.world_size, ctx.rank
    M, H, K, E = SMALL["M"], SMALL["H"], SMALL["K"], SMALL["E_PER_RANK"] * R
    if me in masked:
        return
    x, idx, w = make_inputs(ctx, seed, M, H, E, K)
    tag = f"[shrink, ranks {sorted(masked)} masked, seed {seed}, {kw}]"
    hook = kw.pop("return_recv_hook", False)
    got = []
    for b in (nv, ref):
        rx, count, handle, _, recv_hook = b.low_latency_dispatch(x, idx, M, E, return_recv_hook=hook, **kw)
        if hook:
            recv_hook()
        got.append((rx, count, handle))
    compare_dispatch(got[0], got[1], tag, pad=False)
    y = expert_fn(got[1][0], me, E // R, H)
    out = []
    for b, g in zip((nv, ref), got):
        cx, _, chook = b.low_latency_combine(y, idx, w, g[2], return_recv_hook=hook)
        if hook:
            chook()
        out.append(cx)
    check_same(out[0], out[1], f"{tag} combined")


def case_masked_ranks(ctx):
    """Shrink mode on nvlink against the reference, bit for bit on the live ranks: nothing masked; rank
    R - 1 masked on every rank (it makes no call: the reference's semantics; rows to and from it and
    its experts' share of the sums are left out), over both buffer halves, with hooks and FP8; the
    masked rank calling anyway (itself masked: its call moves nothing); the mask cleaned, the resync
    (clean_low_latency_buffer on every rank), and every rank compared again."""
    R, M, H, K = ctx.world_size, SMALL["M"], SMALL["H"], SMALL["K"]
    me, E = ctx.rank, SMALL["E_PER_RANK"] * R
    gone = R - 1
    nbytes = Buffer.get_low_latency_rdma_size_hint(M, H, R, E)
    nv = Buffer(ctx.group, 0, nbytes, low_latency_mode=True, backend="nvlink", enable_shrink=True,
                explicitly_destroy=True)
    ref = Buffer(ctx.group, 0, nbytes, low_latency_mode=True, backend="reference", enable_shrink=True,
                 explicitly_destroy=True)
    try:
        _masked_round(ctx, nv, ref, 60, set())
        for b in (nv, ref):
            b.low_latency_update_mask_buffer(gone, True)
        status = torch.zeros(R, dtype=torch.int32, device=ctx.device)
        nv.low_latency_query_mask_buffer(status)
        assert status.cpu().tolist() == [0] * (R - 1) + [1], status
        _masked_round(ctx, nv, ref, 61, {gone})
        _masked_round(ctx, nv, ref, 62, {gone}, use_fp8=True, round_scale=True)   # the other half
        _masked_round(ctx, nv, ref, 63, {gone}, use_fp8=False, return_recv_hook=True)
        # DeepEP's test style: the masked rank calls too (its own mask bit set): nothing moves there,
        # and the live ranks neither wait for it nor see its rows
        x, idx, w = make_inputs(ctx, 64, M, H, E, K)
        rx, count, handle, _, _ = nv.low_latency_dispatch(x, idx, M, E, use_fp8=False)
        if me == gone:
            assert int(count.abs().sum()) == 0, count
            assert bool((handle.src_info == -1).all())
        cx, _, _ = nv.low_latency_combine(expert_fn(rx, me, E // R, H), idx, w, handle)
        if me == gone:
            assert int(cx.float().abs().sum()) == 0
        else:  # against the reference's live ranks (same inputs, R - 1 makes no reference call)
            want = ref.low_latency_dispatch(x, idx, M, E, use_fp8=False)
            compare_dispatch((rx, count, handle), want[:3], "[shrink, masked rank calls too]", pad=False)
            got_ref = ref.low_latency_combine(expert_fn(want[0], me, E // R, H), idx, w, want[2])[0]
            check_same(cx, got_ref, "[shrink, masked rank calls too] combined")
        for b in (nv, ref):
            b.low_latency_clean_mask_buffer()
        if me != gone:  # the ranks that called while it was masked refuse to unmask it before the resync
            try:
                nv.low_latency_dispatch(x, idx, M, E, use_fp8=False)
            except ValueError as e:
                assert "clean_low_latency_buffer" in str(e), e
            else:
                raise AssertionError("unmasking without the resync: expected ValueError")
        nv.clean_low_latency_buffer(M, H, E)       # every rank together: the resync
        # the shrink-mode reference's message numbers are out of step on rank R - 1 (it made fewer
        # calls): compare with the shared reference Buffer, which every rank calls
        shared_ref = buffers(ctx)[1]
        _masked_round(ctx, nv, shared_ref, 65, set())
        _masked_round(ctx, nv, shared_ref, 66, set(), use_fp8=True, return_recv_hook=True)
        _masked_round(ctx, nv, shared_ref, 67, set())
    finally:
        torch.cuda.synchronize()
        nv.destroy()
        ref.destroy()


def case_host_ahead_memory(ctx):
    """A host far ahead of the GPU (DeepEP's timing loops: 50 calls, no sync) holds about one call's
    outputs, as DeepEP does: they are allocated on the caller's stream, whose freed blocks are reused
    in stream order. Outputs made on the comm stream and recorded for the caller's stream could be
    reused only once the GPU reached them: one [L, R * M, H] block per call in flight (8 ranks of
    DeepEP's test_low_latency ran out of the GPU's memory that way)."""
    nv, _ = buffers(ctx)
    R, s = ctx.world_size, DECODE
    M, H, E, K = s["M"], s["H"], s["E"], s["K"]
    x, idx, w = make_inputs(ctx, 40, M, H, E, K, T=M)
    y = torch.zeros(E // R, R * M, H, dtype=torch.bfloat16, device=ctx.device)
    per_call = (E // R) * R * M * H           # the FP8 rows, the largest output
    calls = 12
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.cuda._sleep(int(4e8))               # the GPU ~0.2 s behind: every call below is issued ahead
    for _ in range(calls):
        rx, _, handle, _, _ = nv.low_latency_dispatch(x, idx, M, E, use_fp8=True)
        cx, _, _ = nv.low_latency_combine(y, idx, w, handle)
        del rx, handle, cx
    held = torch.cuda.max_memory_allocated() - base
    torch.cuda.synchronize()
    assert held < 3 * per_call, (f"{calls} calls issued ahead held {held / 2**20:.0f} MiB at once, "
                                 f"{held / per_call:.1f} calls' rows (one call: {per_call / 2**20:.0f} MiB)")


def case_teardown(ctx):
    nv, ref = _BUFFERS.pop("ll")
    nv.destroy()
    ref.destroy()
