"""The C++ call path (csrc/callpath.cpp, commlib/cuda/callpath.py) without a GPU.

It builds with the system compiler and loads against the installed torch (a CPU-only one too: it links
no CUDA library). Its twins carry a kept launch's arguments packed as the kernels' C signatures say.
Its engine, run with a recorder in place of the device on a CPU stand-in of the NVLink backend
(tests/nvlink_fakes.py), makes each call the way the Python path does: the same launches (every
argument equal to the Python path's, this call's tensors in the slots the kernels' parameter names
give), the stream waits, events and allocations of Buffer._enter / _leave, the same handle, counts and
counters; a call it must not take returns None; failures raise what the Python path raises.
COMMLIB_CALLPATH=python, and a build that fails, give the Python path (the latter with one warning).
What runs on the GPU: tests/gpu/nvlink_cases.py case_callpath (bit for bit against the Python path
and the reference backend).
"""
from __future__ import annotations

import ctypes
import dataclasses
import re
import struct
import time
import types
import warnings

import pytest
import torch

from commlib.backends.nvlink.engine import CachedPlan, FullPlan
from commlib.buffer import Buffer
from commlib.config import Config
from commlib.cuda import callpath
from commlib.cuda import loader as K
from commlib.handle import DispatchHandle
from commlib.utils.errors import KernelLaunchError, is_device_failure
from commlib.utils.event import EventOverlap
from commlib.validate import CommlibError
from carved import check_carved
from nvlink_fakes import fake_backend

BUFFER_ID, ENTRY, COMPUTE, COMM = 77, 0xE0, 1, 2


@pytest.fixture(scope="module")
def ext():
    """The extension, built here (or taken from the cache) under COMMLIB_CALLPATH=auto."""
    mod = callpath.load()
    assert mod is not None, f"the C++ call path did not build or load: {callpath.why_unavailable}"
    return mod


class FakeLauncher:
    """What loader.Replay and its C++ twin read of a loader._Launcher, from the kernel's C signature."""

    def __init__(self, family: str, name: str) -> None:
        self.name = name
        self.handle = 0xF000 + len(name)
        self.names = tuple(p for p, _ in K.kernel_params(family, name))
        self.codes = K.kernel_signature(family, name)
        self.fmt = struct.Struct("@" + self.codes)
        self.offsets = tuple(K.param_offsets(self.codes))
        self.count = len(self.codes)


@pytest.fixture
def replays(monkeypatch):
    """loader.replay makes Replays on the CPU; their issue records (kernel, stream, arguments)."""
    issued = []

    def replay(family, name, grid, block, args, variant_key=None, shared_mem=0):
        lau = FakeLauncher(family, name)
        lau.fmt.pack(*args)
        return K.Replay(lau, grid, block, list(args), shared_mem)

    monkeypatch.setattr(K, "replay", replay)
    monkeypatch.setattr(K.Replay, "issue", lambda self, stream: issued.append((self.lau.name, stream, list(self.args))))
    return issued


def kernel_args(family: str, name: str, **given) -> list:
    """Arguments of kernel ``name`` in its C order: those given by parameter name, every other a distinct
    stand-in (the twins must carry them unchanged)."""
    out = []
    for i, (param, code) in enumerate(K.kernel_params(family, name)):
        out.append(given.pop(param) if param in given else (0x100000 * (i + 1) if code == "Q" else 1000 + i))
    assert not given, f"{name} has no parameters {sorted(given)}"
    return out


def by_name(family: str, name: str, packed: bytes) -> dict:
    codes = K.kernel_signature(family, name)
    values = struct.unpack("@" + codes, packed[:struct.calcsize("@" + codes)])
    return dict(zip((p for p, _ in K.kernel_params(family, name)), values))


class FakeComm:
    """The comm stream's Python object: what the engine waits on for an event it cannot read itself."""

    def __init__(self) -> None:
        self.waited = []

    def wait_event(self, ev) -> None:
        self.waited.append(ev)


@pytest.fixture
def rig(ext, replays):
    """A CPU NVLink backend that makes twins, a Buffer stand-in, a test-mode engine, the recorder on."""
    be = fake_backend()
    be._twins, be._ring_channels, be.replayed = True, 2, 0
    be._layout_plans, be._full_plans = {}, {}
    buf = types.SimpleNamespace(_destroyed=False, backend=be, buffer_id=BUFFER_ID, _configs={})
    comm = FakeComm()
    eng = callpath.engine(buffer_type=Buffer, comm_stream=comm, entry_event=ENTRY, device_index=-1, rank=0,
                          num_ranks=2, timeout_ns=10**9, test=True, comm_raw=COMM)
    eng.test_stream = COMPUTE
    ext._record(True)
    yield types.SimpleNamespace(be=be, buf=buf, eng=eng, comm=comm, issued=replays, ext=ext)
    ext._record(False)


def ops(ext) -> list:
    return [tuple(op) for op in ext._recorded()]


def launches(recorded) -> list:
    return [op for op in recorded if op[0] == "launch"]


def handle_of(T=8, R=2, N=5, C=2) -> DispatchHandle:
    return DispatchHandle(torch.zeros(R, R, dtype=torch.int32), torch.zeros(R, C, dtype=torch.int32),
                          torch.zeros(R, C, dtype=torch.int32), torch.zeros(N, dtype=torch.int32),
                          torch.zeros(T, R, dtype=torch.bool), torch.zeros(T, R, dtype=torch.int32),
                          num_tokens=T, hidden=256, num_experts=8, num_channels=C, num_recv_tokens=N,
                          buffer_id=BUFFER_ID, backend="nvlink", extra={"send_counts": [3, 2], "recv_counts": [4, 1]})


CFG = Config(4, 8, 64, 64, 1024)
_DISPATCH_FIELDS = ("is_token_in_rank", "rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix")
_COMBINE_FIELDS = ("send_head", "rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix",
                   "sum_order")


def keep_cached(be, h, fp8: bool, T=8, H=256, N=5) -> CachedPlan:
    """What the engine keeps after a cached dispatch (engine.py: CachedPlan, out_slot 8, _keep_plan)."""
    x = torch.zeros(T, H, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
    s = torch.ones(T, H // 128) if fp8 else None
    args = kernel_args("dispatch", "dispatch_kernel", **{f: getattr(h, f).data_ptr() for f in _DISPATCH_FIELDS})
    rep = K.replay("dispatch", "dispatch_kernel", 4, 1024, args)
    plan = CachedPlan(be, x, CFG, 2, rep, (((N, H), x.dtype), ((N, H // 128), torch.float32) if fp8 else None), 8,
                      h.extra["send_counts"], s, tuple((f, getattr(h, f)) for f in _DISPATCH_FIELDS))
    be._keep_plan(h, ("dispatch", x.dtype), plan)
    return plan


def keep_combine(be, h, Kk: int, H=256, N=5) -> CachedPlan:
    y = torch.zeros(N, H, dtype=torch.bfloat16)
    w = torch.ones(N, Kk) if Kk else None
    args = kernel_args("combine", "combine_kernel", send_head=h.send_head.data_ptr(), sum_order=0,
                       **{f: getattr(h, f).data_ptr() for f in _COMBINE_FIELDS[1:4]})
    rep = K.replay("combine", "combine_kernel", 4, 1024, args)
    T = h.num_tokens
    plan = CachedPlan(be, y, CFG, 2, rep, (((T, H), torch.bfloat16), ((T, Kk), torch.float32) if Kk else None), 9,
                      h.extra["recv_counts"], w, tuple((f, getattr(h, f)) for f in _COMBINE_FIELDS))
    be._keep_plan(h, ("combine", Kk), plan)
    return plan


# ------------------------------------------------------------------------------------------------
# build, load, fall back
# ------------------------------------------------------------------------------------------------

def test_builds_and_loads_without_cuda_libraries(ext):
    """The extension links no CUDA library (a CPU-only torch has none): what the build links is listed,
    and the module came from the cache folder named by its build key."""
    cmd = callpath.build_command(callpath.source_path(), callpath.Path("out.so"), "c++")
    libs = [a for a in cmd if a.startswith("-l")]
    assert libs == ["-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python", "-ldl"], libs
    assert "ninja" not in " ".join(cmd)
    key = callpath.build_key(callpath.source_path(), callpath.compiler())
    assert key in ext.__file__, (key, ext.__file__)


def test_python_mode_never_builds(monkeypatch):
    monkeypatch.setattr(callpath, "_module", None)
    monkeypatch.setenv("COMMLIB_CALLPATH", "python")
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert callpath.load() is None
    assert callpath.why_unavailable == "COMMLIB_CALLPATH=python"


@pytest.mark.parametrize("cxx, why", [("false", "failed with code 1"), ("/nonexistent/c++", "no C++ compiler")])
def test_failed_build_falls_back_with_one_warning(monkeypatch, tmp_path, cxx, why):
    """auto: the Python path, with one RuntimeWarning saying why; cpp: an error saying why."""
    monkeypatch.setenv("COMMLIB_KERNEL_CACHE", str(tmp_path))   # nothing cached: it must build
    monkeypatch.setenv("CXX", cxx)
    monkeypatch.setattr(callpath, "_module", None)
    monkeypatch.delenv("COMMLIB_CALLPATH", raising=False)
    with pytest.warns(RuntimeWarning, match=re.escape(why)) as seen:
        assert callpath.load() is None
        assert callpath.load() is None   # tried once
    assert len(seen) == 1
    monkeypatch.setattr(callpath, "_module", None)
    monkeypatch.setenv("COMMLIB_CALLPATH", "cpp")
    with pytest.raises(RuntimeError, match=f"COMMLIB_CALLPATH=cpp.*{re.escape(why)}"):
        callpath.load()


def test_bad_mode_is_named(monkeypatch):
    monkeypatch.setattr(callpath, "_module", None)
    monkeypatch.setenv("COMMLIB_CALLPATH", "fast")
    with pytest.raises(ValueError, match="COMMLIB_CALLPATH='fast'"):
        callpath.load()


def test_buffer_call_path_switch():
    b = Buffer.__new__(Buffer)
    b.rank, b.backend_name, b._cpp, b._cp = 0, "reference", None, None
    assert b.call_path == "python"
    b.set_call_path("python")
    with pytest.raises(ValueError, match="C\\+\\+ call path is unavailable"):
        b.set_call_path("cpp")
    with pytest.raises(ValueError, match="expected 'cpp' or 'python'"):
        b.set_call_path("c")
    b._cpp = object()
    b.set_call_path("cpp")
    assert b.call_path == "cpp" and b._cp is b._cpp


@pytest.mark.parametrize("op", ["layout", "cached_dispatch", "combine", "dispatch"])
def test_buffer_retires_on_a_device_failure_in_cpp(op):
    """A CUDA failure inside a C++ call retires the Buffer as in Buffer._run (CommlibError, backend.failed);
    a host-side error raises as itself; what the C++ call returns is the Buffer's result. ``dispatch`` (the
    internode engine's non-cached one in C++): a backend without an own _device_failure (the internode
    engine's) is retired the Buffer's way too."""
    calls = []

    class FakeEngine:
        def __init__(self, result):
            self.result = result

        def __getattr__(self, name):
            def call(*args):
                calls.append((name, args[0]))
                if isinstance(self.result, Exception):
                    raise self.result
                return self.result
            return call

    b = Buffer.__new__(Buffer)
    b.rank, b.backend = 0, types.SimpleNamespace(failed=None)
    h = handle_of()
    run = {"layout": lambda: b.get_dispatch_layout(torch.zeros(4, 2, dtype=torch.int64), 8),
           "cached_dispatch": lambda: b.dispatch(torch.zeros(8, 256), handle=h),
           "combine": lambda: b.combine(torch.zeros(5, 256), h),
           "dispatch": lambda: b.dispatch(torch.zeros(8, 256), topk_idx=torch.zeros(8, 2, dtype=torch.int64))}[op]
    b._cp = FakeEngine(("out",))
    assert run() == ("out",) and calls == [(op, b)]
    b._cp = FakeEngine(RuntimeError("host-side"))
    with pytest.raises(RuntimeError, match="host-side"):
        run()
    assert b.backend.failed is None
    b._cp = FakeEngine(KernelLaunchError("cuLaunchKernel failed: CUDA_ERROR_LAUNCH_FAILED (719)", 719))
    with pytest.raises(CommlibError, match="unusable"):
        run()
    assert "CUDA error during a call" in b.backend.failed


# ------------------------------------------------------------------------------------------------
# twins: the packed arguments and the named slots
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family, name", [("layout", "layout_kernel"), ("notify", "notify_kernel"),
                                          ("dispatch", "dispatch_kernel"), ("combine", "combine_kernel")])
def test_twin_packs_the_arguments_as_the_kernel_signature(ext, replays, family, name):
    args = kernel_args(family, name)
    rep = K.replay(family, name, 3, 128, args, shared_mem=64)
    twin = callpath.launch_of(rep)
    assert twin.packed() == struct.pack("@" + K.kernel_signature(family, name), *args)
    for i, (param, code) in enumerate(K.kernel_params(family, name)):
        if code in "Qi":
            assert twin.slot(param, code) == i == K.param_index(family, name, param)
    with pytest.raises(ValueError, match="no parameter"):
        twin.slot("nonexistent", "Q")
    assert twin.current()
    K.set_plain(not K.plain_mode())
    try:
        assert not twin.current(), "a twin made under the other load / store mode still replays"
    finally:
        K.set_plain(None)


def test_python_path_slots_are_the_named_parameters():
    """The Python path's fixed argument slots (engine.py) are the parameters the C++ path patches by name."""
    from commlib.backends.nvlink import engine

    assert engine._COMBINE_OUT_SLOT == K.param_index("combine", "combine_kernel", "combined_x")
    assert 8 == K.param_index("dispatch", "dispatch_kernel", "recv_x")   # CachedPlan's out_slot for a dispatch
    named = {"notify_kernel": {0: "is_token_in_rank", 2: "num_tokens_per_rank", 3: "num_tokens_per_expert",
                               4: "topk_idx", 7: "channel_prefix_matrix", 8: "rank_prefix_matrix",
                               9: "recv_channel_prefix_matrix", 10: "host_counts", 25: "host_seq"},
             "dispatch_kernel": {19: "num_out_rows", 34: "abort_word", 13: "send_head"},
             "layout_kernel": {0: "topk_idx", 5: "num_tokens_per_rank", 6: "num_tokens_per_expert",
                               7: "is_token_in_rank"}}
    for kernel, slots in named.items():
        family = kernel.replace("_kernel", "")
        for i, param in slots.items():
            assert K.param_index(family, kernel, param) == i, (kernel, param)


# ------------------------------------------------------------------------------------------------
# cached dispatch and combine
# ------------------------------------------------------------------------------------------------

def _sync_ops(launch, allocs, exit_event) -> list:
    """Buffer._enter / _leave of a synchronous call whose outputs belong to the caller's stream."""
    return [("record", ENTRY, COMPUTE), ("wait", ENTRY, COMM), *allocs, launch, ("record", exit_event, COMM),
            ("wait", exit_event, COMPUTE)]


@pytest.mark.parametrize("fp8", [False, True])
def test_cached_dispatch_runs_as_the_python_path(rig, fp8):
    be, h = rig.be, handle_of()
    plan = keep_cached(be, h, fp8)
    assert len(h.extra["cpp_plans"]) == 1
    x = torch.randn(8, 256).to(torch.float8_e4m3fn if fp8 else torch.bfloat16)
    s = torch.ones(8, 2) if fp8 else None
    out = rig.eng.cached_dispatch(rig.buf, (x, s) if fp8 else x, h, 1, CFG, None, False, False)
    assert out is not None
    recv, i, w, per_expert, handle, ev = out
    assert (i, w, per_expert) == (None, None, None) and handle is h and isinstance(ev, EventOverlap)
    rx, rs = recv if fp8 else (recv, None)
    assert rx.shape == (5, 256) and rx.dtype == x.dtype
    assert (rs.shape, rs.dtype) == ((5, 2), torch.float32) if fp8 else rs is None
    recorded = ops(rig.ext)
    (launch,) = launches(recorded)
    # FP8: one allocation for recv_x and its scales, those at the first 256-byte boundary past recv_x
    allocs = [("alloc", [1280 + 5 * 2 * 4], torch.uint8, COMPUTE)] if fp8 else [("alloc", [5, 256], x.dtype, COMPUTE)]
    assert recorded == _sync_ops(launch, allocs, recorded[-1][1])
    assert ev.event is not None and id(ev.event) == recorded[-1][1] and ev.extra_tensors is None
    assert launch[2] == COMM and launch[3:6] == (4, 1024, 0)
    # the Python path on the same inputs: every argument equal, the outputs each path's own
    first, second = be.run_plan(plan, x, s, COMM)
    (_, stream, py_args), = rig.issued
    names = [p for p, _ in K.kernel_params("dispatch", "dispatch_kernel")]
    cpp = by_name("dispatch", "dispatch_kernel", launch[6])
    py = dict(zip(names, py_args))
    assert cpp["recv_x"] == rx.data_ptr() and py["recv_x"] == first.data_ptr()
    assert cpp["x"] == py["x"] == x.data_ptr()
    if fp8:
        assert cpp["recv_x_scales"] == rs.data_ptr() and py["recv_x_scales"] == second.data_ptr()
        assert cpp["x_scales"] == py["x_scales"] == s.data_ptr()
    assert {k: v for k, v in cpp.items() if not k.startswith("recv_x")} == \
           {k: v for k, v in py.items() if not k.startswith("recv_x")}
    if fp8:
        mine = {"x": rx, "scales": rs}
        del out, recv, rx, rs
        check_carved(mine, {"x": first, "scales": second}, {"x": 0, "scales": 1280})
    else:
        assert (rx.stride(), rx.storage_offset(), rx._base) == (first.stride(), 0, None)
    # both count the rows and the replay alike
    assert be.replayed == 2 and be.counters["local_rows"] == 6 and be.counters["intranode_rows"] == 4
    assert rig.eng.served["cached"] == 1


@pytest.mark.parametrize("Kk", [0, 3])
def test_combine_runs_as_the_python_path(rig, Kk):
    be, h = rig.be, handle_of()
    plan = keep_combine(be, h, Kk)
    y = torch.randn(5, 256).to(torch.bfloat16)
    w = torch.rand(5, Kk) if Kk else None
    out = rig.eng.combine(rig.buf, y, h, w, CFG, None, False, False)
    assert out is not None and len(out) == 3
    cx, cw, ev = out
    assert cx.shape == (8, 256) and cx.dtype == torch.bfloat16
    assert (cw.shape, cw.dtype) == ((8, Kk), torch.float32) if Kk else cw is None
    recorded = ops(rig.ext)
    (launch,) = launches(recorded)
    first, second = be.run_plan(plan, y, w, COMM)
    (_, _, py_args), = rig.issued
    cpp = by_name("combine", "combine_kernel", launch[6])
    py = dict(zip((p for p, _ in K.kernel_params("combine", "combine_kernel")), py_args))
    assert cpp["combined_x"] == cx.data_ptr() and py["combined_x"] == first.data_ptr()
    if Kk:
        assert cpp["combined_topk_weights"] == cw.data_ptr() and py["combined_topk_weights"] == second.data_ptr()
        assert cpp["topk_weights"] == w.data_ptr()
    own = ("combined_x", "combined_topk_weights")
    assert {k: v for k, v in cpp.items() if k not in own} == {k: v for k, v in py.items() if k not in own}
    allocs = [op for op in recorded if op[0] == "alloc"]
    if Kk:   # one allocation: combined_x [8, 256] bf16, the weights at the next 256-byte boundary
        assert allocs == [("alloc", [4096 + 8 * Kk * 4], torch.uint8, COMPUTE)]
        mine = {"x": cx, "w": cw}
        del out, cx, cw
        check_carved(mine, {"x": first, "w": second}, {"x": 0, "w": 4096})
    else:
        assert allocs == [("alloc", [8, 256], torch.bfloat16, COMPUTE)]
    assert be.counters["local_rows"] == 8 and be.counters["intranode_rows"] == 2 and rig.eng.served["combine"] == 1


def test_async_and_previous_event_streams(rig):
    """async_finish: inputs and outputs recorded for the comm stream, no wait by the caller's stream,
    the inputs kept by the event. previous_event: the comm stream waits for it, outputs on the comm
    stream (allocate_on_comm_stream) recorded for the caller's."""
    be, h = rig.be, handle_of()
    keep_cached(be, h, False)
    x = torch.randn(8, 256).to(torch.bfloat16)
    *_, ev = rig.eng.cached_dispatch(rig.buf, x, h, 1, CFG, None, True, False)
    recorded = ops(rig.ext)
    out_ptr = by_name("dispatch", "dispatch_kernel", launches(recorded)[0][6])["recv_x"]
    assert recorded[-2:] == [("record_stream", out_ptr, COMM), ("record", recorded[-1][1], COMM)]
    assert ev.extra_tensors == (x,)
    marker = types.SimpleNamespace(name="previous")
    prev = EventOverlap(marker)
    *_, ev2 = rig.eng.cached_dispatch(rig.buf, x, h, 1, CFG, prev, True, True)
    recorded = ops(rig.ext)
    assert rig.comm.waited == [marker] and recorded[0] == ("alloc", [5, 256], torch.bfloat16, COMM)
    out_ptr = by_name("dispatch", "dispatch_kernel", launches(recorded)[0][6])["recv_x"]
    assert ("record_stream", out_ptr, COMPUTE) in recorded and recorded[-1][0] == "record"
    assert not any(op[0] == "wait" for op in recorded)
    assert ev2.event is not ev.event, "an event the caller still holds was handed out again"
    # allocate_on_comm_stream without previous_event / async_finish: the Python path raises its error
    assert rig.eng.cached_dispatch(rig.buf, x, h, 1, CFG, None, True, True) is None
    assert rig.eng.cached_dispatch(rig.buf, x, h, 1, CFG, prev, False, True) is None
    assert rig.eng.cached_dispatch(rig.buf, x, h, 1, CFG, "not an event", False, False) is None


def test_exit_events_are_reused_once_released(rig):
    be, h = rig.be, handle_of()
    keep_cached(be, h, False)
    x = torch.randn(8, 256).to(torch.bfloat16)
    first = rig.eng.cached_dispatch(rig.buf, x, h, 1, CFG, None, False, False)[5].event
    held = rig.eng.cached_dispatch(rig.buf, x, h, 1, CFG, None, False, False)[5].event
    assert held is not first
    first_id = id(first)
    del first
    again = rig.eng.cached_dispatch(rig.buf, x, h, 1, CFG, None, False, False)[5].event
    assert id(again) == first_id and again is not held


def test_calls_that_differ_take_the_python_path(rig):
    """None (the Python path, with every check) for anything the kept plan was not made from."""
    be, h = rig.be, handle_of()
    keep_cached(be, h, True)
    keep_combine(be, h, 3)
    x, s = torch.zeros(8, 256, dtype=torch.float8_e4m3fn), torch.ones(8, 2)

    def call(xx, hh=h, cfg=CFG, al=1):
        return rig.eng.cached_dispatch(rig.buf, xx, hh, al, cfg, None, False, False)

    assert call((x, s)) is not None
    misaligned = torch.zeros(8 * 256 + 1, dtype=torch.float8_e4m3fn)[1:].view(8, 256)
    for what, args in (("dtype", ((x.view(torch.uint8), s),)), ("no scales", (x,)),
                       ("shape", ((torch.zeros(9, 256, dtype=torch.float8_e4m3fn), s),)),
                       ("misaligned x", ((misaligned, s),)), ("scales dtype", ((x, s.int()),)),
                       ("scales shape", ((x, torch.ones(8, 3)),)),
                       ("non-contiguous scales", ((x, torch.ones(2, 8).t()),)),
                       ("Config values", ((x, s), h, Config(4, 16, 64, 64, 1024))),
                       ("odd num_sms", ((x, s), h, Config(3, 8, 64, 64, 1024))),
                       ("alignment", ((x, s), h, CFG, 0)), ("bool alignment", ((x, s), h, CFG, True)),
                       ("handle copy with other tensors",
                        ((x, s), dataclasses.replace(h, rank_prefix_matrix=h.rank_prefix_matrix.clone()))),
                       ("a handle of another Buffer", ((x, s), dataclasses.replace(h, buffer_id=1)))):
        assert call(*args) is None, f"a call with another {what} ran in C++"
    assert call((x, s), dataclasses.replace(h)) is not None   # a copy holding the same tensors may
    be._ring_channels = 3
    assert call((x, s)) is None, "the rings moved, yet the plan replayed"
    be._ring_channels = 2
    K.set_plain(not K.plain_mode())
    try:
        assert call((x, s)) is None, "a plan of another kernel build replayed"
    finally:
        K.set_plain(None)
    y = torch.zeros(5, 256, dtype=torch.bfloat16)
    assert rig.eng.combine(rig.buf, y, h, torch.ones(5, 3), CFG, None, False, False) is not None
    assert rig.eng.combine(rig.buf, y, h, torch.ones(5, 2), CFG, None, False, False) is None
    assert rig.eng.combine(rig.buf, y, h, None, CFG, None, False, False) is None
    assert rig.eng.combine(rig.buf, y.float(), h, torch.ones(5, 3), CFG, None, False, False) is None
    other = fake_backend()
    rig.buf.backend = other
    other._ring_channels = 2
    assert call((x, s)) is None, "another backend replayed this backend's plan"
    rig.buf.backend = be
    be.failed = "an earlier failure"
    assert call((x, s)) is None, "a failed backend replayed"
    be.failed = None
    rig.buf._destroyed = True
    assert call((x, s)) is None, "a destroyed Buffer replayed"


def test_config_none_takes_the_resolved_one(rig):
    be, h = rig.be, handle_of()
    keep_cached(be, h, False)
    x = torch.zeros(8, 256, dtype=torch.bfloat16)
    assert rig.eng.cached_dispatch(rig.buf, x, h, 1, None, None, False, False) is None   # not resolved yet
    rig.buf._configs[("dispatch", 8, 256, "bf16", Buffer.num_sms)] = CFG
    assert rig.eng.cached_dispatch(rig.buf, x, h, 1, None, None, False, False) is not None


def test_launch_failure_raises_as_the_python_path(rig):
    be, h = rig.be, handle_of()
    keep_cached(be, h, False)
    rig.ext._record(True, 715)
    try:
        with pytest.raises(KernelLaunchError, match="cuLaunchKernel failed") as err:
            rig.eng.cached_dispatch(rig.buf, torch.zeros(8, 256, dtype=torch.bfloat16), h, 1, CFG, None, False, False)
    finally:
        rig.ext._record(True, 0)
    assert err.value.code == 715 and is_device_failure(err.value)


# ------------------------------------------------------------------------------------------------
# layout
# ------------------------------------------------------------------------------------------------

def keep_layout(rig, monkeypatch, T: int, Kk: int, E: int) -> None:
    """What the engine keeps after a layout on stream COMPUTE (engine.py _layout_plans)."""
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: COMPUTE, raising=False)
    args = kernel_args("layout", "layout_kernel", num_tokens=T, num_topk=Kk, num_experts=E, num_ranks=2)
    rep = K.replay("layout", "layout_kernel", 2, K.LAYOUT_THREADS, args, shared_mem=(2 + E) * 4)
    rig.be._layout_plans[(COMPUTE, T, Kk, E)] = (rep, None, callpath.layout_plan(rep))


def test_layout_runs_as_the_python_path(rig, monkeypatch):
    be, T, Kk, E = rig.be, 300, 4, 16
    keep_layout(rig, monkeypatch, T, Kk, E)
    topk = torch.randint(-1, E, (T, Kk))
    out = rig.eng.layout(rig.buf, topk, E)
    ntpr, nrr, ntpe, tir, ev = out
    assert nrr is None and isinstance(ev, EventOverlap) and ev.event is None and ev.extra_tensors is None
    assert (ntpr.shape, ntpr.dtype, ntpe.shape, ntpe.dtype, tir.shape, tir.dtype) == \
           ((2,), torch.int32, (E,), torch.int32, (T, 2), torch.bool)
    recorded = ops(rig.ext)
    (launch,) = launches(recorded)
    # one block for the three outputs (is_token_in_rank first, the counts at 16-byte offsets)
    assert [op[0] for op in recorded] == ["alloc", "launch"] and launch[2] == COMPUTE
    base = tir.data_ptr()
    assert (ntpr.data_ptr() - base, ntpe.data_ptr() - base) == (-(-T * 2 // 16) * 16, -(-T * 2 // 16) * 16 + 16)
    assert all(t.is_contiguous() for t in (ntpr, ntpe, tir))
    assert launch[3:6] == (2, K.LAYOUT_THREADS, (2 + E) * 4)
    lay = be.get_dispatch_layout(topk, E)   # the Python path's replay of the same plan
    (_, stream, py_args), = rig.issued
    cpp = by_name("layout", "layout_kernel", launch[6])
    py = dict(zip((p for p, _ in K.kernel_params("layout", "layout_kernel")), py_args))
    mine = {"num_tokens_per_rank": ntpr, "num_tokens_per_expert": ntpe, "is_token_in_rank": tir}
    theirs = {"num_tokens_per_rank": lay.num_tokens_per_rank, "num_tokens_per_expert": lay.num_tokens_per_expert,
              "is_token_in_rank": lay.is_token_in_rank}
    for k in mine:
        assert cpp[k] == mine[k].data_ptr() and py[k] == theirs[k].data_ptr()
    assert {k: v for k, v in cpp.items() if k not in mine} == {k: v for k, v in py.items() if k not in mine}
    assert cpp["topk_idx"] == topk.data_ptr() and stream == COMPUTE and be.replayed == 2
    o_ntpr = -(-T * 2 // 16) * 16
    del out, ntpr, ntpe, tir
    check_carved(mine, theirs, {"is_token_in_rank": 0, "num_tokens_per_rank": o_ntpr,
                                "num_tokens_per_expert": o_ntpr + 16})
    for bad in (topk.int(), topk[:, :2], topk.t(), topk[None]):
        assert rig.eng.layout(rig.buf, bad, E) is None
    for experts in (E + 1, True, 32, -2):
        assert rig.eng.layout(rig.buf, topk, experts) is None
    rig.eng.test_stream = 5   # another stream: its own plan
    assert rig.eng.layout(rig.buf, topk, E) is None


def test_phases_are_timed_only_when_asked(rig, monkeypatch):
    """callpath.phases: off, nothing is timed; on, each C++ call's phases, one sample per call."""
    keep_layout(rig, monkeypatch, 64, 4, 16)
    h = handle_of()
    keep_cached(rig.be, h, fp8=True)
    topk = torch.randint(-1, 16, (64, 4))
    x, s = torch.zeros(8, 256, dtype=torch.float8_e4m3fn), torch.ones(8, 2)
    assert callpath.phases(False) == {}
    rig.eng.layout(rig.buf, topk, 16)
    assert callpath.phases(True) == {}
    for _ in range(3):
        assert rig.eng.layout(rig.buf, topk, 16) is not None
        assert rig.eng.cached_dispatch(rig.buf, (x, s), h, 1, CFG, None, False, False) is not None
    raw = rig.ext._phases(True)   # nanoseconds per call, and on again
    assert set(raw) == {f"layout.{p}" for p in ("args", "stream", "plan", "alloc", "views", "launch", "count",
                                                "result")} | \
           {f"cached.{p}" for p in ("checks", "enter", "alloc", "launch", "count", "leave", "result")}, raw
    assert all(len(v) == 3 and min(v) >= 0 for v in raw.values()), raw
    rig.eng.layout(rig.buf, topk, 16)
    got = callpath.phases(False)   # the medians, in microseconds
    assert set(got) == {k for k in raw if k.startswith("layout.")} and all(v >= 0 for v in got.values()), got
    rig.eng.layout(rig.buf, topk, 16)
    assert callpath.phases(False) == {}


def test_python_work_per_cached_dispatch(rig):
    """The Python C-API work of one replayed cached dispatch, counted (_py_ops; the internode engine's
    beside it: tests/test_callpath_internode.py): attribute reads and writes, no call into Python."""
    h = handle_of()
    keep_cached(rig.be, h, fp8=False)
    x = torch.zeros(8, 256, dtype=torch.bfloat16)
    for _ in range(2):
        assert rig.eng.cached_dispatch(rig.buf, x, h, 1, CFG, None, False, False) is not None
    rig.ext._py_ops(False)
    assert rig.eng.cached_dispatch(rig.buf, x, h, 1, CFG, None, False, False) is not None
    got = rig.ext._py_ops(False)
    assert (got["get"], got["set"], got["call"], got["alloc"]) == (18, 3, 0, 0), got


# ------------------------------------------------------------------------------------------------
# non-cached dispatch
# ------------------------------------------------------------------------------------------------

def _full_setup(rig, fp8=False, worst=0, weights=True, T=8, H=256, E=8, Kk=2, C=2):
    """A FullPlan as engine._dispatch keeps it (its notify and dispatch launches), the handle of the call
    that made it (buffer_id set, as Buffer.dispatch does) and that call's arguments; the C++ engine
    keeps it as Buffer.dispatch does."""
    be, R = rig.be, 2
    L = E // R
    notify = kernel_args("notify", "notify_kernel", host_counts=0 if worst else be._host_counts.data_ptr(),
                         host_flag=0 if worst else be._host_flag.data_ptr(), host_seq=0, num_tokens=T,
                         num_topk=Kk, num_experts=E, rank=0, num_ranks=R, num_channels=C,
                         mode=2 if worst else 0)
    disp = kernel_args("dispatch", "dispatch_kernel", num_tokens=T, num_local_experts=L, num_out_rows=worst or 7,
                       num_topk=Kk, num_scales=H // 128 if fp8 else 0, flags=1, abort_word=0)
    sig = [H, 1 if fp8 else 2, H // 128 if fp8 else 0, Kk, int(weights) + 2 * 64, E, C]
    plan = FullPlan(K.replay("notify", "notify_kernel", 1, K.NOTIFY_THREADS, notify),
                    K.replay("dispatch", "dispatch_kernel", 2 * C, 1024, disp), sig, L, C, E, be._twins)
    assert plan.cpp is not None
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g).to(torch.float8_e4m3fn if fp8 else torch.bfloat16)
    xs = (x, torch.ones(T, H // 128)) if fp8 else x
    lay = (torch.zeros(R, dtype=torch.int32), None, torch.zeros(E, dtype=torch.int32),
           torch.rand(T, R, generator=g) < .5)
    idx = torch.randint(0, E, (T, Kk), generator=g)
    w = torch.rand(T, Kk, generator=g) if weights else None
    made = DispatchHandle(torch.zeros(R, R, dtype=torch.int32), torch.zeros(R, C, dtype=torch.int32),
                          torch.zeros(R, C, dtype=torch.int32), torch.zeros(7, dtype=torch.int32), lay[3],
                          torch.zeros(T, R, dtype=torch.int32), topology=be.topology, num_tokens=T, hidden=H,
                          num_experts=E, num_channels=C, num_recv_tokens=None if worst else 7, num_worst_tokens=worst,
                          buffer_id=BUFFER_ID, backend="nvlink", extra={} if worst else {"send_counts": [4, 3]})
    args = (xs, lay[0], lay[1], lay[3], lay[2], idx, w, 1, worst, CFG)
    assert rig.eng.keep_dispatch(*args, plan.cpp, made)
    return plan, args


def _counts(be, seq: int, total: int, sent: list, recv: list, experts: list, **extra) -> None:
    """Host words and flag as notify.cu leaves them for call ``seq``."""
    n = K.HOST_COUNTS_EXPERT + len(experts)
    words = (ctypes.c_int32 * n).from_address(be._host_counts.data_ptr())
    for i in range(n):
        words[i] = 0
    hc = K.HOST_COUNTS
    words[hc["total"]], words[hc["bad_rank"]], words[hc["sig_rank"]] = total, -1, -1
    for base, vals in ((hc["sent"], sent), (hc["recv"], recv), (hc["expert"], experts)):
        for j, v in enumerate(vals):
            words[base + j] = v
    for k, v in extra.items():
        words[hc[k]] = v
    ctypes.c_int64.from_address(be._host_flag.data_ptr()).value = seq


@pytest.mark.parametrize("fp8, weights, alignment", [(False, True, 1), (True, True, 1), (False, False, 4)])
def test_dispatch_runs_as_the_python_path(rig, monkeypatch, fp8, weights, alignment):
    be = rig.be
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: COMM, raising=False)
    plan, args = _full_setup(rig, fp8=fp8, weights=weights)
    if alignment != 1:   # a kept call of another alignment: its own signature
        args = args[:7] + (alignment,) + args[8:]
        assert rig.eng.keep_dispatch(*args, plan.cpp, _handle_like(be))
    xs, ntpr, nrr, tir, ntpe, idx, w, al, worst, cfg = args
    experts = [5, 0, 2, 9]
    seq = be._host_seq % 0x7FFFFFFF + 1
    _counts(be, seq, 7, [4, 3], [6, 1], experts)
    out = rig.eng.dispatch(rig.buf, *args, None, False, False)
    assert out is not None and be._host_seq == seq
    recv, ridx, rw, per_expert, h, ev = out
    rx, rs = recv if fp8 else (recv, None)
    assert rx.shape == (7, 256) and ridx.shape == (7, 2) and ridx.dtype == torch.int64
    assert (rw.shape, rw.dtype) == ((7, 2), torch.float32) if weights else rw is None
    assert (rs.shape, rs.dtype) == ((7, 2), torch.float32) if fp8 else rs is None
    assert per_expert == [(c + alignment - 1) // alignment * alignment for c in experts]
    assert h.num_recv_tokens == 7 and h.extra == {"send_counts": [4, 3], "recv_counts": [6, 1]}
    assert h.is_token_in_rank is tir and h.buffer_id == BUFFER_ID and h.sum_order is None
    assert be.counters["local_rows"] == 4 and be.counters["intranode_rows"] == 3 and rig.eng.served["dispatch"] == 1
    recorded = ops(rig.ext)
    n_launch, d_launch = launches(recorded)
    kinds = [op[0] for op in recorded]
    rows = 4 + int(fp8) + int(weights)   # recv_x, [scales], recv_src_idx, send_head, recv_topk_idx, [weights]
    assert kinds == (["record", "wait"] + ["alloc"] * 3 + ["launch"] + ["alloc"] * rows + ["launch"]
                     + ["record", "wait"]), kinds
    # the Python path (engine._dispatch_replayed) on the same inputs, its notify raising the same words
    real_issue = K.Replay.issue

    def issue(self, stream):
        real_issue(self, stream)
        if self.lau.name == "notify_kernel":
            _counts(be, self.args[K.param_index("notify", "notify_kernel", "host_seq")], 7, [4, 3], [6, 1], experts)

    monkeypatch.setattr(K.Replay, "issue", issue)
    from commlib.backends.base import DispatchRequest
    from commlib.layout import Layout
    data, scales = xs if fp8 else (xs, None)
    req = DispatchRequest(data, scales, idx, w, Layout(ntpr, nrr, ntpe, tir), None, 8, al, worst, cfg)
    res = be._dispatch_replayed(plan, req, data, scales, idx, w, tir)
    (_, _, py_n), (_, _, py_d) = rig.issued
    assert res.num_recv_tokens_per_expert_list == per_expert
    assert res.handle.extra == h.extra and res.handle.num_recv_tokens == h.num_recv_tokens
    for f in dataclasses.fields(DispatchHandle):
        a, b = getattr(h, f.name), getattr(res.handle, f.name)
        if isinstance(a, torch.Tensor):
            assert (a.shape, a.dtype) == (b.shape, b.dtype), f.name
        elif f.name != "buffer_id":   # the Buffer sets it after the Python path's call
            assert a == b, f.name
    assert set(vars(h)) == set(vars(res.handle))
    own_n = {"channel_prefix_matrix": h.channel_prefix_matrix, "rank_prefix_matrix": h.rank_prefix_matrix,
             "recv_channel_prefix_matrix": h.recv_channel_prefix_matrix}
    py_own_n = {k: getattr(res.handle, k) for k in own_n}
    cpp = by_name("notify", "notify_kernel", n_launch[6])
    py = dict(zip((p for p, _ in K.kernel_params("notify", "notify_kernel")), py_n))
    for k in own_n:
        assert cpp[k] == own_n[k].data_ptr() and py[k] == py_own_n[k].data_ptr(), k
    assert cpp["host_seq"] == seq and py["host_seq"] == seq + 1
    skip = set(own_n) | {"host_seq"}
    assert {k: v for k, v in cpp.items() if k not in skip} == {k: v for k, v in py.items() if k not in skip}
    own_d = {"recv_x": (rx, res.recv_x), "recv_x_scales": (rs, res.recv_x_scales),
             "recv_src_idx": (h.recv_src_idx, res.handle.recv_src_idx),
             "send_head": (h.send_head, res.handle.send_head),
             "recv_topk_idx": (ridx, res.recv_topk_idx), "recv_topk_weights": (rw, res.recv_topk_weights),
             "rank_prefix_matrix": (h.rank_prefix_matrix, res.handle.rank_prefix_matrix),
             "channel_prefix_matrix": (h.channel_prefix_matrix, res.handle.channel_prefix_matrix),
             "recv_channel_prefix_matrix": (h.recv_channel_prefix_matrix, res.handle.recv_channel_prefix_matrix)}
    cpp = by_name("dispatch", "dispatch_kernel", d_launch[6])
    py = dict(zip((p for p, _ in K.kernel_params("dispatch", "dispatch_kernel")), py_d))
    for k, (mine, theirs) in own_d.items():
        assert cpp[k] == K.ptr(mine) and py[k] == K.ptr(theirs), k
    assert cpp["num_out_rows"] == 7 and cpp["x"] == data.data_ptr()
    assert {k: v for k, v in cpp.items() if k not in own_d} == {k: v for k, v in py.items() if k not in own_d}


DISPATCH_PHASES = ("checks", "enter", "alloc", "notify", "wait", "alloc_out", "launch", "handle", "leave", "result")


@pytest.mark.parametrize("worst", [0, 16])
def test_dispatch_phases(rig, monkeypatch, worst):
    """callpath.phases of the full dispatch: one sample per call of each phase, the count poll its own
    phase (wait: none where num_worst_tokens reads no counts); a call the C++ path declines times nothing."""
    be = rig.be
    plan, args = _full_setup(rig, worst=worst)
    slow = []

    def raise_bad_ids(host, sig):   # inside the poll's phase: a fault check that takes 20 ms and passes
        time.sleep(0.02)
        slow.append(host)

    monkeypatch.setattr(be, "_raise_bad_ids", raise_bad_ids, raising=False)
    assert callpath.phases(True) == {}
    for i in range(3):
        if not worst:   # call i's words (the second with a peer's fault flagged)
            _counts(be, be._host_seq % 0x7FFFFFFF + 1, 7, [4, 3], [6, 1], [5, 0, 2, 9],
                    **({"bad_rank": 1} if i == 1 else {}))
        t0 = time.perf_counter_ns()
        assert rig.eng.dispatch(rig.buf, *args, None, False, False) is not None
        wall = time.perf_counter_ns() - t0
    declined = (torch.zeros(9, 256, dtype=torch.bfloat16),) + args[1:]
    assert rig.eng.dispatch(rig.buf, *declined, None, False, False) is None
    raw = rig.ext._phases(False)
    want = [p for p in DISPATCH_PHASES if p != "wait" or not worst]
    assert list(raw) == [f"dispatch.{p}" for p in want], raw
    assert all(len(v) == 3 and min(v) >= 0 for v in raw.values()), raw
    assert sum(v[2] for v in raw.values()) <= wall   # the last call's phases lie within it
    if not worst:
        assert len(slow) == 1 and raw["dispatch.wait"][1] >= 20e6, raw["dispatch.wait"]
        assert all(v[1] < 20e6 for k, v in raw.items() if k != "dispatch.wait"), raw


def _handle_like(be, T=8, R=2, C=2) -> DispatchHandle:
    return DispatchHandle(*(torch.zeros(1, dtype=torch.int32) for _ in range(6)), topology=be.topology, num_tokens=T,
                          hidden=256, num_experts=8, num_channels=C, buffer_id=BUFFER_ID, backend="nvlink")


def test_worst_dispatch_reads_no_host_words(rig):
    be = rig.be
    plan, args = _full_setup(rig, worst=16)
    before = be._host_seq
    recv, ridx, rw, per_expert, h, ev = rig.eng.dispatch(rig.buf, *args, None, False, False)
    assert recv.shape == (16, 256) and per_expert == [] and h.num_recv_tokens is None and h.extra == {}
    assert be._host_seq == before and be.counters["local_rows"] == 0
    recorded = ops(rig.ext)
    n_launch, d_launch = launches(recorded)
    counts_alloc = [op for op in recorded if op[0] == "alloc"][3]
    assert counts_alloc[1] == [K.HOST_COUNTS_EXPERT + 4]
    n = by_name("notify", "notify_kernel", n_launch[6])
    d = by_name("dispatch", "dispatch_kernel", d_launch[6])
    assert n["host_seq"] == 0 and n["host_flag"] == 0 and n["host_counts"] != 0
    assert d["abort_word"] == n["host_counts"] + 4 * K.HOST_COUNTS["bad_rank"] and d["num_out_rows"] == 16


def test_dispatch_only_for_the_kept_signature(rig):
    be = rig.be
    plan, args = _full_setup(rig)
    xs, ntpr, nrr, tir, ntpe, idx, w, al, worst, cfg = args
    call = lambda *a: rig.eng.dispatch(rig.buf, *a, None, False, False)  # noqa: E731
    changed = {
        "x shape": (torch.zeros(9, 256, dtype=torch.bfloat16),) + args[1:],
        "x dtype": (xs.half(),) + args[1:],
        "non-contiguous x": (torch.zeros(256, 8, dtype=torch.bfloat16).t(),) + args[1:],
        "x subclass": (torch.nn.Parameter(xs, requires_grad=False),) + args[1:],
        "topk columns": args[:5] + (idx[:, :1],) + args[6:],
        "no weights": args[:6] + (None,) + args[7:],
        "num_tokens_per_rdma_rank": args[:2] + (ntpr,) + args[3:],
        "alignment": args[:7] + (2,) + args[8:],
        "num_worst_tokens": args[:8] + (4,) + args[9:],
        "another Config": args[:9] + (Config(4, 8, 64, 64, 1024),),
        "no Config": args[:9] + (None,),
        "int64 is_token_in_rank": args[:3] + (tir.long(),) + args[4:],
    }
    for what, a in changed.items():
        assert call(*a) is None, f"a dispatch with another {what} ran in C++"
    cfg.num_max_nvl_chunked_send_tokens = 16
    try:
        assert call(*args) is None, "a dispatch with a Config changed in place ran in C++"
    finally:
        cfg.num_max_nvl_chunked_send_tokens = 8
    be._ring_channels = 3
    assert call(*args) is None
    be._ring_channels = 2
    be._ce = object()
    assert call(*args) is None, "a dispatch the copy engines take ran in C++"
    be._ce = None
    assert rig.eng.dispatch(rig.buf, *args, "no event", False, False) is None
    assert ops(rig.ext) == []


def test_dispatch_faults_raise_as_the_python_path(rig):
    """The count exchange's faults raise through the engine's own methods, as in the Python path."""
    be = rig.be
    plan, args = _full_setup(rig)
    seq = be._host_seq % 0x7FFFFFFF + 1
    _counts(be, seq, 7, [4, 3], [6, 1], [1, 1, 1, 1], bad_me=3)
    with pytest.raises(ValueError, match="3 of them"):
        rig.eng.dispatch(rig.buf, *args, None, False, False)
    seq += 1
    _counts(be, seq, 7, [4, 3], [6, 1], [1, 1, 1, 1], sig_rank=1)
    with pytest.raises(ValueError, match="ranks disagree"):
        rig.eng.dispatch(rig.buf, *args, None, False, False)
    assert not be.failed
    # the notify kernel ends without raising the flag: CommlibError, the backend retired
    with pytest.raises(CommlibError, match="finished without raising its host flag"):
        rig.eng.dispatch(rig.buf, *args, None, False, False)
    assert be.failed
    assert rig.eng.dispatch(rig.buf, *args, None, False, False) is None   # a failed backend: the Python path


def test_dispatch_keeps_the_handle_fields_and_overlap_attributes(rig):
    """The handle and EventOverlap the engine builds (their __init__ skipped) have the attributes
    those classes' constructors give."""
    plan, args = _full_setup(rig)
    be = rig.be
    _counts(be, be._host_seq % 0x7FFFFFFF + 1, 7, [4, 3], [6, 1], [1, 1, 1, 1])
    *_, h, ev = rig.eng.dispatch(rig.buf, *args, None, False, False)
    assert set(vars(h)) == {f.name for f in dataclasses.fields(DispatchHandle)}
    assert set(vars(ev)) == set(vars(EventOverlap(None)))
    assert type(h) is DispatchHandle and type(ev) is EventOverlap
    assert h.topology is be.topology and h.extra == {"send_counts": [4, 3], "recv_counts": [6, 1]}
