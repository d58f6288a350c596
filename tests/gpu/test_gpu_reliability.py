"""GPU reliability (issue: reliability) on the NVLink engine.

- Long run: 10,000 rounds, hashes equal to the reference, memory flat (reliability_cases.case_long_run).
- Fault injection (gpu_check.sh stage `faults`):
  * ranks disagree on num_experts / hidden / dtype / Config in a dispatch: the count exchange compares
    every rank's call signature, so every rank raises RankDisagreement (a CommlibError and a
    ValueError) naming the field and both values, before any data moves; the Buffer keeps working.
    These never trap, so they share one 2-GPU world (reliability_cases.case_disagree_*).
  * cached dispatch / combine with different shapes on the ranks: the receiver's signature check
    prints '[commlib] rank R dispatch|combine channel c: signature mismatch with rank S ...' and
    traps; a rank skips a combine; a rank calls dispatch twice (the peer calls combine); a rank
    exits before dispatch: the device waits time out with a '[commlib] rank R timeout in ...' line.
    Every surviving rank raises within COMMLIB_TIMEOUT_S, and its Buffer refuses further calls.
    A trapped CUDA context cannot be reused, so each of these runs in its own short world
    (tests/gpu/reliability_faults.py, one rank per GPU, gloo group), one world at a time.
- CPU-side (always run): the NVLink backend's host path with the launches mocked: launch
  arguments match the kernels' C signatures, the mismatch message, poisoning after a CUDA error.
"""
import ctypes
import os
import re
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
pytestmark = pytest.mark.gpu
from nvlink_fakes import dispatch_req as _dispatch_req, fake_backend as _fake_backend  # noqa: E402
from nvlink_fakes import fill_counts as _fill_counts, mock_launch as _mock_launch  # noqa: E402

FAULT_TIMEOUT_S = 4          # COMMLIB_TIMEOUT_S inside the fault worlds
TRAP_CASES = ["sig_cached_dispatch", "sig_combine", "skip_combine", "dispatch_twice", "exit_before_dispatch",
              "ll_bad_expert_id"]
DISAGREE_CASES = ["disagree_num_experts", "disagree_hidden", "disagree_dtype", "disagree_config",
                  "disagree_combine_sms_is_fine"]


from commlib.buffer import _cupy_available as _have_cupy  # noqa: E402


needs_2_gpus = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2 or not _have_cupy(),
                                  reason="needs 2 GPUs and CuPy")


@needs_2_gpus
def test_long_run_10k_rounds():
    from worlds import run_world
    os.environ.setdefault("COMMLIB_TIMEOUT_S", "60")
    results = run_world(2, "reliability_cases", ["long_run"], use_gpu=True, timeout_s=900)
    assert results["long_run"] is None, results["long_run"]


# ------------------------------------------------------------------------------------------------
# Notify-level disagreement: one world, no traps
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def disagree_world():
    from worlds import run_world
    old = os.environ.get("COMMLIB_TIMEOUT_S")
    os.environ["COMMLIB_TIMEOUT_S"] = str(FAULT_TIMEOUT_S + 1)
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(k, v)
    try:
        return run_world(2, "reliability_cases", DISAGREE_CASES, use_gpu=True, timeout_s=240)
    finally:
        if old is None:
            os.environ.pop("COMMLIB_TIMEOUT_S", None)
        else:
            os.environ["COMMLIB_TIMEOUT_S"] = old


@needs_2_gpus
@pytest.mark.parametrize("name", DISAGREE_CASES)
def test_ranks_disagree_gpu(disagree_world, name):
    assert disagree_world[name] is None, disagree_world[name]


# ------------------------------------------------------------------------------------------------
# Trapping faults: one short world each (one rank per GPU), one at a time
# ------------------------------------------------------------------------------------------------

_TRAP_RESULTS: dict = {}


def _run_trap_world(case: str) -> tuple:
    """Run one trap world (once per session), one rank per GPU; returns (returncode, output, seconds).

    One rank per GPU on purpose: with both ranks' contexts on one GPU, a trap in each (both ranks
    fail) left the second context hung in the driver on 2 x H200 (three worlds never finished),
    whereas a trap per GPU is reported at once. Worlds run one at a time (pytest is sequential).
    """
    if case in _TRAP_RESULTS:
        return _TRAP_RESULTS[case]
    logdir = Path(os.environ.get("COMMLIB_FAULT_LOG_DIR", "/tmp/commlib_faults"))
    logdir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, COMMLIB_TIMEOUT_S=str(FAULT_TIMEOUT_S), PYTHONUNBUFFERED="1",
               NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent.parent), str(HERE), env.get("PYTHONPATH", "")])
    log = logdir / f"{case}.log"
    t0 = time.monotonic()
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, str(HERE / "reliability_faults.py"), case], stdout=fh,
                                stderr=subprocess.STDOUT, env=env)
        try:
            rc = proc.wait(timeout=FAULT_TIMEOUT_S + 40)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
    _TRAP_RESULTS[case] = (rc, log.read_text(errors="replace"), time.monotonic() - t0)
    return _TRAP_RESULTS[case]


def _outcomes(out: str) -> dict:
    """rank -> (status, seconds, text) from the worlds' '[fault] rank R: STATUS after S s: TEXT' lines."""
    res = {}
    for line in out.splitlines():
        if line.startswith("[fault] rank "):
            head, _, text = line.partition(": ")
            if len(head.split()) != 3:  # '[fault] rank R after: ...' lines are not the outcome
                continue
            rank = int(head.split()[2])
            status, _, rest = text.partition(" after ")
            secs, _, msg = rest.partition(" s: ")
            res[rank] = (status, float(secs or 0), msg)
    return res


@pytest.mark.skipif(not torch.cuda.is_available() or not _have_cupy(), reason="needs a GPU and CuPy")
def test_ring_stall_names_rank_channel_counter():
    """A full ring whose receiver never comes: the waiting rank traps with a message naming its rank, the
    channel, the ring counter (head or tail) and the peer, and its Buffer refuses later calls. Only one
    rank traps, so both ranks may share one GPU."""
    rc, out, took = _run_trap_world("ring_stall")
    print(f"--- ring_stall: rc {rc}, {took:.1f} s ---\n{out[-3000:]}")
    tail = out[-4000:]
    assert re.search(r"\[commlib\] rank 0 timeout in dispatch channel \d+ waiting for dispatch "
                     r"(head \(receiver consumed\)|tail \(sender progress\)) from rank 1: expected seq \d+ "
                     r"count >= \d+, seen seq \d+ count \d+", out), tail
    res = _outcomes(out)
    assert res.get(0, ("",))[0] == "RAISED" and res[0][1] < FAULT_TIMEOUT_S + 6, f"rank 0: {res.get(0)}\n{tail}"
    assert res.get(1, ("",))[0] == "SKIPPED", f"rank 1: {res.get(1)}\n{tail}"
    for tag in ("after", "again"):
        line = next((ln for ln in out.splitlines() if ln.startswith(f"[fault] rank 0 {tag}: ")), "")
        assert line and "no error" not in line, f"rank 0 {tag}: {line!r}\n{tail}"


@needs_2_gpus
@pytest.mark.parametrize("case", TRAP_CASES)
def test_fault_world(case):
    rc, out, took = _run_trap_world(case)
    print(f"--- {case}: rc {rc}, {took:.1f} s ---\n{out[-3000:]}")
    res = _outcomes(out)
    tail = out[-4000:]
    limit = FAULT_TIMEOUT_S + 6  # device timeout + a sync + the report
    if case in ("sig_cached_dispatch", "sig_combine"):
        kernel = "dispatch" if case == "sig_cached_dispatch" else "combine"
        assert f"{kernel} channel" in out and "signature mismatch with rank" in out, tail
        survivors = [0, 1]
    elif case == "skip_combine":
        assert "[commlib] rank 0 timeout in combine channel" in out and "from rank 1" in out, tail
        survivors = [0]
    elif case == "dispatch_twice":
        assert "[commlib] rank 0 timeout in notify channel -1 waiting for notify flag from rank 1" in out, tail
        assert "[commlib] rank 1 timeout in combine channel" in out, tail
        survivors = [0, 1]
    elif case == "ll_bad_expert_id":
        assert "[commlib] rank 0 low_latency_dispatch: topk_idx[3, 1] = 8 is outside [-1, 8)" in out, tail
        assert "[commlib] rank 1 timeout in low_latency_dispatch" in out, tail
        survivors = [0, 1]
    else:  # exit_before_dispatch: a timeout, or a fault if the dead rank's memory went away
        survivors = [0]
    for r in survivors:
        assert r in res, f"rank {r} reported nothing:\n{tail}"
        status, secs, msg = res[r]
        assert status == "RAISED", f"rank {r}: {status} {msg}\n{tail}"
        assert secs < limit, f"rank {r} took {secs:.1f} s (COMMLIB_TIMEOUT_S={FAULT_TIMEOUT_S})"
    for r in sorted(set(range(2)) - set(survivors)):  # the rank that made the fault: it left on purpose
        assert r in res and res[r][0] == "SKIPPED", f"rank {r}: {res.get(r)}\n{tail}"
    # after the failure the Buffer refuses further calls: every later call raises
    for r in survivors:
        for tag in ("after", "again"):
            line = next((ln for ln in out.splitlines() if ln.startswith(f"[fault] rank {r} {tag}: ")), "")
            assert line and "no error" not in line, f"rank {r} {tag}: {line!r}\n{tail}"
    if case in ("dispatch_twice", "exit_before_dispatch"):
        # the count exchange's host read saw the failure: CommlibError, then the Buffer is poisoned
        status, _, msg = res[0]
        assert msg.startswith("CommlibError") and "failed on the device" in msg, msg
        assert any(ln.startswith("[fault] rank 0 again: CommlibError") and "unusable after an earlier failure" in ln
                   for ln in out.splitlines()), tail


# ------------------------------------------------------------------------------------------------
# CPU-side: the host path of the NVLink backend with the kernel launches mocked
# ------------------------------------------------------------------------------------------------

def test_trace_history_slots():
    """COMMLIB_DEBUG_SMID_SLOTS: each launch gets the next slot of its kind; trace_history reads them
    oldest first, last_trace / last_smids the newest; more launches than slots raise, a reset
    starts over. The kernels are stood in for by writes at the pointer each launch was given."""
    from commlib.cuda import loader as K

    be = _fake_backend()
    slots, words = 3, K.TRACE_OFFSET_WORDS + 256 * K.TRACE_POINTS * 2
    be._smids = torch.full((3, slots, words), -1, dtype=torch.int32)
    be._smid_slots = slots
    be._smid_grids = {kind: [0] * slots for kind in be._smid_count}

    def launch(kind, grid, stamp):
        addr = int(be._smid_ptr(kind, grid))
        row = torch.frombuffer((ctypes.c_int32 * words).from_address(addr), dtype=torch.int32)
        row[:grid] = torch.arange(grid, dtype=torch.int32) + stamp
        pts = row[K.TRACE_OFFSET_WORDS:].view(torch.int64)
        for cta in range(grid):
            pts[cta * K.TRACE_POINTS: (cta + 1) * K.TRACE_POINTS] = torch.tensor([stamp, stamp + 1, stamp + 2 + cta])

    launch("dispatch", 4, 100)
    launch("combine", 2, 500)
    launch("dispatch", 2, 200)
    hist = be.trace_history("dispatch")
    assert [len(t) for t in hist] == [4, 2]
    assert hist[0][3] == (100, 101, 105) and hist[1] == [(200, 201, 202), (200, 201, 203)]
    assert be.last_trace("dispatch") == hist[1] and be.last_smids("dispatch") == [200, 201]
    assert be.trace_history("combine") == [[(500, 501, 502), (500, 501, 503)]]
    launch("dispatch", 2, 300)
    launch("dispatch", 2, 400)  # a fourth launch reuses slot 0
    assert be.last_smids("dispatch") == [400, 401]
    with pytest.raises(RuntimeError, match="COMMLIB_DEBUG_SMID_SLOTS=3"):
        be.trace_history("dispatch")
    be.reset_trace_history()
    assert be.trace_history("dispatch") == [] and be.last_trace("dispatch") == []
    launch("dispatch", 2, 600)
    assert be.trace_history("dispatch") == [[(600, 601, 602), (600, 601, 603)]]
    be._smids = None
    with pytest.raises(RuntimeError, match="COMMLIB_DEBUG_SMID=1"):
        be.trace_history("dispatch")


def test_host_signature_mismatch_message(monkeypatch):
    """The notify launch carries the signature; a peer's differing one raises on this rank with the
    fields and both values, as RankDisagreement (CommlibError and ValueError); the Buffer stays usable."""
    pytest.importorskip("numpy")
    from commlib.backends.nvlink.engine import RankDisagreement
    from commlib.validate import CommlibError

    be = _fake_backend()
    theirs = [256, 1, 2, 2, 1 + 2 * 64, 16, 2]  # rank 1: fp8 (1 byte, 2 scales), 16 experts; weights, ring 64
    calls = _mock_launch(monkeypatch, on_notify=lambda a: _fill_counts(a, {"sig_rank": 1, "sig": theirs}))
    with pytest.raises(RankDisagreement) as ei:
        be.dispatch(_dispatch_req())
    msg = str(ei.value)
    assert isinstance(ei.value, CommlibError) and isinstance(ei.value, ValueError)
    assert "ranks disagree" in msg and "nothing was sent" in msg, msg
    assert "x dtype: rank 1 has fp8" in msg and "rank 0 has bf16" in msg, msg
    assert "num_experts: rank 1 has 16, rank 0 has 8" in msg and "FP8 scales per token" in msg, msg
    assert "hidden" not in msg.split("disagree")[1].split(";")[0], msg  # hidden agrees: not listed
    assert [c[0] for c in calls] == ["notify_kernel"], "the dispatch kernel must not run after a mismatch"
    notify_args = calls[0][1]
    # mode, hidden, element bytes, scales, weights given + 2 x the ring's rows (64)
    assert notify_args[16:21] == [0, 256, 2, 0, 1 + 2 * 64], notify_args
    assert "topk_weights" not in msg, msg  # weights and ring agree: not listed
    assert be.failed is None  # every rank raised before data moved: still usable


def test_host_ring_size_mismatch_is_named(monkeypatch):
    """Ranks whose Configs differ only in the ring size do not pair up: the signature names the ring."""
    pytest.importorskip("numpy")
    from commlib.backends.nvlink.engine import RankDisagreement

    be = _fake_backend()
    theirs = [256, 2, 0, 2, 1 + 2 * 8, 8, 2]  # rank 1: the same call through rings of 8 rows
    _mock_launch(monkeypatch, on_notify=lambda a: _fill_counts(a, {"sig_rank": 1, "sig": theirs}))
    with pytest.raises(RankDisagreement, match="a ring of 8 rows per channel, rank 0 has topk_weights given, "
                                               "a ring of 64 rows per channel"):
        be.dispatch(_dispatch_req())


def test_host_config_mismatch_names_num_sms(monkeypatch):
    from commlib.backends.nvlink.engine import RankDisagreement

    be = _fake_backend()
    theirs = [256, 2, 0, 2, 1, 8, 5]  # rank 1 runs num_sms 10
    _mock_launch(monkeypatch, on_notify=lambda a: _fill_counts(a, {"sig_rank": 1, "sig": theirs}))
    with pytest.raises(RankDisagreement, match=r"num_channels: rank 1 has 5 \(Config.num_sms 10\), rank 0 has 2"):
        be.dispatch(_dispatch_req())


def test_host_launch_arguments_match_kernels(monkeypatch):
    """dispatch (plain, num_worst_tokens), cached dispatch, combine and on_rejected pass exactly the
    kernels' parameters, each fitting its C type."""
    from commlib.backends.base import CombineRequest
    from commlib.config import Config

    be = _fake_backend()
    calls = _mock_launch(monkeypatch, on_notify=lambda a: _fill_counts(a, {"total": 0}))
    res = be.dispatch(_dispatch_req())
    assert [c[0] for c in calls] == ["notify_kernel", "dispatch_kernel"]
    # DISPATCH_STREAM_MAX_SMS (default 20): this 4-SM dispatch launches the streaming sender's build
    from commlib.cuda import loader as K
    name, grid, key = calls.builds[-1]
    assert name == "dispatch_kernel" and grid == 4 and key == K.dispatch_variant_key(4)
    assert dict(key)["DISPATCH_STREAM_SEND"] == 1
    calls.clear()
    be.dispatch(_dispatch_req(worst=16, fp8=True))
    assert calls[0][1][16] == 2, "num_worst_tokens: the notify kernel traps on a mismatch (mode NO_HOST)"
    calls.clear()
    req = _dispatch_req()
    req.handle, req.topk_idx, req.topk_weights, req.layout = res.handle, None, None, None
    be.dispatch(req)
    assert [c[0] for c in calls] == ["dispatch_kernel"]
    calls.clear()
    be.combine(CombineRequest(torch.zeros(0, 256, dtype=torch.bfloat16), res.handle, torch.zeros(0, 2), (),
                              Config(4, 8, 64, 64, 1024)))
    assert [c[0] for c in calls] == ["combine_kernel"]
    calls.clear()
    be.on_rejected(1)
    assert calls[0][0] == "notify_kernel" and calls[0][1][16] == 1  # mode REJECTED


def test_host_copy_engine_path(monkeypatch):
    """COMMLIB_CE_BYTES's host path (rank 1 of 2), launches and copies mocked: the dispatch packs,
    syncs, pushes each block of the peer's rows into the peer's region for this rank and copies the
    blocks the peer pushed into the outputs (no BEGIN wait after the count exchange); the cached
    dispatch moves x only; the combine pushes the peer's rows and weights back and sums; every launch
    passes exactly the kernels' parameters; rows that overflow a region raise before any data kernel or
    copy. Prepacked (Buffer.prepack): the layout and the packing launch ahead on the caller's stream with
    every SM, this rank's own rows into its region of a second pack buffer (the first is still taken),
    and the dispatch then only syncs and copies, own rows included."""
    import types

    from commlib.backends.base import CombineRequest
    from commlib.config import Config
    from commlib.validate import CommlibError

    be = _fake_backend(rank=1, R=2)
    region, base, peer = 1 << 20, 1 << 40, 1 << 41
    be._ce = types.SimpleNamespace(base=base, peer_ptrs={0: peer}, num_bytes=4096 + 2 * region,
                                   peer_bases=torch.tensor([peer, base]))
    be.ce_region_bytes = region
    from commlib.backends.nvlink.engine import StagingPool
    be._ce_packs, be._ce_lands = StagingPool(2 * region, "cpu"), StagingPool(2 * region, "cpu")
    be._ce_packs.take()
    be._ce_event = lambda: "event"
    be._ce_stream = lambda: types.SimpleNamespace(wait_event=lambda e: None)  # no CUDA here
    be._layout_scratch = {}
    be._ce_counter = torch.zeros(1, dtype=torch.int64)
    be._ce_half_sms = 66  # an H200's 132 SMs
    monkeypatch.delenv("COMMLIB_CE_SMS", raising=False)
    copies: list = []
    be._ce_copies = copies.extend
    sent, got = [3, 4], [2, 4]  # rank 1 sends 3 rows to rank 0 and 4 to itself; receives 2 from rank 0
    calls = _mock_launch(monkeypatch, on_notify=lambda a: _fill_counts(a, {"total": 6, "sent": sent, "recv": got}))
    res = be.dispatch(_dispatch_req())
    assert [c[0] for c in calls] == ["notify_kernel", "ce_pack_kernel"] + ["ce_sync_kernel"] * 2
    assert [c[1][0] for c in calls[2:]] == [3, 2]  # pushed (advancing the counter), done
    assert be._ce_packs.events == ["event"] and be._ce_packs.pending == [False]
    assert calls.builds[1][1] == 66  # packing grid: half the SMs, more than the call's num_sms (4)
    pack = calls[1][1]
    row, topk, w, src = 512, 16, 8, 4  # bytes per row of each block (bf16 x of 256, no scales)
    cap = (region - 16 * 5) // (row + topk + w + src)
    a16 = lambda n: (n + 15) // 16 * 16  # noqa: E731 - each block starts 16-byte aligned
    offs = [0, a16(cap * row), a16(cap * row), a16(cap * row) + a16(cap * topk),
            a16(cap * row) + a16(cap * topk) + a16(cap * w)]
    assert pack[6:12] == [be._ce_packs.ptr(0), region] + offs[1:]
    assert pack[12] == res.recv_x.data_ptr() + got[0] * row  # this rank's own rows: after rank 0's
    assert pack[17] == 1 | 4 | 8 | 16  # x, top-k, weights, sources; no scales
    outs = [res.recv_x, None, res.recv_topk_idx, res.recv_topk_weights, res.handle.recv_src_idx]
    sizes = [row, 0, topk, w, src]
    pushes = [(peer + 4096 + 1 * region + offs[b], be._ce_packs.ptr(0) + offs[b], sent[0] * sizes[b])
              for b in (0, 2, 3, 4)]
    pulls = [(outs[b].data_ptr(), base + 4096 + offs[b], got[0] * sizes[b]) for b in (0, 2, 3, 4)]
    assert copies == pushes + pulls
    h = res.handle
    assert h.extra["send_counts"] == sent and h.extra["recv_counts"] == got and "ce_pos" in h.extra

    calls.clear(), copies.clear()
    req = _dispatch_req()
    req.handle, req.topk_idx, req.topk_weights, req.layout = h, None, None, None
    monkeypatch.setenv("COMMLIB_CE_SMS", "15")
    cached = be.dispatch(req)
    monkeypatch.delenv("COMMLIB_CE_SMS")
    # the packing launches as 2-CTA clusters (COMM_CLUSTER): 15 CTAs asked, 16 launched
    assert [g for n, g, _ in calls.builds if n == "ce_pack_kernel"] == [66, 16]
    assert [c[0] for c in calls] == ["ce_pack_kernel"] + ["ce_sync_kernel"] * 3 and calls[0][1][17] == 1
    assert [c[1][0] for c in calls[1:]] == [0, 1, 2]  # no count exchange: begin, pushed, done
    cap1 = (region - 16 * 5) // row
    assert cap1 > 0 and copies == [(peer + 4096 + region, be._ce_packs.ptr(0), sent[0] * row),
                                   (cached.recv_x.data_ptr(), base + 4096, got[0] * row)]

    calls.clear(), copies.clear()
    y, yw = torch.zeros(6, 256, dtype=torch.bfloat16), torch.zeros(6, 2)
    out = be.combine(CombineRequest(y, h, yw, (), Config(4, 8, 64, 64, 1024)))
    assert [c[0] for c in calls] == ["ce_sync_kernel", "ce_sync_kernel", "ce_reduce_kernel", "ce_sync_kernel"]
    assert [g for n, g, _ in calls.builds if n == "ce_reduce_kernel"] == [66]
    ccap = (region - 16 * 2) // (row + w)
    reduce = calls[2][1]
    assert reduce[2:5] == [base, region, a16(ccap * row)] and reduce[7] == got[0]  # rank 0's rows come first
    assert copies == [(peer + 4096 + region, y.data_ptr(), got[0] * row),
                      (peer + 4096 + region + a16(ccap * row), yw.data_ptr(), got[0] * w)]
    assert tuple(out.combined_x.shape) == (8, 256)

    # COMMLIB_CE_STAGING=host: the same pushes (into host memory), then each source's blocks land in
    # its region of a device landing buffer, which the sum reads instead of the staging; the staging
    # is free again (DONE) before the sum
    calls.clear(), copies.clear()
    be._ce_host = True
    be.combine(CombineRequest(y, h, yw, (), Config(4, 8, 64, 64, 1024)))
    be._ce_lands.take()
    land = be._ce_lands.ptr(0)
    assert [c[0] for c in calls] == ["ce_sync_kernel"] * 3 + ["ce_reduce_kernel"]
    assert [c[1][0] for c in calls[:3]] == [0, 1, 2]
    assert calls[3][1][2] == land - 4096  # region s of the sum = land + s * region
    assert copies[2:] == [(land + 0 * region, base + 4096, sent[0] * row),
                          (land + a16(ccap * row), base + 4096 + a16(ccap * row), sent[0] * w)]
    # finish_later: the call stops after DONE; finish() sums with every SM and frees the landing buffer;
    # a second deferred combine meanwhile lands in a second buffer
    calls.clear(), copies.clear(), calls.builds.clear()
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    be._ce_stream = lambda: types.SimpleNamespace(wait_event=lambda e: None)
    req = CombineRequest(y, h, yw, (), Config(4, 8, 64, 64, 1024), finish_later=True)
    be.combine(req)  # COMMLIB_CE_DEFER_SUM unset (default): the sum runs in the call
    assert [c[0] for c in calls] == ["ce_sync_kernel"] * 3 + ["ce_reduce_kernel"]
    calls.clear(), copies.clear()
    monkeypatch.setenv("COMMLIB_CE_DEFER_SUM", "1")
    first, second = be.combine(req), be.combine(req)
    assert [c[0] for c in calls] == ["ce_sync_kernel"] * 6 and be._ce_lands.pending == [True, True]
    assert copies[2][0] == be._ce_lands.ptr(0) and copies[6][0] == be._ce_lands.ptr(1)
    out_x, out_w = first.pending.finish()
    assert out_x is first.combined_x and out_w is first.combined_topk_weights
    assert calls[-1][0] == "ce_reduce_kernel" and calls.builds[-1][1] == 132 and calls[-1][1][2] == land - 4096
    assert be._ce_lands.pending == [False, True] and be._ce_lands.events[0] == "event"
    with pytest.raises(RuntimeError, match="already called"):
        first.pending.finish()
    second.pending.finish()
    be._ce_host = False

    # prepacked: buffer 0 is taken by a prepack not dispatched yet, so the next one packs into buffer 1
    calls.clear(), copies.clear(), calls.builds.clear()
    waits: list = []
    be._ce_stream = lambda: types.SimpleNamespace(wait_event=waits.append)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    req = _dispatch_req()
    layouts: list = []
    be.get_dispatch_layout = lambda topk, E: layouts.append((topk, E)) or req.layout  # on the caller's stream
    first_tok = be.prepack(req.x, None, req.topk_idx, req.topk_weights, 8, None)
    tok = be.prepack(req.x, None, req.topk_idx, req.topk_weights, 8, None)
    assert (first_tok.slot, tok.slot) == (0, 1) and len(be._ce_packs.bufs) == 2 and waits == ["event"]
    assert [n for n, g, _ in calls.builds] == ["ce_pack_kernel"] * 2 and len(layouts) == 2
    assert calls.builds[-1][1] == 132  # every SM: it runs on the compute stream between compute steps
    p = calls[-1][1]
    own = be._ce_packs.ptr(1) + 1 * region  # region `rank` of pack buffer 1
    assert p[6] == be._ce_packs.ptr(1) and p[12:17] == [own + offs[b] if sizes[b] else 0 for b in range(5)]
    calls.clear()
    req.layout, req.prepacked = tok.layout, tok
    res = be.dispatch(req)
    assert [c[0] for c in calls] == ["notify_kernel"] + ["ce_sync_kernel"] * 2 and tok.consumed
    assert be._ce_packs.pending == [True, False] and be._ce_packs.events[1] == "event"
    outs = [res.recv_x, None, res.recv_topk_idx, res.recv_topk_weights, res.handle.recv_src_idx]
    pushes = [(peer + 4096 + region + offs[b], be._ce_packs.ptr(1) + offs[b], sent[0] * sizes[b])
              for b in (0, 2, 3, 4)]
    pulls = [(outs[b].data_ptr(), base + 4096 + offs[b], got[0] * sizes[b]) for b in (0, 2, 3, 4)]
    owns = [(outs[b].data_ptr() + got[0] * sizes[b], own + offs[b], got[1] * sizes[b]) for b in (0, 2, 3, 4)]
    assert copies == pushes + pulls + owns
    be._ce_packs.pending[:] = [True] * 4  # four prepacks never dispatched: the next is refused, nothing taken
    with pytest.raises(ValueError, match="4 prepacked dispatches are outstanding"):
        be.prepack(req.x, None, req.topk_idx, req.topk_weights, 8, None)
    assert len(be._ce_packs.bufs) == 2
    be._ce_packs.pending[:] = [False, False]  # (first_tok is never dispatched here)
    big = _dispatch_req(T=4000)  # more tokens than a region's rows: the call packs itself
    assert be.prepack(big.x, None, big.topk_idx, big.topk_weights, 8, None) is None
    monkeypatch.setenv("COMMLIB_CE_PREPACK", "0")
    assert be.prepack(req.x, None, req.topk_idx, req.topk_weights, 8, None) is None
    monkeypatch.delenv("COMMLIB_CE_PREPACK")

    calls.clear(), copies.clear()
    be.ce_region_bytes = 2048  # 3 dispatch rows of 540 bytes per region
    sent = [5, 4]
    with pytest.raises(CommlibError, match="raise COMMLIB_CE_BYTES"):
        be.dispatch(_dispatch_req())
    assert [c[0] for c in calls] == ["notify_kernel"] and copies == []


def test_host_ce_settings(monkeypatch):
    """The copy-engine settings the nvlink backend starts from: off by default, device or host staging
    with COMMLIB_CE_BYTES, and host staging without bytes (or a bad staging name) refused by name."""
    from commlib.backends.nvlink.engine import ce_settings

    for k in ("COMMLIB_CE_BYTES", "COMMLIB_CE_STAGING"):
        monkeypatch.delenv(k, raising=False)
    assert ce_settings(0) == (0, False)
    monkeypatch.setenv("COMMLIB_CE_BYTES", str(64 << 20))
    assert ce_settings(0) == (64 << 20, False)
    monkeypatch.setenv("COMMLIB_CE_STAGING", "host")
    assert ce_settings(0) == (64 << 20, True)
    monkeypatch.delenv("COMMLIB_CE_BYTES")
    with pytest.raises(ValueError, match="COMMLIB_CE_STAGING=host needs COMMLIB_CE_BYTES"):
        ce_settings(1)
    monkeypatch.setenv("COMMLIB_CE_STAGING", "nvme")
    with pytest.raises(ValueError, match="COMMLIB_CE_STAGING"):
        ce_settings(1)


def test_host_peer_memory_shares_pages(monkeypatch):
    """HostPeerMemory (COMMLIB_CE_STAGING=host) with CUDA mocked, as rank 1 of 2: it maps rank 0's memfd
    through /proc (here a memfd of this process), registers both mappings, and bytes written on either
    side are read on the other; a rank on another host is refused; close() unregisters each mapping."""
    import contextlib
    import socket
    import types

    from commlib.backends.nvlink import peer_memory as pm

    registered, unregistered = [], []
    rt = types.SimpleNamespace(deviceGetAttribute=lambda attr, dev: 1,
                               hostRegister=lambda p, n, flags: registered.append((p, n, flags)),
                               hostUnregister=unregistered.append)
    monkeypatch.setattr(pm.K, "cupy", lambda: types.SimpleNamespace(
        cuda=types.SimpleNamespace(runtime=rt, Device=lambda dev: contextlib.nullcontext())))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    n = 1 << 16
    fd0 = os.memfd_create("rank0")
    os.ftruncate(fd0, n)
    os.pwrite(fd0, b"from rank 0", 100)
    host = [socket.gethostname()]

    def gather(out, obj, group=None):
        out[0], out[1] = (os.getpid(), fd0, host[0]), obj

    monkeypatch.setattr(pm.dist, "all_gather_object", gather)
    try:
        mem = pm.HostPeerMemory(n, None, 1, 2, torch.device("cpu"))
        assert ctypes.string_at(mem.peer_ptrs[0] + 100, 11) == b"from rank 0"
        ctypes.memmove(mem.peer_ptrs[0] + 200, b"from rank 1", 11)
        assert os.pread(fd0, 11, 200) == b"from rank 1"
        ctypes.memmove(mem.base + 8, b"own", 3)
        assert os.pread(mem._fd, 3, 8) == b"own"
        assert mem.peer_bases.tolist() == [mem.peer_ptrs[0], mem.base]
        assert sorted(p for p, _, _ in registered) == sorted([mem.base, mem.peer_ptrs[0]])
        assert all(size == n and flags == 3 for _, size, flags in registered)  # portable | mapped
        ptrs = [mem.base, mem.peer_ptrs[0]]
        mem.close()
        assert sorted(unregistered) == sorted(ptrs) and mem.base is None
        host[0] = "elsewhere"
        unregistered.clear()
        with pytest.raises(RuntimeError, match="one host"):
            pm.HostPeerMemory(n, None, 1, 2, torch.device("cpu"))
        assert len(unregistered) == 1  # its own mapping, released on the way out
    finally:
        os.close(fd0)


def test_host_device_failure_poisons_buffer(monkeypatch):
    """A CUDA error in a call (a trapped kernel) raises CommlibError and the backend refuses later calls."""
    from commlib.validate import CommlibError

    be = _fake_backend()
    _mock_launch(monkeypatch, fail=True)
    with pytest.raises(CommlibError, match="failed on the device"):
        be.dispatch(_dispatch_req())
    assert be.failed
    with pytest.raises(CommlibError, match="unusable after an earlier failure"):
        be.dispatch(_dispatch_req())


def test_kept_plans_replay_only_identical_calls():
    """NVLinkBackend.plan_for hands back a cached dispatch's kept plan only for a call like the one
    it was made from (dtype, shape, contiguity, 16-byte alignment, Config values, ring channels, the
    handle's own tensors, the FP8 scales' dtype and shape, the same backend, no failure); run_plan
    puts the new tensors' addresses in the kernel's argument slots and counts the rows. The replayed
    kernel is stood in for by a recorder."""
    from commlib.backends.nvlink.engine import CachedPlan
    from commlib.config import Config
    from commlib.handle import DispatchHandle

    class Recorder:
        def __init__(self, n):
            self.args, self.issued = [0] * n, []

        def current(self):
            return True

        def issue(self, stream):
            self.issued.append((stream, list(self.args)))

    be, other = _fake_backend(), _fake_backend()
    be._ring_channels, be.replayed = 2, 0
    z = torch.zeros(2, 2, dtype=torch.int32)
    h = DispatchHandle(z, z, z, torch.zeros(5, dtype=torch.int32), torch.zeros(8, 2, dtype=torch.bool), z)
    cfg = Config(4, 8, 64, 64, 1024)
    x, s = torch.zeros(8, 256, dtype=torch.bfloat16), torch.ones(8, 2)
    key = ("dispatch", torch.bfloat16)
    rec = Recorder(38)
    fields = ("is_token_in_rank", "rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix")
    plan = CachedPlan(be, x, cfg, 2, rec, (((5, 256), torch.bfloat16), ((5, 2), torch.float32)), 8, [3, 2], s,
                      tuple((f, getattr(h, f)) for f in fields))
    be._keep_plan(h, key, plan)
    assert be.plan_for(h, key, torch.ones_like(x), Config(4, 8, 64, 64, 1024), torch.zeros_like(s)) is plan
    misaligned = torch.zeros(8 * 256 + 1, dtype=torch.bfloat16)[1:].view(8, 256)
    for what, args in (
            ("dtype", (x.half(), cfg, s)),
            ("shape", (torch.zeros(9, 256, dtype=torch.bfloat16), cfg, s)),
            ("non-contiguous x", (torch.zeros(256, 8, dtype=torch.bfloat16).t(), cfg, s)),
            ("misaligned x", (misaligned, cfg, s)),
            ("Config values", (x, Config(4, 16, 64, 64, 1024), s)),
            ("no scales", (x, cfg, None)),
            ("scales dtype", (x, cfg, s.int())),
            ("scales shape", (x, cfg, torch.ones(8, 3)))):
        assert be.plan_for(h, key, *args) is None, f"a call with another {what} got the kept plan"
    be._ring_channels = 3
    assert be.plan_for(h, key, x, cfg, s) is None, "the rings moved, yet the plan was kept"
    be._ring_channels = 2
    assert other.plan_for(h, key, x, cfg, s) is None, "another backend replayed this backend's plan"
    import dataclasses
    copied = dataclasses.replace(h, rank_prefix_matrix=z.clone())   # shares extra (the plans), not this tensor
    assert be.plan_for(copied, key, x, cfg, s) is None, "a handle copy with other tensors replayed the plan"
    assert be.plan_for(dataclasses.replace(h), key, x, cfg, s) is plan   # a copy with the same tensors may
    first, second = be.run_plan(plan, x, s, 1234)
    assert first.shape == (5, 256) and first.dtype == torch.bfloat16 and second.shape == (5, 2)
    stream, args = rec.issued[-1]
    assert stream == 1234 and args[0] == x.data_ptr() and args[1] == s.data_ptr()
    assert args[8] == first.data_ptr() and args[9] == second.data_ptr()
    assert be.counters["local_rows"] == 3 and be.counters["intranode_rows"] == 2 and be.replayed == 1
    be.failed = "an earlier failure"
    assert be.plan_for(h, key, x, cfg, s) is None, "a failed backend replayed"
