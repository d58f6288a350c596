"""commlib.backends.internode.fanout.NodeFanout's host side without a GPU: the arguments each launch passes
match its kernel's C signature in csrc/fanout.cu (count, order, packable types), and bad shapes,
strides and sizes are refused before any launch. The kernels themselves: tests/gpu/test_fanout_gpu.py.
"""
from __future__ import annotations

import struct
from types import SimpleNamespace

import pytest
import torch

from commlib.backends.internode import fanout as F
from commlib.cuda import loader


@pytest.fixture
def fan(monkeypatch):
    """A NodeFanout of local rank 1 of 4 on the CPU with a fake buffer; launches are recorded."""
    launches = []
    monkeypatch.setattr(loader, "launch", lambda family, name, grid, block, args, shared_mem=0: launches.append(
        (family, name, grid, block, tuple(args))))
    f = object.__new__(F.NodeFanout)
    f.group, f.local_rank, f.num_local = None, 1, 4
    f.device, f.num_ctas, f.timeout_ns = torch.device("cpu"), 3, 7_000_000_000
    f.capacity = 1 << 20
    f.mem = SimpleNamespace(base=1 << 40)
    f.peer_bases = torch.zeros(4, dtype=torch.int64)
    f.launches = launches
    return f


def _packs(family: str, name: str, args: tuple) -> None:
    codes = loader.kernel_signature(family, name)
    assert len(codes) == len(args), (name, codes, args)
    struct.pack("@" + codes, *args)  # every value fits its C type


def test_launch_arguments_match_the_kernels(fan):
    fan.barrier()
    W, P = 1036, 4
    landed = torch.zeros(40, W + 4 * P + 12, dtype=torch.uint8)[:, :W + 4 * P]
    fan.forward(landed, W)
    landed_pos = torch.empty(40, P, dtype=torch.int32)
    fan.forward(landed, W, row_bytes=1040, pos_out=landed_pos)
    pos = torch.full((5, P), -1, dtype=torch.int32)
    out = torch.zeros(5, 2 * 7168 + 4 * 9 + 4, dtype=torch.uint8)
    fan.reduce(pos, 7168, 9, out)
    fan.reduce(pos, 7168, 9, out, row_bytes=14384)
    names = [launch[1] for launch in fan.launches]
    assert names == ["fanout_barrier_kernel", "fanout_forward_kernel", "fanout_forward_kernel",
                     "fanout_reduce_kernel", "fanout_reduce_kernel"]
    for family, name, grid, block, args in fan.launches:
        assert family == F.FAMILY
        _packs(family, name, args)
    b, f1, f2, r1, r2 = fan.launches
    assert b[2:4] == (1, F.BARRIER_THREADS)
    assert b[4] == (fan.peer_bases.data_ptr(), 1, 4, F.SIGNAL_OFFSET, 7_000_000_000)
    # (landed, J, row_stride, W, P, peer_bases, data_offset, dst_stride, lo, hi, pos_out, local_rank,
    # signal_offset, timeout_ns, sync); 40 rows, 16 warps per CTA: 3 CTAs; no window: every final row, from
    # the area's first row; no pos_out: 0; no sync: 0
    assert f1[2:] == (3, F.THREADS, (landed.data_ptr(), 40, W + 4 * P + 12, W, P, fan.peer_bases.data_ptr(),
                                     F.DATA_OFFSET, W, 0, F.FORWARD_ALL, 0, 1, F.SIGNAL_OFFSET, 7_000_000_000, 0))
    assert f2[4][7] == 1040 and f2[4][F.FORWARD_POS] == landed_pos.data_ptr()
    # (pos, J, P, peer_bases, data_offset, src_stride, H, K, out, out_stride, local_rank, signal_offset,
    # timeout_ns, sync); 5 rows: 1 CTA
    assert r1[2:] == (1, F.THREADS, (pos.data_ptr(), 5, P, fan.peer_bases.data_ptr(), F.DATA_OFFSET,
                                     2 * 7168 + 36, 7168, 9, out.data_ptr(), out.stride(0), 1, F.SIGNAL_OFFSET,
                                     7_000_000_000, 0))
    assert r2[4][5] == 14384
    assert F.DATA_OFFSET % 128 == 0 and F.DATA_OFFSET >= 8 * (loader.MAX_RANKS + 2)


def test_sync_flags(fan):
    """The barrier's pieces (``sync``): in their slot, packable; a forward or reduce with flags launches
    even with no rows (one CTA that only syncs), without flags it does not; flags that cannot go together
    are refused; kernels.rows_spec takes sync_args the same way; chunk_syncs puts the first and last
    flags on a call's first and last chunk."""
    from commlib.backends.internode import kernels as IK
    W, P = 1036, 4
    landed = torch.zeros(40, W + 4 * P, dtype=torch.uint8)
    spec = fan.forward_spec(landed, W, 1040, sync=F.SYNC_ENTER | F.SYNC_ARRIVE_END | F.SYNC_WAIT_END)
    assert spec[4][F.FORWARD_SYNC] == 7 and spec[2] == 3
    _packs(F.FAMILY, "fanout_forward_kernel", tuple(spec[4]))
    none = landed[:0]
    assert fan.forward_spec(none, W, 1040) is None
    spec = fan.forward_spec(none, W, 1040, sync=F.SYNC_ENTER)
    assert spec[2] == 1 and spec[4][F.FORWARD_J] == 0 and spec[4][F.FORWARD_SYNC] == F.SYNC_ENTER
    assert spec[4][2] == landed.stride(0)   # a kept launch made from it serves rows later: the real stride
    _packs(F.FAMILY, "fanout_forward_kernel", tuple(spec[4]))
    pos, out = torch.empty(0, P, dtype=torch.int32), torch.zeros(0, 2 * 64 + 8, dtype=torch.uint8)
    assert fan.reduce_spec(pos, 64, 2, out) is None
    spec = fan.reduce_spec(pos, 64, 2, out, sync=F.SYNC_WAIT_START)
    assert spec[2] == 1 and spec[4][F.REDUCE_J] == 0 and spec[4][F.REDUCE_SYNC] == F.SYNC_WAIT_START
    _packs(F.FAMILY, "fanout_reduce_kernel", tuple(spec[4]))
    for bad in (F.SYNC_WAIT_END, F.SYNC_WAIT_START | F.SYNC_ENTER, F.SYNC_ARRIVE_START, 32):
        with pytest.raises(ValueError, match="sync flags"):
            fan.forward_spec(landed, W, 1040, sync=bad)
    # a cached dispatch's last forward: the wait for its pack's arrival, then the barrier after its stores
    spec = fan.forward_spec(landed, W, 1040, sync=F.SYNC_WAIT_START | F.SYNC_ARRIVE_END | F.SYNC_WAIT_END)
    assert spec[4][F.FORWARD_SYNC] == 14
    y = torch.zeros(3, 64, dtype=torch.bfloat16)
    args = fan.sync_args(F.SYNC_ENTER | F.SYNC_ARRIVE_END)
    assert args == [fan.peer_bases.data_ptr(), 1, 4, F.SIGNAL_OFFSET, 7_000_000_000, 3]
    spec = IK.rows_spec(None, 0, y, None, 1 << 20, 128, args)
    assert spec is not None and spec[2] == 1 and spec[4][IK.ROWS_SYNC] == 3
    _packs(IK.FAMILY, "inter_rows_kernel", tuple(spec[4]))
    assert IK.rows_spec(None, 0, y, None, 1 << 20, 128) is None
    # many rows: a synced rows kernel's grid split among the ranks sharing a GPU (its CTAs wait at its start)
    assert IK.rows_spec(None, 8192, y, None, 1 << 20, 128, args, IK.synced_ctas(4))[2] == IK.MAX_CTAS // 8
    assert IK.rows_spec(None, 8192, y, None, 1 << 20, 128)[2] == IK.MAX_CTAS == IK.synced_ctas(1)
    assert IK.synced_ctas(2) == IK.MAX_CTAS // 4 and IK.synced_ctas(10 ** 6) == 1
    assert IK.rows_spec(None, 3, y, None, 1 << 20, 128)[4][IK.ROWS_SYNC] == 0
    assert F.chunk_syncs(0, 1, 6) == [] and F.chunk_syncs(1, 1, 6) == [7] and F.chunk_syncs(3, 1, 6) == [1, 0, 6]
    # a cached dispatch: the last chunk on the current stream, the ones before alternating; the first forward
    # of each stream waits for the packs' arrival, the last one takes the barrier after the stores
    ws, end = F.SYNC_WAIT_START, F.SYNC_ARRIVE_END | F.SYNC_WAIT_END
    assert F.chunk_sides(1) == [False] and F.chunk_sides(4) == [True, False, True, False]
    assert F.two_stream_syncs(1) == [ws | end] and F.two_stream_syncs(2) == [ws, ws | end]
    assert F.two_stream_syncs(4) == [ws, ws, 0, end] and F.two_stream_syncs(5) == [ws, ws, 0, 0, end]
    # and its pack (kernels.pack_spec): the arrival alone, in its slot, launched even with no tokens
    x, sh, slot = torch.zeros(0, 64, dtype=torch.bfloat16), torch.zeros(0, 8, dtype=torch.int32), \
        torch.zeros(0, 2, dtype=torch.int32)
    send = torch.zeros(0, 128 + 4 + 4 * P, dtype=torch.uint8)
    geo = dict(me=0, M=2, P=P, Kc=1, ring=1)
    assert IK.pack_spec(None, send, slot, sh, x, None, None, None, **geo) is None
    spec = IK.pack_spec(None, send, slot, sh, x, None, None, None, **geo, sync=fan.sync_args(F.DISPATCH_PACK_SYNC))
    assert spec[2] == 1 and spec[4][IK.PACK_SYNC] == F.SYNC_ARRIVE_START and spec[4][IK.PACK_SYNC - 5:] == \
        fan.sync_args(F.SYNC_ARRIVE_START)
    _packs(IK.FAMILY, "inter_pack_kernel", tuple(spec[4]))


def test_kept_slots_name_their_tensors(fan):
    """forward_spec / reduce_spec: the slots a kept call sets per call hold landed's and out's addresses,
    and the spec is what forward / reduce launch."""
    W, P = 1036, 4
    landed = torch.zeros(40, W + 4 * P, dtype=torch.uint8)
    spec = fan.forward_spec(landed, W, 1040)
    assert spec[4][F.FORWARD_LANDED] == landed.data_ptr() and spec[4][F.FORWARD_POS] == 0
    fan.forward(landed, W, 1040)
    assert fan.launches[-1] == spec[:4] + (tuple(spec[4]),)
    landed_pos = torch.empty(40, P, dtype=torch.int32)
    assert fan.forward_spec(landed, W, 1040, pos_out=landed_pos)[4][F.FORWARD_POS] == landed_pos.data_ptr()
    for bad in (torch.empty(40, P, dtype=torch.int64), torch.empty(39, P, dtype=torch.int32),
                torch.empty(P, 40, dtype=torch.int32).t()):   # a dtype, a shape, not contiguous
        with pytest.raises(ValueError, match="pos_out"):
            fan.forward_spec(landed, W, 1040, pos_out=bad)
    pos = torch.full((5, P), -1, dtype=torch.int32)
    out = torch.zeros(5, 2 * 7168 + 4 * 9, dtype=torch.uint8)
    spec = fan.reduce_spec(pos, 7168, 9, out)
    assert spec[4][F.REDUCE_OUT] == out.data_ptr()
    fan.reduce(pos, 7168, 9, out)
    assert fan.launches[-1] == spec[:4] + (tuple(spec[4]),)
    spec = fan.barrier_spec()
    fan.barrier()
    assert fan.launches[-1] == spec[:4] + (tuple(spec[4]),)


def test_forward_window_arguments(fan):
    """A window (lo, hi, at): lo and hi passed, the area's first row ``at`` folded into data_offset;
    a window whose rows from ``at`` pass the data area (1 MiB here) is refused before any launch."""
    W, P = 1036, 4
    landed = torch.zeros(40, W + 4 * P, dtype=torch.uint8)
    fan.forward(landed, W, 1040, (100, 150, 50))
    args = fan.launches[-1][4]
    assert args[6:11] == (F.DATA_OFFSET + 50 * 1040, 1040, 100, 150, 0)
    assert fan.forward_spec(landed, W, 1040, (100, 150, 50))[4] == list(args)
    rows = (1 << 20) // 1040
    fan.forward(landed, W, 1040, (0, rows, 0))                      # exactly the area
    for bad in ((0, rows + 1, 0), (0, rows, 1), (5, 5, 0), (-1, 3, 0), (0, 3, -1), (0, 1 << 31, 0)):
        with pytest.raises(ValueError, match="window"):
            fan.forward(landed, W, 1040, bad)
    assert len(fan.launches) == 2


def test_forwarder_windows():
    """ForwarderNode.window: one window where the rows fit the areas as they are; else windows of half
    the areas (no growth), or where the areas are small, of a quarter of the rows' bytes (at most 8
    windows) but never below WINDOW_FLOOR; COMMLIB_FANOUT_WINDOW_ROWS caps it."""
    from commlib.backends.internode import node as N
    fwd = object.__new__(N.ForwarderNode)
    fwd.fan, fwd.window_rows = SimpleNamespace(capacity=0), 0
    Wd = 14448
    # the test_internode shape: 65,536 rows after a dispatch that reserved 26,880 rows
    fwd.fan.capacity = 26_880 * Wd
    assert fwd.window(65_536, Wd) == 13_440
    assert fwd.window(26_880, Wd) == 26_880 and fwd.window(100, Wd) == 100
    fwd.fan.capacity = 0   # a first call: a quarter of the bytes, two halves of an eighth
    assert fwd.window(65_536, Wd) == 8192
    assert fwd.window(1000, Wd) == 1000   # within WINDOW_FLOOR: one window
    assert fwd.window(0, Wd) == 0
    fwd.window_rows = 5
    assert fwd.window(65_536, Wd) == 5 and fwd.window(5, Wd) == 5 and fwd.window(3, Wd) == 3


def test_empty_chunks_launch_nothing(fan):
    fan.forward(torch.zeros(0, 64 + 16, dtype=torch.uint8), 64)
    fan.reduce(torch.zeros(0, 4, dtype=torch.int32), 8, 1, torch.zeros(0, 20, dtype=torch.uint8))
    assert fan.launches == []


@pytest.mark.parametrize("call", [
    lambda f: f.forward(torch.zeros(2, 6 + 16, dtype=torch.uint8), 6),                 # W not a multiple of 4
    lambda f: f.forward(torch.zeros(2, 64, dtype=torch.uint8), 64),                    # no room for P positions
    lambda f: f.forward(torch.zeros(2, 64 + 16, dtype=torch.uint8), 64, row_bytes=60),  # data rows shorter than W
    lambda f: f.forward(torch.zeros(2, 64 + 18, dtype=torch.uint8)[:, :80], 64),       # row stride 82
    lambda f: f.forward(torch.zeros(164, dtype=torch.uint8)[1:161].view(2, 80), 64),   # address off by one
    lambda f: f.forward(torch.zeros(2, 80, dtype=torch.int32), 64),                    # not uint8
    lambda f: f.reduce(torch.zeros(2, 5, dtype=torch.int32), 8, 1, torch.zeros(2, 20, dtype=torch.uint8)),
    lambda f: f.reduce(torch.zeros(2, 4, dtype=torch.int64), 8, 1, torch.zeros(2, 20, dtype=torch.uint8)),
    lambda f: f.reduce(torch.zeros(2, 4, dtype=torch.int32), 8, 1, torch.zeros(2, 19, dtype=torch.uint8)),
    lambda f: f.reduce(torch.zeros(2, 4, dtype=torch.int32), 8, 1, torch.zeros(3, 20, dtype=torch.uint8)),
    lambda f: f.reduce(torch.zeros(2, 4, dtype=torch.int32), 8, 1, torch.zeros(2, 20, dtype=torch.uint8), 19),
    lambda f: f.rows(1 << 20, 2),
])
def test_bad_arguments_are_refused(fan, call):
    with pytest.raises(ValueError):
        call(fan)
    assert fan.launches == []


def test_reserve_within_capacity_is_free(fan, monkeypatch):
    """No collective, no sync, no new buffer when the rows fit (the engine calls it every time)."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: pytest.fail("reserve synced"))
    fan.reserve(1024, 1024)
    fan.reserve(0, 14372)
    assert fan.capacity == 1 << 20
    with pytest.raises(ValueError):
        fan.reserve(-1, 8)


def test_closed_refuses(fan):
    fan.mem = None
    fan.close()  # twice is fine
    with pytest.raises(RuntimeError, match="closed"):
        fan.barrier()


def test_internode_kernel_names_read_as_deepeps():
    """DeepEP's test_internode profiles a cached dispatch and a combine and needs exactly one kernel
    whose name contains "dispatch" (resp. "combine") and one containing "notify" (its bench_kineto): the
    internode engine's kernels (the per-token steps and the forwarder) name them once each."""
    names = [loader.kernel_name(f, n) for f in ("internode", "fanout") for n in loader.FAMILIES[f]]
    for word, want in (("dispatch", "commlib::fanout::dispatch"), ("combine", "commlib::fanout::combine"),
                       ("notify", "commlib::fanout::notify")):
        assert [n for n in names if word in n] == [want], (word, names)
    source = (loader.CSRC / "fanout.cu").read_text()
    for kernel in ("notify", "dispatch", "combine"):   # the names the loader asks NVRTC for exist
        assert f") {kernel}(" in source
