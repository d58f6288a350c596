"""commlib.backends.internode.fanout.NodeFanout (csrc/fanout.cu) inside spawned GPU worlds, against torch oracles.

Every rank of the world is a local rank of one node (the node group is the world's group). Each rank
builds the same random data on the CPU (one seed for all), forwards its own landed chunks, and
checks its own results bit for bit against an oracle written here in plain torch:
  forward   each rank's rows after barrier -> forward per chunk -> barrier: rows no landed row
            names keep the sentinel byte they were filled with, the others hold the payload of the
            one landed row naming them (row_bytes > W: the padding keeps the sentinel too);
  reduce    each landed row: a float32 loop over local ranks p = 0, 1, ... adding rank p's row where
            pos[j, p] >= 0 to zeros, then bf16 (weights stay float32), compared as raw bytes;
  graphs    barrier + forward + barrier (and barrier + write + barrier + reduce) captured once and
            replayed 3 times with new contents in the same tensors, then an eager round again;
  sync      the barriers folded into the kernels (fanout.py sync flags), one rank late in turn
            (torch.cuda._sleep on its stream), against the same oracles (scripts/plant_fanout_sync.sh
            drops each wait: every plant must fail it).
The oracles share no code with commlib (reference.sum_rows included).

What the checks catch (planted by hand; the window plants: scripts/plant_fanout_windows.sh): a
forward that skips p = P - 1 leaves rank P - 1's rows at the sentinel; a window bound off by one
stores a row outside the window's rows or skips one; a reduce that sums in descending p (or starts from the first row instead of +0.0, or
flushes subnormals) differs in the float32 weights of rows with three or more contributors (the
4-rank world), in -0.0 inputs and in the subnormal values planted below.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from commlib.backends.internode.fanout import (DISPATCH_PACK_SYNC, SYNC_ARRIVE_END, SYNC_ENTER, SYNC_WAIT_END,
                                               SYNC_WAIT_START, NodeFanout, two_stream_syncs, chunk_sides, chunk_syncs)
from commlib.utils.timing import capture_graph

TIMEOUT_S = 60.0
SENTINEL = 0xA5


# ------------------------------------------------------------------ data
def positions(g: torch.Generator, P: int, chunk_rows: list, keep: float = 0.6, extra: int = 5):
    """Random positions for every (forwarder f, chunk k): pos[f][k] int32 [J, P], where column p is a
    slice of a random permutation of rank p's N[p] output rows (so no output row is named twice),
    -1 where p does not get the row (about 1 - keep of them, plus whole rows going nowhere).
    ``chunk_rows[f][k]`` = J. Returns (pos, N) with N[p] = rows named on p + ``extra`` never named."""
    masks = []
    for f in range(P):
        row = []
        for J in chunk_rows[f]:
            m = torch.rand(J, P, generator=g) < keep
            if J:
                m[torch.rand(J, generator=g) < 0.1] = False   # rows no local rank gets
            row.append(m)
        masks.append(row)
    N = [int(sum(m[:, p].sum() for row in masks for m in row)) + extra for p in range(P)]
    pos = [[torch.full((m.shape[0], P), -1, dtype=torch.int32) for m in row] for row in masks]
    for p in range(P):
        perm = torch.randperm(N[p], generator=g).to(torch.int32)
        used = 0
        for f in range(P):
            for k, m in enumerate(masks[f]):
                sel = m[:, p].nonzero().flatten()
                pos[f][k][sel, p] = perm[used:used + sel.numel()]
                used += sel.numel()
        assert used == N[p] - extra
    return pos, N


def chunk_sizes(g: torch.Generator, P: int, num_chunks: int) -> list:
    """Rows per (forwarder, chunk): mostly random in [0, 150), with a 0 and a 1 somewhere."""
    sizes = [[int(v) for v in torch.randint(0, 150, (num_chunks,), generator=g)] for _ in range(P)]
    sizes[0][0] = 0
    sizes[P - 1][num_chunks - 1] = 1
    return sizes


def landed_chunk(payload: torch.Tensor, pos: torch.Tensor, row_stride: int, device) -> torch.Tensor:
    """uint8 [J, W + 4 P] on ``device`` (payload then positions), a view into rows of ``row_stride``
    bytes (row_stride > W + 4 P: a padded, non-contiguous landed chunk)."""
    J, W = payload.shape
    P = pos.shape[1]
    full = torch.zeros(J, row_stride, dtype=torch.uint8)
    full[:, :W] = payload
    full[:, W:W + 4 * P] = pos.contiguous().view(torch.uint8).view(J, 4 * P)
    return full.to(device)[:, :W + 4 * P]


def forward_oracle(payloads: list, pos: list, p: int, N: int, W: int, row_bytes: int) -> torch.Tensor:
    """Rank p's rows [N, row_bytes] after every forwarder's chunks landed: the sentinel, with the
    payload of every landed row that names p at its position."""
    out = torch.full((N, row_bytes), SENTINEL, dtype=torch.uint8)
    for f in range(len(payloads)):
        for k in range(len(payloads[f])):
            for j in range(payloads[f][k].shape[0]):
                r = int(pos[f][k][j, p])
                if r >= 0:
                    out[r, :W] = payloads[f][k][j]
    return out


def reduce_values(g: torch.Generator, N: int, H: int, K: int):
    """A rank's rows: y bf16 [N, H] over a wide range of magnitudes (so float32 sums depend on their
    order), with -0.0 and bf16 subnormals planted; w float32 [N, K] likewise (float32 subnormals)."""
    scale = torch.exp2(torch.randint(-20, 21, (N, H), generator=g).float())
    y = (torch.randn(N, H, generator=g) * scale).to(torch.bfloat16)
    flat = y.view(-1)
    if flat.numel():
        flat[torch.rand(flat.numel(), generator=g) < 0.05] = -0.0
        flat[torch.rand(flat.numel(), generator=g) < 0.01] = 3e-39   # a bf16 subnormal
    w = torch.randn(N, K, generator=g) * torch.exp2(torch.randint(-12, 13, (N, K), generator=g).float())
    wf = w.view(-1)
    if wf.numel():
        wf[torch.rand(wf.numel(), generator=g) < 0.1] = -0.0
        wf[torch.rand(wf.numel(), generator=g) < 0.05] = 1e-41        # a float32 subnormal
    return y, w


def packed(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """uint8 [N, 2 H + 4 K]: y's bytes then w's."""
    return torch.cat([y.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8)], 1)


def reduce_oracle(ys: list, ws: list, pos: torch.Tensor) -> torch.Tensor:
    """uint8 [J, 2 H + 4 K]: per row j, bf16(sum over p = 0, 1, ... with pos[j, p] >= 0 of float(ys[p]
    row)) and the float32 sum of ws[p] rows, each from float32 zeros, one add per contributor."""
    J, P = pos.shape
    H, K = ys[0].shape[1], ws[0].shape[1]
    acc_y = torch.zeros(J, H, dtype=torch.float32)
    acc_w = torch.zeros(J, K, dtype=torch.float32)
    for p in range(P):
        for j in range(J):
            r = int(pos[j, p])
            if r >= 0:
                acc_y[j] = acc_y[j] + ys[p][r].float()
                acc_w[j] = acc_w[j] + ws[p][r]
    return packed(acc_y.to(torch.bfloat16), acc_w)


def expect_equal(errors: list, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Record a mismatch instead of raising: every rank keeps making the same barrier calls until the
    case's end (a rank that left early would leave its peers waiting, or writing into freed memory)."""
    if not torch.equal(got, want):
        bad = (got != want).nonzero()
        errors.append(f"{what}: {bad.shape[0]} bytes differ, first (row, byte): {bad[:5].tolist()}")


def expect_positions(errors: list, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """``got`` (a forward's pos_out, on the device) equals the landed rows' positions ``want`` [J, P]."""
    got = got.cpu()
    if not torch.equal(got, want.to(torch.int32)):
        bad = (got != want).nonzero()
        errors.append(f"{what}: {bad.shape[0]} positions differ, first (row, p): {bad[:5].tolist()}")


def raise_errors(ctx, errors: list) -> None:
    if errors:
        raise AssertionError(f"rank {ctx.rank}: " + "\n".join(errors))


def finish(fan: NodeFanout) -> None:
    """A last barrier (every peer is done with this rank's buffer once it passes), then close."""
    fan.barrier()
    torch.cuda.synchronize()
    fan.close()
    assert fan.settled is None   # closed: the C++ call path asks the node (which raises)


# ------------------------------------------------------------------ forward
# (W, landed row stride padding, data row stride) per round: the 4-byte copy path (W not a multiple
# of 16, tiny and DeepSeek-sized rows), the 16-byte path (everything 16-aligned), a padded data stride.
FORWARD_ROUNDS = [(12, 0, None), (1024, "align16", None), (2 * 7168 + 36, 0, None), (2064, "align16", 2096),
                  (1024, 4, None)]


def _stride(W: int, P: int, pad) -> int:
    if pad == "align16":
        return -(-(W + 4 * P) // 16) * 16
    return W + 4 * P + pad


def run_forward_round(ctx, fan: NodeFanout, errors: list, seed: int, W: int, pad, row_bytes) -> None:
    P, me, dev = ctx.world_size, ctx.rank, ctx.device
    rb = W if row_bytes is None else row_bytes
    g = torch.Generator().manual_seed(seed)
    sizes = chunk_sizes(g, P, 3)
    pos, N = positions(g, P, sizes)
    payloads = [[torch.randint(0, 256, (J, W), dtype=torch.uint8, generator=g) for J in row] for row in sizes]
    mine = [landed_chunk(payloads[me][k], pos[me][k], _stride(W, P, pad), dev) for k in range(len(sizes[me]))]
    fan.reserve(max(N), rb)
    if fan.settled != (fan.capacity, fan.data_address()):   # what the C++ call path reads instead of reserving
        errors.append(f"forward round seed {seed}: settled {fan.settled}, capacity {fan.capacity}, area "
                      f"{fan.data_address()}")
    own = fan.rows(N[me], rb)
    fan.barrier()               # peers are done reading my rows (a reduce before this round)
    own.fill_(SENTINEL)         # (the engine writes nothing here; the test's sentinel is a write)
    fan.barrier()               # my rows are filled before any peer forwards into them
    # every other round also has the positions stored (pos_out: combine's sources), over a sentinel
    outs = [torch.full((c.shape[0], P), -7, dtype=torch.int32, device=dev) if seed % 2 else None for c in mine]
    for chunk, out in zip(mine, outs):
        fan.forward(chunk, W, row_bytes, pos_out=out)
    fan.barrier()
    got = own.cpu()
    want = forward_oracle(payloads, pos, me, N[me], W, rb)
    expect_equal(errors, got, want, f"forward round seed {seed} W {W} pad {pad} row_bytes {row_bytes}")
    for k, out in enumerate(outs):
        if out is not None:
            expect_positions(errors, out, pos[me][k], f"forward round seed {seed} W {W} chunk {k}: pos_out")


def case_forward(ctx):
    errors: list = []
    fan = NodeFanout(ctx.group, ctx.device, num_ctas=3, timeout_s=TIMEOUT_S)
    try:
        caps = []
        for i, (W, pad, row_bytes) in enumerate(FORWARD_ROUNDS):
            run_forward_round(ctx, fan, errors, 100 + i, W, pad, row_bytes)
            caps.append(fan.capacity)
        assert caps == sorted(caps) and caps[0] < caps[-1], f"the data area should have grown: {caps}"
        # several rounds on one buffer size (the epochs keep counting)
        for i in range(3):
            run_forward_round(ctx, fan, errors, 200 + i, 1024, "align16", None)
        assert fan.capacity == caps[-1]
    finally:
        finish(fan)
    raise_errors(ctx, errors)


# ------------------------------------------------------------------ windows
# (seed, W, rows per window): the 16-byte path with windows of 7 rows, the 4-byte path with windows of
# 3, DeepSeek-sized rows in windows of 50 (a window or two past every rank's rows)
WINDOW_ROUNDS = [(800, 1040, 7), (801, 12, 3), (802, 2 * 7168 + 36, 50)]


def case_forward_windows(ctx):
    """Windowed forwards (fanout.py, Windows: the num_worst_tokens route's): every rank's landed chunks
    forwarded window by window, final rows [lo, lo + win) into area rows [at, at + win), at = 0 and win
    in turn, up to the most rows any rank has (windows past a rank's rows store nothing there). After
    each window, every rank's two halves are the sentinel but for that window's rows at ``at``: the
    oracle's rows lo .. lo + win - 1 (sentinel where no landed row names one). A bound off by one
    stores a row into the other half or skips one; a position not rebased stores past the window."""
    P, me, dev = ctx.world_size, ctx.rank, ctx.device
    errors: list = []
    fan = NodeFanout(ctx.group, ctx.device, num_ctas=3, timeout_s=TIMEOUT_S)
    try:
        for seed, W, win in WINDOW_ROUNDS:
            g = torch.Generator().manual_seed(seed)
            sizes = chunk_sizes(g, P, 3)
            pos, N = positions(g, P, sizes)
            payloads = [[torch.randint(0, 256, (J, W), dtype=torch.uint8, generator=g) for J in row] for row in sizes]
            mine = [landed_chunk(payloads[me][k], pos[me][k], _stride(W, P, 0), dev) for k in range(len(sizes[me]))]
            every = forward_oracle(payloads, pos, me, N[me], W, W)
            fan.reserve(2 * win, W)
            own = fan.rows(2 * win, W)
            for i, lo in enumerate(range(0, max(N) + win, win)):
                at = (i % 2) * win
                fan.barrier()           # peers are done reading my rows
                own.fill_(SENTINEL)
                fan.barrier()           # my rows are filled before any peer forwards into them
                outs = [torch.full((c.shape[0], P), -7, dtype=torch.int32, device=dev) for c in mine]
                for chunk, out in zip(mine, outs):   # (every row's positions, in the window or not)
                    fan.forward(chunk, W, None, (lo, lo + win, at), pos_out=out)
                fan.barrier()
                for k, out in enumerate(outs):
                    expect_positions(errors, out, pos[me][k], f"window seed {seed} rows [{lo}, {lo + win}) "
                                                              f"chunk {k}: pos_out")
                want = torch.full((2 * win, W), SENTINEL, dtype=torch.uint8)
                rows = every[lo:lo + win]
                want[at:at + rows.shape[0]] = rows
                expect_equal(errors, own.cpu(), want, f"window seed {seed} W {W} rows [{lo}, {lo + win}) at {at}")
        # a window past the data area is refused on the host (every rank alike)
        try:
            fan.forward(mine[0], W, None, (0, fan.capacity, 1))
            errors.append("a window past the data area was not refused")
        except ValueError:
            pass
    finally:
        finish(fan)
    raise_errors(ctx, errors)


# ------------------------------------------------------------------ reduce
# (H, K, data row stride, out row stride): the u32 path (H = 7168, odd K, packed rows), the int4 path
# (16-byte row strides), the u16 path (odd H: the weights sit at a 2-byte offset), no weights.
REDUCE_ROUNDS = [(7168, 9, None, None), (7168, 9, 14384, 14384), (37, 3, None, None), (64, 0, None, 144),
                 (7168, 1, None, None)]


def run_reduce_round(ctx, fan: NodeFanout, errors: list, seed: int, H: int, K: int, row_bytes, out_stride) -> None:
    P, me, dev = ctx.world_size, ctx.rank, ctx.device
    W = 2 * H + 4 * K
    rb = W if row_bytes is None else row_bytes
    ob = W if out_stride is None else out_stride
    g = torch.Generator().manual_seed(seed)
    sizes = chunk_sizes(g, P, 3)
    pos, N = positions(g, P, sizes, keep=0.7)
    vals = [reduce_values(g, N[p], H, K) for p in range(P)]
    ys, ws = [v[0] for v in vals], [v[1] for v in vals]
    fan.reserve(max(N), rb)
    own = fan.rows(N[me], rb)
    fan.barrier()                                       # peers are done reading the previous rows
    own[:, :W].copy_(packed(ys[me], ws[me]).to(dev))
    fan.barrier()                                       # every rank's rows are written
    outs = []
    for k in range(len(sizes[me])):
        out = torch.full((sizes[me][k], ob), SENTINEL, dtype=torch.uint8, device=dev)
        fan.reduce(pos[me][k].to(dev), H, K, out, row_bytes)   # writes bytes [0, W) of each row
        outs.append(out)
    for k, out in enumerate(outs):
        got = out.cpu()
        want = torch.full_like(got, SENTINEL)
        want[:, :W] = reduce_oracle(ys, ws, pos[me][k])
        expect_equal(errors, got, want, f"reduce round seed {seed} H {H} K {K} row_bytes {row_bytes} chunk {k}")


def case_reduce(ctx):
    errors: list = []
    fan = NodeFanout(ctx.group, ctx.device, num_ctas=5, timeout_s=TIMEOUT_S)
    try:
        for i, (H, K, row_bytes, out_stride) in enumerate(REDUCE_ROUNDS):
            run_reduce_round(ctx, fan, errors, 300 + i, H, K, row_bytes, out_stride)
    finally:
        finish(fan)
    raise_errors(ctx, errors)


def case_dispatch_then_combine(ctx):
    """Forward rounds and reduce rounds interleaved on one NodeFanout (the engine's call pattern)."""
    errors: list = []
    fan = NodeFanout(ctx.group, ctx.device, num_ctas=2, timeout_s=TIMEOUT_S)
    try:
        for i in range(3):
            run_forward_round(ctx, fan, errors, 400 + i, 2 * 512 + 36, 0, None)
            run_reduce_round(ctx, fan, errors, 500 + i, 512, 5, None, None)
    finally:
        finish(fan)
    raise_errors(ctx, errors)


# ------------------------------------------------------------------ the barrier's pieces (sync flags)
LATE_CYCLES = 100_000_000   # about 50 ms of a late rank's stream (torch.cuda._sleep) before its step


def run_sync_forward_round(ctx, fan: NodeFanout, errors: list, seed: int, W: int, late: int,
                           cached: bool = False) -> None:
    """A forward round as the engine runs it (node.py ForwarderNode): chunk 0's forward with SYNC_ENTER,
    the last one's with SYNC_ARRIVE_END | SYNC_WAIT_END (an empty chunk there launches only to sync).
    ``cached``: as a cached dispatch runs it (kept.py): a pack of no tokens arrives (DISPATCH_PACK_SYNC),
    the chunks' forwards alternate between a side stream forked after it and this one (chunk_sides),
    the first on each waiting for every rank's pack (two_stream_syncs), this stream joining the side one
    before the last. The test's own sentinel fill comes after a barrier launch (peers past their reads
    of this rank's rows). Local rank ``late`` sleeps on its stream before that fill: without the
    entering barrier (or a stream's wait for it) a peer's stores land before it (sentinel where rows
    belong); without the one at the end a rank reads its rows before the late rank's stores (sentinel
    again)."""
    P, me, dev = ctx.world_size, ctx.rank, ctx.device
    g = torch.Generator().manual_seed(seed)
    sizes = chunk_sizes(g, P, 3)   # (rank 0's first chunk is empty: a forward that only enters the barrier)
    if seed % 2 == 0:              # an empty last chunk: a forward that only takes the barrier after
        sizes[P - 1][2] = 0
    pos, N = positions(g, P, sizes)
    payloads = [[torch.randint(0, 256, (J, W), dtype=torch.uint8, generator=g) for J in row] for row in sizes]
    mine = [landed_chunk(payloads[me][k], pos[me][k], _stride(W, P, 0), dev) for k in range(len(sizes[me]))]
    own = fan.rows(N[me], W)
    fan.barrier()           # peers are done reading my rows (the reduce round before)
    if me == late:
        torch.cuda._sleep(LATE_CYCLES)
    own.fill_(SENTINEL)     # (before the entering barrier: no peer stores into it before this)
    outs = [torch.full((c.shape[0], P), -7, dtype=torch.int32, device=dev) for c in mine]
    if not cached:
        syncs = chunk_syncs(len(mine), SYNC_ENTER, SYNC_ARRIVE_END | SYNC_WAIT_END)
        for chunk, out, sync in zip(mine, outs, syncs):
            fan.forward(chunk, W, None, pos_out=out if chunk.shape[0] else None, sync=sync)
    else:
        from commlib.backends.internode import kernels as IK
        Hp = 64   # a pack of no tokens, only its arrival (kernels.pack_spec: launched for its flags)
        no = torch.zeros(0, Hp, dtype=torch.bfloat16, device=dev)
        IK.launch(IK.pack_spec(None, torch.zeros(0, 2 * Hp + 4 + 4 * P, dtype=torch.uint8, device=dev),
                               torch.zeros(0, 2, dtype=torch.int32, device=dev),
                               torch.zeros(0, 2 * P, dtype=torch.int32, device=dev), no, None, None, None,
                               me=me, M=2, P=P, Kc=1, ring=1, sync=fan.sync_args(DISPATCH_PACK_SYNC)))
        main, side = torch.cuda.current_stream(), torch.cuda.Stream()
        side.wait_stream(main)
        n, sides, syncs = len(mine), chunk_sides(len(mine)), two_stream_syncs(len(mine))
        for k, (chunk, out, sync) in enumerate(zip(mine, outs, syncs)):
            if k == n - 1:
                main.wait_stream(side)
            with torch.cuda.stream(side if sides[k] else main):
                fan.forward(chunk, W, None, pos_out=out if chunk.shape[0] else None, sync=sync)
    got = own.cpu()
    expect_equal(errors, got, forward_oracle(payloads, pos, me, N[me], W, W),
                 f"sync forward round seed {seed} W {W} (late rank {late})")
    for k, out in enumerate(outs):
        expect_positions(errors, out, pos[me][k], f"sync forward round seed {seed} chunk {k}: pos_out")


def run_sync_reduce_round(ctx, fan: NodeFanout, errors: list, seed: int, H: int, K: int, late_write: int,
                          late_read: int, enter: bool) -> None:
    """A reduce round: this rank's rows written by kernels.rows with SYNC_ARRIVE_END, chunk 0's reduce
    with SYNC_WAIT_START (launched even with no rows). ``enter``: as the engine runs it, the rows kernel
    also enters the barrier before its stores (SYNC_ENTER); else a barrier launch does, then rank
    ``late_write`` sleeps before its rows, so that without the arrival after them or the first reduce's
    wait a peer sums stale rows. Rank ``late_read`` sleeps before its reduces: without the entering
    barrier of an ``enter`` round after it, that round's rows overwrite what it still reads."""
    from commlib.backends.internode import kernels as IK
    P, me, dev = ctx.world_size, ctx.rank, ctx.device
    W = 2 * H + 4 * K
    g = torch.Generator().manual_seed(seed)
    sizes = chunk_sizes(g, P, 3)
    pos, N = positions(g, P, sizes, keep=0.7)
    vals = [reduce_values(g, N[p], H, K) for p in range(P)]
    ys, ws = [v[0] for v in vals], [v[1] for v in vals]
    y, w = ys[me].to(dev), (ws[me].to(dev) if K else None)
    if not enter:
        fan.barrier()
    if me == late_write:
        torch.cuda._sleep(LATE_CYCLES)
    IK.rows(None, N[me], y, w, fan.data_address(), W, fan.sync_args((SYNC_ENTER if enter else 0) | SYNC_ARRIVE_END))
    if me == late_read:
        torch.cuda._sleep(LATE_CYCLES)
    outs = []
    for k in range(len(sizes[me])):
        out = torch.full((sizes[me][k], W), SENTINEL, dtype=torch.uint8, device=dev)
        fan.reduce(pos[me][k].to(dev), H, K, out, None, SYNC_WAIT_START if k == 0 else 0)
        outs.append(out)
    for k, out in enumerate(outs):
        expect_equal(errors, out.cpu(), reduce_oracle(ys, ws, pos[me][k]),
                     f"sync reduce round seed {seed} H {H} K {K} chunk {k} (late {late_write} / {late_read})")


def case_sync_pieces(ctx):
    """Forward and reduce rounds with the barriers folded into the kernels (sync flags), one rank late
    in turn, beside plain barrier launches (both count barriers alike: the tickets); forward rounds as
    a dispatch and as a cached dispatch (a pack's arrival, two streams) runs them. The areas are
    reserved once, up front, so no host-side collective lines the ranks up between rounds."""
    P = ctx.world_size
    errors: list = []
    fan = NodeFanout(ctx.group, ctx.device, num_ctas=3, timeout_s=TIMEOUT_S)
    try:
        fan.reserve(4096, 2 * 7168 + 64)
        for i in range(2 * P):
            run_sync_forward_round(ctx, fan, errors, 900 + i, (1024, 12, 2 * 7168 + 36)[i % 3], i % P)
            # as a cached dispatch: its pack's arrival, the forwards on two streams
            run_sync_forward_round(ctx, fan, errors, 920 + i, (1024, 12, 2 * 7168 + 36)[i % 3], (i + 1) % P, True)
            H, K = (512, 7168, 64)[i % 3], (5, 1, 0)[i % 3]
            # a late writer, and a late reader just before an entering rows kernel, then the engine's round
            run_sync_reduce_round(ctx, fan, errors, 950 + i, H, K, i % P, (i + 1) % P, False)
            run_sync_reduce_round(ctx, fan, errors, 970 + i, H, K, (i + 1) % P, -1, True)
        torch.cuda.synchronize()
    finally:
        finish(fan)
    raise_errors(ctx, errors)


# ------------------------------------------------------------------ CUDA graphs
def case_graph_forward(ctx):
    """barrier + forward per chunk + barrier captured once, replayed 3 times with new landed contents
    (positions included) in the same tensors, then the same steps eagerly."""
    P, me, dev = ctx.world_size, ctx.rank, ctx.device
    W = 1040
    errors: list = []
    fan = NodeFanout(ctx.group, ctx.device, num_ctas=4, timeout_s=TIMEOUT_S)
    try:
        g0 = torch.Generator().manual_seed(600)
        sizes = chunk_sizes(g0, P, 3)                     # the same J every replay (static shapes)
        n_fixed = sum(sum(row) for row in sizes) + 3      # every rank's rows, whatever the positions
        stride = _stride(W, P, "align16")
        landed = [torch.zeros(J, stride, dtype=torch.uint8, device=dev) for J in sizes[me]]
        fan.reserve(n_fixed, W)
        own = fan.rows(n_fixed, W)

        def steps():
            fan.barrier()
            for chunk in landed:
                fan.forward(chunk[:, :W + 4 * P], W)
            fan.barrier()

        graph, _ = capture_graph(steps, warm=False)
        for it in range(4):
            g = torch.Generator().manual_seed(610 + it)
            pos, _ = positions(g, P, sizes, extra=0)
            payloads = [[torch.randint(0, 256, (J, W), dtype=torch.uint8, generator=g) for J in row] for row in sizes]
            for k, chunk in enumerate(landed):
                chunk[:, :W + 4 * P].copy_(landed_chunk(payloads[me][k], pos[me][k], W + 4 * P, dev))
            own.fill_(SENTINEL)
            if it < 3:
                graph.replay()
            else:
                steps()                                   # eager after the replays: epochs still in step
            expect_equal(errors, own.cpu(), forward_oracle(payloads, pos, me, n_fixed, W, W), f"graph forward iteration {it}")
        del graph
    finally:
        finish(fan)
    raise_errors(ctx, errors)


def case_graph_combine(ctx):
    """barrier + write own rows + barrier + reduce per chunk captured once, replayed 3 times with new
    rows and positions in the same tensors."""
    P, me, dev = ctx.world_size, ctx.rank, ctx.device
    H, K = 7168, 3
    W = 2 * H + 4 * K
    errors: list = []
    fan = NodeFanout(ctx.group, ctx.device, num_ctas=4, timeout_s=TIMEOUT_S)
    try:
        g0 = torch.Generator().manual_seed(700)
        sizes = chunk_sizes(g0, P, 2)
        n_fixed = sum(sum(row) for row in sizes) + 2
        src = torch.zeros(n_fixed, W, dtype=torch.uint8, device=dev)
        pos_dev = [torch.full((J, P), -1, dtype=torch.int32, device=dev) for J in sizes[me]]
        outs = [torch.zeros(J, W, dtype=torch.uint8, device=dev) for J in sizes[me]]
        fan.reserve(n_fixed, W)
        own = fan.rows(n_fixed, W)

        def steps():
            fan.barrier()
            own.copy_(src)
            fan.barrier()
            for pd, out in zip(pos_dev, outs):
                fan.reduce(pd, H, K, out)

        graph, _ = capture_graph(steps, warm=False)
        for it in range(3):
            g = torch.Generator().manual_seed(710 + it)
            pos, _ = positions(g, P, sizes, keep=0.8, extra=0)
            vals = [reduce_values(g, n_fixed, H, K) for _ in range(P)]
            ys, ws = [v[0] for v in vals], [v[1] for v in vals]
            src.copy_(packed(ys[me], ws[me]).to(dev))
            for pd, p_host in zip(pos_dev, pos[me]):
                pd.copy_(p_host.to(dev))
            graph.replay()
            for k, out in enumerate(outs):
                got = out.cpu()
                want = reduce_oracle(ys, ws, pos[me][k])
                expect_equal(errors, got, want, f"graph combine iteration {it} chunk {k}")
        del graph
    finally:
        finish(fan)
    raise_errors(ctx, errors)


def case_refusals(ctx):
    """Host-side argument checks (no kernel runs); every rank raises the same way."""
    fan = NodeFanout(ctx.group, ctx.device, num_ctas=1, timeout_s=TIMEOUT_S)
    try:
        P, dev = ctx.world_size, ctx.device
        fan.reserve(4, 64)
        for bad in (lambda: fan.rows(10_000_000, 64),
                    lambda: fan.forward(torch.zeros(2, 6 + 4 * P, dtype=torch.uint8, device=dev), 6),
                    lambda: fan.forward(torch.zeros(2, 64, dtype=torch.uint8, device=dev), 64),
                    lambda: fan.reduce(torch.zeros(2, P + 1, dtype=torch.int32, device=dev), 8, 1,
                                       torch.zeros(2, 20, dtype=torch.uint8, device=dev)),
                    lambda: fan.reduce(torch.zeros(2, P, dtype=torch.int32, device=dev), 8, 1,
                                       torch.zeros(2, 19, dtype=torch.uint8, device=dev))):
            try:
                bad()
            except ValueError:
                continue
            raise AssertionError("NodeFanout accepted bad arguments")
        dist.barrier(group=ctx.group)
    finally:
        finish(fan)
