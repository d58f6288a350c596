"""Cases run inside spawned CPU worlds (see worlds.py); each checks every rank against the oracle.

Every rank regenerates every rank's inputs from (case seed, rank), so the oracle needs no
communication. The oracle (oracle.py) and this file import nothing from commlib but the API under
test (Buffer, Config): inputs are made with the oracle's own gate and FP8 cast, and the layout,
channel prefixes and combine are checked against the oracle's own definitions.
"""
from __future__ import annotations

import zlib

import oracle as O
import torch
from worlds import expect_raises as _expect

import commlib
from commlib import Config

E, H, K = 32, 256, 4
ROUTINGS = ("random", "group_limited", "one_expert", "silent_rank", "zero_tokens", "some_empty")


def num_tokens_of(rank: int, routing_name: str) -> int:
    if routing_name == "zero_tokens" and rank == 0:
        return 0
    return 20 + 3 * rank


def make_inputs(seed: int, rank: int, routing_name: str, num_ranks: int):
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    T = num_tokens_of(rank, routing_name)
    x = (torch.randn(T, H, generator=g) * (1 + rank)).to(torch.bfloat16)
    if routing_name == "group_limited":
        scores = torch.sigmoid(torch.randn(T, E, generator=g))
        idx, w = O.gate(scores, num_groups=4, topk_groups=2, topk=K)
    else:
        idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]) if T else torch.empty(0, K, dtype=torch.int64)
        w = torch.rand(T, K, generator=g)
        if routing_name == "one_expert":
            idx[:, :] = -1
            idx[:, 0] = 5
        elif routing_name == "silent_rank" and rank == 1 % num_ranks and num_ranks > 1:
            idx[:, :] = -1
        elif routing_name == "some_empty":
            drop = torch.rand(T, K, generator=g) < 0.3
            idx[drop] = -1
    return x, idx.to(torch.int64).contiguous(), w.to(torch.float32).contiguous()


def make_buffer(ctx, ranks_per_node: int, hidden_bytes: int = H * 2, backend: str = "reference", **kw):
    cfg = commlib.Buffer.get_dispatch_config(ctx.world_size)
    return commlib.Buffer(ctx.group, cfg.get_nvl_buffer_size_hint(hidden_bytes, ranks_per_node),
                          cfg.get_rdma_buffer_size_hint(hidden_bytes, ctx.world_size),
                          ranks_per_node=ranks_per_node, backend=backend, **kw)


def topologies(world: int) -> list[int]:
    return [p for p in (world, 4, 2, 1) if p <= world and world % p == 0][:4]


def bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def check_full(ctx, ranks_per_node: int, routing_name: str, fp8: bool, seed: int, backend: str = "reference",
               config=None) -> None:
    R, me = ctx.world_size, ctx.rank
    inputs = [make_inputs(seed, r, routing_name, R) for r in range(R)]
    xs = [i[0] for i in inputs]
    idxs = [i[1] for i in inputs]
    ws = [i[2] for i in inputs]
    x, idx, w = inputs[me]
    buf = make_buffer(ctx, ranks_per_node, backend=backend)
    tag = f"[{backend} {routing_name} rpn={ranks_per_node} fp8={fp8}]"

    # ---- layout ----
    ntr, nrr, nte, tir, _ = buf.get_dispatch_layout(idx, E)
    exp_ntr, exp_nrr, exp_nte, exp_tir = O.layout(idx, E, R, ranks_per_node)
    assert torch.equal(tir, exp_tir), f"{tag} is_token_in_rank"
    assert torch.equal(ntr, exp_ntr), f"{tag} num_tokens_per_rank"
    assert torch.equal(nte, exp_nte), f"{tag} num_tokens_per_expert"
    if exp_nrr is None:
        assert nrr is None
    else:
        assert torch.equal(nrr, exp_nrr), f"{tag} num_tokens_per_rdma_rank"

    # ---- dispatch ----
    if fp8:
        q = [O.cast_fp8(xx) for xx in xs]
        x_in = q[me]
        data_all = [qq[0] for qq in q]
        scales_all = [qq[1] for qq in q]
    else:
        x_in = x
        data_all = xs
    before = buf.counters
    recv_x, recv_idx, recv_w, per_expert, handle, event = buf.dispatch(
        x_in, num_tokens_per_rank=ntr, num_tokens_per_rdma_rank=nrr, is_token_in_rank=tir,
        num_tokens_per_expert=nte, topk_idx=idx, topk_weights=w, config=config)
    event.current_stream_wait()
    exp = O.dispatch_oracle(data_all, idxs, ws, E, R, me)
    got_x = recv_x[0] if fp8 else recv_x
    assert bytes_equal(got_x, exp["recv_x"]), f"{tag} recv_x"
    if fp8:
        exp_s = O.dispatch_oracle(scales_all, idxs, ws, E, R, me)["recv_x"]
        assert bytes_equal(recv_x[1], exp_s), f"{tag} recv scales"
    assert torch.equal(recv_idx, exp["recv_topk_idx"]), f"{tag} recv_topk_idx"
    assert torch.equal(recv_w, exp["recv_topk_weights"]), f"{tag} recv_topk_weights"
    assert per_expert == exp["per_expert"], f"{tag} per-expert {per_expert} != {exp['per_expert']}"
    assert torch.equal(handle.rank_prefix_matrix, exp["rank_prefix_matrix"]), f"{tag} rank_prefix_matrix"
    # positional order: DeepEP's intranode tuple on one node, its internode tuple on several
    multi = handle.topology.num_nodes > 1
    assert handle[0] is (handle.is_token_in_rank if multi else handle.rank_prefix_matrix) and len(handle) == (10 if multi else 6)
    assert torch.equal(handle.recv_src_idx, exp["recv_src_idx"]), f"{tag} recv_src_idx"
    assert torch.equal(handle.recv_src_rank, exp["recv_src_rank"]), f"{tag} recv_src_rank"
    assert handle.num_recv_tokens == exp["recv_x"].shape[0]

    # channel prefix matrices and send_head against their definitions
    C = handle.num_channels
    assert torch.equal(handle.channel_prefix_matrix, O.channel_prefix(exp_tir, C)), f"{tag} channel_prefix_matrix"
    for s in range(R):
        theirs = O.channel_prefix(O.layout(idxs[s], E, R, ranks_per_node)[3], C)
        assert torch.equal(handle.recv_channel_prefix_matrix[s], theirs[me]), f"{tag} recv_channel_prefix_matrix[{s}]"
    oracles = [O.dispatch_oracle(data_all, idxs, ws, E, R, r) for r in range(R)]
    for r in range(R):
        pos = {(int(s), int(t)): i for i, (s, t) in enumerate(zip(oracles[r]["recv_src_rank"], oracles[r]["recv_src_idx"]))}
        for t in range(idx.shape[0]):
            assert int(handle.send_head[t, r]) == pos.get((me, t), -1), f"{tag} send_head[{t},{r}]"

    # once-per-node: rows that crossed between nodes are the minimum
    after = buf.counters
    crossed = torch.tensor([after["internode_rows"] - before["internode_rows"]])
    torch.distributed.all_reduce(crossed)
    assert int(crossed) == O.min_internode_rows(idxs, E, R, ranks_per_node), f"{tag} internode rows {int(crossed)}"

    # ---- cached dispatch = fresh dispatch ----
    recv2, i2, w2, l2, h2, _ = buf.dispatch(x_in, handle=handle, config=config)
    assert i2 is None and w2 is None and l2 is None and h2 is handle
    if fp8:
        assert bytes_equal(recv2[0], recv_x[0]) and bytes_equal(recv2[1], recv_x[1]), f"{tag} cached"
    else:
        assert bytes_equal(recv2, recv_x), f"{tag} cached"

    # ---- combine: rows scaled per rank, half their elements (and the biases') +-2^26 (O.spread), so
    # the summation order (DeepEP's: biases first, then rank order) shows in the bits ----
    def rows_for(r):
        o = oracles[r]
        base = O.dequant(o["recv_x"], O.dispatch_oracle(scales_all, idxs, ws, E, R, r)["recv_x"]) \
            if fp8 else o["recv_x"]
        return O.spread((base.float() * (1 + r / 8)).to(torch.bfloat16), seed * 31 + r)
    ys = [rows_for(r) for r in range(R)]
    srcs = [list(zip(oracles[r]["recv_src_rank"].tolist(), oracles[r]["recv_src_idx"].tolist())) for r in range(R)]
    T = idx.shape[0]
    g = torch.Generator().manual_seed(seed + 7 * me)
    bias = tuple(O.spread(torch.randn(T, H, generator=g).to(torch.bfloat16), seed * 37 + 2 * me + i) for i in range(2))
    for biases in ((), bias[:1], bias):
        cx, cw, _ = buf.combine(ys[me], handle, recv_w, bias=biases if biases else None, config=config)
        exp_cx = O.combine_oracle(ys, srcs, T, H, me, ranks_per_node, R, biases)
        assert bytes_equal(cx, exp_cx), f"{tag} combine ({len(biases)} biases)"
        ws_rows = [oracles[r]["recv_topk_weights"] for r in range(R)]
        exp_cw = O.combine_weights_oracle(ws_rows, srcs, T, K, me, ranks_per_node, R)
        assert torch.equal(cw, exp_cw), f"{tag} combined weights"
    if ranks_per_node == R:  # a summation order per token (commlib's handle.sum_order), one node only
        orders = torch.randint(-2 ** 31, 2 ** 31, (T,), generator=g, dtype=torch.int64).to(torch.int32)
        orders[::2] = torch.tensor([sum(int(r) << (4 * i) for i, r in enumerate(torch.randperm(8, generator=g)))
                                    for _ in range(orders[::2].numel())], dtype=torch.int64).to(torch.int32) \
            if T else orders[::2]
        handle.sum_order = orders
        cx, _, _ = buf.combine(ys[me], handle, recv_w, bias=bias, config=config)
        handle.sum_order = None
        exp_cx = O.combine_oracle(ys, srcs, T, H, me, ranks_per_node, R, bias, sum_orders=orders.tolist())
        assert bytes_equal(cx, exp_cx), f"{tag} combine in handle.sum_order's order"
    # combine of the unchanged rows on one node = x times the number of ranks reached
    if ranks_per_node == R and not fp8:
        cx, cw, _ = buf.combine(recv_x, handle, config=config)
        assert cw is None
        k = exp_tir.sum(1, keepdim=True).float()
        assert bytes_equal(cx, (x.float() * k + 0.0).to(torch.bfloat16)), f"{tag} combine = x * ranks"
    buf.destroy()


def _routing_case(name):
    def case(ctx):
        for i, p in enumerate(topologies(ctx.world_size)):
            check_full(ctx, p, name, fp8=False, seed=zlib.crc32(name.encode()) % 1000 + i)
            if name in ("random", "group_limited", "some_empty"):
                check_full(ctx, p, name, fp8=True, seed=zlib.crc32(name.encode()) % 1000 + 50 + i)
    return case


for _name in ROUTINGS:
    globals()[f"case_routing_{_name}"] = _routing_case(_name)


def case_options(ctx):
    """expert_alignment, num_worst_tokens padding, and a too-small num_worst_tokens."""
    R, me = ctx.world_size, ctx.rank
    for p in topologies(R)[:2]:
        inputs = [make_inputs(11, r, "random", R) for r in range(R)]
        xs, idxs, ws = [i[0] for i in inputs], [i[1] for i in inputs], [i[2] for i in inputs]
        x, idx, w = inputs[me]
        buf = make_buffer(ctx, p)
        ntr, nrr, nte, tir, _ = buf.get_dispatch_layout(idx, E)
        exp = O.dispatch_oracle(xs, idxs, ws, E, R, me, alignment=8)
        _, _, _, lst, _, _ = buf.dispatch(x, num_tokens_per_rank=ntr, num_tokens_per_rdma_rank=nrr,
                                          is_token_in_rank=tir, num_tokens_per_expert=nte, topk_idx=idx,
                                          topk_weights=w, expert_alignment=8)
        assert lst == exp["per_expert"] and all(c % 8 == 0 for c in lst), lst
        n_max = max(O.dispatch_oracle(xs, idxs, ws, E, R, r)["recv_x"].shape[0] for r in range(R))
        worst = n_max + 5
        rx, ri, rw, lst, h, _ = buf.dispatch(x, num_tokens_per_rank=ntr, num_tokens_per_rdma_rank=nrr,
                                             is_token_in_rank=tir, num_tokens_per_expert=nte, topk_idx=idx,
                                             topk_weights=w, num_worst_tokens=worst)
        n = exp["recv_x"].shape[0]
        assert rx.shape[0] == worst and ri.shape[0] == worst and rw.shape[0] == worst
        assert lst == [] and h.num_recv_tokens is None
        assert bytes_equal(rx[:n], exp["recv_x"]) and bool((rx[n:] == 0).all())
        assert torch.equal(ri[:n], exp["recv_topk_idx"]) and bool((ri[n:] == -1).all())
        assert torch.equal(rw[:n], exp["recv_topk_weights"]) and bool((rw[n:] == 0).all())
        # combine of the padded rows: the padding is ignored, the rows sum as the oracle says
        cx, _, _ = buf.combine(rx, h)
        oracles = [O.dispatch_oracle(xs, idxs, ws, E, R, r) for r in range(R)]
        srcs = [list(zip(o["recv_src_rank"].tolist(), o["recv_src_idx"].tolist())) for o in oracles]
        exp_cx = O.combine_oracle([o["recv_x"] for o in oracles], srcs, x.shape[0], H, me, p, R)
        assert bytes_equal(cx, exp_cx), "combine after num_worst_tokens"
        try:
            buf.dispatch(x, num_tokens_per_rank=ntr, num_tokens_per_rdma_rank=nrr, is_token_in_rank=tir,
                         num_tokens_per_expert=nte, topk_idx=idx, num_worst_tokens=max(n_max - 1, 1))
        except ValueError as e:
            assert "num_worst_tokens" in str(e)
        else:
            if n_max > 1:
                raise AssertionError("too-small num_worst_tokens was accepted")
        buf.destroy()


def case_node_limit(ctx):
    """A token reaching more nodes than max_nodes_per_token is refused on every rank."""
    R = ctx.world_size
    if R < 5:
        return
    buf = make_buffer(ctx, 1, max_nodes_per_token=4)
    per = E // R
    x = torch.randn(2, H).to(torch.bfloat16)
    idx = torch.tensor([[0, per, 2 * per, 3 * per, 4 * per], [0, -1, -1, -1, -1]], dtype=torch.int64)
    ntr, nrr, nte, tir, _ = buf.get_dispatch_layout(idx, E)
    try:
        buf.dispatch(x, num_tokens_per_rank=ntr, num_tokens_per_rdma_rank=nrr, is_token_in_rank=tir,
                     num_tokens_per_expert=nte, topk_idx=idx)
    except ValueError as e:
        assert "max_nodes_per_token" in str(e), e
    else:
        raise AssertionError("5-node routing was accepted with the limit at 4")
    buf.destroy()
    buf = make_buffer(ctx, 1, max_nodes_per_token=8)  # raising the limit lets it through
    ntr, nrr, nte, tir, _ = buf.get_dispatch_layout(idx, E)
    rx, *_ = buf.dispatch(x, num_tokens_per_rank=ntr, num_tokens_per_rdma_rank=nrr, is_token_in_rank=tir,
                          num_tokens_per_expert=nte, topk_idx=idx)
    buf.destroy()


def case_bad_input(ctx):
    """Bad input: a clear error naming the argument, raised before anything is sent."""
    R = ctx.world_size
    buf = make_buffer(ctx, R)
    x, idx, w = make_inputs(3, ctx.rank, "random", R)
    ntr, nrr, nte, tir, _ = buf.get_dispatch_layout(idx, E)
    lay = dict(num_tokens_per_rank=ntr, is_token_in_rank=tir, num_tokens_per_expert=nte)
    _expect(TypeError, ["x", "bfloat16"], lambda: buf.dispatch(x.float(), topk_idx=idx, **lay))
    _expect(TypeError, ["topk_idx", "int64"], lambda: buf.dispatch(x, topk_idx=idx.int(), **lay))
    _expect(TypeError, ["topk_weights", "float32"], lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w.double(), **lay))
    _expect(ValueError, ["topk_idx", "rows"], lambda: buf.dispatch(x, topk_idx=idx[:-1], **lay))
    _expect(ValueError, ["x", "2-D"], lambda: buf.dispatch(x[0], topk_idx=idx, **lay))
    _expect(ValueError, ["contiguous"], lambda: buf.dispatch(x.t().contiguous().t(), topk_idx=idx, **lay))
    bad = idx.clone()
    bad[0, 0] = E
    _expect(ValueError, ["topk_idx", str(E)], lambda: buf.get_dispatch_layout(bad, E))
    _expect(ValueError, ["topk_idx"], lambda: buf.dispatch(x, topk_idx=bad, **lay))
    bad[0, 0] = -2
    _expect(ValueError, ["topk_idx", "-2"], lambda: buf.get_dispatch_layout(bad, E))
    if R > 1:
        _expect(ValueError, ["num_experts", "divisible"], lambda: buf.get_dispatch_layout(idx, R * 8 + 1))
    q, s = O.cast_fp8(torch.randn(4, 256))
    _expect(ValueError, ["scales", "shape"], lambda: buf.dispatch((q, s[:3]), topk_idx=idx[:4], **{
        "num_tokens_per_rank": ntr, "is_token_in_rank": tir[:4].contiguous(), "num_tokens_per_expert": nte}))
    odd = torch.zeros(4, 200, dtype=torch.float8_e4m3fn)
    _expect(ValueError, ["multiple of 128"], lambda: buf.dispatch((odd, torch.ones(4, 1)), topk_idx=idx[:4], **lay))
    _expect(ValueError, ["is_token_in_rank", "shape"],
            lambda: buf.dispatch(x, topk_idx=idx, num_tokens_per_rank=ntr, is_token_in_rank=tir[:-1].contiguous(),
                                 num_tokens_per_expert=nte))
    # rings larger than the buffer: the message says which size hint to pass
    big = Config(2, 8, 8192)  # 1 channel, rings of 8192 slots
    _expect(ValueError, ["get_nvl_buffer_size_hint", "num_max_nvl_chunked_recv_tokens"],
            lambda: buf.dispatch(x, topk_idx=idx, config=big, **lay))
    small = commlib.Buffer(ctx.group, 1024, ranks_per_node=R, backend="reference")
    _expect(ValueError, ["num_nvl_bytes", "get_nvl_buffer_size_hint"], lambda: small.dispatch(x, topk_idx=idx, **lay))
    # combine: wrong rows, wrong bias, foreign handle, use after destroy
    rx, ri, rw, _, h, _ = buf.dispatch(x, topk_idx=idx, topk_weights=w, **lay)
    _expect(ValueError, ["rows"], lambda: buf.combine(torch.cat([rx, rx[:1]]), h))
    _expect(ValueError, ["bias[0]", "shape"], lambda: buf.combine(rx, h, bias=torch.zeros(1, H, dtype=torch.bfloat16)))
    _expect(TypeError, ["handle"], lambda: buf.combine(rx, tuple(h)))
    _expect(ValueError, ["another Buffer"], lambda: small.combine(rx, h))
    _expect(TypeError, ["Config"], lambda: buf.dispatch(x, topk_idx=idx, config=object(), **lay))
    for args in ((4, 32, 16), (0, 1, 1)):
        _expect(ValueError, ["Config"], lambda: Config(*args))
    # DeepEP's Config takes an odd num_sms; a call refuses it (two CTAs per channel)
    _expect(ValueError, ["num_sms"], lambda: buf.dispatch(x, topk_idx=idx, config=Config(3, 8, 16), **lay))
    _expect(ValueError, ["even"], lambda: commlib.Buffer.set_num_sms(7))
    small.destroy()
    buf.destroy()
    _expect(RuntimeError, ["destroy"], lambda: buf.dispatch(x, topk_idx=idx, **lay))
    normal = make_buffer(ctx, R)
    _expect(RuntimeError, ["low_latency_mode=True"], lambda: normal.low_latency_dispatch(x, idx, 64, E))
    normal.destroy()


def case_error_kinds(ctx):
    """A host-side error inside a call (whatever its message says, e.g. torch's "cannot pin
    'torch.cuda.LongTensor'") raises as itself and the Buffer keeps working; a sticky CUDA failure
    (a trapped kernel: KernelLaunchError 719) raises CommlibError and retires the Buffer."""
    from commlib.utils.errors import CommlibError, KernelLaunchError, is_device_failure

    R = ctx.world_size
    assert not is_device_failure(RuntimeError("CUDA error: cannot pin 'torch.cuda.LongTensor'"))
    assert is_device_failure(KernelLaunchError("cuLaunchKernel failed: CUDA_ERROR_LAUNCH_FAILED (719)", 719))
    assert not is_device_failure(KernelLaunchError("cuLaunchKernel failed: CUDA_ERROR_INVALID_VALUE (1)", 1))
    buf = make_buffer(ctx, R)
    x, idx, w = make_inputs(5, ctx.rank, "random", R)
    real = buf.backend.get_dispatch_layout

    def host_error(*a):
        raise RuntimeError("cannot pin 'torch.cuda.LongTensor' only dense CPU tensors can be pinned")

    buf.backend.get_dispatch_layout = host_error
    _expect(RuntimeError, ["cannot pin"], lambda: buf.get_dispatch_layout(idx, E))
    buf.backend.get_dispatch_layout = real
    want = real(idx, E)
    got = buf.get_dispatch_layout(idx, E)   # still usable
    assert torch.equal(got[0], want.num_tokens_per_rank) and torch.equal(got[3], want.is_token_in_rank)

    def trapped(*a):
        raise KernelLaunchError("cuLaunchKernel failed: CUDA_ERROR_LAUNCH_FAILED (719)", 719)

    buf.backend.get_dispatch_layout = trapped
    try:
        buf.get_dispatch_layout(idx, E)
    except CommlibError as e:
        assert "unusable" in str(e), e
    else:
        raise AssertionError("a trapped kernel did not raise CommlibError")
    buf.backend.get_dispatch_layout = real
    _expect(RuntimeError, ["unusable after an earlier failure"], lambda: buf.get_dispatch_layout(idx, E))
    buf.destroy()


def case_one_channel(ctx):
    """num_sms=2 is one channel: the [R, 1] channel prefix matrices (and a zero-token rank's) must
    work through dispatch, cached dispatch and combine, flat, multi-node and on the internode engine."""
    one = Config(2, 8, 64)  # 1 channel of 64 slots: room for every rank's tokens
    for i, p in enumerate(topologies(ctx.world_size)):
        check_full(ctx, p, "random", fp8=False, seed=600 + i, config=one)
        check_full(ctx, p, "some_empty", fp8=True, seed=610 + i, config=one)
        check_full(ctx, p, "zero_tokens", fp8=False, seed=620 + i, config=one)
        if ctx.world_size // p > 1:
            check_full(ctx, p, "random", fp8=False, seed=630 + i, backend="internode", config=one)
