"""DeepEP V2's ElasticBuffer on commlib: cases run inside spawned CPU worlds (worlds.py), through ``import deep_ep``.

The oracle below is written from V2's documented semantics (deep_ep/buffers/elastic.py's docstrings
and handle fields, its copy epilogue's layouts, its reference combine's reduction order), in plain
loops over (source rank, token) pairs; it shares no code with commlib.elastic. Every rank rebuilds
every rank's inputs from (seed, rank), so expected values need no communication. The client cases
replay the call sequences of vLLM's deepep_v2 prepare/finalize and all2all manager, SGLang's
DeepEPv2 dispatcher and Megatron-Core's _DeepepV2Manager / fused_a2a, as read in their sources.
"""
from __future__ import annotations

import inspect
import itertools

import torch

import deep_ep
import oracle as O
from commlib.elastic import DEFAULT_NUM_DEVICE_SMS
from worlds import expect_raises

E, H, K, MAXT = 16, 256, 4, 24


# ------------------------------------------------------------------ inputs
def _inputs(seed: int, rank: int, fp8: bool = False, T: int | None = None):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    T = 10 + 3 * rank if T is None else T
    xf = torch.randn(T, H, generator=g) * (1 + rank)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.empty(0, K, dtype=torch.int64)
    if T:
        idx[torch.rand(T, K, generator=g) < 0.2] = -1
    w = torch.rand(T, K, generator=g)
    if fp8:
        sf = torch.rand(T, H // 128, generator=g) + 0.5
        x = (xf.clamp(-200, 200).to(torch.float8_e4m3fn), sf)
    else:
        x = xf.to(torch.bfloat16)
    return x, idx.contiguous(), w.contiguous()


def _rows_value(seed: int, rank: int, src: int, t: int, width: int, salt: int = 0,
               spread: bool = False) -> torch.Tensor:
    """A bf16 row a rank sends back for (src, t): deterministic, so the home rank can expect it.
    spread: half its elements +-2^26 (oracle.spread), so sums of such rows depend on their order."""
    key = ((seed * 97 + rank) * 131 + src) * 1009 + t * 7 + salt
    v = torch.randn(width, generator=torch.Generator().manual_seed(key)).to(torch.bfloat16)
    return O.spread(v, key + 1) if spread else v


def _weight_value(seed: int, rank: int, src: int, t: int, j: int) -> float:
    g = torch.Generator().manual_seed(((seed * 89 + rank) * 137 + src) * 997 + t * 11 + j)
    return float(torch.rand(1, generator=g))


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


# ------------------------------------------------------------------ the oracle (V2's documented semantics)
def oracle_dispatch(seed: int, R: int, me: int, scaleup: int, alignment: int, fp8: bool, max_tokens: int = MAXT):
    """What V2's dispatch gives rank ``me`` in deterministic order: rows by (source rank, token)."""
    L = E // R
    lo = me * L
    rows, x_rows, sf_rows, idx_rows, w_rows = [], [], [], [], []
    for src in range(R):
        x, idx, w = _inputs(seed, src, fp8)
        data, sf = x if fp8 else (x, None)
        for t in range(idx.shape[0]):
            local = [int(e) - lo if lo <= int(e) < lo + L else -1 for e in idx[t]]
            if any(v >= 0 for v in local):
                rows.append((src, t))
                x_rows.append(data[t])
                sf_rows.append(sf[t] if sf is not None else None)
                idx_rows.append(local)
                w_rows.append([float(w[t, j]) if local[j] >= 0 else 0.0 for j in range(K)])
    N = len(rows)
    counts = [sum(1 for r in idx_rows for v in r if v == e) for e in range(L)]
    aligned = [_align(c, alignment) for c in counts]
    starts = [sum(aligned[:e]) for e in range(L)]
    per_src = [sum(1 for s, _ in rows if s == src) for src in range(R)]
    per_scaleup = [sum(per_src[src] for src in range(R) if src % scaleup == u) for u in range(scaleup)]
    X = sum(aligned)
    slots = [[-1] * K for _ in range(N)]
    seen = [0] * L
    for i in range(N):
        for j in range(K):
            e = idx_rows[i][j]
            if e >= 0:
                slots[i][j] = starts[e] + seen[e]
                seen[e] += 1
    out = dict(rows=rows, N=N, L=L, counts=counts, aligned=aligned, X=X, slots=slots,
               psum_scaleup=[sum(per_scaleup[:u + 1]) for u in range(scaleup)],
               psum_expert=[sum(aligned[:e + 1]) for e in range(L)],
               psum_expert_expand=[starts[e] + counts[e] for e in range(L)],
               gidx=[src * max_tokens + t for src, t in rows],
               first_local=[src * K + min(j for j in range(K) if idx_rows[i][j] >= 0) for i, (src, _) in enumerate(rows)])
    dt = torch.float8_e4m3fn if fp8 else torch.bfloat16
    out["x"] = torch.stack(x_rows) if N else torch.empty(0, H, dtype=dt)
    out["sf"] = (torch.stack(sf_rows) if N else torch.empty(0, H // 128)) if fp8 else None
    out["idx"] = torch.tensor(idx_rows, dtype=torch.int64).view(N, K)
    out["w"] = torch.tensor(w_rows, dtype=torch.float32).view(N, K)
    ex = torch.zeros(X, H, dtype=dt)
    exw = torch.zeros(X)
    exsf = torch.zeros(X, H // 128) if fp8 else None
    full_w = [_inputs(seed, src, fp8)[2] for src in range(R)]
    for i, (src, t) in enumerate(rows):
        for j in range(K):
            s = slots[i][j]
            if s >= 0:
                ex[s] = out["x"][i]
                exw[s] = float(full_w[src][t, j])
                if fp8:
                    exsf[s] = out["sf"][i]
    out.update(ex=ex, exw=exw, exsf=exsf)
    return out


def oracle_combine(seed: int, R: int, me: int, expand: bool, bias, weights: bool, salt: int = 0, per_node: int = 0,
                   spread: bool = False, rank_order: bool = False):
    """V2's combine on rank ``me`` when every rank r sends back, for the row of (me, t), the value
    _rows_value(seed, r, me, t, spread=spread) (expand: per local expert e, _rows_value(..., salt=1 + e);
    summed in top-k order inside the rank, in float32, to bf16). Home sum: float32 from 0, the biases
    first (bias0 then bias1), then the ranks in the order of their last top-k slot; bf16 at the end.
    Hybrid (``per_node`` ranks per scaleup domain, several domains): each domain's ranks are first
    summed the same way (float32 from 0, last-slot order, to bf16), then the domains. rank_order: ranks
    and domains in ascending order instead (commlib on several nodes, docs/deep_ep.md). Weights: slot j
    from the rank owning it."""
    _, idx, _ = _inputs(seed, me)
    T = idx.shape[0]
    L = E // R
    out = torch.empty(T, H, dtype=torch.bfloat16)
    w_out = torch.zeros(T, K)
    for t in range(T):
        acc = torch.zeros(H)
        if bias is not None:
            for b in (bias if isinstance(bias, tuple) else (bias,)):
                acc = acc + b[t].float()
        owners = [int(e) // L if int(e) >= 0 else -1 for e in idx[t]]
        last = {r: (r if rank_order else j) for j, r in enumerate(owners) if r >= 0}

        def rank_part(r):
            if not expand:
                return _rows_value(seed, r, me, t, H, salt=salt, spread=spread)
            part = torch.zeros(H)
            for j in range(K):
                if owners[j] == r:
                    part += _rows_value(seed, r, me, t, H, salt=1 + int(idx[t, j]) + salt, spread=spread).float()
            return part.to(torch.bfloat16)

        if per_node and R > per_node:
            node_last = {}
            for r in sorted(last, key=last.get):
                node_last[r // per_node] = r // per_node if rank_order else last[r]
            for d in sorted(node_last, key=node_last.get):
                part = torch.zeros(H)
                for r in sorted((r for r in last if r // per_node == d), key=last.get):
                    part += rank_part(r).float()
                acc += part.to(torch.bfloat16).float()
        else:
            for r in sorted(last, key=last.get):
                acc += rank_part(r).float()
        out[t] = acc.to(torch.bfloat16)
        if weights:
            for j in range(K):
                if owners[j] >= 0:
                    w_out[t, j] = _weight_value(seed, owners[j], me, t, j)
    return out, w_out


def oracle_combine_single(seed: int, R: int, me: int, bias, spread: bool = False) -> torch.Tensor:
    """V2's expanded combine with allow_multiple_reduction=False on rank ``me`` (its reference with no
    reduction before home, as test_ep.py runs it for that mode), when every rank sends back, for the
    expanded row of (me, t, expert e), _rows_value(seed, rank, me, t, salt=1 + e, spread=spread): per
    token, float32 bias0 + bias1 (0 without a bias), then for each top-k slot in slot order the
    expanded row of that slot's expert as float32 (slots of -1 add nothing), bf16 once."""
    _, idx, _ = _inputs(seed, me)
    biases = () if bias is None else (bias if isinstance(bias, tuple) else (bias,))
    L = E // R
    out = torch.empty(idx.shape[0], H, dtype=torch.bfloat16)
    for t in range(idx.shape[0]):
        acc = torch.zeros(H)
        if biases:
            acc = biases[0][t].float() if len(biases) == 1 else biases[0][t].float() + biases[1][t].float()
        for j in range(K):
            e = int(idx[t, j])
            if e >= 0:
                acc = acc + _rows_value(seed, e // L, me, t, H, salt=1 + e, spread=spread).float()
        out[t] = acc.to(torch.bfloat16)
    return out


# ------------------------------------------------------------------ helpers
# Where the buffers run: the CPU suite uses the reference backend; tests/gpu/test_elastic_gpu.py sets
# DEVICE to the rank's GPU and BACKEND to None (auto: the NVLink engine) and runs the same cases.
DEVICE = torch.device("cpu")
BACKEND = "reference"


class _OnDevice:
    """An ElasticBuffer whose dispatch / combine take and return CPU tensors, moved to and from DEVICE
    (the oracle and the checks stay on the CPU). Handles and events pass through untouched."""

    def __init__(self, buf):
        self.buf = buf
        self._moved = {}

    def __getattr__(self, name):
        return getattr(self.buf, name)

    def on_device(self, t):
        if not isinstance(t, torch.Tensor) or t.device == DEVICE:
            return t
        hit = self._moved.get(id(t))
        if hit is None or hit[0] is not t:
            hit = self._moved[id(t)] = (t, t.to(DEVICE))
        return hit[1]

    def _in(self, v):
        return tuple(self.on_device(t) for t in v) if isinstance(v, tuple) else self.on_device(v)

    @staticmethod
    def _out(v):
        if isinstance(v, tuple):
            return tuple(_OnDevice._out(t) for t in v)
        return v.cpu() if isinstance(v, torch.Tensor) else v

    def dispatch(self, x, **kw):
        host_stats = kw.get("cumulative_local_expert_recv_stats")
        kw = {k: self._in(v) for k, v in kw.items()}
        out = self.buf.dispatch(self._in(x), **kw)
        self._wait(out[-1])  # before anything is read back: an async call's epilogue writes the stats too
        stats = kw.get("cumulative_local_expert_recv_stats")
        if stats is not None and stats is not host_stats:   # the device copy accumulated: bring it back
            host_stats.copy_(stats.cpu())
        return self._out(out[:3]) + out[3:]

    def combine(self, x, handle, **kw):
        kw = {k: self._in(v) for k, v in kw.items()}
        out = self.buf.combine(self._in(x), handle, **kw)
        self._wait(out[-1])
        return self._out(out[:2]) + out[2:]

    @staticmethod
    def _wait(event) -> None:
        """An async call's outputs are read here, before the caller waits: wait for them first."""
        if getattr(event, "event", None) is not None:
            event.current_stream_wait()


def _wrap(buf):
    return _OnDevice(buf)


def _buffer(ctx, **kw):
    kw.setdefault("num_max_tokens_per_rank", MAXT)
    kw.setdefault("hidden", H)
    kw.setdefault("num_topk", K)
    return _wrap(deep_ep.ElasticBuffer(ctx.group, explicitly_destroy=True, backend=BACKEND, **kw))


def _eq(name, got, want):
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
    assert tuple(got.shape) == tuple(want.shape), f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if got.dtype == torch.float8_e4m3fn:
        got, want = got.view(torch.uint8), want.view(torch.uint8)
    assert torch.equal(got, want), f"{name} differs:\n{got}\nexpected\n{want}"


def _combine_input(seed, R, me, handle, expand, salt=0, spread=False):
    """The rows a rank sends back, built from the handle's metadata (source global index, slots)."""
    meta = handle.recv_src_metadata
    n = int(handle.psum_num_recv_tokens_per_scaleup_rank[-1])
    rows = handle.num_expanded_tokens if expand else meta.shape[0]
    y = torch.full((rows, H), float("nan"), dtype=torch.bfloat16)  # unfilled rows must not matter
    w = torch.full((rows,) if expand else (rows, K), float("nan"))
    mt = handle.num_max_tokens_per_rank
    _, idx_me, _ = _inputs(seed, me)
    for i in range(n):
        src, t = divmod(int(meta[i, 0]), mt)
        if expand:
            _, idx, _ = _inputs(seed, src)
            for j in range(K):
                s = int(meta[i, 2 + j])
                if s >= 0:
                    y[s] = _rows_value(seed, me, src, t, H, salt=1 + int(idx[t, j]) + salt, spread=spread)
                    w[s] = _weight_value(seed, me, src, t, j)
        else:
            y[i] = _rows_value(seed, me, src, t, H, salt=salt, spread=spread)
            for j in range(K):
                w[i, j] = _weight_value(seed, me, src, t, j)
    return y, w


# ------------------------------------------------------------------ API surface
V2_INIT = ["group", "num_bytes", "num_cpu_bytes", "num_max_tokens_per_rank", "hidden", "num_topk",
           "use_fp8_dispatch", "deterministic", "allow_hybrid_mode", "allow_multiple_reduction",
           "prefer_overlap_with_compute", "sl_idx", "num_allocated_qps", "num_cpu_timeout_secs",
           "num_gpu_timeout_secs", "explicitly_destroy"]
V2_DISPATCH = ["x", "topk_idx", "topk_weights", "cumulative_local_expert_recv_stats", "num_experts",
               "num_max_tokens_per_rank", "expert_alignment", "num_sms", "num_qps", "previous_event",
               "previous_event_before_epilogue", "async_with_compute_stream", "allocate_on_comm_stream", "handle",
               "do_handle_copy", "do_cpu_sync", "do_expand", "do_zero_padding", "use_tma_aligned_col_major_sf"]
V2_COMBINE = ["x", "handle", "topk_weights", "bias", "num_sms", "num_qps", "previous_event",
              "previous_event_before_epilogue", "async_with_compute_stream", "allocate_on_comm_stream"]
V2_HANDLE = ["do_expand", "num_experts", "expert_alignment", "num_max_tokens_per_rank", "num_sms", "topk_idx",
             "psum_num_recv_tokens_per_scaleup_rank", "psum_num_recv_tokens_per_expert",
             "num_recv_tokens_per_expert_list", "num_unaligned_recv_tokens_per_expert", "recv_src_metadata",
             "dst_buffer_slot_idx", "token_metadata_at_forward", "channel_linked_list", "num_recv_tokens",
             "num_expanded_tokens"]


def case_surface(ctx):
    R, me = ctx.world_size, ctx.rank
    import commlib
    assert deep_ep.ElasticBuffer is commlib.ElasticBuffer and deep_ep.EPHandle is commlib.EPHandle
    for fn, names in ((deep_ep.ElasticBuffer.__init__, V2_INIT), (deep_ep.ElasticBuffer.dispatch, V2_DISPATCH),
                      (deep_ep.ElasticBuffer.combine, V2_COMBINE)):
        params = list(inspect.signature(fn).parameters)[1:]
        assert params[:len(names)] == names, (fn.__name__, params)
    hint = deep_ep.ElasticBuffer.get_buffer_size_hint(ctx.group, MAXT, H, num_topk=K)
    assert hint > 0 and hint % (2 << 20) == 0
    # the size does not depend on the token bound: rings stream any count
    assert hint == deep_ep.ElasticBuffer.get_buffer_size_hint(ctx.group, 8 * MAXT, H, num_topk=K)
    buf = _buffer(ctx)
    assert buf.num_bytes >= hint and buf.group is ctx.group and buf.num_max_tokens_per_rank == MAXT
    assert buf.rank_idx == me and buf.num_ranks == R
    P = ctx.ranks_per_node
    assert buf.get_physical_domain_size() == (R // P, P)
    assert buf.get_logical_domain_size() == (R // P, P)
    assert (buf.scaleout_rank_idx, buf.scaleup_rank_idx) == divmod(me, P)
    direct = _buffer(ctx, allow_hybrid_mode=False)
    assert direct.get_logical_domain_size() == (1, R) and direct.scaleup_rank_idx == me
    # SM / QP helpers: V2's model's properties, and its QP formula
    for b in (buf, direct):
        n = b.get_theoretical_num_sms(E, K)
        device_sms = (torch.cuda.get_device_properties(DEVICE).multi_processor_count if DEVICE.type == "cuda"
                      else DEFAULT_NUM_DEVICE_SMS)
        assert n % 2 == 0 and 4 <= n <= device_sms, n
        assert b.get_theoretical_num_sms(E, K) == n  # remembered
        assert b.get_theoretical_num_qps(n) == min(n * 16 + 1 if b.allow_hybrid_mode else min(n, 9), b.num_allocated_qps)
    busy = _buffer(ctx, prefer_overlap_with_compute=False)
    assert busy.get_theoretical_num_sms(E, K) >= 64
    assert buf.num_allocated_qps == 129 and direct.num_allocated_qps == 17
    # V2's size hints for its experimental primitives; the primitives themselves are refused
    assert deep_ep.ElasticBuffer.get_pp_buffer_size_hint(100, 3) == 2 << 20
    assert deep_ep.ElasticBuffer.get_engram_storage_size_hint(10, 7168, 4) == (2 << 20, 2 << 20)
    assert deep_ep.ElasticBuffer.get_agrs_num_max_session_bytes(ctx.group, (3, 5), torch.bfloat16) == \
        _align(R * 30, 32)
    for name, args in (("engram_fetch", (None,)), ("pp_send", (None, 0)), ("all_gather", (None,))):
        expect_raises(NotImplementedError, ["not served"], lambda: getattr(buf, name)(*args))
    assert buf.capture().__class__.__name__ == "EventHandle"
    assert (buf.get_comm_stream() is None) == (DEVICE.type == "cpu")
    buf.barrier(with_cpu_sync=True)
    for b in (buf, direct, busy):
        b.destroy()
    implicit = deep_ep.ElasticBuffer(ctx.group, num_max_tokens_per_rank=MAXT, hidden=H, backend=BACKEND)
    expect_raises(RuntimeError, ["explicitly_destroy"], implicit.destroy)


def case_errors(ctx):
    R, me = ctx.world_size, ctx.rank
    buf = _buffer(ctx)
    x, idx, w = _inputs(1, me)
    recv = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)
    h = recv[3]
    expect_raises(ValueError, ["topk_idx=None"], lambda: buf.dispatch(x, topk_idx=idx, handle=h))
    expect_raises(ValueError, ["CPU sync"], lambda: buf.dispatch(x, handle=h, do_cpu_sync=True))
    expect_raises(ValueError, ["do_zero_padding"], lambda: buf.dispatch(x, topk_idx=idx, num_experts=E, do_zero_padding=True))
    expect_raises(ValueError, ["num_experts"], lambda: buf.dispatch(x, topk_idx=idx))
    expect_raises(ValueError, ["num_max_tokens_per_rank", str(x.shape[0])],
                  lambda: buf.dispatch(x, topk_idx=idx, num_experts=E, num_max_tokens_per_rank=x.shape[0] - 1))
    expect_raises(ValueError, ["num_qps", "num_allocated_qps"],
                  lambda: buf.dispatch(x, topk_idx=idx, num_experts=E, num_qps=buf.num_allocated_qps + 1))
    expect_raises(ValueError, ["allocate_on_comm_stream"],
                  lambda: buf.dispatch(x, topk_idx=idx, num_experts=E, previous_event=buf.capture()))
    expect_raises(ValueError, ["do_expand"], lambda: buf.dispatch(x, handle=h, do_expand=True))
    expect_raises(ValueError, ["cumulative_local_expert_recv_stats"],
                  lambda: buf.dispatch(x, handle=h, cumulative_local_expert_recv_stats=torch.zeros(E // R, dtype=torch.int32)))
    expect_raises(ValueError, ["differ"], lambda: buf.dispatch(x, handle=h, expert_alignment=4))
    expect_raises(TypeError, ["EPHandle"], lambda: buf.combine(recv[0], handle=object()))
    expect_raises(ValueError, ["rows"], lambda: buf.combine(torch.zeros(h.num_recv_tokens + 1, H, dtype=torch.bfloat16), h))
    other = _buffer(ctx)
    expect_raises(ValueError, ["another ElasticBuffer"], lambda: other.combine(recv[0], h))
    expect_raises(ValueError, ["num_bytes"], lambda: deep_ep.ElasticBuffer(ctx.group, backend=BACKEND))
    # every rank refused the same calls before any collective: the world is still in step
    buf.combine(recv[0], h)
    other.destroy()
    buf.destroy()


def case_capture_error(ctx):
    """An ElasticBuffer, or a v1 Buffer, built inside a CUDA graph capture: a clear error naming the
    rank and the class, raised before any collective (the capture is faked: the CPU has none)."""
    real = (torch.cuda.is_available, torch.cuda.is_current_stream_capturing)
    torch.cuda.is_available = lambda: True
    torch.cuda.is_current_stream_capturing = lambda: True
    try:
        expect_raises(RuntimeError, ["CUDA graph capture", f"rank {ctx.rank}] ElasticBuffer", "before torch.cuda.graph"],
                      lambda: _buffer(ctx))
        expect_raises(RuntimeError, ["CUDA graph capture", f"rank {ctx.rank}] Buffer", "before torch.cuda.graph"],
                      lambda: deep_ep.Buffer(ctx.group, 1 << 20, 0, backend=BACKEND))
    finally:
        torch.cuda.is_available, torch.cuda.is_current_stream_capturing = real
    # nobody entered a collective: the next constructions pair up
    _buffer(ctx).destroy()
    deep_ep.Buffer(ctx.group, 1 << 20, 0, backend=BACKEND, explicitly_destroy=True).destroy()


# ------------------------------------------------------------------ the modes, against the oracle
def _check_dispatch(tag, o, out, expand, cpu_sync, fp8, alignment, R, with_w=True):
    recv_x, recv_idx, recv_w, h, _ = out
    N, X = o["N"], o["X"]
    data, sf = recv_x if fp8 else (recv_x, None)
    n_alloc = N if cpu_sync else R * MAXT
    L = o["L"]
    x_alloc = X if cpu_sync else _align(R * MAXT * min(K, L) + (alignment - 1) * L, alignment)
    assert h.num_recv_tokens == n_alloc and h.recv_src_metadata.shape == (n_alloc, K + 2), tag
    assert h.psum_num_recv_tokens_per_scaleup_rank.tolist() == o["psum_scaleup"], tag
    assert h.recv_src_metadata[:N, 0].tolist() == o["gidx"], tag
    assert h.recv_src_metadata[:N, 1].tolist() == o["first_local"], tag
    assert h.num_recv_tokens_per_expert_list == (o["aligned"] if cpu_sync else []), tag
    if expand:
        assert recv_idx is None and h.num_expanded_tokens == x_alloc, tag
        assert h.recv_src_metadata[:N, 2:].tolist() == o["slots"], tag
        assert h.psum_num_recv_tokens_per_expert.tolist() == o["psum_expert_expand"], tag
        assert h.num_unaligned_recv_tokens_per_expert.tolist() == o["counts"], tag
        filled = torch.zeros(x_alloc, dtype=torch.bool)
        for row in o["slots"]:
            for s in row:
                if s >= 0:
                    filled[s] = True
        assert data.shape == (x_alloc, H), tag
        _eq(tag + " expanded x", data[:X][filled[:X]], o["ex"][filled[:X]])
        if fp8:
            _eq(tag + " expanded sf", sf[:X][filled[:X]], o["exsf"][filled[:X]])
        if with_w:
            _eq(tag + " expanded w", recv_w[:X][filled[:X]], o["exw"][filled[:X]])
        return filled
    assert data.shape == (n_alloc, H), tag
    _eq(tag + " x", data[:N], o["x"])
    if fp8:
        _eq(tag + " sf", sf[:N], o["sf"])
    _eq(tag + " topk_idx", recv_idx[:N], o["idx"])
    if with_w:
        _eq(tag + " w (local slots)", recv_w[:N], o["w"])
    assert h.psum_num_recv_tokens_per_expert.tolist() == o["psum_expert"], tag
    assert (h.recv_src_metadata[:N, 2:] == -1).all(), tag
    return None


def case_modes(ctx):
    R, me = ctx.world_size, ctx.rank
    P = ctx.ranks_per_node
    buf = _buffer(ctx)
    seed = 5
    bias_cycle = itertools.cycle([0, 1, 2])
    for cpu_sync, expand, alignment, fp8 in itertools.product((True, False), (False, True), (1, 4), (False, True)):
        tag = f"cpu_sync={cpu_sync} expand={expand} alignment={alignment} fp8={fp8}"
        x, idx, w = _inputs(seed, me, fp8)
        o = oracle_dispatch(seed, R, me, P, alignment, fp8)
        out = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E, expert_alignment=alignment,
                           do_cpu_sync=cpu_sync, do_expand=expand, do_zero_padding=expand and alignment > 1)
        filled = _check_dispatch(tag, o, out, expand, cpu_sync, fp8, alignment, R)
        h = out[3]
        if expand and alignment > 1:  # do_zero_padding: the alignment gaps (every unfilled row) are zero
            data = out[0][0] if fp8 else out[0]
            assert (data[:o["X"]][~filled[:o["X"]]].float() == 0).all(), tag
            assert (out[2][:o["X"]][~filled[:o["X"]]] == 0).all(), tag
        # cached: same rows, same handle object, no weights unless given
        cached = buf.dispatch(x, handle=h, do_expand=expand)
        assert cached[3] is h and cached[2] is None, tag
        _check_dispatch(tag + " cached", o, cached, expand, cpu_sync, fp8, alignment, R, with_w=False)
        cached_w = buf.dispatch(x, handle=h, topk_weights=w, do_expand=expand)
        _check_dispatch(tag + " cached+w", o, cached_w, expand, cpu_sync, fp8, alignment, R)
        # combine: bias 0 / 1 / 2, weights back per slot
        nb = next(bias_cycle)
        g = torch.Generator().manual_seed(100 + me)
        T = idx.shape[0]
        bias = None if nb == 0 else (torch.randn(T, H, generator=g).to(torch.bfloat16) if nb == 1 else
                                      tuple(torch.randn(T, H, generator=g).to(torch.bfloat16) for _ in range(2)))
        y, yw = _combine_input(seed, R, me, h, expand)
        combined, combined_w, _ = buf.combine(y, h, topk_weights=yw, bias=bias)
        want, want_w = oracle_combine(seed, R, me, expand, bias, True, per_node=P)
        _eq(tag + f" combined bias={nb}", combined, want)
        _eq(tag + " combined w", combined_w, want_w)
        no_w = buf.combine(y, h)
        assert no_w[1] is None and torch.equal(no_w[0], oracle_combine(seed, R, me, expand, None, False, per_node=P)[0]), tag
    buf.destroy()


def case_sum_order(ctx):
    """The summation order, where the bits show it: rows and biases half +-2^26 (oracle.spread), top-k
    ids with repeated ranks, bias 0 / 1 / 2, both layouts, bit for bit (torch.equal) against the oracle:
    biases first, then V2's last-slot order on one node; on several nodes rank order (node, then rail:
    docs/deep_ep.md)."""
    R, me = ctx.world_size, ctx.rank
    P = ctx.ranks_per_node
    buf = _buffer(ctx)
    seed = 11
    x, idx, w = _inputs(seed, me)
    owners = torch.where(idx >= 0, idx // (E // R), -1)
    assert any(len(set(o.tolist()) - {-1}) < int((o >= 0).sum()) for o in owners), "no token repeats a rank"
    T = idx.shape[0]
    g = torch.Generator().manual_seed(200 + me)
    biases = [O.spread(torch.randn(T, H, generator=g).to(torch.bfloat16), 300 + 2 * me + i) for i in range(2)]
    for expand in (False, True):
        h = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E, do_expand=expand)[3]
        y, yw = _combine_input(seed, R, me, h, expand, spread=True)
        for nb in (0, 1, 2):
            bias = None if nb == 0 else (biases[0] if nb == 1 else tuple(biases))
            got, got_w, _ = buf.combine(y, h, topk_weights=yw, bias=bias)
            want, want_w = oracle_combine(seed, R, me, expand, bias, True, per_node=P, spread=True,
                                          rank_order=R > P)
            _eq(f"expand={expand} bias={nb} combined", got, want)
            _eq(f"expand={expand} bias={nb} combined w", got_w, want_w)
    buf.destroy()


def case_nomr(ctx):
    """allow_multiple_reduction=False: the expanded combine adds every expanded row once, at home, after
    the biases, in top-k slot order (oracle_combine_single), bit for bit with rows whose sums show their
    order (oracle.spread), on every topology; CPU sync or not, alignment 1 / 4, bias 0 / 1 / 2, fewer
    rows than the handle holds; expanded topk_weights refused. The non-expanded combine is the one of
    allow_multiple_reduction=True."""
    R, me = ctx.world_size, ctx.rank
    P = ctx.ranks_per_node
    buf = _buffer(ctx, allow_multiple_reduction=False)
    seed = 13
    x, idx, w = _inputs(seed, me)
    owners = torch.where(idx >= 0, idx // (E // R), -1)
    assert any(len(set(o.tolist()) - {-1}) < int((o >= 0).sum()) for o in owners), "no rank holds two slots of a token"
    assert (idx < 0).any() and (idx >= 0).all(1).any(), "want tokens with and without empty slots"
    T = idx.shape[0]
    g = torch.Generator().manual_seed(400 + me)
    biases = [O.spread(torch.randn(T, H, generator=g).to(torch.bfloat16), 500 + 2 * me + i) for i in range(2)]
    for cpu_sync, alignment in ((True, 1), (False, 4)):
        tag = f"cpu_sync={cpu_sync} alignment={alignment}"
        h = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E, expert_alignment=alignment,
                         do_cpu_sync=cpu_sync, do_expand=True)[3]
        y, yw = _combine_input(seed, R, me, h, True, spread=True)
        for nb in (0, 1, 2):
            bias = None if nb == 0 else (biases[0] if nb == 1 else tuple(biases))
            got, got_w, _ = buf.combine(y, h, bias=bias)
            assert got_w is None, tag
            _eq(f"{tag} bias={nb} combined", got, oracle_combine_single(seed, R, me, bias, spread=True))
        n = int(h.psum_num_recv_tokens_per_expert[-1])  # the filled rows' end (SGLang passes no more)
        _eq(f"{tag} {n} rows", buf.combine(y[:n].contiguous(), h)[0], oracle_combine_single(seed, R, me, None, spread=True))
        expect_raises(ValueError, [f"rank {me}]", "topk_weights must be None", "allow_multiple_reduction=False"],
                      lambda: buf.combine(y, h, topk_weights=yw))
        expect_raises(ValueError, [f"rank {me}]", "bias[1]", f"[{T}, {H}]"],
                      lambda: buf.combine(y, h, bias=(biases[0], biases[1][:-1])))
    # not expanded: the same sum as with allow_multiple_reduction=True (weights come back too)
    h = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E)[3]
    y, yw = _combine_input(seed, R, me, h, False, spread=True)
    got, got_w, _ = buf.combine(y, h, topk_weights=yw, bias=tuple(biases))
    want, want_w = oracle_combine(seed, R, me, False, tuple(biases), True, per_node=P, spread=True, rank_order=R > P)
    _eq("not expanded combined", got, want)
    _eq("not expanded combined w", got_w, want_w)
    buf.destroy()


def case_handle_copy(ctx):
    R, me = ctx.world_size, ctx.rank
    buf = _buffer(ctx)
    x, idx, w = _inputs(7, me)
    for copy in (True, False):
        h = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E, do_handle_copy=copy)[3]
        assert (h.topk_idx.data_ptr() != buf.on_device(idx).data_ptr()) == copy
        assert torch.equal(h.topk_idx.cpu(), idx)
        again = buf.dispatch(x, handle=h)[3]
        assert again is h and again.topk_idx.data_ptr() == h.topk_idx.data_ptr()
        # the slot each token landed in on its destination rank, -1 for empty slots
        assert h.dst_buffer_slot_idx.shape == (x.shape[0], K)
        assert ((h.dst_buffer_slot_idx.cpu() >= 0) == (idx >= 0)).all()
    # V2's attributes are all there
    for name in V2_HANDLE:
        assert hasattr(h, name), name
    # the dispatch's SM count is the combine's default; stats count real (unaligned) tokens
    stats = torch.zeros(E // R, dtype=torch.int32)
    out = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E, num_sms=6, expert_alignment=4,
                       cumulative_local_expert_recv_stats=stats)
    assert out[3].num_sms == 6
    o = oracle_dispatch(7, R, me, ctx.ranks_per_node, 4, False)
    assert stats.tolist() == o["counts"]
    buf.dispatch(x, topk_idx=idx, num_experts=E, cumulative_local_expert_recv_stats=stats)
    assert stats.tolist() == [2 * c for c in o["counts"]]
    assert buf.dispatch(x, topk_idx=idx, num_experts=E)[3].num_sms == buf.get_theoretical_num_sms(E, K)
    buf.destroy()
    # direct mode (allow_hybrid_mode=False): one scaleup domain of all R ranks
    direct = _buffer(ctx, allow_hybrid_mode=False)
    h = direct.dispatch(x, topk_idx=idx, num_experts=E)[3]
    assert h.psum_num_recv_tokens_per_scaleup_rank.tolist() == oracle_dispatch(7, R, me, R, 1, False)["psum_scaleup"]
    direct.destroy()


def case_layouts(ctx):
    """TMA-aligned column-major scales; combine of fewer rows than the handle holds (SGLang slices)."""
    R, me = ctx.world_size, ctx.rank
    buf = _buffer(ctx, use_fp8_dispatch=True)
    x, idx, w = _inputs(9, me, fp8=True)
    o = oracle_dispatch(9, R, me, ctx.ranks_per_node, 1, True)
    for expand in (False, True):
        raw = buf.buf.dispatch(buf._in(x), topk_idx=buf.on_device(idx), topk_weights=buf.on_device(w), num_experts=E,
                               do_expand=expand, use_tma_aligned_col_major_sf=True)
        sf = raw[0][1]  # the layout is checked where it was made (a copy to the CPU may repack it)
        rows = sf.shape[0]
        assert sf.stride() == (1, _align(rows, 4)), sf.stride()
        out = buf._out(raw[:3]) + raw[3:]
        _check_dispatch(f"tma expand={expand}", o, out, expand, True, True, 1, R)
    h = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=E, do_cpu_sync=False)[3]
    n = int(h.psum_num_recv_tokens_per_scaleup_rank[-1])
    y, _ = _combine_input(9, R, me, h, False)
    got = buf.combine(y[:n].contiguous(), h)[0]
    assert torch.equal(got, oracle_combine(9, R, me, False, None, False, per_node=ctx.ranks_per_node)[0])
    # num_max_tokens_per_rank per call (vLLM rounds its batch up to a power of two): worst-case rows follow it
    for mt in (x[0].shape[0], 32, 64):
        h = buf.dispatch(x, topk_idx=idx, num_experts=E, num_max_tokens_per_rank=max(mt, 16), do_cpu_sync=False)[3]
        assert h.num_recv_tokens == R * max(mt, 16) and h.num_max_tokens_per_rank == max(mt, 16)
    buf.destroy()


# ------------------------------------------------------------------ clients, as their sources call it
def case_vllm(ctx):
    """vLLM's DeepEPV2All2AllManager + DeepEPV2PrepareAndFinalize: decode (no expand, no CPU sync,
    power-of-two token bound, padding rows masked through the scaleup psum) and prefill (expand + CPU
    sync, expert ids rebuilt from the per-expert list); finalize combines without weights,
    async_with_compute_stream and allocate_on_comm_stream together and no previous_event."""
    R, me = ctx.world_size, ctx.rank
    kwargs = dict(group=ctx.group, num_max_tokens_per_rank=MAXT, hidden=H, num_topk=K, use_fp8_dispatch=False,
                  allow_hybrid_mode=True, prefer_overlap_with_compute=True, allow_multiple_reduction=True,
                  explicitly_destroy=True)
    buffer = _wrap(deep_ep.ElasticBuffer(**kwargs, backend=BACKEND))
    num_sms = buffer.get_theoretical_num_sms(num_experts=E, num_topk=K)
    assert num_sms >= 4
    L = E // R
    offset = me * L
    seed = 21
    x, idx, w = _inputs(seed, me)
    for use_cudagraph in (True, False):
        n = max(_inputs(seed, r)[0].shape[0] for r in range(R))
        bound = min(1 << max(n - 1, 0).bit_length(), MAXT) if use_cudagraph else None
        recv_x, recv_idx, recv_w, handle, event = buffer.dispatch(
            x=x, topk_idx=idx, topk_weights=w, num_experts=E, num_max_tokens_per_rank=bound,
            do_expand=not use_cudagraph, do_cpu_sync=not use_cudagraph, async_with_compute_stream=False)
        if event.event is not None:
            event.current_stream_wait()
        counts = handle.num_recv_tokens_per_expert_list
        o = oracle_dispatch(seed, R, me, ctx.ranks_per_node, 1, False, max_tokens=bound or MAXT)
        if recv_idx is None:  # prefill: expert ids from the per-expert counts
            assert counts == o["counts"]
            ids = torch.repeat_interleave(torch.arange(L) + offset, torch.tensor(counts), output_size=sum(counts))
            ids = ids.unsqueeze(1)
            assert recv_w.ndim == 1
            recv_w = recv_w.unsqueeze(1)
            # the experts: scale each row by (1 + global expert id), weights applied before combine
            expert_out = (recv_x.float() * (1 + ids.float()) * recv_w).to(torch.bfloat16)
        else:  # decode: globalize local ids; rows past the received count are padding
            assert counts == []
            num_recv = int(handle.psum_num_recv_tokens_per_scaleup_rank[-1])  # vLLM reads it on the device
            rows = torch.arange(recv_idx.shape[0]).unsqueeze(1)
            ids = torch.where((recv_idx >= 0) & (rows < num_recv), recv_idx + offset, torch.full_like(recv_idx, -1))
            wk = torch.where(ids >= 0, recv_w, torch.zeros_like(recv_w))
            expert_out = torch.zeros(recv_x.shape, dtype=torch.float32)
            for j in range(K):
                expert_out += recv_x.float() * (1 + ids[:, j:j + 1].clamp(min=0).float()) * wk[:, j:j + 1]
            expert_out = expert_out.to(torch.bfloat16)
        output = torch.empty(x.shape, dtype=torch.bfloat16)
        combined_x, _, event = buffer.combine(x=expert_out, handle=handle, topk_weights=None,
                                              async_with_compute_stream=True, allocate_on_comm_stream=True)
        if event.event is not None:
            event.current_stream_wait()
        output.copy_(combined_x, non_blocking=True)
        # the MoE output, computed at home in float64: sum over slots of weight * (1 + expert) * x
        want = torch.zeros(x.shape, dtype=torch.float64)
        for j in range(K):
            sel = (idx[:, j] >= 0).double().unsqueeze(1)
            want += sel * w[:, j:j + 1].double() * (1 + idx[:, j:j + 1].clamp(min=0).double()) * x.double()
        assert torch.allclose(output.double(), want, rtol=3e-2, atol=3e-2 * want.abs().max().item()), use_cudagraph
    buffer.destroy()


def case_sglang(ctx):
    """SGLang's DeepEPv2Dispatcher: buffer with sl_idx=0 and prefer_overlap_with_compute=False; SM and
    QP counts from the helpers; extend (non-expand, CPU sync, slice to psum[-1], per-expert list) and
    decode (expand, no CPU sync, alignment 128); an empty batch padded to one dummy token."""
    R, me = ctx.world_size, ctx.rank
    buffer = deep_ep.ElasticBuffer(ctx.group, num_max_tokens_per_rank=MAXT, hidden=H, num_topk=K,
                                   use_fp8_dispatch=False, allow_hybrid_mode=True, sl_idx=0,
                                   prefer_overlap_with_compute=False, backend=BACKEND)
    buffer = _wrap(buffer)
    assert buffer.num_bytes > 0
    num_sms = buffer.get_theoretical_num_sms(E, K)
    num_qps = buffer.get_theoretical_num_qps(num_sms)
    seed = 31
    for expand in (False, True):
        for empty in (False, True):
            x, idx, w = _inputs(seed, me, T=0 if (empty and me == 0) else None)
            if x.shape[0] == 0 and not expand:  # the dispatcher's padding of an idle rank
                x = x.new_zeros((1, H))
                idx = torch.arange(K, dtype=torch.int64).unsqueeze(0)
                w = w.new_zeros((1, K))
            alignment = 128 if expand else 1
            recv_x, recv_idx, recv_w, handle, event = buffer.dispatch(
                x, topk_idx=idx, topk_weights=w, num_experts=E, num_max_tokens_per_rank=MAXT,
                expert_alignment=alignment, num_sms=num_sms, num_qps=num_qps, use_tma_aligned_col_major_sf=False,
                do_cpu_sync=not expand, do_expand=expand)
            if event.event is not None:
                event.current_stream_wait()
            if expand:
                hidden, topk_w = recv_x, None      # weights applied by the masked GEMM before combine
                hidden = (recv_x.float() * 2).to(torch.bfloat16)
            else:
                n = int(handle.psum_num_recv_tokens_per_scaleup_rank[-1].item())
                hidden = (recv_x[:n].float() * 2).to(torch.bfloat16)
                topk_w = recv_w[:n]
                assert list(handle.num_recv_tokens_per_expert_list) == handle.num_recv_tokens_per_expert_list
            combined_x, _, event = buffer.combine(hidden, handle=handle, topk_weights=topk_w, num_sms=num_sms,
                                                  num_qps=num_qps)
            if event.event is not None:
                event.current_stream_wait()
            if empty and me == 0 and not expand:
                combined_x = combined_x[:0]
            # each rank returns 2 x per expert slot it holds (expand) or per rank it holds (non-expand)
            L = E // R
            owners = torch.where(idx >= 0, idx // L, torch.full_like(idx, -1))
            if expand:
                hits = (idx >= 0).sum(1, keepdim=True)
            else:
                hits = torch.stack([(owners == r).any(1) for r in range(R)], 1).sum(1, keepdim=True)
            want = (x.float() * 2 * hits).to(torch.bfloat16)[:combined_x.shape[0]]
            assert torch.allclose(combined_x.float(), want.float(), rtol=2e-2, atol=1e-2), (expand, empty)
    del buffer  # SGLang drops its reference (it builds the buffer without explicitly_destroy)


def case_megatron(ctx):
    """Megatron-Core's _DeepepV2Manager through fused_a2a: get_elastic_buffer's reuse test (group,
    num_bytes vs the size hint, num_max_tokens_per_rank), dispatch with expert_alignment=1 and
    num_sms=0, tokens_per_expert from the list, combine; backward: dispatch's is a combine with the
    probs' gradient as topk_weights, combine's a cached dispatch. previous_event only when async and
    allocating on the comm stream, as its autograd functions pass it."""
    R, me = ctx.world_size, ctx.rank
    try:
        from megatron.core.transformer.moe import fused_a2a
    except ImportError:
        fused_a2a = None
    if fused_a2a is not None and getattr(fused_a2a, "HAVE_DEEP_EP_V2", False):
        fused_a2a._elastic_buffer = None
        buf = fused_a2a.get_elastic_buffer(ctx.group, num_max_tokens_per_rank=MAXT, hidden=H, num_topk=K)
        assert fused_a2a.get_elastic_buffer(ctx.group, MAXT, H, K) is buf
        x, idx, w = (t.to(DEVICE) for t in _inputs(40, me))
        recv_x, _, _, tokens_per_expert, handle = fused_a2a.deepepv2_dispatch(buf, x, idx, w, E, MAXT)
        out, _ = fused_a2a.deepepv2_combine(buf, recv_x, handle)
        owners = torch.where(idx >= 0, idx // (E // R), torch.full_like(idx, -1))
        hits = torch.stack([(owners == r).any(1) for r in range(R)], 1).sum(1, keepdim=True)
        assert torch.allclose(out.float(), x.float() * hits, rtol=2e-2, atol=2e-2)
        fused_a2a._elastic_buffer = None
    seed = 41
    x, idx, w = _inputs(seed, me)
    T = x.shape[0]
    hint = deep_ep.ElasticBuffer.get_buffer_size_hint(ctx.group, num_max_tokens_per_rank=T, hidden=H, num_topk=K)
    buffer = deep_ep.ElasticBuffer(ctx.group, num_bytes=hint, num_max_tokens_per_rank=T, hidden=H, num_topk=K,
                                   backend=BACKEND)
    buffer = _wrap(buffer)
    # get_elastic_buffer keeps the buffer while it is big enough
    assert buffer.group == ctx.group and buffer.num_bytes >= hint and buffer.num_max_tokens_per_rank >= T
    bound = max(_inputs(seed, r)[0].shape[0] for r in range(R))  # the ranks agree on the bound
    for async_finish, allocate in ((False, False), (True, True)):
        prev = buffer.capture() if async_finish and allocate else None
        recv_x, recv_idx, recv_probs, handle, event = buffer.dispatch(
            x, topk_idx=idx, topk_weights=w, num_experts=E, num_max_tokens_per_rank=bound, expert_alignment=1,
            num_sms=0, previous_event=prev, async_with_compute_stream=async_finish, allocate_on_comm_stream=allocate)
        if async_finish:
            event.current_stream_wait()
        tokens_per_expert = torch.tensor(handle.num_recv_tokens_per_expert_list)
        o = oracle_dispatch(seed, R, me, ctx.ranks_per_node, 1, False, max_tokens=bound)
        assert tokens_per_expert.tolist() == o["counts"]
        _eq("megatron probs", recv_probs, o["w"])
        # combine forward
        prev = buffer.capture() if async_finish and allocate else None
        combined, combined_probs, event = buffer.combine(recv_x, handle=handle, num_sms=0, previous_event=prev,
                                                         async_with_compute_stream=async_finish,
                                                         allocate_on_comm_stream=allocate)
        if async_finish:
            event.current_stream_wait()
        assert combined_probs is None
        L = E // R
        owners = torch.where(idx >= 0, idx // L, torch.full_like(idx, -1))
        hits = torch.stack([(owners == r).any(1) for r in range(R)], 1).sum(1, keepdim=True)
        assert torch.allclose(combined.float(), (x.float() * hits), rtol=2e-2, atol=2e-2)
        # combine backward: a cached dispatch of the output gradient
        grad_x, _, _, _, event = buffer.dispatch(combined.contiguous(), handle=handle, num_sms=handle.num_sms,
                                                 previous_event=buffer.capture() if async_finish else None,
                                                 async_with_compute_stream=async_finish,
                                                 allocate_on_comm_stream=async_finish)
        if async_finish:
            event.current_stream_wait()
        assert grad_x.shape == recv_x.shape
        # dispatch backward: a combine with the probs' gradient; each slot's comes back from its owner
        grad_probs_in = recv_probs * 3
        gx, grad_probs, event = buffer.combine(recv_x.contiguous(), handle=handle, topk_weights=grad_probs_in.float(),
                                               num_sms=handle.num_sms)
        assert torch.equal(grad_probs, torch.where(idx >= 0, w * 3, torch.zeros_like(w)))
