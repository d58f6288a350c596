"""The internode engine's C++ call path (csrc/callpath_internode.cpp) without a GPU.

Its engine runs in test mode (a recorder in place of the device) on the CPU stand-in of the
internode engine's device path (tests/internode_host.py, fakes for launches and collectives), with
loader.replay making driver Replays of fake launchers, so the Python path's kept calls and their C++
twins exist. A cached dispatch or combine the C++ engine replays issues what the Python replay
(plan_for / run_plan) issues for the same call: the same launches, argument for argument (this
call's tensors named: inputs, outputs, scratch at its offsets), the same network chunks, the same
allocations but that two outputs are carved from one; it counts the same; a call that differs in anything the Python replay checks returns
None. A non-cached dispatch it serves (opt-in, one rank per node) issues what device.py dispatch issues
(launches, the all-gather, the digest read, the all-to-all) and returns the same outputs, handle and plan.
The C++ collective (torch's c10d ProcessGroup from C++) runs on a one-rank gloo group.
What runs on the GPU: tests/cases_internode.py case_callpath and case_callpath_dispatch (bit for bit,
gpu_check.sh stage incpp).
"""
from __future__ import annotations

import ctypes
import dataclasses
import gc
import struct
import types
import weakref

import pytest
import torch
import torch.distributed as dist

import internode_host as IH
from carved import check_carved
from commlib.backends.base import CombineRequest, DispatchRequest
from commlib.backends.internode.fanout import FORWARD_POS, chunk_sides
from commlib.backends.probe import NULL_PROBE, RecordingProbe
from commlib.buffer import Buffer
from commlib.config import Config
from commlib.cuda import callpath
from commlib.cuda import loader as K
from commlib.fp8 import per_token_cast_to_fp8

BUFFER_ID, ENTRY, COMPUTE, COMM = 91, 0xE0, 1, 2
CFG = Config(2, 4, 8, 1, 2)   # a ring of 2 rows: several chunks where the cap allows


@pytest.fixture(scope="module")
def ext():
    mod = callpath.load_internode()
    assert mod is not None, f"the internode C++ call path did not build or load: {callpath.why_unavailable}"
    return mod


class _Launcher:
    """What loader.Replay and its C++ twin read of a loader._Launcher (from the kernel's C signature)."""

    ids: dict = {}

    def __init__(self, family: str, name: str) -> None:
        self.family, self.name = family, name
        self.handle = self.ids.setdefault(name, 0xF000 + 16 * len(self.ids))
        self.names = tuple(p for p, _ in K.kernel_params(family, name))
        self.codes = K.kernel_signature(family, name)
        self.fmt = struct.Struct("@" + self.codes)
        self.offsets = tuple(K.param_offsets(self.codes))
        self.count = len(self.codes)


@pytest.fixture
def rig(ext, monkeypatch):
    """Builds a rig per (P, chunks): the engine stand-in with Replays that trace into its fakes, the
    C++ engine in test mode, a Buffer stand-in."""
    names = {}

    def replay(family, name, grid, block, args, variant_key=None, shared_mem=0):
        lau = _Launcher(family, name)
        names[lau.handle] = lau
        lau.fmt.pack(*args)
        return K.Replay(lau, grid, block, list(args), shared_mem)

    monkeypatch.setattr(K, "replay", replay)
    made = []

    def build(P: int, chunks: int, sync: bool = False):
        """``sync``: the rail step can issue on the current stream (NCCL's asyncOp=False: no work)."""
        be, fakes, inp, _ = IH.build(2, P, 64, 256, 64, 4, chunks, CFG)
        be._twins, be.timeout_ns = True, 10**9
        fakes.waits = 0
        if sync:
            be.network._direct_sync = (lambda out, send, o, i, opts: fakes.all_to_all(out, send, o, i) and None, None)

        def wait(work, *a, **k):
            fakes.waits += 1
            return True
        monkeypatch.setattr(IH._Work, "wait", wait)
        monkeypatch.setattr(K.Replay, "issue", lambda self, stream: fakes.launch(
            self.lau.family, self.lau.name, self.grid, self.block, self.args, self.shared_mem))   # traced there
        eng = callpath.engine(buffer_type=Buffer, comm_stream=types.SimpleNamespace(), entry_event=ENTRY,
                              device_index=-1, rank=0, num_ranks=2 * P, timeout_ns=10**9, test=True, comm_raw=COMM,
                              make_twin=be.cpp_twin)
        eng.test_stream = COMPUTE
        buf = types.SimpleNamespace(_destroyed=False, backend=be, buffer_id=BUFFER_ID, _configs={})
        cm = IH.patched(fakes)
        cm.__enter__()
        made.append(cm)
        return types.SimpleNamespace(be=be, fakes=fakes, inp=inp, eng=eng, buf=buf, names=names)
    ext._record(True)
    yield build
    ext._record(False)
    for cm in reversed(made):   # (nested patches: the last made restores first)
        cm.__exit__(None, None, None)


def _dispatch(r, fp8: bool):
    """A non-cached dispatch (its handle) and the cached dispatch's and combine's full paths (their
    kept calls): (x, scales, handle, y, weights)."""
    idx, w, lay = r.inp
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    xq, sq = per_token_cast_to_fp8(x) if fp8 else (x, None)
    res = r.be.dispatch(DispatchRequest(xq, sq, idx, w, lay, None, 64, 1, 0, CFG))
    h = res.handle
    h.buffer_id = BUFFER_ID
    y = torch.randn(h.num_recv_tokens, 256).to(torch.bfloat16)
    r.be.dispatch(DispatchRequest(xq, sq, None, None, None, h, 0, 1, 0, CFG))
    r.be.combine(CombineRequest(y, h, res.recv_topk_weights, [], CFG))
    return xq, sq, h, y, res.recv_topk_weights


def _python(r, key, a, b, h) -> tuple:
    """The Python replay of a call (plan_for / run_plan): (trace, outputs, scratch)."""
    made, real = [], torch.empty

    def spy(*args, **kw):
        t = real(*args, **kw)
        made.append(t)
        return t
    kept = r.be.plan_for(h, key, a, CFG, b)
    assert kept is not None
    r.fakes.trace = []
    torch.empty = spy
    try:
        outs = r.be.run_plan(kept, a, b, 0)
    finally:
        torch.empty = real
    trace, r.fakes.trace = r.fakes.trace, None
    # (run: its outputs' one allocation; its scratch is its rows in the engine's staging rows, kept)
    return trace, [o for o in outs if o is not None], kept.scratch(), len(made)


def _cpp(r, ext, recorded, streams=None) -> tuple:
    """The C++ call's recorded operations as the Python trace's entries: (trace, scratch (address, bytes),
    allocations, the other operations); ``streams`` gets each launch's (name, stream)."""
    trace, scratch, allocs, other = [], None, 0, []
    for op in recorded:
        if op[0] == "launch":
            lau = r.names[op[1]]
            args = lau.fmt.unpack(op[6][:lau.fmt.size])
            trace.append((lau.name, op[3], op[4], tuple(args), op[5]))
            if streams is not None:
                streams.append((lau.name, op[2]))
            assert op[2] in (COMM, COMM + 1)   # the comm stream, or a cached dispatch's side stream (test mode)
        elif op[0] == "a2a":
            trace.append(tuple(op))
        elif op[0] == "scratch":
            scratch = (op[1], op[2])
        elif op[0] == "alloc":
            allocs += 1
        else:
            other.append(op[0])
    return trace, scratch, allocs, other


def _namer(regions: list):
    """Addresses inside one of ``regions`` [(label, address, bytes)] as (label, offset), else one just past
    one's end (an empty view at its end); other values as they are."""
    def name(v):
        if type(v) is int and v > 1 << 16:
            for label, lo, n in regions:
                if lo <= v < lo + max(1, n):
                    return (label, v - lo)
            for label, lo, n in regions:
                if v == lo + n:
                    return (label, n)
        return v
    return name


def _named(trace, regions: list) -> list:
    name = _namer(regions)
    return [tuple(name(v) if not isinstance(v, tuple) else tuple(map(name, v)) for v in e) for e in trace]


def _region(t) -> tuple:
    return t.data_ptr(), t.numel() * t.element_size()


@pytest.mark.parametrize("P,chunks,fp8,sync", [(1, 1, False, False), (1, 1, True, False), (2, 3, False, False),
                                              (2, 3, True, False), (1, 1, True, True), (1, 3, False, True),
                                              (2, 1, False, True), (2, 3, True, True)])
def test_cpp_replays_issue_what_python_replays_issue(rig, ext, P, chunks, fp8, sync):
    """The C++ replays issue what the Python replays issue, launch for launch, chunk for chunk, wait for
    wait. ``sync``: the chunks go on the current stream where no node step runs beside them (one chunk,
    or one rank per node), without a wait, in both paths."""
    r = rig(P, chunks, sync)
    on_stream = sync and (chunks == 1 or P == 1)
    xq, sq, h, y, wts = _dispatch(r, fp8)
    if P > 1:
        assert h.extra["plan"].num_chunks == chunks
    # another handle's calls between: they move the shared per-shape launches' slots to its tensors
    r.be.head.busy = True   # as if a call were in flight: a new head row (tests/test_internode_host.py)
    other = _dispatch(r, fp8)[2]
    assert other.send_head.data_ptr() != h.send_head.data_ptr()
    for op in ("cached", "combine"):
        a, b = (xq.clone(), sq.clone() if sq is not None else None) if op == "cached" else (y.clone(), wts.clone())
        ext._recorded()
        if op == "cached":
            out = r.eng.cached_dispatch(r.buf, a if b is None else (a, b), h, 1, CFG, None, False, False)
            assert out is not None and out[4] is h and out[1:4] == (None, None, None)
            outs = [out[0]] if b is None else list(out[0])
            key = ("dispatch", a.dtype)
        else:
            out = r.eng.combine(r.buf, a, h, b, CFG, None, False, False)
            assert out is not None and out[1] is not None
            outs, key = [out[0], out[1]], ("combine", b.shape[1])
        streams = []
        got, scratch, allocs, other_ops = _cpp(r, ext, ext._recorded(), streams)
        w0 = r.fakes.waits
        want, p_outs, p_scratch, p_allocs = _python(r, key, a, b, h)
        p_waits = r.fakes.waits - w0
        ins = [("in a", *_region(a))] + ([("in b", *_region(b))] if b is not None else [])
        cpp_named = _named(got, ins + [(f"out {i}", *_region(t)) for i, t in enumerate(outs)] + [("scratch", *scratch)])
        py_named = _named(want, ins + [(f"out {i}", *_region(t)) for i, t in enumerate(p_outs)]
                          + [("scratch", *_region(p_scratch))])
        assert cpp_named == py_named and len(got) >= 3, op
        assert p_scratch.numel() and all(t.numel() for t in outs)   # rows to move: every launch and chunk runs
        # two outputs (FP8 scales, combined weights): one allocation, the second at a 256-byte boundary, alike
        assert allocs == p_allocs and scratch[1] == p_scratch.numel()
        assert [t.data_ptr() - outs[0].data_ptr() for t in outs] == [t.data_ptr() - p_outs[0].data_ptr() for t in p_outs]
        assert len({t.untyped_storage().data_ptr() for t in p_outs}) == 1
        assert [tuple(t.shape) for t in outs] == [tuple(t.shape) for t in p_outs]
        assert [t.dtype for t in outs] == [t.dtype for t in p_outs]
        # a cached dispatch with the forwarder and several chunks: its chunks on two streams, the side stream's
        # fork before the first and its join before the last forward (network.py stream), no wait between
        two = op == "cached" and P > 1 and chunks > 1 and sync
        waits = other_ops.count("a2a_wait")
        assert waits == p_waits and (waits == 0) == (on_stream or two), (waits, p_waits)   # the comm stream's waits
        # _enter, _leave (and the fork and join)
        assert [o for o in other_ops if o != "a2a_wait"] == (["record", "wait", "fork", "join", "record", "wait"] if two
                                                             else ["record", "wait", "record", "wait"]), other_ops
        sides = chunk_sides(chunks)
        want_streams = [COMM + 1 if two and sides[k] else COMM for k in range(chunks)] if P > 1 and op == "cached" else []
        assert [st for name, st in streams if name == "fanout_forward_kernel"] == want_streams, streams
        assert all(st == COMM for name, st in streams if name != "fanout_forward_kernel"), streams
        if len(outs) == 2:
            mine = dict(enumerate(outs))
            del out, outs
            first = p_outs[0].numel() * p_outs[0].element_size()
            check_carved(mine, dict(enumerate(p_outs)), {0: 0, 1: -(-first // 256) * 256})
    assert r.eng.served["cached"] == 1 and r.eng.served["combine"] == 1


def test_cpp_counts_as_python(rig, ext):
    """Rows counted, calls and replays: a C++ replay adds what a Python replay adds."""
    r = rig(2, 3)
    xq, sq, h, y, wts = _dispatch(r, False)
    deltas = []
    for run in (lambda: r.eng.cached_dispatch(r.buf, xq, h, 1, CFG, None, False, False),
                lambda: r.be.run_plan(r.be.plan_for(h, ("dispatch", xq.dtype), xq, CFG, None), xq, None, 0)):
        c0, n0 = dict(r.be.counters), (r.be.calls, r.be.replayed)
        assert run() is not None
        deltas.append(({k: r.be.counters[k] - c0[k] for k in c0}, r.be.calls - n0[0], r.be.replayed - n0[1]))
    assert deltas[0] == deltas[1] and deltas[0][1:] == (1, 1) and sum(deltas[0][0].values()) > 0


def test_calls_that_differ_take_the_python_path(rig, ext):
    r = rig(2, 1)
    xq, sq, h, y, wts = _dispatch(r, False)
    eng, buf = r.eng, r.buf
    run = lambda *a, **k: eng.cached_dispatch(buf, *a, **k)
    assert run(xq, h, 1, CFG, None, False, False) is not None
    assert run(xq[:-1], h, 1, CFG, None, False, False) is None                       # another shape
    assert run(xq.float(), h, 1, CFG, None, False, False) is None                    # another dtype
    assert run(xq.t().contiguous().t(), h, 1, CFG, None, False, False) is None       # not contiguous
    assert run(xq, h, 1, Config(4, 4, 8, 1, 2), None, False, False) is None          # another Config
    assert run(xq, h, 1, Config(2, 4, 8, 1, 2), None, False, False) is not None      # an equal one
    assert run(xq, h, 0, CFG, None, False, False) is None                            # bad alignment: its error
    assert run(xq, h, 1, CFG, None, False, True) is None                             # allocate_on_comm without event
    assert run((xq, torch.ones(64, 2)), h, 1, CFG, None, False, False) is None       # scales the kept call had not
    send_head = h.send_head
    h.send_head = send_head.clone()
    assert run(xq, h, 1, CFG, None, False, False) is None                            # another send_head
    h.send_head = send_head
    h.buffer_id = 5
    assert run(xq, h, 1, CFG, None, False, False) is None                            # another Buffer's handle
    h.buffer_id = BUFFER_ID
    r.be.set_probe(RecordingProbe())
    assert run(xq, h, 1, CFG, None, False, False) is None                            # a recording probe: Python
    r.be.set_probe(NULL_PROBE)
    r.be.failed = "boom"
    assert run(xq, h, 1, CFG, None, False, False) is None
    r.be.failed = None
    comb = lambda yy, ww: eng.combine(buf, yy, h, ww, CFG, None, False, False)
    assert comb(y, wts) is not None
    assert comb(y, None) is None and comb(y[:-1], wts[:-1]) is None and comb(y, wts[:, :-1].contiguous()) is None
    h.num_tokens += 1
    assert comb(y, wts) is None
    h.num_tokens -= 1
    buf._destroyed = True
    assert comb(y, wts) is None


def _full_args(r, x0, **change) -> tuple:
    """A non-cached Buffer.dispatch's arguments as the C++ engine's dispatch / keep_dispatch take them."""
    idx, w, lay = r.inp
    a = dict(x=x0, ntpr=lay.num_tokens_per_rank, nrr=lay.num_tokens_per_rdma_rank, tir=lay.is_token_in_rank,
             ntpe=lay.num_tokens_per_expert, topk=idx, w=w, alignment=1, worst=0, config=CFG)
    a.update(change)
    return tuple(a.values())


def _kept_full(r, ext, x, scales=None, alignment=1):
    """A Python non-cached dispatch at 2 x 1 with the C++ twin on (COMMLIB_CALLPATH_INTERNODE_DISPATCH=1),
    kept by the C++ engine as Buffer.dispatch keeps it: (request, result, twin)."""
    idx, w, lay = r.inp
    r.be._full_twins = True
    req = DispatchRequest(x, scales, idx, w, lay, None, 64, alignment, 0, CFG)
    res = r.be.dispatch(req)
    twin = r.be.last_full_plan.cpp
    xa = x if scales is None else (x, scales)
    assert r.eng.keep_dispatch(*_full_args(r, xa, alignment=alignment), twin, res.handle)
    return req, res, twin


def test_noncached_dispatch_kept_for_cpp(rig, ext, monkeypatch):
    """COMMLIB_CALLPATH_INTERNODE_DISPATCH (on by default, 0 turns it off): a non-cached dispatch on the
    device path at one chunk and one rank per node leaves its kept launches for the C++ engine, which keeps
    them with the call's signature and serves a later call with that signature only (else None: the
    Python path)."""
    from commlib.utils import env
    monkeypatch.setenv("COMMLIB_CALLPATH_INTERNODE_DISPATCH", "0")
    assert not env.callpath_internode_dispatch()
    monkeypatch.delenv("COMMLIB_CALLPATH_INTERNODE_DISPATCH")
    assert env.callpath_internode_dispatch()   # on by default
    r = rig(1, 1)
    idx, w, lay = r.inp
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    req = DispatchRequest(x, None, idx, w, lay, None, 64, 1, 0, CFG)
    r.be.dispatch(req)
    assert r.be.last_full_plan is None   # the knob off: nothing kept
    r.be._full_twins = True
    res = r.be.dispatch(req)
    twin = r.be.last_full_plan.cpp
    f = r.be.scratch.last
    # the twin's launches are the Python path's kept ones, argument for argument
    want = [(p.lau.handle, p.grid, p.block, p.shared_mem, p.lau.fmt.pack(*p.args))
            for p in (f.meta, f.digest, f.pack, f.land, f.recv_chan)]
    assert all(wl is not None for wl in want) and twin.launches() == want
    eng, buf = r.eng, r.buf
    assert eng.keep_dispatch(*_full_args(r, x), twin, res.handle)
    assert not eng.keep_dispatch(*_full_args(r, x, topk=None), twin, res.handle)   # no top-k: not taken
    assert not eng.keep_dispatch(*_full_args(r, x.float()), twin, res.handle)      # not the twin's dtype
    run = lambda *a, prev=None, af=False, alloc=False: eng.dispatch(buf, *a, prev, af, alloc)
    assert run(*_full_args(r, x)) is not None and eng.full_found == 1 and eng.served["dispatch"] == 1
    assert run(*_full_args(r, x.clone())) is not None and eng.full_found == 2   # other tensors, same signature
    for change in (dict(x=x[:-1]), dict(x=x.float()), dict(x=x.t().contiguous().t()), dict(topk=idx.int()),
                   dict(w=None), dict(w=w.double()), dict(tir=lay.is_token_in_rank.int()), dict(alignment=2),
                   dict(worst=64), dict(config=Config(2, 4, 8, 1, 2)), dict(config=Config(4, 4, 8, 1, 2)),
                   dict(ntpe=lay.num_tokens_per_expert[:-1]), dict(x=(x, torch.ones(64, 2)))):
        assert run(*_full_args(r, x, **change)) is None and eng.full_found == 2, list(change)
    assert run(*_full_args(r, x), alloc=True) is None and eng.full_found == 2   # allocate_on_comm without event
    r.be.failed = "boom"
    assert run(*_full_args(r, x)) is None and eng.full_found == 2
    r.be.failed = None
    r.be.set_probe(RecordingProbe())
    assert run(*_full_args(r, x)) is None and eng.full_found == 2   # a recording probe: the Python path
    r.be.set_probe(NULL_PROBE)
    assert run(*_full_args(r, x)) is not None and eng.full_found == 3 and eng.served["dispatch"] == 3
    # the twin holds the per-shape scratch its launches point into, past the Scratch's own
    alive = weakref.ref(f)
    del f
    r.be.scratch.shapes.clear()
    r.be.scratch.last = None
    gc.collect()
    assert alive() is not None
    # no reference cycle through C++: the engine and the backend go once the Buffer lets go of them
    gone = weakref.ref(r.be)
    del r, eng, buf, res, twin, run
    gc.collect()
    assert gone() is None
    # the forwarder (2 x 2): a twin too, with its barrier and forward
    r2 = rig(2, 1)
    r2.be._full_twins = True
    idx2, w2, lay2 = r2.inp
    res2 = r2.be.dispatch(DispatchRequest(x, None, idx2, w2, lay2, None, 64, 1, 0, CFG))
    assert r2.be.last_full_plan is not None and r2.be.scratch.last.node_launches is not None
    # a node step other than the forwarder (the node group's all-to-all): no twin
    from commlib.backends.internode import twins
    other = dataclasses.replace(r2.be.wiring, node=types.SimpleNamespace(in_area=False))
    sig = r2.be.signature(1, 256, 64, False, 4, True, CFG)
    assert twins.full_twin(other, r2.be.scratch, res2, sig, 64, 1, 1, r2.be) is None
    assert twins.full_twin(r2.be.wiring, r2.be.scratch, res2, sig, 64, 1, 1, r2.be) is not None


def test_cpp_noncached_dispatch_count_read_in_sync_debug_mode(rig, ext, monkeypatch):
    """torch.cuda.set_sync_debug_mode sees the C++ dispatch's count read as it sees the Python path's (a
    tensor's host read): mode 1 one warning per call, mode 2 the error, mode 0 nothing; the replays that
    follow never (they do not wait)."""
    import warnings
    mode = [0]
    monkeypatch.setattr(torch._C, "_cuda_get_sync_debug_mode", lambda: mode[0], raising=False)
    r = rig(1, 1)   # (the engine looks the mode's getter up when it is made)
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    _kept_full(r, ext, x)
    run = lambda: r.eng.dispatch(r.buf, *_full_args(r, x), None, False, False)

    def synced(m):
        mode[0] = m
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            out = run()
        assert out is not None
        return [str(w.message) for w in seen if "called a synchronizing" in str(w.message)], out
    assert synced(0)[0] == []
    said, out = synced(1)
    assert len(said) == 1 and r.eng.served["dispatch"] == 2
    h = out[4]
    h.buffer_id = BUFFER_ID
    r.be.dispatch(DispatchRequest(x, None, None, None, None, h, 0, 1, 0, CFG))   # the kept call for the replay
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert r.eng.cached_dispatch(r.buf, x, h, 1, CFG, None, False, False) is not None
    assert not [w for w in seen if "synchronizing" in str(w.message)] and r.eng.served["cached"] == 1
    mode[0] = 2
    with pytest.raises(RuntimeError, match="called a synchronizing CUDA operation"):
        run()


def _cpp_full_trace(r, recorded, streams=None) -> tuple:
    """The C++ dispatch's recorded operations: (trace of launches, collectives and the read as the Python
    trace writes them, {label: (address, bytes)} of its head row, rows and int32 block, other operations);
    ``streams`` gets each launch's (name, stream)."""
    trace, regions, other = [], {}, []
    for op in recorded:
        if op[0] == "launch":
            lau = r.names[op[1]]
            trace.append((lau.name, op[3], op[4], tuple(lau.fmt.unpack(op[6][:lau.fmt.size])), op[5]))
            if streams is not None:
                streams.append((lau.name, op[2]))
            assert op[2] in (COMM, COMM + 1)   # the comm stream, or the side stream (test mode)
        elif op[0] in ("a2a", "allgather"):
            trace.append(tuple(op))
        elif op[0] == "head":
            regions["head"] = (op[1], 8 * op[2])
        elif op[0] == "rows":
            regions["rows"], regions["block"] = (op[1], op[2]), (op[4], op[5])
        else:
            other.append(op[0])
    return trace, regions, other


def _python_full(r, req) -> tuple:
    """The Python path's non-cached dispatch of ``req`` traced: (result, trace, its allocations, its head row)."""
    made, real, real_gather = [], torch.empty, r.be._all_gather

    def spy(*args, **kw):
        t = real(*args, **kw)
        made.append(t)
        return t

    def gather(out, row, **kw):
        r.fakes.trace.append(("allgather", out.data_ptr(), row.data_ptr(), row.numel()))
        return real_gather(out, row, **kw)
    r.fakes.trace, r.be._all_gather, torch.empty = [], gather, spy
    try:
        res = r.be.dispatch(req)
    finally:
        torch.empty, r.be._all_gather = real, real_gather
    trace, r.fakes.trace = r.fakes.trace, None
    return res, trace, made, r.be.head._head[0]


def _layout_of(t, named) -> tuple:
    return (tuple(t.shape), t.dtype, tuple(t.stride()), named(t.data_ptr()) if t.numel() else 0)


@pytest.mark.parametrize("P,chunks,fp8,alignment,empty,two", [
    (1, 1, False, 1, False, False), (1, 1, True, 1, False, False), (1, 1, False, 4, False, False),
    (1, 1, True, 1, True, False), (2, 1, False, 1, False, False), (2, 3, True, 1, False, False),
    (2, 3, False, 4, False, False), (2, 3, False, 1, True, False), (2, 3, True, 1, False, True),
    (2, 1, False, 1, False, True)])
def test_cpp_noncached_dispatch_issues_what_python_issues(rig, ext, P, chunks, fp8, alignment, empty, two):
    """A non-cached dispatch the C++ engine serves issues what the Python path (device.py dispatch) issues
    for the same call: meta, the all-gather, digest, its read, pack, the rail all-to-all per network chunk
    (with the forwarder, P > 1: the barriers, each landed chunk's forward after the next chunk is posted,
    the comm stream's waits), land, recv_chan, argument for argument (this call's allocations named: the
    head row, the rows, the int32 block, the outputs), the same allocations, outputs, handle and plan,
    counts and per-expert list. ``empty``: a digest of no rows anywhere (zero network chunks: no
    all-to-all, no land), as every rank reads it. ``two``: NCCL's collectives on the current stream
    (asyncOp=False), so with the forwarder and several chunks they alternate between the comm stream and
    a side stream with their forwards (network.py stream's ``sides``): a fork, a join, no waits."""
    r = rig(P, chunks, two)
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    xq, sq = per_token_cast_to_fp8(x) if fp8 else (x, None)
    req, _, _ = _kept_full(r, ext, xq, sq, alignment)
    if empty:   # what the digest kernel writes (the fakes, for the Python path) and what the C++ read finds
        r.fakes.digest.zero_()
        r.be.scratch.last.dig.zero_()
    before = (dict(r.be.counters), r.be.calls, r.be.host_reads)
    ext._recorded()
    out = r.eng.dispatch(r.buf, *_full_args(r, xq if sq is None else (xq, sq), alignment=alignment), None, False,
                         False)
    assert out is not None and r.eng.served["dispatch"] == 1
    streams = []
    got, regions, other = _cpp_full_trace(r, ext._recorded(), streams)
    mid = (dict(r.be.counters), r.be.calls, r.be.host_reads)
    res, want, made, p_head = _python_full(r, req)
    after = (dict(r.be.counters), r.be.calls, r.be.host_reads)
    delta = lambda a, b: ({k: b[0][k] - a[0][k] for k in a[0]}, b[1] - a[1], b[2] - a[2])
    assert delta(before, mid) == delta(mid, after) and delta(before, mid)[1:] == (1, 1)
    # the head row: [0] + signature, the call count its word 2 (the Python call came one later)
    n_head = regions["head"][1] // 8
    c_head = list((ctypes.c_int64 * n_head).from_address(regions["head"][0]))
    p_words = p_head.tolist()
    assert c_head[2] == r.be.calls - 1 and p_words[2] == r.be.calls
    assert c_head[:2] + c_head[3:] == p_words[:2] + p_words[3:]
    recv, c_topk, c_w, c_per_expert, c_h, event = out
    c_x, c_s = (recv, None) if sq is None else recv
    c_outs = [t for t in (c_x, c_s, c_topk, c_w) if t is not None]
    p_outs = [t for t in (res.recv_x, res.recv_x_scales, res.recv_topk_idx, res.recv_topk_weights) if t is not None]
    c_regions = [("head", *regions["head"]), ("rows", *regions["rows"]), ("block", *regions["block"])] + \
        [(f"out {i}", *_region(t)) for i, t in enumerate(c_outs)]
    p_regions = [("head", *_region(p_head)), ("rows", *_region(made[0])), ("block", *_region(made[1]))] + \
        [(f"out {i}", *_region(t)) for i, t in enumerate(p_outs)]
    c_named, p_named = _namer(c_regions), _namer(p_regions)
    kinds = [e[0] for e in got]
    K = 0 if empty else chunks
    alternate = two and P > 1 and K > 1
    if P == 1:
        network = ["a2a"] * K
    elif alternate:   # each chunk's forward right after its collective, on its stream
        network = ["a2a", "fanout_forward_kernel"] * K
    else:   # chunk k + 1 posted before chunk k's forward (one forward per chunk here: every chunk lands rows);
        # the pack arrives at the first node barrier, the first forward waits, the last takes the second,
        # which needs a launch of its own only with no chunk
        network = (["a2a"] + ["a2a", "fanout_forward_kernel"] * (K - 1) + ["fanout_forward_kernel"] if K
                   else ["fanout_barrier_kernel"])
    assert kinds == ["inter_meta_kernel", "allgather", "inter_digest_kernel", "inter_pack_kernel"] + network + \
        ([] if empty else ["inter_land_kernel"]) + ["inter_recv_chan_kernel"], kinds
    assert _named(got, c_regions) == _named(want, p_regions)
    # _enter's event pair, the digest read, three allocations (rows, block, the outputs: views of one in both
    # paths), the comm stream's wait per chunk (none for one chunk: on the comm stream, ordered there, as
    # network.py's), _leave's pair
    waits = ["fork", "join"] if alternate else ["a2a_wait"] * (K if K > 1 else 0)
    # (with the forwarder, the forward kernel stores the landed rows' positions into the block: no copy)
    assert other == ["record", "wait", "read"] + ["alloc"] * 3 + waits + ["record", "wait"], other
    sides = chunk_sides(K)
    assert [st for name, st in streams if name == "fanout_forward_kernel"] == \
        [COMM + 1 if alternate and sides[k] else COMM for k in range(K if P > 1 else 0)], streams
    assert all(st == COMM for name, st in streams if name != "fanout_forward_kernel"), streams
    assert len(made) == 3 and len({t.untyped_storage().data_ptr() for t in p_outs}) == 1
    # the outputs, the handle and its plan: shapes, dtypes, strides and (named) storage as the Python path's
    assert [_layout_of(t, c_named) for t in c_outs] == [_layout_of(t, p_named) for t in p_outs]
    assert c_per_expert == res.num_recv_tokens_per_expert_list and c_h.buffer_id == BUFFER_ID
    assert event is not None and c_w is not None
    p_h = res.handle
    # the handle and its plan made in C++: their types and fields as the Python path's, field order included
    assert type(c_h) is type(p_h) and list(vars(c_h)) == list(vars(p_h))
    assert type(c_h.extra["plan"]) is type(p_h.extra["plan"]) and list(vars(c_h.extra["plan"])) == \
        list(vars(p_h.extra["plan"])) and list(c_h.extra) == list(p_h.extra)
    for f in dataclasses.fields(p_h):
        a, b = getattr(c_h, f.name), getattr(p_h, f.name)
        if f.name == "buffer_id":
            continue
        if isinstance(b, torch.Tensor):
            assert _layout_of(a, c_named) == _layout_of(b, p_named), f.name
        elif f.name == "extra":
            assert set(a) == set(b) and a["num_recv"] == b["num_recv"]
        else:
            assert a == b, f.name
    cp, pp = c_h.extra["plan"], p_h.extra["plan"]
    for f in dataclasses.fields(pp):
        a, b = getattr(cp, f.name), getattr(pp, f.name)
        if isinstance(b, torch.Tensor):
            assert _layout_of(a, c_named) == _layout_of(b, p_named), f.name
        elif f.name == "landed_pos":   # the forwarder's: [J_k, P] int32 per chunk, views of the int32 block
            # after the source rows, where the forward launches (argument FORWARD_POS, compared above) store
            # the landed rows' positions (their values: a GPU case, the combine on this handle, checks them)
            assert len(a) == len(b) == (K if P > 1 else 0), f.name
            for u, v in zip(a, b):
                assert _layout_of(u, c_named) == _layout_of(v, p_named) and u.is_contiguous(), f.name
                assert u.numel() == 0 or c_named(u.data_ptr())[0] == "block", f.name
        else:
            assert a == b, f.name
    assert (cp.num_chunks, cp.num_recv > 0) == ((0, False) if empty else (chunks, True))
    if P > 1 and not empty:   # each chunk's forward stores its positions at that chunk's rows of landed_pos
        fwd = [e for e in got if e[0] == "fanout_forward_kernel"]
        assert [e[3][FORWARD_POS] for e in fwd] == [u.data_ptr() for u in cp.landed_pos]
    assert cp.slot is not None and (cp.land_all is not None) == (P == 1)
    # the outputs carved from their one allocation, each at a 256-byte boundary
    ends, offsets = 0, {}
    for i, t in enumerate(p_outs):
        offsets[i] = ends
        ends = -(-(ends + t.numel() * t.element_size()) // 256) * 256
    mine = dict(enumerate(c_outs))
    del out, recv, c_x, c_s, c_topk, c_w, c_outs, t
    check_carved(mine, dict(enumerate(p_outs)), offsets)
    # no list or dict shared with another plan (the kept calls' dict, the chunk lists: each plan its own)
    out2 = r.eng.dispatch(r.buf, *_full_args(r, xq if sq is None else (xq, sq), alignment=alignment), None, False,
                          False)
    ext._recorded()
    cp2 = out2[4].extra["plan"]
    for f in dataclasses.fields(cp2):
        a, b = getattr(cp, f.name), getattr(cp2, f.name)
        if f.name == "landed_pos":   # (tensors: each call's own copies)
            assert len(a) == len(b) and a is not b and all(u.data_ptr() != v.data_ptr() for u, v in zip(a, b)
                                                           if u.numel()), f.name
        elif isinstance(a, (list, dict)):
            assert a == b and a is not b, f.name
    assert out2[4].extra is not c_h.extra and out2[3] is not c_per_expert


def test_digest_read_timeout_retires_the_buffer():
    """The C++ dispatch's digest read past COMMLIB_TIMEOUT_S (device.read_timed_out): the backend is failed
    (the Buffer refuses later calls) and CommlibError names the rank and the step."""
    from commlib.backends.internode import device
    from commlib.topology import Topology
    from commlib.utils.errors import CommlibError
    be = types.SimpleNamespace(topology=Topology(rank=3, num_ranks=4, ranks_per_node=1), failed=None)
    with pytest.raises(CommlibError, match=r"\[commlib rank 3\] dispatch: the count exchange did not complete within 2.0 s"):
        device.read_timed_out(be, 2.0)
    assert be.failed and "rank 3" in be.failed


def test_cpp_dispatch_python_work_per_call(rig, ext):
    """A C++ non-cached dispatch's Python C-API work, the same every call: reads (the Buffer and its live
    backend 6, the Config's 5 fields, calls, buffer_id), writes (calls, the plan's and the handle's
    __dict__, the EventOverlap's two) and no call into Python (the plan and the handle are made in C++)."""
    r = rig(1, 1)
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    _kept_full(r, ext, x)
    seen = []
    for _ in range(3):
        r.eng.dispatch(r.buf, *_full_args(r, x), None, False, False)   # (its exit event back in the pool)
        ext._py_ops(False)
        out = r.eng.dispatch(r.buf, *_full_args(r, x), None, False, False)
        ops = ext._py_ops(False)
        assert out is not None
        del out
        seen.append((ops["get"], ops["set"], ops["call"]))
    assert seen == [(13, 5, 0)] * 3, seen


def test_cpp_forwarder_dispatch_reserves_only_where_the_areas_are_short(rig, ext):
    """With the forwarder, a C++ non-cached dispatch whose node rows fit the areas (their ``fan.settled``
    capacity) calls nothing in Python; where they do not (or the areas are closed: settled None) it calls
    the node's reserve, as the Python path's dispatch_begin does, and issues the same work."""
    r = rig(2, 1)
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    _kept_full(r, ext, x)
    assert r.eng.dispatch(r.buf, *_full_args(r, x), None, False, False) is not None   # (its first: the pools)
    fan = r.be.node.fan
    kept = fan.settled
    grown = []
    real = type(r.be.node).reserve
    r.be.node.reserve = lambda rows, row_bytes: grown.append(rows * row_bytes) or real(r.be.node, rows, row_bytes)
    seen = []
    try:
        for settled in (kept, (0, kept[1]), None, kept):
            fan.settled = settled
            ext._recorded()
            ext._py_ops(True)
            out = r.eng.dispatch(r.buf, *_full_args(r, x), None, False, False)
            calls = ext._py_ops(False)["call"]
            assert out is not None
            del out
            seen.append((calls, len(grown), [o for o in ext._recorded() if o[0] == "launch"]))
    finally:
        fan.settled = kept
        del r.be.node.reserve
    assert [s[:2] for s in seen] == [(0, 0), (1, 1), (1, 2), (0, 2)], [s[:2] for s in seen]
    assert grown[0] > 0
    area = struct.pack("<Q", kept[1])   # the land kernel reads this rank's area at the address settled holds
    for s in seen:
        assert [o[1:6] for o in s[2]] == [o[1:6] for o in seen[0][2]]   # the same kernels, grids and streams
        assert any(area in o[6] for o in s[2])


def test_cpp_digest_parse_matches_python(ext):
    """The C++ dispatch's digest parse (Digest) reads every field where exchange.parse_digest does."""
    from commlib.backends.internode.exchange import parse_digest
    from commlib.backends.internode.kernels import digest_len
    gen = torch.Generator().manual_seed(11)
    for _ in range(300):
        M, P, Kc, Lx = (int(torch.randint(1, hi, (1,), generator=gen)) for hi in (9, 5, 5, 33))
        d = torch.randint(-5, 1 << 40, (digest_len(M, P, Kc, Lx),), generator=gen).tolist()
        assert ext._parse_digest(d, M, P, Kc, Lx) == parse_digest(d, M, P, Kc, Lx), (M, P, Kc, Lx)
    with pytest.raises(ValueError, match="shorter"):
        ext._parse_digest([0] * 5, 2, 1, 1, 4)


def test_cpp_dispatch_error_word_raises_as_python(rig, ext):
    """A digest that flags an error (a rank refused its input: its row's error word): the C++ dispatch,
    past the exchange every rank took part in, raises on every rank what the Python path raises (the
    rows read and checked), with no second collective; the head row stays busy (a new one next call)."""
    r = rig(1, 1)
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    req, _, _ = _kept_full(r, ext, x)
    f = r.be.scratch.last
    assert r.eng.dispatch(r.buf, *_full_args(r, x), None, False, False) is not None
    head0 = [op for op in ext._recorded() if op[0] == "head"][0][1]
    good_g, good_d = r.fakes.g.clone(), r.fakes.digest.clone()
    r.fakes.g[1, 0] = 1
    r.fakes.digest[0] = 1
    f.g.copy_(r.fakes.g)
    f.dig.copy_(r.fakes.digest)
    reads0, calls0 = r.be.host_reads, r.be.calls
    with pytest.raises(ValueError) as c_err:
        r.eng.dispatch(r.buf, *_full_args(r, x), None, False, False)
    kinds = [op[0] for op in ext._recorded()]
    assert kinds.count("allgather") == 1 and "a2a" not in kinds and kinds[-1] == "read"
    assert (r.be.host_reads - reads0, r.be.calls - calls0) == (2, 1)
    with pytest.raises(ValueError) as p_err:
        r.be.dispatch(req)
    assert str(c_err.value) == str(p_err.value) and "rejected their input" in str(c_err.value)
    assert (r.be.host_reads - reads0, r.be.calls - calls0) == (4, 2)
    r.fakes.g.copy_(good_g)
    r.fakes.digest.copy_(good_d)
    f.g.copy_(good_g)
    f.dig.copy_(good_d)
    assert r.eng.dispatch(r.buf, *_full_args(r, x), None, False, False) is not None
    head1 = [op for op in ext._recorded() if op[0] == "head"][0][1]
    assert head1 != head0   # the errored call's head row was still busy: a new one


def test_bench_internode_cpp_dispatch_rows(rig, ext):
    """bench_internode --host's C++ rows with the opt-in non-cached dispatch: the first call of the
    signature is the Python path's (kept, as Buffer.dispatch keeps it), every timed call runs in C++,
    the digest read's wait is left out of host_us, and the phases cover the dispatch's steps."""
    from benchmarks import bench_internode as BI
    r = rig(1, 1)
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    idx, w, lay = r.inp
    req = DispatchRequest(x, None, idx, w, lay, None, 64, 1, 0, CFG)
    buf = types.SimpleNamespace(call_path="cpp", _cpp=r.eng, backend=r.be, device=torch.device("cpu"))

    def dispatch():   # what Buffer.dispatch does around the engine's two entry points
        out = r.eng.dispatch(r.buf, *_full_args(r, x), None, False, False)
        if out is None:
            res = r.be.dispatch(req)
            if r.be.last_full_plan is not None:
                r.eng.keep_dispatch(*_full_args(r, x), r.be.last_full_plan.cpp, res.handle)
        ext._recorded()

    def host_times(fn, iters, ahead, group, wait_ns=None, excluded_ns=None):
        for _ in range(iters):
            fn()
        t = {"host_us": 10.0, "cpu_us": 9.0}
        if wait_ns is not None:
            t.update(total_us=8.0, wait_us=wait_ns() / 1e3)
        return {**t, **({"excluded_us": excluded_ns() / 1e3} if excluded_ns else {})}
    rows = BI._cpp_rows(buf, {"dispatch_bf16": dispatch}, 4, 1, None, 1, 1,
                        types.SimpleNamespace(host_times=host_times, current_cpu=lambda: 0), dispatch=True)
    assert [x["op"] for x in rows] == ["dispatch_bf16_cpp"] and rows[0]["cpp_calls"] == 4 and rows[0]["host_us"] == 8.0
    steps = ("outside", "checks", "enter", "count", "meta", "exchange", "read_event", "read_wait",
             "read_host", "geometry", "alloc", "pack", "a2a", "chunk_wait", "land", "handle", "leave", "result")
    assert set(rows[0]["phases_us"]) == {f"in_dispatch.{p}" for p in steps}, rows[0]["phases_us"]
    assert rows[0]["phased_host_us"] == 8.0 and rows[0]["phased_call_sum_us"] > 0
    assert not r.be._full_twins   # left off: the Python rows keep no twin


def test_bench_internode_call_sums():
    """The per-call phase sum lines up each phase's last n samples (``outside`` has none for the first
    call) and leaves the count read's wait out."""
    from benchmarks import bench_internode as BI
    raw = {"in_dispatch.outside": [1.0, 2.0], "in_dispatch.pack": [10.0, 20.0, 30.0],
           "in_dispatch.read_wait": [1e3, 1e3, 1e3]}
    assert BI._call_sums(raw) == 26.5   # calls 2 and 3: 1 + 20, 2 + 30
    assert BI._call_sums({}) == 0.0


def test_c10d_alltoall_from_cpp(ext):
    """The collectives the engine issues (torch's c10d ProcessGroup ops from C++, waited for) on a
    one-rank gloo group: the rows arrive as torch.distributed's all_to_all_single puts them, and the
    count exchange's all-gather's."""
    from torch.distributed import HashStore
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo", rank=0, world_size=1, store=HashStore())
    try:
        g = dist.new_group([0])
        x = torch.arange(24, dtype=torch.uint8).view(6, 4)
        out, ref = torch.zeros_like(x), torch.zeros_like(x)
        ext._alltoall(g, out, x, [6], [6])
        dist.all_to_all_single(ref, x, [6], [6], group=g)
        assert torch.equal(out, ref) and torch.equal(out, x)
        row = torch.arange(7, dtype=torch.int64) * 3 + 1   # the count exchange's all-gather (one rank: a copy)
        got = torch.zeros(7, dtype=torch.int64)
        ext._allgather(g, got, row)
        assert torch.equal(got, row)
    finally:
        if made:
            dist.destroy_process_group()


PHASES = ("checks", "enter", "alloc", "count", "scratch", "pre", "a2a", "wait", "post", "leave", "result")


@pytest.mark.parametrize("P,chunks", [(1, 1), (2, 3)])
def test_phases_of_the_internode_calls(rig, ext, P, chunks):
    """callpath.phases reads the internode module too: off, nothing; on, one sample per call and phase
    (a phase marked once per chunk, the network's, summed), the forwarder's area read and node steps
    where there are some."""
    r = rig(P, chunks)
    xq, sq, h, y, wts = _dispatch(r, False)
    calls = {"in_cached": lambda: r.eng.cached_dispatch(r.buf, xq, h, 1, CFG, None, False, False),
             "in_combine": lambda: r.eng.combine(r.buf, y, h, wts, CFG, None, False, False)}
    callpath.phases(False)
    for f in calls.values():
        assert f() is not None
    assert callpath.phases(True) == {}
    for _ in range(3):
        for f in calls.values():
            assert f() is not None
    raw = ext._phases(True)
    want = set(PHASES) | ({"area", "node"} if P > 1 else set())
    for op in calls:
        assert {k.split(".")[1] for k in raw if k.startswith(op + ".")} == want, (op, sorted(raw))
    assert all(len(v) == 3 and min(v) >= 0 for v in raw.values()), raw
    assert calls["in_cached"]() is not None
    got = callpath.phases(False)   # medians in microseconds
    assert set(got) == {f"in_cached.{p}" for p in want} and all(v >= 0 for v in got.values()), got
    assert calls["in_cached"]() is not None and callpath.phases(False) == {}


@pytest.mark.parametrize("P,chunks", [(1, 1), (2, 3)])
def test_python_work_and_device_operations_per_call(rig, ext, P, chunks):
    """What one replayed call costs the host besides its device work, counted (the same on every call):
    Python attribute reads and writes, no call into Python (the forwarder's area address is read from
    its node's ``fan.settled``; with the areas closed, its area_address is called), and the device
    operations: the entry and exit event pairs, one allocation (the outputs in one block; the scratch
    is the kept call's rows in the engine's staging rows), one all-to-all and one wait per chunk, the
    kept launches. The NVLink cached dispatch
    (tests/test_callpath.py) reads 18 attributes, writes 3, calls nothing."""
    r = rig(P, chunks)
    xq, sq, h, y, wts = _dispatch(r, True)
    calls = {"cached": lambda: r.eng.cached_dispatch(r.buf, (xq, sq), h, 1, CFG, None, False, False),
             "combine": lambda: r.eng.combine(r.buf, y, h, wts, CFG, None, False, False)}
    K = h.extra["plan"].num_chunks
    for op, f in calls.items():
        seen = []
        for _ in range(3):
            f()
            ext._recorded()
            ext._py_ops(True)
            out = f()
            ops = ext._py_ops(False)
            kinds = [o[0] for o in ext._recorded()]
            assert out is not None
            del out
            seen.append((ops, kinds))
        assert all(s == seen[0] for s in seen), seen
        ops, kinds = seen[0]
        # reads: Buffer (2), live backend (6), handle (2: extra, send_head / num_tokens), calls, replayed, counters,
        # the forwarder's node, its fan and the fan's settled areas; writes: calls, replayed, the EventOverlap's two
        assert (ops["get"], ops["set"], ops["call"]) == (14 + 3 * (P > 1), 4, 0), (op, ops)
        assert ops["alloc"] > 0
        assert kinds.count("alloc") == 1 and kinds.count("a2a") == K and kinds.count("a2a_wait") >= 1, kinds
        assert [k for k in kinds if k in ("record", "wait")] == ["record", "wait", "record", "wait"], kinds
        assert len(kinds) == 2 + 1 + 1 + kinds.count("launch") + K + kinds.count("a2a_wait") + 2, kinds
        if P > 1:   # the areas closed (settled None): the node's area_address is called, as the Python path does
            fan, kept = r.be.node.fan, r.be.node.fan.settled
            fan.settled = None
            try:
                ext._py_ops(True)
                assert f() is not None
                assert ext._py_ops(False)["call"] == 1
                ext._recorded()
            finally:
                fan.settled = kept


def test_bench_internode_cpp_rows_carry_phases(rig, ext, capsys):
    """bench_internode --host's C++ rows: each timed once more with the phases on, its medians in the row
    (the JSON) and printed as bench_host prints its own."""
    from benchmarks import bench_internode as BI
    from benchmarks import host_timing as HT
    r = rig(1, 1)
    xq, sq, h, y, wts = _dispatch(r, False)
    buf = types.SimpleNamespace(call_path="cpp", _cpp=r.eng, backend=r.be, device=torch.device("cpu"))

    def host_times(fn, iters, ahead, group, wait_ns=None, excluded_ns=None):
        assert wait_ns is None   # no count read in a cached dispatch or combine
        for _ in range(iters):
            fn()
            ext._recorded()
        return {"host_us": 10.0, "cpu_us": 9.0, **({"excluded_us": excluded_ns() / 1e3} if excluded_ns else {})}
    ops = {"cached_bf16": lambda: r.eng.cached_dispatch(r.buf, xq, h, 1, CFG, None, False, False),
           "combine": lambda: r.eng.combine(r.buf, y, h, wts, CFG, None, False, False),
           "dispatch_bf16": lambda: pytest.fail("a non-cached dispatch has no C++ row")}
    rows = BI._cpp_rows(buf, ops, 4, 1, None, 4, 1, types.SimpleNamespace(host_times=host_times, current_cpu=lambda: 0))
    assert [x["op"] for x in rows] == ["cached_bf16_cpp", "combine_cpp"]
    for row, op in zip(rows, ("in_cached", "in_combine")):
        assert row["cpp_calls"] == 4 and set(row["phases_us"]) == {f"{op}.{p}" for p in PHASES}, row
        line = HT.phases_line("2 x 1 " + row["op"], row["phases_us"])
        assert line.startswith("# phases (rank 0, median us) 2 x 1 " + row["op"] + ": checks ") and "(sum " in line
    assert callpath.phases(False) == {}   # left off


def test_pin_host_keeps_one_layout(monkeypatch):
    """bench_internode --pin: each rank's main thread on a core of its own (core 0 and the other ranks'
    left to the rest), every other thread off the ranks' cores, and the same layout on every later call
    (a call after the first pinning must not derive it again from the pinned thread's own CPUs)."""
    import os
    import threading
    from benchmarks import host_timing as HT
    monkeypatch.setattr(HT, "_pinned", {})
    cpus, set_to = set(range(16)), {}
    me = threading.get_native_id()
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(set_to.get(me, cpus)))
    monkeypatch.setattr(os, "sched_setaffinity", lambda tid, mask: set_to.__setitem__(tid, set(mask)))
    first = HT.pin_host(1, 4)
    assert first["main"] == 2 and sorted(first["others"]) == [0] + list(range(5, 16))
    assert set_to[me] == {2} and all(m == set(first["others"]) for t, m in set_to.items() if t != me)
    for _ in range(3):
        assert HT.pin_host(1, 4) == first
    monkeypatch.setattr(HT, "_pinned", {})
    cpus = {0, 1, 2, 3}
    set_to.clear()
    assert HT.pin_host(0, 4) == {}   # too few cores: nothing pinned


def test_pin_host_quiet(monkeypatch):
    """bench_internode --pin quiet: quiet_cpus ranks the CPUs by a loop timed on each (the thread's own
    affinity restored after), and pin_host puts each rank's main thread on its chosen CPU, every other
    thread on the CPUs no rank's main thread has."""
    import os
    import threading
    from benchmarks import host_timing as HT
    monkeypatch.setattr(HT, "_pinned", {})
    me = threading.get_native_id()
    set_to = {}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(set_to.get(pid, set(range(8)))))
    monkeypatch.setattr(os, "sched_setaffinity", lambda tid, mask: set_to.__setitem__(tid, set(mask)))
    slow = {0: 5.0, 3: 9.0, 5: 2.0}   # seconds of the loop on a CPU (others 1.0)
    monkeypatch.setattr(HT, "loop_seconds", lambda iters: slow.get(next(iter(set_to[me])), 1.0))
    set_to[me] = set(range(8))
    mains = HT.quiet_cpus(4)
    assert mains == [1, 2, 4, 6] and set_to[me] == set(range(8))
    got = HT.pin_host(2, 4, mains)
    assert got == {"main": 4, "others": [0, 3, 5, 7]} and set_to[me] == {4}
    assert HT.pin_host(2, 4, [1, 2, 3]) == {}   # not one CPU per rank


def test_current_cpu_is_one_the_thread_may_run_on():
    import os
    from benchmarks import host_timing as HT
    assert HT.current_cpu() in os.sched_getaffinity(0)


def test_cpu_siblings_probe_shape():
    """benchmarks.cpu_siblings: a time alone per CPU and a ratio per pair of CPUs (this machine's)."""
    import os
    from benchmarks import cpu_siblings as CS
    old, CS.WORK = CS.WORK, 20_000
    try:
        out = CS.probe(reps=1)
    finally:
        CS.WORK = old
    cpus = sorted(os.sched_getaffinity(0))
    assert out["cpus"] == cpus and sorted(out["alone_us"]) == cpus
    assert [p[:2] for p in out["pairs"]] == [[a, b] for i, a in enumerate(cpus) for b in cpus[i + 1:]]
    assert all(p[2] > 0.5 for p in out["pairs"])
    assert set(out["steal_percent"]) >= set(cpus) and all(0.0 <= v <= 100.0 for v in out["steal_percent"].values())
    assert CS.steal_percent({0: (10, 100)}, {0: (30, 200)}) == {0: 20.0}


def test_thread_cpu_finds_a_busy_thread_of_a_child(tmp_path):
    """benchmarks.thread_cpu: a grandchild's spinning thread (one that ends before the command does)
    shows up as about one CPU; the sleeping main threads do not; the command's status comes back."""
    import json
    import sys
    from benchmarks import thread_cpu as TC
    spin = ("import threading, time\n"
            "def spin():\n"
            "    t = time.monotonic()\n"
            "    while time.monotonic() - t < 1.2: pass\n"
            "th = threading.Thread(target=spin); th.start(); th.join(); time.sleep(0.4)\n"
            "raise SystemExit(3)")
    child = f"import subprocess, sys; sys.exit(subprocess.call([sys.executable, '-c', {spin!r}]))"
    out = tmp_path / "t.json"
    assert TC.main(["--interval", "0.1", "--json", str(out), "--", sys.executable, "-c", child]) == 3
    got = json.loads(out.read_text())
    busy = [t for t in got["threads"] if t["cpu_share"] > 0.3]
    assert len(busy) == 1 and busy[0]["cpu_share"] < 1.2, got["threads"]
    assert got["busy_threads"]["max"] == 1 and got["busy_threads"]["min"] == 0


def test_bench_internode_cpp_nccl_verdicts():
    """A C++ row's NCCL-issuing phases (the slowest rank's) against the bare calls of the Python row of the
    same op: the dispatch's exchange against its all-gather, its a2a against the network chunks' sum."""
    from benchmarks import bench_internode as BI
    py = {"nccl": [{"floor_us": 40.0}, {"floor_us": 30.0}, {"floor_us": 30.0}]}
    r = {"op": "dispatch_bf16_cpp", "phases_by_rank": [{"in_dispatch.exchange": 30.0, "in_dispatch.a2a": 50.0},
                                                       {"in_dispatch.exchange": 42.0, "in_dispatch.a2a": 70.0}]}
    got = BI.cpp_nccl_verdicts(r, py)
    assert [(t["value"], t["met"]) for t in got] == [(1.05, True), (1.17, False)]
    assert "'exchange'" in got[0]["target"] and "'a2a'" in got[1]["target"]
    cached = {"op": "cached_fp8_cpp", "phases_by_rank": [{"in_cached.a2a": 33.0}]}
    assert [t["value"] for t in BI.cpp_nccl_verdicts(cached, {"nccl": [{"floor_us": 30.0}]})] == [1.1]
    assert BI.cpp_nccl_verdicts(cached, None) == []


def test_bench_internode_cpp_phase_lines():
    """bench_internode --host prints rank 0's phases, every rank's figures and, where another rank is the
    slowest, that rank's phases too."""
    from benchmarks import bench_internode as BI
    r = {"op": "dispatch_bf16_cpp", "chunk_cap": 1, "phases_us": {"in_dispatch.pack": 5.0},
         "by_rank": [[300.0, 150.0, 290.0, 295.0, 340.0, 3], [600.0, 330.0, 610.0, 620.0, 680.0, 7]],
         "phases_by_rank": [{"in_dispatch.pack": 5.0}, {"in_dispatch.pack": 11.0}]}
    lines = BI.cpp_phase_lines(r, "2 x 2")
    assert lines[0].startswith("# phases (rank 0, median us) 2 x 2 dispatch_bf16_cpp cap 1: pack 5.00")
    assert "per rank" in lines[1] and "host probe, cpu]" in lines[1] and "[600.0, 330.0, 610.0, 620.0, 680.0, 7]" in lines[1]
    assert lines[2].startswith("# phases (rank 1, median us) 2 x 2 dispatch_bf16_cpp cap 1 (the slowest rank): pack 11.00")
    r["by_rank"].reverse()   # rank 0 the slowest: its line is already there
    assert len(BI.cpp_phase_lines(r, "2 x 2")) == 2
