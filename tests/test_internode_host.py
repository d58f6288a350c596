"""The internode engine's per-call host work on the device path, counted on the CPU with fake
launches and collectives (tests/internode_host.py): the Python and C calls a call makes stay within
what the kept scratch and plans leave, and a non-cached dispatch of one shape reuses its scratch."""
import pytest
import torch

import internode_host as IH
from commlib import Config
from commlib.backends.internode import kernels as IK
from commlib.backends.internode.exchange import N_SIG


def test_calls_per_op_stay_within_budget():
    """Python / C calls per call at 2 x 1 and 2 x 2 (T 64): the full paths and the Buffer's replays of a
    cached dispatch and a combine (plan_for / run_plan). 2 x 1: dispatch 70 / 92, cached 46 / 27, combine
    47 / 31, their replays 25 / 15 and 25 / 20 (before kept launches: 149 / 133, 68 / 33, 54 / 36); 2 x 2:
    91 / 103, 71 / 35, 71 / 38, replays 33 / 18 and 33 / 23 (before: 183 / 154, 97 / 48, 81 / 54). The
    outputs are views of one allocation (rows.output_views: two C calls each, one allocator call fewer
    per output), the kept calls' scratch the engine's staging rows. A budget a few calls above, so an
    added per-call step shows."""
    budget = {1: {"dispatch": (74, 96), "cached": (50, 30), "combine": (51, 34), "cached_replay": (28, 18),
                  "combine_replay": (28, 23)},
              2: {"dispatch": (95, 107), "cached": (75, 38), "combine": (75, 41), "cached_replay": (36, 21),
                  "combine_replay": (36, 26)}}
    for P, limits in budget.items():
        got = IH.run(2, P, 64, 256, 64, 4, reps=3)
        for op, (py, c) in limits.items():
            assert got[op]["python_calls"] <= py and got[op]["c_calls"] <= c, (P, op, got[op])


def test_kept_calls_share_the_staging_rows():
    """The kept calls' scratch is the engine's staging rows (Wiring.staging): two handles' cached
    dispatches and combines all use it, none allocates its own; a call needing more grows it (a quarter
    of headroom), a call kept before keeps its rows; past the Buffer's num_rdma_bytes it warns, once."""
    import types
    import warnings
    from commlib.backends.base import CombineRequest, DispatchRequest
    be, fakes, inp, cfg = IH.build(2, 2, 64, 256, 64, 4, 2, Config(2, 4, 8, 1, 2))
    w, (idx, wts, lay) = be.wiring, inp
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    kept = []
    with IH.patched(fakes):
        for _ in range(2):   # two handles, each with its cached dispatch and combine
            res = be.dispatch(DispatchRequest(x, None, idx, wts, lay, None, 64, 1, 0, cfg))
            h = res.handle
            be.dispatch(DispatchRequest(x, None, None, None, None, h, 0, 1, 0, cfg))
            y = torch.zeros(h.num_recv_tokens, 256, dtype=torch.bfloat16)
            be.combine(CombineRequest(y, h, res.recv_topk_weights, [], cfg))
            kept += list(h.extra["plan"].kept.values())
    stage = w.stage
    assert len(kept) == 4 and stage is not None and stage.dim() == 1 and stage.dtype == torch.uint8
    for k in kept:
        assert k.scratch().untyped_storage().data_ptr() == stage.untyped_storage().data_ptr()
        assert k.scratch().shape == (k.rows, k.width)
    held = w.staging(3, 8)   # an earlier call's rows, then a call that needs more
    need = stage.numel() + 1
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        w.ctx = types.SimpleNamespace(num_rdma_bytes=need, comm_stream=None)
        grown = w.staging(1, need)
        again = w.staging(1, need + need // 8)
    assert grown.shape == (1, need) and w.stage.numel() == need + (need >> 2)
    assert again.untyped_storage().data_ptr() == grown.untyped_storage().data_ptr()   # within the headroom
    assert held.untyped_storage().data_ptr() == stage.untyped_storage().data_ptr() != grown.untyped_storage().data_ptr()
    assert kept[0].scratch().untyped_storage().data_ptr() == stage.untyped_storage().data_ptr()
    assert sum("num_rdma_bytes" in str(m.message) for m in seen) == 1
    be.destroy()   # the Buffer's destroy lets the engine's staging rows go
    assert w.stage is None


def test_dispatch_keeps_its_scratch_and_launches_per_shape():
    """A non-cached dispatch of a shape seen before reuses its scratch and its kept launches (the same
    objects, nothing rebuilt); another shape (FP8 x) gets its own, and the first is still there."""
    be, fakes, inp, cfg = IH.build(2, 1, 64, 256, 64, 4)
    with IH.patched(fakes):
        ops = IH.calls_of(be, 256, inp, cfg)
        (key, f), = be.scratch.shapes.items()
        kept = (f.row, f.g, f.dig, f.meta, f.digest, f.pack, f.land, f.recv_chan)
        assert all(k is not None for k in kept)
        ops["dispatch"]()
        assert be.scratch.shapes == {key: f}
        assert all(a is b for a, b in zip(kept, (f.row, f.g, f.dig, f.meta, f.digest, f.pack, f.land, f.recv_chan)))
        IH.calls_of(be, 256, inp, cfg, fp8=True)["dispatch"]()
        assert len(be.scratch.shapes) == 2 and be.scratch.shapes[key] is f and fakes.launches > 0


def test_meta_reads_the_calls_signature():
    """The meta launch's head row (pinned host memory the engine writes in place) holds [0] + this
    call's signature at the address and length the launch names, call after call, and in a fresh row
    when the last one may still be read (busy)."""
    be, fakes, inp, cfg = IH.build(2, 1, 64, 256, 64, 4)
    with IH.patched(fakes):
        ops = IH.calls_of(be, 256, inp, cfg)
        rows = set()
        for busy in (False, False, True, False):
            be.head.busy = busy
            fakes.trace = []
            ops["dispatch"]()
            meta, = [e for e in fakes.trace if e[0] == "inter_meta_kernel"]
            fakes.trace = None
            head = be.head._head[0]
            sig = be.signature(1, 256, 64, False, 4, True, cfg)
            assert meta[3][IK.META_HEAD] == head.data_ptr() and meta[3][4] == head.numel() == 1 + len(sig)
            assert head.tolist() == [0] + sig, (head.tolist(), sig)
            rows.add(head.data_ptr())
        assert len(rows) == 2   # the busy call made a new row, kept from then on


@pytest.mark.parametrize("P", [1, 2])
def test_dispatch_network_chunk_moves_the_exchanged_counts(P):
    """A one-chunk dispatch's all-to-all sends this rank's rows per node and receives, from each rail
    peer, that peer's rows for this node, as the gathered exchange rows say (read from the rows
    themselves, not from the digest the engine reads)."""
    be, fakes, inp, cfg = IH.build(2, P, 64, 256, 64, 4)
    with IH.patched(fakes):
        ops = IH.calls_of(be, 256, inp, cfg)
        fakes.trace = []
        ops["dispatch"]()
        a2a = [e for e in fakes.trace if e[0] == "a2a"]
        fakes.trace = None
    M, R = 2, 2 * P
    width = N_SIG + R + 2 + M   # the row up to its rows per destination node [M] (exchange.py)
    send1 = fakes.g[:, width - M:width].tolist()
    (_, _, _, out_splits, in_splits), = a2a
    assert list(in_splits) == send1[0] and list(out_splits) == [send1[m * P][0] for m in range(M)], (a2a, send1)


def _traced(fakes, fn, inputs, held: list) -> list:
    """What one call issues (launches, network chunks), each address named by the tensor it points
    into: ``inputs`` by name (a dict, or a callable giving it after the call), the call's outputs, its
    other allocations by order; other addresses (the handle's and the plan's tensors,
    kept across calls) as they are. Every allocation is held in ``held``, so no address of this call
    can be one an earlier traced call had."""
    made, real = [], torch.empty

    def spy(*a, **k):
        t = real(*a, **k)
        made.append(t)
        return t
    fakes.trace = []
    torch.empty = spy
    try:
        out = fn()
    finally:
        torch.empty = real
    trace, fakes.trace = fakes.trace, None
    held.append((made, out))
    outs = [t for t in (out if isinstance(out, tuple) else (out.recv_x, out.recv_x_scales, out.recv_topk_idx,
                                                             out.recv_topk_weights) if hasattr(out, "recv_x")
                        else (out.combined_x, out.combined_topk_weights)) if t is not None]
    if callable(inputs):   # tensors the call made and kept (named after it)
        inputs = inputs()
    named = [(f"in {k}", t) for k, t in inputs.items() if t is not None] + [(f"out {i}", t) for i, t in enumerate(outs)]
    storages = {t.untyped_storage().data_ptr() for _, t in named}
    named += [(f"alloc {i}", t) for i, t in enumerate(t for t in made if t.untyped_storage().data_ptr() not in storages)]

    def name(v):
        if type(v) is int and v > 1 << 16:
            for label, t in named:
                lo = t.data_ptr()
                if lo <= v < lo + max(1, t.numel() * t.element_size()) and t.numel():
                    return (label, v - lo)
        return v
    return [tuple(name(v) if not isinstance(v, tuple) else tuple(map(name, v)) for v in entry) for entry in trace]


@pytest.mark.parametrize("P,chunks,fp8", [(1, 1, False), (1, 1, True), (2, 3, False), (2, 3, True)])
def test_replays_issue_what_the_full_path_issues(P, chunks, fp8):
    """A replayed cached dispatch and combine (plan_for / run_plan on new inputs) issue the launches and
    network chunks of the full path, argument for argument, with every address in its place: the
    inputs', the outputs', the scratch's (at its offsets), the plan's."""
    be, fakes, inp, cfg = IH.build(2, P, 64, 256, 64, 4, chunks, Config(2, 4, 8, 1, 2))   # ring of 2 rows
    with IH.patched(fakes):
        from commlib.backends.base import CombineRequest, DispatchRequest
        from commlib.fp8 import per_token_cast_to_fp8
        idx, w, lay = inp
        x = torch.randn(64, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
        xq, sq = per_token_cast_to_fp8(x) if fp8 else (x, None)
        res = be.dispatch(DispatchRequest(xq, sq, idx, w, lay, None, 64, 1, 0, cfg))
        h, wts = res.handle, res.recv_topk_weights
        assert h.extra["plan"].num_chunks == (chunks if P > 1 else 1)
        y = torch.randn(h.num_recv_tokens, 256).to(torch.bfloat16)
        held = []
        stage = lambda **kw: dict(kw, stage=be.wiring.stage)   # the kept calls' scratch: the engine's staging rows
        full = _traced(fakes, lambda: be.dispatch(DispatchRequest(xq, sq, None, None, None, h, 0, 1, 0, cfg)),
                       lambda: stage(x=xq, scales=sq), held)
        x2, s2 = xq.clone(), (sq.clone() if sq is not None else None)   # other addresses
        kept = be.plan_for(h, ("dispatch", xq.dtype), x2, cfg, s2)
        assert kept is not None and be.plan_for(h, ("dispatch", xq.dtype), x2[:-1], cfg, s2) is None
        again = _traced(fakes, lambda: be.run_plan(kept, x2, s2, 0), lambda: stage(x=x2, scales=s2), held)
        assert again == full and len(full) >= 3
        full = _traced(fakes, lambda: be.combine(CombineRequest(y, h, wts, [], cfg)), lambda: stage(y=y, w=wts), held)
        y2, w2 = y.clone(), wts.clone()
        kept = be.plan_for(h, ("combine", wts.shape[1]), y2, cfg, w2)
        assert kept is not None and be.plan_for(h, ("combine", wts.shape[1]), y2, cfg, None) is None
        again = _traced(fakes, lambda: be.run_plan(kept, y2, w2, 0), lambda: stage(y=y2, w=w2), held)
        assert again == full and len(full) >= 3


def _handle_names(h) -> dict:
    """The tensors of a dispatch's handle and plan, by name (what its later calls' launches point at)."""
    plan = h.extra["plan"]
    out = {f: getattr(h, f) for f in ("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix",
                                      "recv_src_idx", "send_head")}
    out.update({"slot": plan.slot, "land_all": plan.land_all})
    out.update({f"landed_pos {k}": t for k, t in enumerate(plan.landed_pos)})
    return out


@pytest.mark.parametrize("P,chunks", [(1, 1), (2, 3)])
def test_kept_launches_issue_what_first_ones_issue(P, chunks):
    """A dispatch, its cached dispatch and its combine on the launches kept from the calls of another
    routing's handle (the shared per-shape launches) issue what an engine's first such calls issue for
    the same calls, argument for argument (addresses named: inputs, the staging rows, the handle's and
    plan's tensors, the calls' allocations and outputs; the row counts)."""
    from commlib.backends.base import CombineRequest, DispatchRequest
    cfg = Config(2, 4, 8, 1, 2)
    (a, fa, inp_a, _), (b, fb, inp_b, _) = (IH.build(2, P, 64, 256, 64, 4, chunks, cfg, seed=s) for s in (100, 300))
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    req = lambda inp: DispatchRequest(x, None, inp[0], inp[1], inp[2], None, 64, 1, 0, cfg)
    cached = lambda be, h: be.dispatch(DispatchRequest(x, None, None, None, None, h, 0, 1, 0, cfg))
    ys = {}

    def combine(be, res):
        y = ys.setdefault(res.handle.num_recv_tokens, torch.randn(res.handle.num_recv_tokens, 256).to(torch.bfloat16))
        return be.combine(CombineRequest(y, res.handle, res.recv_topk_weights, [], cfg))

    def named(be, inp, res=None):
        (f,) = be.scratch.shapes.values()
        fan = getattr(be.node, "fan", None)   # the forwarder's: the peers' addresses and this rank's area
        out = {"x": x, "tir": inp[2].is_token_in_rank, "topk": inp[0], "w": inp[1], "head": be.head._head[0],
               "row": f.row, "g": f.g, "dig": f.dig, "before": f.before, "spos": f.spos,
               "peers": fan and fan.peer_bases, "area": fan and fan.area, "stage": be.wiring.stage}
        if res is not None:
            out.update(_handle_names(res.handle), y=ys.get(res.handle.num_recv_tokens), rw=res.recv_topk_weights)
        return out
    held, got = [], {}
    with IH.patched(fa):
        res_a = a.dispatch(req(inp_a))          # the shape's launches, kept
        cached(a, res_a.handle)
        combine(a, res_a)
        assert fa.digest[2] != fb.digest[2]     # the other routing lands another number of rows here
        fa.g, fa.digest = fb.g, fb.digest       # the peers' rows of the other routing
        a.head.busy = True                      # as if a call were in flight: a new head row
        res = []
        got["kept"] = [_traced(fa, lambda: res.append(a.dispatch(req(inp_b))) or res[0], lambda: named(a, inp_b),
                               held)]
        got["kept"] += [_traced(fa, fn, lambda: named(a, inp_b, res[0]), held)
                        for fn in (lambda: cached(a, res[0].handle), lambda: combine(a, res[0]))]
    with IH.patched(fb):
        res = []
        got["first"] = [_traced(fb, lambda: res.append(b.dispatch(req(inp_b))) or res[0], lambda: named(b, inp_b),
                                held)]
        got["first"] += [_traced(fb, fn, lambda: named(b, inp_b, res[0]), held)
                         for fn in (lambda: cached(b, res[0].handle), lambda: combine(b, res[0]))]
    for op, kept, first in zip(("dispatch", "cached dispatch", "combine"), got["kept"], got["first"]):
        assert len(kept) >= 3 and kept == first, f"{op}: kept launches issued other launches than first ones"


@pytest.mark.parametrize("P", [1, 2])
def test_dispatch_launches_point_at_the_handle_and_outputs(P):
    """The slots a dispatch sets in its kept launches hold the addresses of the tensors it returns: the
    handle's matrices and indices, the plan's slots and landed positions, the outputs (the second
    dispatch of the shape, on the kept launches)."""
    from commlib.backends.base import DispatchRequest
    be, fakes, inp, cfg = IH.build(2, P, 64, 256, 64, 4)
    x = torch.randn(64, 256).to(torch.bfloat16)
    with IH.patched(fakes):
        be.dispatch(DispatchRequest(x, None, inp[0], inp[1], inp[2], None, 64, 1, 0, cfg))
        fakes.trace = []
        res = be.dispatch(DispatchRequest(x, None, inp[0], inp[1], inp[2], None, 64, 1, 0, cfg))
    h = res.handle
    plan = h.extra["plan"]
    issued = {e[0]: e[3] for e in fakes.trace if e[0] != "a2a"}
    ptr = lambda t: t.data_ptr()
    pack, land, chan = issued["inter_pack_kernel"], issued["inter_land_kernel"], issued["inter_recv_chan_kernel"]
    assert (pack[IK.PACK_SLOT], pack[IK.PACK_SEND_HEAD], pack[IK.PACK_RANK_PREFIX], pack[IK.PACK_CHAN_PREFIX],
            pack[IK.PACK_X], pack[IK.PACK_TIR], pack[IK.PACK_TOPK], pack[IK.PACK_W]) == \
        tuple(map(ptr, (plan.slot, h.send_head, h.rank_prefix_matrix, h.channel_prefix_matrix, x,
                        inp[2].is_token_in_rank, inp[0], inp[1])))
    assert (land[IK.LAND_X], land[IK.LAND_SRC], land[IK.LAND_TOPK], land[IK.LAND_W], land[IK.LAND_N_OUT]) == \
        (ptr(res.recv_x), ptr(h.recv_src_idx), ptr(res.recv_topk_idx), ptr(res.recv_topk_weights), h.num_recv_tokens)
    assert land[IK.LAND_POS] == (ptr(plan.land_all) if P == 1 else 0)
    assert (chan[IK.RECV_CHAN_SRC], chan[IK.RECV_CHAN_OUT]) == (ptr(h.recv_src_idx), ptr(h.recv_channel_prefix_matrix))


def _node_barriers(trace: list) -> list:
    """A call's launches as the node barrier sees them, in order: ("barrier",) for a barrier launch,
    ("forward" / "reduce" / "rows" / "pack", rows, sync flags) for a kernel that may take its pieces
    (fanout.py sync; a pack without flags left out)."""
    from commlib.backends.internode import fanout as F
    out = []
    for e in trace:
        name, args = e[0], e[3] if len(e) > 3 else ()
        if name == "fanout_barrier_kernel":
            out.append(("barrier",))
        elif name == "fanout_forward_kernel":
            out.append(("forward", args[F.FORWARD_J], args[F.FORWARD_SYNC]))
        elif name == "fanout_reduce_kernel":
            out.append(("reduce", args[F.REDUCE_J], args[F.REDUCE_SYNC]))
        elif name == "inter_rows_kernel":
            out.append(("rows", args[IK.ROWS_N], args[IK.ROWS_SYNC]))
        elif name == "inter_pack_kernel" and args[IK.PACK_SYNC]:
            out.append(("pack", args[4], args[IK.PACK_SYNC]))
    return out


def _check_node_protocol(steps: list, op: str, sides: list = None) -> None:
    """fanout.py's protocol, whatever carries the barriers: a call enters two barriers (every local
    rank alike, so their counts stay in step); a dispatch's stores come after the first (a forward
    that enters it takes it before its own stores) and before the second, which is a whole one (the
    landed rows are read after it); a combine's rows come between its two barriers and no reduce reads
    before the second is waited for (a split one: its first reduce waits). ``sides``: the forwards run
    on two streams (a cached dispatch: forward k on the side stream where sides[k]), each waiting on its
    own stream, which forks from the current one after the pack and joins it before the last forward."""
    from commlib.backends.internode import fanout as F
    entered, waited, k = 0, {False: 0, True: 0}, 0   # barriers entered; the last one waited for, per stream
    for step in steps:
        kind, sync = step[0], (step[2] if len(step) > 2 else 0)
        if kind == "barrier":
            entered = waited[False] = entered + 1
            continue
        side = bool(sides and kind == "forward" and sides[k])
        if kind == "forward" and sides and k == len(sides) - 1:   # the join: the side stream's waits count
            waited[False] = max(waited[False], waited[True])
        if sync & (F.SYNC_ENTER | F.SYNC_ARRIVE_START):
            entered += 1
        if sync & F.SYNC_ENTER:
            waited[side] = entered
        if sync & F.SYNC_WAIT_START:
            waited[side] = entered
        if kind in ("forward", "rows"):   # stores into areas: after the first barrier, before the second
            assert waited[side] == 1 and entered == 1, (op, steps)
        if kind == "reduce":              # loads from peers' areas: after every rank's rows
            assert waited[side] == 2, (op, steps)
        if sync & F.SYNC_ARRIVE_END:
            entered += 1
            if sync & F.SYNC_WAIT_END:
                waited[side] = entered
        k += kind == "forward"
    assert entered == 2, (op, steps)
    if op != "combine":
        assert waited[False] == 2, (op, steps)


@pytest.mark.parametrize("chunks", [1, 3])
def test_forwarder_calls_keep_the_node_barrier_protocol(chunks):
    """2 x 2 (the forwarder): the Python paths and the Buffer's replays of a dispatch, cached dispatch
    and combine each enter the node barrier twice, in fanout.py's order, with the barriers folded into
    the kernels beside them (no barrier launch of their own); a dispatch's pack arrives and its
    forwards, on two streams, wait on each."""
    be, fakes, inp, cfg = IH.build(2, 2, 64, 256, 64, 4, chunks, Config(2, 4, 8, 1, 2))
    be.node.gpu_share = 4   # four ranks on one GPU: the synced rows kernel's grid is split four ways
    with IH.patched(fakes):
        from commlib.backends.base import CombineRequest, DispatchRequest
        idx, w, lay = inp
        x = torch.randn(64, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
        held = []
        calls = {}
        res = None

        def dispatch():
            nonlocal res
            res = be.dispatch(DispatchRequest(x, None, idx, w, lay, None, 64, 1, 0, cfg))
            return res
        calls["dispatch"] = _traced(fakes, dispatch, {"x": x}, held)
        h = res.handle
        assert h.extra["plan"].num_chunks == chunks
        y = torch.randn(h.num_recv_tokens, 256).to(torch.bfloat16)
        cached = DispatchRequest(x, None, None, None, None, h, 0, 1, 0, cfg)
        calls["cached dispatch"] = _traced(fakes, lambda: be.dispatch(cached), {"x": x}, held)
        kept = be.plan_for(h, ("dispatch", x.dtype), x, cfg, None)
        calls["cached replay"] = _traced(fakes, lambda: be.run_plan(kept, x, None, 0), {"x": x}, held)
        comb = CombineRequest(y, h, res.recv_topk_weights, [], cfg)
        calls["combine"] = _traced(fakes, lambda: be.combine(comb), {"y": y}, held)
        kept = be.plan_for(h, ("combine", 4), y, cfg, res.recv_topk_weights)
        calls["combine replay"] = _traced(fakes, lambda: be.run_plan(kept, y, res.recv_topk_weights, 0), {"y": y}, held)
    assert h.extra["plan"].kept[("combine", 4)].rows_ctas == IK.MAX_CTAS // 8
    from commlib.backends.internode.fanout import chunk_sides
    for op, trace in calls.items():
        steps = _node_barriers(trace)
        assert steps and not any(s[0] == "barrier" for s in steps), (op, steps)
        two = not op.startswith("combine")   # a dispatch's pack arrives, its forwards on two streams
        assert two == (steps[0][0] == "pack"), (op, steps)
        _check_node_protocol(steps, "combine" if op.startswith("combine") else "dispatch",
                             chunk_sides(chunks) if two else None)
