"""commlib.backends.internode.kernels without a GPU: every launch passes what its kernel's C signature
in csrc/internode.cu takes (count, order, packable types), with the grid and shared memory the
kernel's comments ask for, and bad dtypes / layouts are refused before any launch. What the kernels
compute: tests/gpu/test_internode_gpu.py (the engine against the reference backend, bit for bit)."""
from __future__ import annotations

import struct

import pytest
import torch

from commlib.backends.internode import device
from commlib.backends.internode import kernels as IK
from commlib.backends.internode.exchange import exchange_digest
from commlib.backends.internode.rows import int32_views, typed_views
from commlib.cuda import loader


@pytest.fixture
def launches(monkeypatch):
    seen = []
    monkeypatch.setattr(loader, "launch", lambda family, name, grid, block, args, shared_mem=0: seen.append(
        (family, name, grid, block, tuple(args), shared_mem)))
    return seen


def _packs(name: str, args: tuple) -> None:
    codes = loader.kernel_signature(IK.FAMILY, name)
    assert len(codes) == len(args), (name, codes, args)
    struct.pack("@" + codes, *args)


T, M, P, E, K, Kc, H, C = 40, 2, 4, 64, 6, 4, 256, 3
R = M * P


def _inputs():
    tir = torch.rand(T, R) < 0.3
    topk = torch.randint(-1, E, (T, K))
    x = torch.zeros(T, H, dtype=torch.bfloat16)
    scales = torch.zeros(T, H // 128)
    w = torch.rand(T, K)
    return tir, topk, x, scales, w


def test_every_launch_matches_its_kernel(launches):
    tir, topk, x, scales, w = _inputs()
    head = torch.zeros(12, dtype=torch.int64)
    row = torch.zeros(12 + R + 2 + M + M * Kc * P + E + 1, dtype=torch.int64)
    before, spos = torch.zeros(T, R, dtype=torch.int32), torch.zeros(T, M, dtype=torch.int32)
    IK.meta(tir, topk, None, head, row, before, spos, M=M, P=P, E=E, Kc=Kc, ring=3, max_nodes=2)
    IK.meta(tir, None, torch.zeros(E, dtype=torch.int32), head, row, before, spos, M=M, P=P, E=E, Kc=Kc,
            ring=3, max_nodes=2)
    g = torch.zeros(R, row.numel(), dtype=torch.int64)
    W = 2 * H + 4 * (H // 128) + 4 + 12 * K
    send = torch.zeros(50, W + 4 * P, dtype=torch.uint8)
    slot, send_head = torch.zeros(T, M, dtype=torch.int32), torch.zeros(T, R, dtype=torch.int32)
    rp, cp = torch.zeros(R, R, dtype=torch.int32), torch.zeros(R, C, dtype=torch.int32)
    IK.pack(g, send, slot, send_head, x, scales, topk, w, me=5, M=M, P=P, Kc=Kc, ring=3, n_sig=12, tir=tir,
            before=before, spos=spos, rank_prefix=rp, chan_prefix=cp)
    cached = torch.zeros(50, 2 * H + 4 * (H // 128) + 4 + 4 * P, dtype=torch.uint8)
    IK.pack(None, cached, slot, send_head, x, scales, None, None, me=5, M=M, P=P, Kc=Kc, ring=1)
    rx, rs = torch.zeros(30, H, dtype=torch.bfloat16), torch.zeros(30, H // 128)
    src, ids, ws, pos = (torch.zeros(30, dtype=torch.int32), torch.zeros(30, K, dtype=torch.int64),
                         torch.zeros(30, K), torch.zeros(30, dtype=torch.int32))
    IK.land(send.data_ptr(), 30, W + 4 * P, W, rx, rs, src, ids, ws, K=K, expert_lo=40,
            num_local=8, pos_out=pos)
    IK.recv_chan(src, g, torch.zeros(R, C, dtype=torch.int32), n_sig=12, me=5)
    y = torch.zeros(30, H, dtype=torch.bfloat16)
    part = torch.zeros(30, 2 * H + 4 * K, dtype=torch.uint8)
    IK.rows(pos, 30, y, ws, part.data_ptr(), 2 * H + 4 * K)
    IK.rows(None, 30, y, ws, part.data_ptr(), 2 * H + 4 * K + 16)
    IK.home(part, slot, [torch.zeros(T, H, dtype=torch.bfloat16)] * 2, torch.zeros(T, H, dtype=torch.bfloat16),
            torch.zeros(T, K), H=H, K=K)
    IK.digest(g, torch.zeros(IK.digest_len(M, P, Kc, E // R), dtype=torch.int64), n_sig=12, me=5, node=1, loc=1, M=M,
              P=P, Kc=Kc, ring=3, Lx=E // R)
    names = [entry[1] for entry in launches]
    assert names == ["inter_meta_kernel", "inter_meta_kernel", "inter_pack_kernel", "inter_pack_kernel",
                     "inter_land_kernel", "inter_recv_chan_kernel", "inter_rows_kernel", "inter_rows_kernel",
                     "inter_home_kernel", "inter_digest_kernel"]
    for family, name, grid, block, args, shared in launches:
        assert family == IK.FAMILY
        _packs(name, args)
    meta = launches[0]
    assert meta[2:4] == (R + M + 1, IK.META_THREADS) and meta[5] == 4 * max(E, Kc * P)
    assert launches[1][4][2] != 0 and launches[1][4][1] == 0   # no top-k: experts_in instead
    fresh, cached_pack = launches[2], launches[3]
    assert fresh[5] == 4 * (R + Kc * M + M) and fresh[4][0] == g.data_ptr() and fresh[4][10] == C
    assert cached_pack[4][0] == 0 and cached_pack[4][22] == 0   # cached: no exchange, no top-k
    assert launches[4][4][3] == W and launches[4][4][4] == 30   # position byte, rows out
    assert launches[9][2:4] == (1, IK.DIGEST_THREADS) and launches[9][4][0] == g.data_ptr()


def test_kept_slots_name_their_tensors():
    """The argument slots a kept call sets per call (kernels.PACK_X, ...) hold those tensors' addresses
    in the specs (every tensor a distinct allocation), and each spec is what its launcher launches."""
    tir, topk, x, scales, w = _inputs()
    W = 2 * H + 4 * (H // 128) + 4
    send = torch.zeros(50, W + 4 * P, dtype=torch.uint8)
    slot, send_head = torch.zeros(T, M, dtype=torch.int32), torch.zeros(T, R, dtype=torch.int32)
    pack = IK.pack_spec(None, send, slot, send_head, x, scales, None, None, me=5, M=M, P=P, Kc=Kc, ring=1)
    assert (pack[4][IK.PACK_X], pack[4][IK.PACK_SCALES], pack[4][IK.PACK_SEND]) == \
        (x.data_ptr(), scales.data_ptr(), send.data_ptr())
    rx, rs = torch.zeros(30, H, dtype=torch.bfloat16), torch.zeros(30, H // 128)
    land = IK.land_spec(send.data_ptr() + 4 * (W + 4 * P), 30, W + 4 * P, W, rx, rs)
    assert (land[4][IK.LAND_ROWS], land[4][IK.LAND_X], land[4][IK.LAND_SCALES]) == \
        (send.data_ptr() + 4 * (W + 4 * P), rx.data_ptr(), rs.data_ptr())
    y, ws = torch.zeros(30, H, dtype=torch.bfloat16), torch.zeros(30, K)
    part = torch.zeros(30, 2 * H + 4 * K, dtype=torch.uint8)
    rows = IK.rows_spec(None, 30, y, ws, part.data_ptr(), 2 * H + 4 * K)
    assert (rows[4][IK.ROWS_Y], rows[4][IK.ROWS_W], rows[4][IK.ROWS_OUT]) == (y.data_ptr(), ws.data_ptr(),
                                                                             part.data_ptr())
    oy, ow = torch.zeros(T, H, dtype=torch.bfloat16), torch.zeros(T, K)
    home = IK.home_spec(part, slot, [], oy, ow, H=H, K=K)
    assert (home[4][IK.HOME_BACK], home[4][IK.HOME_Y], home[4][IK.HOME_W]) == (part.data_ptr(), oy.data_ptr(),
                                                                              ow.data_ptr())
    # a non-cached dispatch's: meta, the fresh pack, land with every output, recv_chan
    head, row = torch.zeros(12, dtype=torch.int64), torch.zeros(12 + R + 2 + M + M * Kc * P + E + 1, dtype=torch.int64)
    before, spos = torch.zeros(T, R, dtype=torch.int32), torch.zeros(T, M, dtype=torch.int32)
    meta = IK.meta_spec(tir, topk, None, head, row, before, spos, M=M, P=P, E=E, Kc=Kc, ring=3, max_nodes=2)
    experts = torch.zeros(E, dtype=torch.int32)
    meta2 = IK.meta_spec(tir, None, experts, head, row, before, spos, M=M, P=P, E=E, Kc=Kc, ring=3, max_nodes=2)
    assert (meta[4][IK.META_TIR], meta[4][IK.META_TOPK], meta[4][IK.META_HEAD], meta2[4][IK.META_EXPERTS]) == \
        (tir.data_ptr(), topk.data_ptr(), head.data_ptr(), experts.data_ptr())
    g = torch.zeros(R, row.numel(), dtype=torch.int64)
    Wf = W + 12 * K
    fsend = torch.zeros(50, Wf + 4 * P, dtype=torch.uint8)
    rp, cp = torch.zeros(R, R, dtype=torch.int32), torch.zeros(R, C, dtype=torch.int32)
    fresh = IK.pack_spec(g, fsend, slot, send_head, x, scales, topk, w, me=5, M=M, P=P, Kc=Kc, ring=3, n_sig=12,
                         tir=tir, before=before, spos=spos, rank_prefix=rp, chan_prefix=cp)
    assert [fresh[4][i] for i in (IK.PACK_TIR, IK.PACK_SLOT, IK.PACK_SEND_HEAD, IK.PACK_RANK_PREFIX,
                                  IK.PACK_CHAN_PREFIX, IK.PACK_X, IK.PACK_SCALES, IK.PACK_TOPK, IK.PACK_W,
                                  IK.PACK_SEND)] == \
        [t.data_ptr() for t in (tir, slot, send_head, rp, cp, x, scales, topk, w, fsend)]
    src, ids, pos = torch.zeros(30, dtype=torch.int32), torch.zeros(30, K, dtype=torch.int64), torch.zeros(30, dtype=torch.int32)
    full = IK.land_spec(fsend.data_ptr(), 29, Wf + 4 * P, Wf, rx, rs, src, ids, ws, K=K, expert_lo=8, num_local=8,
                        pos_out=pos)
    assert [full[4][i] for i in (IK.LAND_ROWS, IK.LAND_N, IK.LAND_N_OUT, IK.LAND_X, IK.LAND_SCALES, IK.LAND_SRC,
                                 IK.LAND_TOPK, IK.LAND_W, IK.LAND_POS)] == \
        [fsend.data_ptr(), 29, 30] + [t.data_ptr() for t in (rx, rs, src, ids, ws, pos)]
    out = torch.zeros(R, C, dtype=torch.int32)
    chan = IK.recv_chan_spec(src, g, out, n_sig=12, me=5)
    assert (chan[4][IK.RECV_CHAN_SRC], chan[4][IK.RECV_CHAN_OUT]) == (src.data_ptr(), out.data_ptr())
    for spec in (pack, land, rows, home, meta, meta2, fresh, full, chan):
        assert spec[0] == IK.FAMILY
        _packs(spec[1], spec[4])
    assert IK.land_spec(0, 0, W, W, rx[:0]) is None and IK.rows_spec(None, 0, y, ws, 0, 2 * H + 4 * K) is None


def test_bad_inputs_are_refused_before_a_launch(launches):
    tir, topk, x, scales, w = _inputs()
    head = torch.zeros(12, dtype=torch.int64)
    row = torch.zeros(200, dtype=torch.int64)
    before, spos = torch.zeros(T, R, dtype=torch.int32), torch.zeros(T, M, dtype=torch.int32)
    with pytest.raises(ValueError, match="contiguous bool"):
        IK.meta(tir.int(), topk, None, head, row, before, spos, M=M, P=P, E=E, Kc=Kc, ring=1, max_nodes=2)
    with pytest.raises(ValueError, match="columns"):
        IK.meta(tir, topk, None, head, row, before, spos, M=M, P=P + 1, E=E, Kc=Kc, ring=1, max_nodes=2)
    with pytest.raises(ValueError, match="int32 tokens per expert"):
        IK.meta(tir, None, None, head, row, before, spos, M=M, P=P, E=E, Kc=Kc, ring=1, max_nodes=2)
    slot, send_head = torch.zeros(T, M, dtype=torch.int32), torch.zeros(T, R, dtype=torch.int32)
    with pytest.raises(ValueError, match="send rows"):
        IK.pack(None, torch.zeros(5, 7, dtype=torch.uint8), slot, send_head, x, None, None, None, me=0, M=M, P=P,
                Kc=Kc, ring=1)
    with pytest.raises(ValueError, match="float32"):
        IK.rows(None, 3, torch.zeros(3, H, dtype=torch.bfloat16), torch.zeros(3, K, dtype=torch.float64), 0, 2 * H + 4 * K)
    with pytest.raises(ValueError, match="biases"):
        IK.home(torch.zeros(3, 2 * H, dtype=torch.uint8), slot, [torch.zeros(T, H)], torch.zeros(T, H, dtype=torch.bfloat16),
                None, H=H, K=0)
    g, out = torch.zeros(R, 200, dtype=torch.int64), torch.zeros(IK.digest_len(M, P, Kc, 8), dtype=torch.int64)
    with pytest.raises(ValueError, match="local rank"):
        IK.digest(g, out, n_sig=12, me=5, node=1, loc=2, M=M, P=P, Kc=Kc, ring=1, Lx=8)
    with pytest.raises(ValueError, match="out must be"):
        IK.digest(g, out[1:], n_sig=12, me=5, node=1, loc=1, M=M, P=P, Kc=Kc, ring=1, Lx=8)
    with pytest.raises(ValueError, match="int64 gathered"):
        IK.digest(g.int(), out, n_sig=12, me=5, node=1, loc=1, M=M, P=P, Kc=Kc, ring=1, Lx=8)
    assert launches == []


def test_dispatches_the_kernels_cannot_move_take_the_torch_steps():
    """A hidden size whose rows are not whole 4-byte words in FP8 (H % 4 != 0), and num_worst_tokens
    (the padded path), go to the torch steps even where the kernels are on."""
    from types import SimpleNamespace

    req = lambda H, worst=0: SimpleNamespace(x=torch.zeros(3, H, dtype=torch.bfloat16), num_worst_tokens=worst)
    assert device.fits(req(7168)) and device.fits(req(256))
    assert not device.fits(req(37)) and not device.fits(req(258))
    assert not device.fits(req(7168, worst=64))


def test_one_chunk_geometry_is_the_chunked_one():
    """geometry's one-chunk shortcut (the splits are the counts) gives the plan the chunked geometry
    gives, for streams that fit one chunk of ring / chunk cap (the digest's count is then 1)."""
    import random

    from commlib.backends.internode.geometry import chunk_rows, chunked, geometry
    rng = random.Random(5)
    for _ in range(300):
        M, P, Kc, ring = rng.choice((2, 3, 4)), rng.choice((1, 2)), rng.choice((1, 2, 4)), rng.choice((1, 3, 8, 64))
        streams = [[rng.choice((0, 1, 2, 5, 9, 40, 200)) for _ in range(M)] for _ in range(2)]
        if max(-(-c // chunk_rows(c, ring, Kc)) for c in streams[0] + streams[1]) != 1:
            continue   # the digest would count more chunks (or none)
        counts = {"num_chunks": 1, "mine": streams[0], "rail_in": streams[1], "num_recv": 17, "node_rows": 23,
                  "fan_send": [[rng.randrange(9) for _ in range(P)] for _ in range(Kc)],
                  "fan_recv": [[rng.randrange(9) for _ in range(P)] for _ in range(Kc)]}
        assert geometry("device", counts, ring, Kc) == chunked("device", counts, ring, Kc), counts


def test_int32_views_share_one_allocation_without_overlap():
    shapes = [(3, 3), (3, 2), (0,), (5,), (4, 1)]
    views = int32_views(torch.device("cpu"), *shapes)
    assert [tuple(v.shape) for v in views] == shapes
    base = views[0]._base
    assert base is not None and all(v._base is base for v in views)
    assert all(v.dtype == torch.int32 and v.is_contiguous() for v in views)
    for i, v in enumerate(views):   # each view its own elements: writing one leaves the others
        v.fill_(i)
    for i, v in enumerate(views):
        assert bool((v == i).all())
    assert base.numel() == sum(v.numel() for v in views)


def test_typed_views_share_one_allocation_aligned_and_apart():
    parts = [(torch.int64, (5,)), (torch.int64, (3, 4)), (torch.int32, (7, 3)), (torch.int32, (1, 2)), (torch.int64, (2,))]
    views = typed_views(torch.device("cpu"), *parts)
    storage = views[0].untyped_storage().data_ptr()   # one allocation
    assert all(v.untyped_storage().data_ptr() == storage and v.dtype == d and tuple(v.shape) == s and v.is_contiguous()
               for v, (d, s) in zip(views, parts))
    assert all(v.data_ptr() % 8 == 0 for v in views)
    for i, v in enumerate(views):
        v.fill_(i + 1)
    assert all(bool((v == i + 1).all()) for i, v in enumerate(views))


def test_head_row_is_kept_until_a_read_shows_it_was_used(monkeypatch):
    """The meta kernel's head row ([0] + signature) lives in one pinned buffer across calls: rewritten
    in place when the last call's read came back, a fresh buffer while a call is still in flight
    (its kernel may not have read the old one yet)."""
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)   # no CUDA here: plain host memory
    head = device.HeadRow()
    first = head.get([7, 8, 9])
    assert first.tolist() == [0, 7, 8, 9] and head.busy and first.device.type == "cpu"
    head.released()                             # the dispatch's one read: the stream is past the kernel
    again = head.get([7, 8, 10])
    assert again is first and first.tolist() == [0, 7, 8, 10]
    in_flight = head.get([7, 8, 11])            # no read since: the kept one may still be read
    assert in_flight is not first and in_flight.tolist() == [0, 7, 8, 11] and first.tolist() == [0, 7, 8, 10]
    head.released()
    assert head.get([1, 2, 3, 4]).tolist() == [0, 1, 2, 3, 4]   # another length: another buffer


def _digest_oracle(rows: list, *, n_sig, me, node, loc, M, P, Kc, ring, Lx) -> list:
    """The exchange digest in plain Python over the gathered rows (lists), read off the row layout
    of exchange.row_len: [error, signature | counts per rank R | over the node limit | bad
    ids | rows per node M | (node, chunk, local rank) blocks M Kc P | per expert E | T]."""
    R = len(rows)
    per_node = n_sig + R + 2
    blk = per_node + M + node * Kc * P
    error = any(row[0] != 0 or row[1:n_sig] != rows[me][1:n_sig] or row[n_sig + R] > 0 or row[n_sig + R + 1] > 0
                for row in rows)
    chunks = 0
    for row in rows:
        for c in row[per_node:per_node + M]:
            per = max(1, ring, -(-c // Kc))
            chunks = max(chunks, -(-c // per))
    column = lambda j: sum(row[j] for row in rows)
    out = [int(error), chunks, column(n_sig + me), max(column(n_sig + node * P + p) for p in range(P))]
    out += rows[me][per_node:per_node + M]
    out += [rows[m * P + loc][per_node + node] for m in range(M)]
    out += [sum(rows[n * P + loc][blk + k * P + p] for n in range(M)) for k in range(Kc) for p in range(P)]
    out += [sum(rows[n * P + q][blk + k * P + loc] for n in range(M)) for k in range(Kc) for q in range(P)]
    ex = per_node + M + M * Kc * P + me * Lx
    out += [column(ex + i) for i in range(Lx)]
    return out


@pytest.mark.parametrize("M,P,Kc,E,ring", [(2, 1, 1, 16, 1), (2, 4, 4, 64, 3), (4, 2, 2, 32, 50), (8, 8, 4, 256, 7),
                                               (2, 2, 4, 16, 1000)])   # a ring above every stream: one chunk
def test_exchange_digest_matches_the_rows_read_whole(M, P, Kc, E, ring):
    """The digest the host reads instead of the whole gathered exchange (exchange_digest, the spec of
    the digest kernel) against the same quantities read off the whole rows in plain Python, for every
    rank, with and without each kind of error in the rows."""
    gen = torch.Generator().manual_seed(M * 100 + P)
    R, n_sig = M * P, 13
    length = n_sig + R + 2 + M + M * Kc * P + E + 1
    g = torch.randint(0, 300, (R, length), generator=gen, dtype=torch.int64)
    g[:, 0] = 0
    g[:, 1:n_sig] = torch.arange(1, n_sig)
    g[:, n_sig + R:n_sig + R + 2] = 0
    g[:, n_sig + R + 2] = 0   # a stream with no rows
    variants = {"clean": g}
    for name, (col, value) in {"refused": (0, 1), "signature": (4, 99), "over the node limit": (n_sig + R, 2),
                               "bad ids": (n_sig + R + 1, 1)}.items():
        bad = g.clone()
        bad[R - 1, col] = value
        variants[name] = bad
    for name, rows in variants.items():
        for me in range(R):
            kw = dict(n_sig=n_sig, me=me, node=me // P, loc=me % P, M=M, P=P, Kc=Kc, ring=ring, Lx=E // R)
            got = exchange_digest(rows, **kw)
            assert got.dtype == torch.int64 and got.numel() == IK.digest_len(M, P, Kc, E // R)
            want = _digest_oracle(rows.tolist(), **kw)
            assert got.tolist() == want, (name, me)
            assert want[0] == (name != "clean")
