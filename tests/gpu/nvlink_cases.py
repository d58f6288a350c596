"""NVLink engine cases, run inside spawned GPU worlds (tests/worlds.py runs ``case_<name>(ctx)``).

Every case makes the same calls through two Buffers of the same world, one on the nvlink backend
and one forced to the reference backend (the executable specification), and compares every output
bit for bit (raw bytes: FP8 rows and scales are moved, never converted, so they are exact too).
Each rank draws only its own inputs (seeded by case and rank).
"""
from __future__ import annotations

import os
import time

import oracle as O
import torch
import torch.distributed as dist

from commlib.cuda import loader as commlib_kernels
from commlib import routing
from commlib.buffer import Buffer
from commlib.config import Config
from commlib.fp8 import per_token_cast_back, per_token_cast_to_fp8
from commlib.utils.timing import capture_graph

_BUFFERS: dict = {}  # per process: Buffers are built once per world (creation is collective)

# Test harness knob (not a library setting): run every case under another kernel build, e.g.
# COMMLIB_TEST_KERNEL_VARIANT="LOCAL_IN_RECEIVER=1,DISPATCH_THREADS=1024" (keys: commlib.cuda.loader.DEFAULT_VARIANT).
_VARIANT = os.environ.get("COMMLIB_TEST_KERNEL_VARIANT", "")
if _VARIANT:
    from commlib.cuda import loader as _K
    _K.set_variant({k: int(v) for k, v in (kv.split("=") for kv in _VARIANT.split(",") if kv)})


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------

# Every case's config fits this one (<= 20 SMs, <= 256 slots, rows <= 7168 bf16).
_SIZE_CFG = Config(20, 32, 256, 64, 1024)
_SIZE_HIDDEN_BYTES = 7168 * 2


# Ring cases: Buffers sized by the size hint of the largest config they run, nothing more.
_RING_CFGS = {"rings": (Config(24, 6, 256, 6, 128), 256 * 2), "rings_v3": (Config(24, 6, 256, 6, 128), 7168 * 2),
              "rings_tiny": (Config(20, 1, 8), 256 * 2)}


def buffers(ctx, key: str = "main"):
    """(nvlink Buffer, reference Buffer), built once per world and key."""
    if key not in _BUFFERS:
        cfg, hidden_bytes = _RING_CFGS.get(key, (_SIZE_CFG, _SIZE_HIDDEN_BYTES))
        nbytes = cfg.get_nvl_buffer_size_hint(hidden_bytes, ctx.world_size)
        nv = Buffer(ctx.group, nbytes, backend="nvlink", explicitly_destroy=True)
        ref = Buffer(ctx.group, nbytes, backend="reference", explicitly_destroy=True)
        assert nv.backend.name == "nvlink", nv.backend.name
        _BUFFERS[key] = (nv, ref)
    return _BUFFERS[key]


def raw(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.reshape(-1).view(torch.uint8) if t.numel() else t.reshape(-1).to(torch.uint8)


def dev_hash(t: torch.Tensor) -> torch.Tensor:
    """Position-weighted byte sum, on the device (one host sync per comparison, not per tensor)."""
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=t.device)
    b = t.contiguous().reshape(-1).view(torch.uint8).to(torch.int64)
    w = torch.arange(b.numel(), device=t.device, dtype=torch.int64) % 65521 + 1
    return (b * w).sum() * 7 + b.numel()


def check_same(got, want, what: str) -> None:
    if got is None or want is None:
        assert got is None and want is None, f"{what}: one side is None (nvlink {type(got)}, reference {type(want)})"
        return
    if isinstance(got, (list, tuple)) and not isinstance(got, torch.Tensor):
        assert list(got) == list(want), f"{what}: {got} != {want}"
        return
    assert tuple(got.shape) == tuple(want.shape), f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    if got.numel() == 0:
        return
    a, b = raw(got), raw(want)
    if not torch.equal(a, b):
        g, w = got.detach().cpu(), want.detach().cpu()
        diff = (raw(g).view(-1) != raw(w).view(-1)).nonzero()
        first = int(diff[0]) // max(1, g.element_size())
        raise AssertionError(f"{what}: {diff.numel()} bytes differ; first element {first}: "
                             f"nvlink {g.reshape(-1)[first].item()} vs reference {w.reshape(-1)[first].item()}")


def make_routing(name: str, T: int, E: int, K: int, rank: int, R: int, g: torch.Generator):
    L = E // R
    if name == "group_limited":
        groups = 8 if E % 8 == 0 and K <= 4 * (E // 8) else R
        scores = torch.sigmoid(torch.randn(T, E, generator=g))
        idx, w = routing.group_limited_topk(scores, num_groups=groups, topk_groups=min(4, groups), topk=K)
        return idx, w
    idx = torch.rand(T, E, generator=g).topk(K, dim=1).indices if T else torch.empty(0, K, dtype=torch.int64)
    w = torch.rand(T, K, generator=g)
    if name == "one_expert":
        idx[:, :] = -1
        idx[:, 0] = 3 % E
    elif name == "silent_rank" and rank == 1 % R:
        idx[:, :] = -1
    elif name == "some_empty":
        idx[torch.rand(T, K, generator=g) < 0.3] = -1
    elif name == "all_local":
        idx = rank * L + torch.rand(T, L, generator=g).topk(min(K, L), dim=1).indices
    elif name == "all_remote":
        idx = ((rank + 1) % R) * L + torch.rand(T, L, generator=g).topk(min(K, L), dim=1).indices
    return idx.to(torch.int64), w.float()


def make_x(T: int, H: int, fp8: bool, g: torch.Generator, dev):
    x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev)
    if fp8:
        q, s = per_token_cast_to_fp8(x)
        return (q.contiguous(), s.contiguous()), x
    return x, x


def as_bf16(recv_x):
    if isinstance(recv_x, tuple):
        q, s = recv_x
        return per_token_cast_back(q, s) if q.shape[0] else torch.empty(0, q.shape[1], dtype=torch.bfloat16,
                                                                        device=q.device)
    return recv_x


def random_sum_orders(T: int, g: torch.Generator) -> torch.Tensor:
    """[T] int32 DispatchHandle.sum_order words: a permutation of ranks 0..7 per token, or (every third
    token) 8 random nibbles, naming ranks that hold no row, ranks twice, and leaving ranks unnamed."""
    perm = (torch.stack([torch.randperm(8, generator=g) for _ in range(T)]) if T
            else torch.zeros(0, 8, dtype=torch.int64))
    nib = torch.where((torch.arange(T) % 3 == 2).unsqueeze(1), torch.randint(0, 16, (T, 8), generator=g), perm)
    word = (nib << (4 * torch.arange(8))).sum(1)
    return torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)


def run_case(ctx, *, routing_name="random", T=64, H=256, E=32, K=4, fp8=False, weights=True, worst=0,
             alignment=1, cfg: Config, combine_cfg: Config | None = None, num_bias=0, seed=0, cached=True,
             key="main", token_counts=None, prepack=False, sum_order=False, spread=False):
    """Dispatch + cached dispatch + combine through both Buffers; compare everything. prepack: the
    nvlink Buffer's dispatches (both) get their rows packed ahead by Buffer.prepack, the non-cached
    one its layout from there too, and its combine leaves its sum to PendingCombine.finish().
    sum_order: both handles get the same random DispatchHandle.sum_order before combine. spread: the
    combine rows and biases are half +-2^26 (oracle.spread), so a sum in another order shows in the bits."""
    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    combine_cfg = combine_cfg or cfg
    nv, ref = buffers(ctx, key)
    g = torch.Generator().manual_seed(seed * 7919 + me)
    if token_counts is not None:
        T = token_counts[me]
    elif routing_name == "zero_tokens" and me == 0:
        T = 0
    idx, w = make_routing(routing_name, T, E, K, me, R, g)
    idx, w = idx.to(dev), w.to(dev)
    x, x_bf = make_x(T, H, fp8, g, dev)
    biases = tuple(torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev) for _ in range(num_bias))
    if spread:
        biases = tuple(O.spread(b, seed * 41 + 2 * me + i) for i, b in enumerate(biases))
    orders = random_sum_orders(T, g).to(dev) if sum_order else None
    tag = (f"[{routing_name} T={T} H={H} E={E} K={K} fp8={fp8} w={weights} worst={worst} sms={cfg.num_sms} "
           f"bias={num_bias} order={sum_order} spread={spread}]")
    out = {}
    for name, buf in (("nvlink", nv), ("reference", ref)):
        ahead = prepack and name == "nvlink"
        if ahead:
            tok = buf.prepack(x, topk_idx=idx, topk_weights=w if weights else None, num_experts=E)
            assert tok is not None, f"{tag} prepack returned None on the copy-engine path"
            lay = tok.layout
            ntpr, nrr, ntpe, tir = (lay.num_tokens_per_rank, lay.num_tokens_per_rdma_rank, lay.num_tokens_per_expert,
                                    lay.is_token_in_rank)
            rx, ridx, rw, per_expert, handle, _ = buf.dispatch(
                x, topk_idx=idx, topk_weights=w if weights else None, expert_alignment=alignment, config=cfg,
                prepacked=tok)
        else:
            ntpr, nrr, ntpe, tir, _ = buf.get_dispatch_layout(idx, E)
            rx, ridx, rw, per_expert, handle, _ = buf.dispatch(
                x, num_tokens_per_rank=ntpr, num_tokens_per_rdma_rank=nrr, is_token_in_rank=tir,
                num_tokens_per_expert=ntpe, topk_idx=idx, topk_weights=w if weights else None,
                expert_alignment=alignment, num_worst_tokens=worst, config=cfg)
        res = {"layout": (ntpr, nrr, ntpe, tir), "recv_x": rx, "idx": ridx, "w": rw, "per_expert": per_expert,
               "handle": handle}
        if cached:
            x2, _ = make_x(T, H, fp8, torch.Generator().manual_seed(seed * 31 + me + 1), dev)
            tok2 = buf.prepack(x2, handle=handle) if ahead else None
            assert tok2 is not None or not ahead, f"{tag} cached prepack returned None"
            res["cached"] = buf.dispatch(x2, handle=handle, config=cfg, **({"prepacked": tok2} if ahead else {}))[0]
        y = as_bf16(rx)
        y = (y.float() * (1.0 + 0.25 * me)).to(torch.bfloat16)
        if spread:
            y = O.spread(y, seed * 43 + me)
        if orders is not None:
            handle.sum_order = orders
        if ahead:  # with the sum left to the caller's stream (host staging) or handed over finished
            os.environ["COMMLIB_CE_DEFER_SUM"] = "1"
            try:
                pending, none, _ = buf.combine(y, handle, topk_weights=rw, bias=biases or None, config=combine_cfg,
                                               finish_later=True)
            finally:
                del os.environ["COMMLIB_CE_DEFER_SUM"]
            assert none is None, f"{tag} combine(finish_later=True) returned outputs"
            cx, cw = pending.finish()
        else:
            cx, cw, _ = buf.combine(y, handle, topk_weights=rw, bias=biases or None, config=combine_cfg)
        res["combined"] = (cx, cw)
        out[name] = res
    a, b = out["nvlink"], out["reference"]
    for i, nm in enumerate(("num_tokens_per_rank", "num_tokens_per_rdma_rank", "num_tokens_per_expert",
                            "is_token_in_rank")):
        check_same(a["layout"][i], b["layout"][i], f"{tag} layout.{nm}")
    if isinstance(a["recv_x"], tuple):
        check_same(a["recv_x"][0], b["recv_x"][0], f"{tag} recv_x (fp8)")
        check_same(a["recv_x"][1], b["recv_x"][1], f"{tag} recv_x scales")
    else:
        check_same(a["recv_x"], b["recv_x"], f"{tag} recv_x")
    check_same(a["idx"], b["idx"], f"{tag} recv_topk_idx")
    check_same(a["w"], b["w"], f"{tag} recv_topk_weights")
    assert a["per_expert"] == b["per_expert"], f"{tag} per-expert list {a['per_expert']} != {b['per_expert']}"
    ha, hb = a["handle"], b["handle"]
    for nm in ("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix", "recv_src_idx",
               "is_token_in_rank", "send_head"):
        check_same(getattr(ha, nm), getattr(hb, nm), f"{tag} handle.{nm}")
    for nm in ("num_tokens", "hidden", "num_experts", "num_channels", "num_recv_tokens", "num_worst_tokens"):
        assert getattr(ha, nm) == getattr(hb, nm), f"{tag} handle.{nm}: {getattr(ha, nm)} != {getattr(hb, nm)}"
    if cached:
        ca, cb = a["cached"], b["cached"]
        if isinstance(ca, tuple):
            check_same(ca[0], cb[0], f"{tag} cached recv_x (fp8)")
            check_same(ca[1], cb[1], f"{tag} cached scales")
        else:
            check_same(ca, cb, f"{tag} cached recv_x")
    check_same(a["combined"][0], b["combined"][0], f"{tag} combined_x")
    check_same(a["combined"][1], b["combined"][1], f"{tag} combined_topk_weights")
    return out


def case_replays(ctx):
    """Repeated layouts, cached dispatches and combines replay the launch kept from their first call
    (NVLinkBackend.plan_for): each replay, with fresh inputs, equals the reference bit for bit, with
    and without FP8 scales and combine weights, synchronous and async after a previous_event; a
    Config changed in place, or another one, is not replayed but still exact."""
    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    nv, ref = buffers(ctx)
    T, H, E, K = 96, 512, 32, 4
    g = torch.Generator().manual_seed(4242 + me)
    idx, w = make_routing("random", T, E, K, me, R, g)
    idx, w = idx.to(dev), w.to(dev)
    cfg = default_cfg()
    before = nv.backend.replayed
    for fp8 in (False, True):
        handles, recvs, full = {}, {}, {}
        for name, buf in (("nvlink", nv), ("reference", ref)):
            for rep in range(3):   # the layout's launch replays from its second call on
                lay = buf.get_dispatch_layout(idx, E)
                if rep:
                    for a, b in zip(lay[:4], first[:4]):
                        if a is not None:
                            check_same(a, b, f"[replays fp8={fp8}] {name} layout call {rep}")
                else:
                    first = lay
            for rep in range(3):   # the full dispatch's two launches replay from its second call on
                x, _ = make_x(T, H, fp8, torch.Generator().manual_seed(31 * rep + me), dev)
                out = buf.dispatch(x, num_tokens_per_rank=lay[0], is_token_in_rank=lay[3],
                                   num_tokens_per_expert=lay[2], topk_idx=idx, topk_weights=w, config=cfg,
                                   expert_alignment=1 + rep)
                full.setdefault(rep, {})[name] = out
            handles[name], recvs[name] = out[4], out[2]
        for rep, outs in full.items():
            a, b = outs["nvlink"], outs["reference"]
            tag = f"[replays fp8={fp8} full dispatch call {rep}]"
            for i, what in ((0, "recv_x"), (1, "recv_topk_idx"), (2, "recv_topk_weights")):
                ga, gb = a[i], b[i]
                for j, (u, v) in enumerate(zip(ga, gb) if isinstance(ga, tuple) else [(ga, gb)]):
                    check_same(u, v, f"{tag} {what}[{j}]")
            assert a[3] == b[3], f"{tag} per-expert list {a[3]} != {b[3]}"
            for nm in ("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix", "recv_src_idx",
                       "is_token_in_rank", "send_head"):
                check_same(getattr(a[4], nm), getattr(b[4], nm), f"{tag} handle.{nm}")
        for rep in range(4):
            x, _ = make_x(T, H, fp8, torch.Generator().manual_seed(777 + 13 * rep + me), dev)
            y = torch.randn(handles["nvlink"].recv_src_idx.shape[0], H,
                            generator=torch.Generator().manual_seed(99 + rep + me)).to(torch.bfloat16).to(dev)
            weights = recvs["nvlink"] if rep % 2 else None
            got, want = {}, {}
            for name, buf, res in (("nvlink", nv, got), ("reference", ref, want)):
                h = handles[name]
                if rep == 3:  # async, after an event, outputs on the comm stream
                    ev = buf.capture()
                    rx, _, _, _, _, e1 = buf.dispatch(x, handle=h, config=cfg, previous_event=ev, async_finish=True,
                                                      allocate_on_comm_stream=True)
                    e1.current_stream_wait()
                    ev = buf.capture()
                    cx, cw, e2 = buf.combine(y, h, topk_weights=weights, config=cfg, previous_event=ev,
                                             async_finish=True, allocate_on_comm_stream=True)
                    e2.current_stream_wait()
                else:
                    rx = buf.dispatch(x, handle=h, config=cfg)[0]
                    cx, cw, _ = buf.combine(y, h, topk_weights=weights, config=cfg)
                res.update(rx=rx, cx=cx, cw=cw)
            tag = f"[replays fp8={fp8} call {rep}]"
            if fp8:
                check_same(got["rx"][0], want["rx"][0], f"{tag} cached recv_x (fp8)")
                check_same(got["rx"][1], want["rx"][1], f"{tag} cached scales")
            else:
                check_same(got["rx"], want["rx"], f"{tag} cached recv_x")
            check_same(got["cx"], want["cx"], f"{tag} combined_x")
            if weights is not None:
                check_same(got["cw"], want["cw"], f"{tag} combined_topk_weights")
    replayed = nv.backend.replayed - before
    # per dtype: 2 layouts, 2 full and 3 cached dispatches, 3 combines (each op's first call lays its plan)
    assert replayed >= 2 * (2 + 2 + 3 + 2), f"only {replayed} calls were replayed"
    # a Config changed in place, then another Config: the full path (no replay), still exact
    h_nv, h_ref = handles["nvlink"], handles["reference"]
    x, _ = make_x(T, H, True, g, dev)
    mutated = default_cfg()
    nv.dispatch(x, handle=h_nv, config=mutated)
    mutated.num_max_nvl_chunked_send_tokens = 16
    count = nv.backend.replayed
    a = nv.dispatch(x, handle=h_nv, config=mutated)[0]
    b = ref.dispatch(x, handle=h_ref, config=mutated)[0]
    assert nv.backend.replayed == count, "a dispatch with a changed Config was replayed"
    check_same(a[0], b[0], "[replays] changed config recv_x")
    check_same(a[1], b[1], "[replays] changed config scales")


def _same_call(got, want, tag: str, strides: bool = False) -> None:
    """Two paths' outputs of one call (a tuple as the Buffer returns it), bit for bit; handles field by field.
    ``strides``: the output tensors' strides too (the C++ path carves some from one allocation)."""
    assert type(got) is type(want) and (not isinstance(got, tuple) or len(got) == len(want)), \
        f"{tag}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(got, tuple):
        for i, (a, b) in enumerate(zip(got, want)):
            _same_call(a, b, f"{tag}[{i}]", strides)
    elif isinstance(got, torch.Tensor):
        check_same(got, want, tag)
        assert not strides or got.stride() == want.stride(), f"{tag}: strides {got.stride()} != {want.stride()}"
    elif hasattr(got, "rank_prefix_matrix"):   # a DispatchHandle
        for nm in ("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix", "recv_src_idx",
                   "is_token_in_rank", "send_head"):
            check_same(getattr(got, nm), getattr(want, nm), f"{tag}.{nm}")
        for nm in ("num_tokens", "hidden", "num_experts", "num_channels", "num_recv_tokens", "num_worst_tokens"):
            assert getattr(got, nm) == getattr(want, nm), f"{tag}.{nm}: {getattr(got, nm)} != {getattr(want, nm)}"
    elif isinstance(got, list):
        assert got == want, f"{tag}: {got} != {want}"
    elif got is not None and not hasattr(got, "current_stream_wait"):   # events differ by nature
        assert got == want, f"{tag}: {got!r} != {want!r}"


def _callpath_pass(buf, me, idx, w, T, H, E, fp8, worst, cfg, check) -> list:
    """case_callpath's calls through ``buf``: per round (alignments 1, 1, 2, 2) a layout, a non-cached
    dispatch, and twice a cached dispatch and a combine on its handle (a handle's first lays the
    plan); the last round's calls asynchronous after a previous_event, outputs on the comm stream.
    ``check(round, index, outputs)`` sees each call's outputs as soon as they are complete."""
    dev = idx.device

    def overlap(on):
        return dict(previous_event=buf.capture(), async_finish=True, allocate_on_comm_stream=True) if on else {}

    calls = []
    for rep, alignment in enumerate((1, 1, 2, 2)):
        last = rep == 3
        outs = [buf.get_dispatch_layout(idx, E)]
        check(rep, 0, outs[0])
        lay = outs[0]
        x, _ = make_x(T, H, fp8, torch.Generator().manual_seed(31 * rep + me), dev)
        full = buf.dispatch(x, num_tokens_per_rank=lay[0], num_tokens_per_rdma_rank=lay[1], is_token_in_rank=lay[3],
                            num_tokens_per_expert=lay[2], topk_idx=idx, topk_weights=w, expert_alignment=alignment,
                            num_worst_tokens=worst, config=cfg, **overlap(last))
        full[5].current_stream_wait()
        outs.append(full)
        check(rep, 1, full)
        h = full[4]
        weights = full[2] if rep % 2 else None
        for again in (0, 1):
            x2, _ = make_x(T, H, fp8, torch.Generator().manual_seed(77 + 13 * rep + 5 * again + me), dev)
            cached = buf.dispatch(x2, handle=h, config=cfg, **overlap(last and again))
            cached[5].current_stream_wait()
            outs.append(cached)
            check(rep, len(outs) - 1, cached)
            y = torch.randn(h.recv_src_idx.shape[0], H,
                            generator=torch.Generator().manual_seed(99 + rep + 7 * again + me))
            comb = buf.combine(y.to(torch.bfloat16).to(dev), h, topk_weights=weights, config=cfg,
                               **overlap(last and again))
            comb[2].current_stream_wait()
            outs.append(comb)
            check(rep, len(outs) - 1, comb)
        calls.append(outs)
    return calls


def case_callpath(ctx):
    """Every op through the C++ call path (csrc/callpath.cpp), through the Python path of the same
    Buffer and through the reference backend: bit for bit, replays included. Per dtype (BF16, FP8) and
    num_worst_tokens (0, or padded): layouts, non-cached dispatches (two per alignment: the second runs
    in C++), cached dispatches and combines (with and without weights; a handle's second of each runs
    in C++), the last round asynchronous after a previous_event with outputs on the comm stream; a
    handle the C++ path made combines through the Python path too. Each C++ call is compared as soon as
    it returns (a planted fault raises on every rank before it feeds a later call). The C++ engine must
    have served every op."""
    from commlib.cuda import callpath

    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    nv, ref = buffers(ctx)
    assert nv._cpp is not None, f"the C++ call path did not load: {callpath.why_unavailable}"
    T, H, E, K = 96, 512, 32, 4
    cfg = default_cfg()
    g = torch.Generator().manual_seed(5150 + me)
    idx, w = make_routing("random", T, E, K, me, R, g)
    idx, w = idx.to(dev), w.to(dev)
    served = dict(nv._cpp.served)
    names = ("layout", "dispatch", "cached dispatch", "combine", "cached dispatch again", "combine again")
    try:
        for fp8 in (False, True):
            for worst in (0, T * R + 8):
                tag = f"[callpath fp8={fp8} worst={worst}"
                runs = {"reference": _callpath_pass(ref, me, idx, w, T, H, E, fp8, worst, cfg, lambda *a: None)}
                nv.set_call_path("python")
                runs["python"] = _callpath_pass(nv, me, idx, w, T, H, E, fp8, worst, cfg, lambda *a: None)
                nv.set_call_path("cpp")

                def check(rep, i, out):
                    for other in ("python", "reference"):
                        _same_call(out, runs[other][rep][i], f"{tag} call {rep}] cpp vs {other} {names[i]}",
                                   strides=other == "python")

                cpp = _callpath_pass(nv, me, idx, w, T, H, E, fp8, worst, cfg, check)
                # a handle the C++ path made (round 1's dispatch), combined through both paths
                h_cpp = cpp[1][1][4]
                y = torch.randn(h_cpp.recv_src_idx.shape[0], H, generator=torch.Generator().manual_seed(7 + me))
                y = y.to(torch.bfloat16).to(dev)
                nv.set_call_path("python")
                a = nv.combine(y, h_cpp, config=cfg)[0]
                nv.set_call_path("cpp")
                b = nv.combine(y, h_cpp, config=cfg)[0]
                check_same(a, b, f"{tag}] the C++ path's handle: Python vs C++ combine")
    finally:
        nv.set_call_path("cpp")
    done = {op: nv._cpp.served[op] - served[op] for op in served}
    # per (dtype, worst): 4 layouts, 2 of 4 dispatches, the second cached dispatch and combine of each round
    assert done["layout"] >= 16 and done["dispatch"] >= 8 and done["cached"] >= 16 and done["combine"] >= 16, done


def default_cfg(num_sms=20, send=32, recv=256) -> Config:
    return Config(num_sms, send, recv, 64, 1024)


# ------------------------------------------------------------------------------------------------
# 2 ranks (one per GPU)
# ------------------------------------------------------------------------------------------------

def case_smoke(ctx):
    run_case(ctx, cfg=default_cfg(), T=40, H=256, seed=1)


def case_routings_bf16(ctx):
    cfg = default_cfg()
    for i, name in enumerate(("random", "group_limited", "one_expert", "silent_rank", "zero_tokens",
                              "some_empty", "all_local", "all_remote")):
        run_case(ctx, routing_name=name, cfg=cfg, T=96 + 7 * i, H=512, E=64, K=6, seed=10 + i, num_bias=i % 3)


def case_routings_fp8(ctx):
    cfg = default_cfg()
    for i, name in enumerate(("random", "group_limited", "silent_rank", "zero_tokens", "some_empty")):
        run_case(ctx, routing_name=name, cfg=cfg, T=80 + 5 * i, H=1024, E=64, K=6, fp8=True, seed=30 + i,
                 weights=i % 2 == 0)


def case_odd_hidden(ctx):
    # 1000 bf16 = 125 vectors: partial unrolled passes, rows not a multiple of 512 bytes
    run_case(ctx, cfg=default_cfg(), T=77, H=1000, E=16, K=3, seed=40, num_bias=2)
    run_case(ctx, cfg=default_cfg(num_sms=4, send=8, recv=256), T=150, H=264, E=16, K=2, seed=41)


def case_v3_shape(ctx):
    # the real model shape on a few hundred tokens: 7168 hidden, top-8 of 256, group-limited
    cfg = default_cfg(recv=128)
    run_case(ctx, routing_name="group_limited", cfg=cfg, T=600, H=7168, E=256, K=8, seed=50, num_bias=1)
    run_case(ctx, routing_name="group_limited", cfg=cfg, T=333, H=7168, E=256, K=8, fp8=True, seed=51)


def case_options(ctx):
    cfg = default_cfg()
    run_case(ctx, cfg=cfg, T=90, H=256, E=32, K=4, alignment=16, seed=60)
    run_case(ctx, cfg=cfg, T=90, H=256, E=32, K=4, worst=400, seed=61, num_bias=2)
    run_case(ctx, cfg=cfg, T=90, H=256, E=32, K=4, worst=400, fp8=False, weights=False, seed=62)
    run_case(ctx, cfg=cfg, T=0, H=256, E=32, K=4, worst=16, seed=63, token_counts=[0, 0])
    run_case(ctx, cfg=cfg, T=50, H=256, E=32, K=4, seed=64, token_counts=[0, 50])
    # combine with fewer SMs than the dispatch used (CTA pairs serve several channels)
    run_case(ctx, cfg=cfg, combine_cfg=default_cfg(num_sms=6), T=200, H=512, E=32, K=4, seed=65)
    # many rounds per channel (send chunk 8), few channels
    run_case(ctx, cfg=default_cfg(num_sms=4, send=8, recv=256), T=500, H=256, E=32, K=4, seed=66)


def case_sum_order(ctx):
    """Combine's summation order where the bits show it (rows and biases half +-2^26): biases 0 / 1 / 2
    first, then the rows in rank order or in random per-token sum orders (DispatchHandle.sum_order),
    with rings that hold the call, rings that wrap, fewer combine SMs, num_worst_tokens and the V3
    shape; bit for bit with the reference."""
    R = ctx.world_size
    small = R > 2  # several processes per GPU: time-sliced, few SMs each
    cfg = default_cfg(num_sms=4, send=8, recv=64) if small else default_cfg()
    for i in ((1, 3, 5) if small else range(6)):
        run_case(ctx, cfg=cfg, T=(40 if small else 120) + i, H=512, E=8 * R, K=6, seed=700 + i, num_bias=i % 3,
                 sum_order=i >= 3, spread=True, routing_name="some_empty" if i % 2 else "random")
    run_case(ctx, cfg=cfg, combine_cfg=default_cfg(num_sms=2 if small else 6), T=90, H=256, E=8 * R, K=4,
             worst=120 * R, seed=710, num_bias=2, sum_order=True, spread=True)
    tiny = Config(4, 1, 8) if small else _RING_CFGS["rings_tiny"][0]   # rings that wrap
    run_case(ctx, cfg=tiny, T=3 * _ring_unit(tiny) + 1, H=256, E=8 * R, K=4, seed=711, key="rings_tiny", num_bias=1,
             sum_order=True, spread=True)
    if not small:
        run_case(ctx, routing_name="group_limited", cfg=default_cfg(recv=128), T=300, H=7168, E=256, K=8, seed=712,
                 num_bias=2, sum_order=True, spread=True)


def case_bad_ids(ctx):
    """Ids outside [-1, E) on one rank: every rank raises ValueError before data moves; the
    Buffer keeps working afterwards."""
    me, dev = ctx.rank, ctx.device
    cfg = default_cfg()
    nv, _ = buffers(ctx)
    E, K, T = 32, 4, 20
    idx = torch.randint(0, E, (T, K), device=dev)
    if me == 0:
        idx[3, 1] = E + 5
    x = torch.randn(T, 256, device=dev).to(torch.bfloat16)
    ntpr, _, ntpe, tir, _ = nv.get_dispatch_layout(idx, E)
    try:
        nv.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=tir, num_tokens_per_expert=ntpe, topk_idx=idx,
                    config=cfg)
    except ValueError as e:
        msg = str(e)
        assert "outside [-1, num_experts)" in msg and f"rank {me}" in msg, msg
        if me != 0:
            assert "rank 0" in msg, msg
    else:
        raise AssertionError("dispatch with bad expert ids did not raise")
    if me == 0:
        assert nv.backend.layout_error_count() >= 1
    # with num_worst_tokens: no host sync, so no raise; outputs are all padding on every rank
    ntpr, _, ntpe, tir, _ = nv.get_dispatch_layout(idx, E)
    rx, ridx, rw, lst, h, _ = nv.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=tir,
                                          num_tokens_per_expert=ntpe, topk_idx=idx, num_worst_tokens=64,
                                          config=cfg)
    assert rx.shape[0] == 64 and int(rx.float().abs().sum()) == 0 and bool((ridx == -1).all()), "not padding"
    run_case(ctx, cfg=cfg, T=30, H=256, seed=70)  # still in step


def case_rejected_input(ctx):
    """One rank's Buffer refuses its input (wrong dtype): the peers raise too, nobody hangs."""
    me, dev = ctx.rank, ctx.device
    cfg = default_cfg()
    nv, _ = buffers(ctx)
    E, K, T = 32, 4, 20
    idx = torch.randint(0, E, (T, K), device=dev)
    x = torch.randn(T, 256, device=dev).to(torch.bfloat16)
    if me == 1:
        x = x.float()
    ntpr, _, ntpe, tir, _ = nv.get_dispatch_layout(idx, E)
    try:
        nv.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=tir, num_tokens_per_expert=ntpe, topk_idx=idx,
                    config=cfg)
    except (TypeError, ValueError) as e:
        if me != 1:
            assert "rank 1" in str(e), str(e)
    else:
        raise AssertionError("no error")
    run_case(ctx, cfg=cfg, T=30, H=256, seed=71)


def _check_graph_replays(ctx, nv, ref, cfg, T, H, E, K, W, what: str) -> None:
    """layout + dispatch (num_worst_tokens W) + combine on ``nv`` captured once, replayed 4 times with
    fresh inputs, each replay's outputs equal to ``ref``'s eager call."""
    me, R, dev = ctx.rank, ctx.world_size, ctx.device
    x_s = torch.zeros(T, H, dtype=torch.bfloat16, device=dev)
    idx_s = torch.zeros(T, K, dtype=torch.int64, device=dev)
    w_s = torch.zeros(T, K, dtype=torch.float32, device=dev)

    def step(buf):
        ntpr, _, ntpe, tir, _ = buf.get_dispatch_layout(idx_s, E)
        rx, ridx, rw, _, handle, _ = buf.dispatch(x_s, num_tokens_per_rank=ntpr, is_token_in_rank=tir,
                                                  num_tokens_per_expert=ntpe, topk_idx=idx_s, topk_weights=w_s,
                                                  num_worst_tokens=W, config=cfg)
        cx, cw, _ = buf.combine(rx, handle, topk_weights=rw, config=cfg)
        return rx, ridx, rw, handle.send_head, cx, cw

    def fill(seed):
        g = torch.Generator().manual_seed(seed * 100 + me)
        idx, w = make_routing("some_empty", T, E, K, me, R, g)
        x_s.copy_(torch.randn(T, H, generator=g).to(torch.bfloat16))
        idx_s.copy_(idx)
        w_s.copy_(w)

    fill(0)
    graph, static_out = capture_graph(lambda: step(nv), capture_error_mode="thread_local")
    for it in range(4):
        fill(it + 1)
        graph.replay()
        torch.cuda.synchronize()
        want = step(ref)
        names = ("recv_x", "recv_topk_idx", "recv_topk_weights", "send_head", "combined_x", "combined_w")
        for nm, got, exp in zip(names, static_out, want):
            check_same(got, exp, f"[{what} {it}] {nm}")


def case_cuda_graph(ctx):
    """layout + dispatch (num_worst_tokens) + combine captured once, replayed with fresh inputs."""
    R = ctx.world_size
    cfg = default_cfg()
    nv, ref = buffers(ctx)
    T, H, E, K, W = 64, 256, 32, 4, 64 * R
    _check_graph_replays(ctx, nv, ref, cfg, T, H, E, K, W, "graph replay")


def case_copy_engines(ctx):
    """COMMLIB_CE_BYTES set (the world's environment): dispatch, cached dispatch and combine move the
    rows with the copy engines (csrc/ce.cu's kernels run, the SM data kernels do not) and match the
    reference backend bit for bit; a call whose rows overflow a staging region raises on the ranks
    concerned before anything moves, and the Buffer stays usable."""
    from commlib.validate import CommlibError

    from commlib.backends.nvlink.peer_memory import HostPeerMemory

    nv, _ = buffers(ctx)
    assert nv.backend._ce is not None, "COMMLIB_CE_BYTES is not set in this world"
    host = os.environ.get("COMMLIB_CE_STAGING") == "host"
    assert isinstance(nv.backend._ce, HostPeerMemory) == host, (type(nv.backend._ce), host)
    for fp8 in (False, True):
        with commlib_kernels.record_launches() as launches:
            run_case(ctx, cfg=default_cfg(num_sms=4), T=300, H=512, E=32, K=4, fp8=fp8, num_bias=2, seed=90)
        torch.cuda.synchronize()
        names = [n for n, _, _ in launches]
        assert {"ce_pack_kernel", "ce_reduce_kernel", "ce_sync_kernel"} <= set(names), names
        assert not {"dispatch_kernel", "combine_kernel"} & set(names), names
    # a staging of 2 x 8 KB regions holds a few rows of 512 bf16 only
    old = os.environ.get("COMMLIB_CE_BYTES")
    os.environ["COMMLIB_CE_BYTES"] = str(4096 + ctx.world_size * 8192)
    try:
        small = Buffer(ctx.group, _SIZE_CFG.get_nvl_buffer_size_hint(_SIZE_HIDDEN_BYTES, ctx.world_size),
                       backend="nvlink", explicitly_destroy=True)
    finally:
        os.environ["COMMLIB_CE_BYTES"] = old
    dev = ctx.device
    E, K = 32, 4
    for T, fits in ((200, False), (2, True)):
        idx = ((torch.arange(T * K, device=dev) * 7) % E).reshape(T, K)  # every rank gets rows
        x = torch.randn(T, 512, device=dev).to(torch.bfloat16)
        ntpr, _, ntpe, tir, _ = small.get_dispatch_layout(idx, E)
        try:
            rx, _, _, _, h, _ = small.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=tir,
                                               num_tokens_per_expert=ntpe, topk_idx=idx, config=default_cfg())
        except CommlibError as e:
            assert not fits and "raise COMMLIB_CE_BYTES" in str(e), str(e)
            continue
        assert fits, "a dispatch overflowing the copy-engine staging did not raise"
        cx, _, _ = small.combine(rx, h, config=default_cfg())
        want = x.float() * tir.sum(1, keepdim=True).float()  # every rank returns the row unchanged
        assert torch.equal(cx, want.to(torch.bfloat16)), "combine after the refused call differs"
    torch.cuda.synchronize()
    dist.barrier(group=ctx.group)
    small.destroy()


def case_ce_prepack(ctx):
    """Buffer.prepack on the copy-engine path: the rows (and, non-cached, the layout) are packed on the
    caller's stream ahead of the dispatch; the outputs match the reference bit for bit (BF16 and FP8,
    cached too, a rank without tokens). Two prepacks in flight take two pack buffers and each dispatch
    gets its own rows; a token is refused by name (before any collective) for another x, a second use
    and num_worst_tokens, and the Buffer stays usable. COMMLIB_CE_PREPACK=0: prepack returns None."""
    nv, ref = buffers(ctx)
    assert nv.backend._ce is not None, "COMMLIB_CE_BYTES is not set in this world"
    for i, (rname, fp8) in enumerate((("random", False), ("group_limited", True), ("zero_tokens", False),
                                      ("all_remote", True), ("some_empty", False))):
        run_case(ctx, routing_name=rname, cfg=default_cfg(num_sms=4), T=120 + 9 * i, H=512, E=32, K=4, fp8=fp8,
                 num_bias=i % 2, seed=200 + i, prepack=True)
    me, dev, E, K, H = ctx.rank, ctx.device, 32, 4, 512
    g = torch.Generator().manual_seed(77 + me)
    xs, idxs, toks = [], [], []
    for j in range(2):  # both packed before either dispatch
        idx, _ = make_routing("random", 64 + 8 * j, E, K, me, ctx.world_size, g)
        x = torch.randn(64 + 8 * j, H, generator=g).to(torch.bfloat16).to(dev)
        xs.append(x)
        idxs.append(idx.to(dev))
        toks.append(nv.prepack(x, topk_idx=idxs[-1], num_experts=E))
    assert toks[0].slot != toks[1].slot, "two prepacks in flight share a pack buffer"
    for j in range(2):
        got = nv.dispatch(xs[j], topk_idx=idxs[j], config=default_cfg(num_sms=4), prepacked=toks[j])[0]
        lay = ref.get_dispatch_layout(idxs[j], E)
        want = ref.dispatch(xs[j], num_tokens_per_rank=lay[0], is_token_in_rank=lay[3], num_tokens_per_expert=lay[2],
                            topk_idx=idxs[j], config=default_cfg(num_sms=4))[0]
        check_same(got, want, f"two prepacks in flight, dispatch {j}")
    x, idx = xs[0], idxs[0]
    for bad, kw, words in ((xs[1], {}, "another dispatch"), (x, {"num_worst_tokens": 4096}, "num_worst_tokens"),
                           (x, {"again": True}, "already dispatched")):
        tok = nv.prepack(x, topk_idx=idx, num_experts=E)
        if kw.pop("again", False):
            nv.dispatch(x, topk_idx=idx, config=default_cfg(num_sms=4), prepacked=tok)
        try:
            nv.dispatch(bad, topk_idx=idxs[0] if bad is x else idxs[1], config=default_cfg(num_sms=4), prepacked=tok,
                        **kw)
        except ValueError as e:
            assert words in str(e), str(e)
        else:
            raise AssertionError(f"a prepacked token was not refused ({words})")
        if not tok.consumed:  # the refused token's buffer: dispatch it as meant, so none stays taken
            nv.dispatch(x, topk_idx=idx, config=default_cfg(num_sms=4), prepacked=tok)
    old = os.environ.get("COMMLIB_CE_PREPACK")
    os.environ["COMMLIB_CE_PREPACK"] = "0"
    try:
        assert nv.prepack(x, topk_idx=idx, num_experts=E) is None
    finally:
        if old is None:
            del os.environ["COMMLIB_CE_PREPACK"]
        else:
            os.environ["COMMLIB_CE_PREPACK"] = old
    run_case(ctx, cfg=default_cfg(num_sms=4), T=50, H=512, E=32, K=4, seed=230)  # still usable
    torch.cuda.synchronize()


def case_smid(ctx):
    """With COMMLIB_DEBUG_SMID=1, every kernel records %smid per CTA: a dispatch and a combine use
    exactly num_sms CTAs on at most num_sms SMs, also while a long GEMM runs on another stream.
    With COMMLIB_DEBUG_SMID_SLOTS=8 every launch keeps its own slot: trace_history has one entry per
    launch since the reset, the last one equal to last_smids / last_trace."""
    os.environ["COMMLIB_DEBUG_SMID"] = "1"
    os.environ["COMMLIB_DEBUG_SMID_SLOTS"] = "8"
    try:
        nv, _ = buffers(ctx, key="smid")
    finally:
        os.environ.pop("COMMLIB_DEBUG_SMID", None)
        os.environ.pop("COMMLIB_DEBUG_SMID_SLOTS", None)
    nv.backend.reset_trace_history()
    me, dev = ctx.rank, ctx.device
    a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    for num_sms in (20, 8):
        cfg = default_cfg(num_sms=num_sms)
        torch.cuda.synchronize()
        dist.barrier()
        with torch.cuda.stream(side):
            for _ in range(20):
                a = a @ a / 64
        run_case(ctx, cfg=cfg, T=200, H=512, E=32, K=4, seed=80 + num_sms, key="smid", cached=False)
        torch.cuda.synchronize()
        for kind in ("dispatch", "combine"):
            ids = nv.backend.last_smids(kind)
            assert len(ids) == num_sms and min(ids) >= 0, f"{kind}: {ids}"
            assert len(set(ids)) <= num_sms, f"{kind}: {len(set(ids))} SMs for {num_sms} CTAs"
            if commlib_kernels.variant()["COMM_TRACE"]:  # start <= own work done <= end on every CTA, within a second
                trace = nv.backend.last_trace(kind)
                assert len(trace) == num_sms, f"{kind}: {len(trace)} trace rows"
                assert all(0 < a <= b <= c < a + 10 ** 9 for a, b, c in trace), f"{kind}: {trace}"
        if me == 0:
            print(f"[smid] num_sms={num_sms} dispatch SMs {sorted(set(nv.backend.last_smids('dispatch')))}",
                  flush=True)
    for kind in ("dispatch", "combine"):  # one non-cached dispatch and one combine per num_sms above
        hist = nv.backend.trace_history(kind)
        assert [len(t) for t in hist] == [20, 8], f"{kind}: {[len(t) for t in hist]} CTAs per launch"
        if commlib_kernels.variant()["COMM_TRACE"]:
            assert hist[-1] == nv.backend.last_trace(kind)
            assert hist[0][0][0] < hist[1][0][0], f"{kind}: the second launch's trace is not later"


def case_pressure(ctx):
    """1000 dispatch/combine rounds, fresh random routing and sizes each round, every result equal
    to the reference's (one hash comparison per round)."""
    R, me, dev = ctx.world_size, ctx.rank, ctx.device
    cfg = default_cfg(recv=64)
    nv, ref = buffers(ctx, key="pressure")
    E, K, H = 32, 4, 512
    rounds = int(os.environ.get("COMMLIB_TEST_PRESSURE_ROUNDS", "1000"))
    g = torch.Generator(device=dev).manual_seed(1234 + me)
    t0 = time.perf_counter()
    for it in range(rounds):
        T = int(torch.randint(0, 160, (1,), generator=g, device=dev).item())
        idx = torch.rand(T, E, generator=g, device=dev).topk(K, dim=1).indices
        idx[torch.rand(T, K, generator=g, device=dev) < 0.1] = -1
        w = torch.rand(T, K, generator=g, device=dev)
        x = torch.randn(T, H, generator=g, device=dev).to(torch.bfloat16)
        worst = 160 * R if it % 5 == 3 else 0
        hashes = []
        for buf in (nv, ref):
            ntpr, _, ntpe, tir, _ = buf.get_dispatch_layout(idx, E)
            rx, ridx, rw, _, h, _ = buf.dispatch(x, num_tokens_per_rank=ntpr, is_token_in_rank=tir,
                                                 num_tokens_per_expert=ntpe, topk_idx=idx, topk_weights=w,
                                                 num_worst_tokens=worst, config=cfg)
            if it % 7 == 0:
                rx = buf.dispatch(x * 2, handle=h, num_worst_tokens=worst, config=cfg)[0]
            cx, cw, _ = buf.combine(rx, h, topk_weights=rw, config=cfg)
            hashes.append(torch.stack([dev_hash(t) for t in (rx, ridx, rw, h.send_head, cx, cw)]))
        if not torch.equal(hashes[0], hashes[1]):
            raise AssertionError(f"round {it} (T={T}, worst={worst}): nvlink {hashes[0].tolist()} != "
                                 f"reference {hashes[1].tolist()}")
    if me == 0:
        print(f"[pressure] {rounds} rounds in {time.perf_counter() - t0:.1f} s", flush=True)


# ------------------------------------------------------------------------------------------------
# 4 and 8 ranks (several processes per GPU: time-sliced, so small)
# ------------------------------------------------------------------------------------------------

def case_many_ranks(ctx):
    R = ctx.world_size
    cfg = default_cfg(num_sms=4, send=8, recv=64)
    for i, name in enumerate(("random", "group_limited", "silent_rank", "zero_tokens", "one_expert")):
        run_case(ctx, routing_name=name, cfg=cfg, T=24 + i, H=256, E=8 * R, K=4, seed=90 + i, num_bias=i % 3)
    run_case(ctx, cfg=cfg, T=30, H=256, E=8 * R, K=4, fp8=False, worst=40 * R, seed=96)
    run_case(ctx, cfg=cfg, T=30, H=512, E=8 * R, K=4, fp8=True, seed=97)


# ------------------------------------------------------------------------------------------------
# Rings: token counts past the ring (issue #28), on Buffers sized by the hint alone
# ------------------------------------------------------------------------------------------------

def _ring_unit(cfg: Config) -> int:
    return cfg.num_channels * cfg.num_max_nvl_chunked_recv_tokens


def case_rings(ctx):
    """DeepEP's test config Config(24, 6, 256) with 4,096 tokens (V3 rows too); tiny rings Config(20, 1, 8)
    at 0, 1, ring boundaries (k rings per channel, +-1) and 8x the ring, bf16 and FP8, cached, padded."""
    deep, tiny = _RING_CFGS["rings"][0], _RING_CFGS["rings_tiny"][0]
    R = ctx.world_size
    run_case(ctx, cfg=deep, T=4096, H=256, E=8 * R, K=4, seed=300, key="rings")
    run_case(ctx, cfg=deep, T=4096, H=256, E=8 * R, K=4, fp8=False, worst=4096 * R, seed=301, key="rings")
    if R <= 2:
        run_case(ctx, routing_name="group_limited", cfg=deep, T=4096, H=7168, E=256, K=8, seed=302, key="rings_v3")
        run_case(ctx, routing_name="group_limited", cfg=deep, T=4096, H=7168, E=256, K=8, fp8=True, seed=303,
                 key="rings_v3")
    unit = _ring_unit(tiny)
    counts = [0, 1] + [n for k in (1, 2) for n in (k * unit - 1, k * unit, k * unit + 1)] + [8 * unit]
    for i, T in enumerate(counts):
        run_case(ctx, cfg=tiny, T=T, H=256, E=8 * R, K=4, fp8=i % 2 == 1, seed=310 + i, key="rings_tiny",
                 routing_name="random" if i % 3 else "some_empty")
    run_case(ctx, cfg=tiny, T=0, H=256, E=8 * R, K=4, seed=330, key="rings_tiny",
             token_counts=[(0 if r == 0 else 8 * unit - r) for r in range(R)])
    run_case(ctx, cfg=tiny, T=0, H=256, E=8 * R, K=4, worst=8 * unit * R, seed=331, key="rings_tiny",
             token_counts=[8 * unit - 3 * r for r in range(R)])


def case_rings_random(ctx):
    """COMMLIB_TEST_RING_ROUNDS (default 1000) random rounds: a random tiny-ring config, token counts
    from 0 to 8x its rings per rank, bf16 / FP8, every output compared with the reference backend."""
    import random
    rounds = int(os.environ.get("COMMLIB_TEST_RING_ROUNDS", "1000"))
    rng = random.Random(400)  # the same draws on every rank
    R = ctx.world_size
    cfgs = [_RING_CFGS["rings_tiny"][0], Config(4, 1, 2), Config(6, 2, 3), Config(8, 3, 16), Config(2, 4, 5)]
    for i in range(rounds):
        cfg = rng.choice(cfgs)
        counts = [rng.randint(0, 8 * _ring_unit(cfg)) for _ in range(R)]
        run_case(ctx, cfg=cfg, combine_cfg=rng.choice([cfg, _RING_CFGS["rings_tiny"][0]]), T=0, H=256, E=8 * R, K=4,
                 fp8=rng.random() < 0.3, worst=rng.choice([0, 0, 0, 8 * _ring_unit(cfg) * R]), seed=1000 + i,
                 key="rings_tiny", token_counts=counts, cached=rng.random() < 0.5,
                 routing_name=rng.choice(["random", "some_empty", "all_remote", "one_expert"]))


def case_rings_graph(ctx):
    """A CUDA graph of layout + dispatch (num_worst_tokens) + combine whose rows wrap tiny rings 8 times."""
    R = ctx.world_size
    cfg = _RING_CFGS["rings_tiny"][0]
    nv, ref = buffers(ctx, "rings_tiny")
    T, H, E, K = 8 * _ring_unit(cfg), 256, 8 * R, 4
    W = T * R
    _check_graph_replays(ctx, nv, ref, cfg, T, H, E, K, W, "ring graph replay")
