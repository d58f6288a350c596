"""Launches of csrc/internode.cu: the internode engine's per-token steps on the GPU (one launch each
instead of tens of torch ops; internode/device.py calls them).

Each function takes tensors and host ints, checks what the kernel relies on (dtype, contiguity,
4-byte row geometry) and launches on torch's current stream. Nothing here reads the device. The
row-moving steps also come as ``*_spec``: the same checks, then the launch as a ``Spec`` (family,
name, grid, block, argument list, shared memory) for a caller that keeps it and replays it with
new tensors at the argument slots named below (internode/kept.py).
The kernels' contracts are in the .cu file's comments; the torch steps of internode/counted.py are
their specification, and the device tests compare the engine's outputs and handles with the
reference backend's, bit for bit.
"""
from __future__ import annotations

import torch

from commlib.cuda import loader

FAMILY = "internode"
META_THREADS = 1024
THREADS = 512
RECV_CHAN_THREADS = 256
MAX_CTAS = 264   # two waves of 132 SMs: these kernels copy rows at HBM speed, not the network's


def _fail(what: str) -> None:
    """A refused input (the checks are inline: a check that passes builds no message)."""
    raise ValueError(f"commlib internode kernels: {what}")


def grid(n: int, max_ctas: int = MAX_CTAS) -> int:
    """CTAs of the row kernels (pack, land, rows, home) for ``n`` rows: a warp per row, at most ``max_ctas``."""
    return max(1, min(max_ctas, -(-n // (THREADS // 32))))


def _sync_tail(sync) -> list:
    """A launch's trailing node-barrier arguments (fanout.NodeFanout.sync_args; None: none, flags 0)."""
    return list(sync) if sync is not None else [0, 0, 0, 0, 0, 0]


def synced_ctas(gpu_share: int) -> int:
    """The most CTAs of a rows kernel that takes the node barrier's pieces, with ``gpu_share`` ranks on
    one GPU. Its CTAs wait at its start, holding their SMs, while every rank of the node must start one
    of its own. A rank on a GPU of its own keeps MAX_CTAS. Ranks sharing a GPU (CUDA MPS) also share its
    CTA slots (two of these CTAs per SM): filling them with waiting CTAs leaves a peer's kernel, or an
    NCCL kernel it waits behind, none. A V3 combine hung with 264 CTAs in each of four processes, and
    again with 66 (run 34), so sharing ranks take half the slots between them."""
    share = max(1, int(gpu_share))
    return MAX_CTAS if share == 1 else max(1, MAX_CTAS // (2 * share))


def launch(spec) -> None:
    """Launch a ``*_spec`` result (nothing for None: a step with no rows)."""
    if spec is not None:
        loader.launch(*spec)


# Argument slots of the specs that a kept launch sets per call (tests/test_internode_kernels.py
# checks each names its tensor's address or its count): meta's inputs; pack's inputs, send rows and
# the handle's matrices; land's rows, row counts and outputs; recv_chan's source indices and out;
# rows' positions, count, y, weights and out; home's back rows, slots, out_y and out_w.
META_TIR, META_TOPK, META_EXPERTS, META_HEAD = 0, 1, 2, 3
PACK_TIR, PACK_SLOT, PACK_SEND_HEAD, PACK_RANK_PREFIX, PACK_CHAN_PREFIX = 11, 14, 15, 16, 17
PACK_X, PACK_SCALES, PACK_TOPK, PACK_W, PACK_SEND, PACK_SYNC = 18, 20, 22, 23, 25, 32
LAND_ROWS, LAND_N, LAND_N_OUT, LAND_X, LAND_SCALES, LAND_SRC, LAND_TOPK, LAND_W, LAND_POS = 0, 1, 4, 5, 7, 9, 10, 11, 16
RECV_CHAN_SRC, RECV_CHAN_OUT = 0, 7
ROWS_POS, ROWS_N, ROWS_Y, ROWS_W, ROWS_OUT, ROWS_SYNC = 0, 1, 2, 4, 6, 13
HOME_BACK, HOME_SLOT, HOME_Y, HOME_W = 0, 2, 9, 10


def meta(tir: torch.Tensor, topk, experts_in, head: torch.Tensor, row: torch.Tensor, before: torch.Tensor,
         spos: torch.Tensor, *, M: int, P: int, E: int, Kc: int, ring: int, max_nodes: int) -> None:
    """The count exchange's row (``row``: int64, ``head`` copied to its start) and the scans ``before``
    [T, R] and ``spos`` [T, M] (int32) from is_token_in_rank ``tir`` [T, R] (bool) and ``topk`` [T, K]
    int64 (or, without top-k, ``experts_in``: int32 [E] tokens per expert)."""
    launch(meta_spec(tir, topk, experts_in, head, row, before, spos, M=M, P=P, E=E, Kc=Kc, ring=ring,
                     max_nodes=max_nodes))


def meta_spec(tir: torch.Tensor, topk, experts_in, head: torch.Tensor, row: torch.Tensor, before: torch.Tensor,
              spos: torch.Tensor, *, M: int, P: int, E: int, Kc: int, ring: int, max_nodes: int) -> tuple:
    """``meta``'s checks, then its launch."""
    T, R = tir.shape
    K = topk.shape[1] if topk is not None else 0
    if not (tir.dtype == torch.bool and tir.is_contiguous()):
        _fail("is_token_in_rank must be contiguous bool")
    if not (R == M * P):
        _fail(f"is_token_in_rank has {R} columns, the topology {M} x {P} ranks")
    if not (topk is None or (topk.dtype == torch.int64 and topk.is_contiguous())):
        _fail("topk_idx must be contiguous int64")
    if not (topk is not None or (experts_in is not None and experts_in.dtype == torch.int32 and experts_in.numel() == E)):
        _fail("without topk_idx, int32 tokens per expert [E]")
    if not (row.dtype == torch.int64 and head.dtype == torch.int64):
        _fail("the exchange row and its head are int64")
    if not (before.dtype == torch.int32 and spos.dtype == torch.int32):
        _fail("before / spos are int32")
    return (FAMILY, "inter_meta_kernel", R + M + 1, META_THREADS,
            [tir.data_ptr(), 0 if topk is None else topk.data_ptr(), 0 if experts_in is None else experts_in.data_ptr(),
             head.data_ptr(), head.numel(), T, R, M, P, E, K, Kc, ring, max_nodes, row.data_ptr(), before.data_ptr(),
             spos.data_ptr()], 4 * max(E, Kc * P, 1))


DIGEST_THREADS = 256


def digest_len(M: int, P: int, Kc: int, Lx: int) -> int:
    """Length of the exchange digest (``digest``; exchange.py ``exchange_digest``)."""
    return 4 + 2 * M + 2 * Kc * P + Lx


def digest(g: torch.Tensor, out: torch.Tensor, *, n_sig: int, me: int, node: int, loc: int, M: int, P: int,
           Kc: int, ring: int, Lx: int) -> None:
    """What the host needs of the gathered exchange ``g`` [R, row_len] (int64) into ``out`` (int64
    [digest_len]): the same vector as ``exchange_digest``."""
    launch(digest_spec(g, out, n_sig=n_sig, me=me, node=node, loc=loc, M=M, P=P, Kc=Kc, ring=ring, Lx=Lx))


def digest_spec(g: torch.Tensor, out: torch.Tensor, *, n_sig: int, me: int, node: int, loc: int, M: int, P: int,
                Kc: int, ring: int, Lx: int) -> tuple:
    """``digest``'s checks, then its launch (for a caller whose g and out stay: nothing to set per call)."""
    R, row_len = g.shape
    if not (g.dtype == torch.int64 and g.is_contiguous()):
        _fail("g must be the contiguous int64 gathered exchange")
    if not (R == M * P and 0 <= me < R and me == node * P + loc):
        _fail(f"rank {me} is not (node {node}, local rank {loc}) " f"of {M} x {P}")
    if not (out.dtype == torch.int64 and out.is_contiguous() and out.numel() == digest_len(M, P, Kc, Lx)):
        _fail(f"out must be contiguous int64 [{digest_len(M, P, Kc, Lx)}]")
    return (FAMILY, "inter_digest_kernel", 1, DIGEST_THREADS,
            [g.data_ptr(), row_len, n_sig, me, node, loc, R, M, P, Kc, ring, Lx, out.data_ptr()], 0)


def _row_parts(x: torch.Tensor, scales, topk, w) -> tuple:
    """(x bytes, scales bytes) of one row, after the checks every row-moving kernel shares."""
    if not (x.is_contiguous() and x.dim() == 2):
        _fail("x must be a contiguous [T, H] tensor")
    x_bytes = x.shape[1] * x.element_size()
    s_bytes = 0
    if scales is not None:
        if not (scales.dtype == torch.float32 and scales.is_contiguous()):
            _fail("scales must be contiguous float32")
        s_bytes = scales.shape[1] * 4
    if not (x_bytes % 4 == 0):
        _fail(f"a row of x must be a multiple of 4 bytes, is {x_bytes}")
    if not (topk is None or (topk.dtype == torch.int64 and topk.is_contiguous())):
        _fail("topk_idx must be contiguous int64")
    if not (w is None or (w.dtype == torch.float32 and w.is_contiguous())):
        _fail("topk_weights must be contiguous float32")
    return x_bytes, s_bytes


def pack(g, send: torch.Tensor, slot: torch.Tensor, send_head: torch.Tensor, x: torch.Tensor, scales, topk, w, *,
         me: int, M: int, P: int, Kc: int, ring: int, n_sig: int = 0, tir=None, before=None, spos=None,
         rank_prefix=None, chan_prefix=None) -> None:
    """Every (token, node) row into ``send`` (uint8 [S, W + 4 P]) at its slot. Fresh (``g``: the
    gathered exchange [R, row_len] int64): also writes ``slot`` [T, M], ``send_head`` [T, R],
    ``rank_prefix`` [R, R] and ``chan_prefix`` [R, C] (int32). Cached (``g`` None): reads slot and
    send_head."""
    launch(pack_spec(g, send, slot, send_head, x, scales, topk, w, me=me, M=M, P=P, Kc=Kc, ring=ring, n_sig=n_sig,
                     tir=tir, before=before, spos=spos, rank_prefix=rank_prefix, chan_prefix=chan_prefix))


def pack_spec(g, send: torch.Tensor, slot: torch.Tensor, send_head: torch.Tensor, x: torch.Tensor, scales, topk, w, *,
              me: int, M: int, P: int, Kc: int, ring: int, n_sig: int = 0, tir=None, before=None, spos=None,
              rank_prefix=None, chan_prefix=None, sync=None):
    """``pack``'s checks, then its launch (None: nothing to pack and no sync). ``sync``: the node
    barrier's arguments with its flags (fanout.NodeFanout.sync_args; argument PACK_SYNC the flags: a
    cached dispatch's pack arrives for its forwards, kept.py), with which it runs even with no tokens."""
    T = x.shape[0]
    R = send_head.shape[1]
    K = topk.shape[1] if topk is not None else 0
    x_bytes, s_bytes = _row_parts(x, scales, topk, w)
    W = x_bytes + s_bytes + 4 + (8 * K + (4 * K if w is not None else 0))
    if not (send.dtype == torch.uint8 and send.dim() == 2 and send.is_contiguous() and send.shape[1] == W + 4 * P):
        _fail(f"send rows must be contiguous uint8 [S, {W + 4 * P}]")
    if not (slot.dtype == torch.int32 and send_head.dtype == torch.int32 and slot.is_contiguous()
            and send_head.is_contiguous()):
        _fail("slot and send_head are contiguous int32")
    C = 1
    if g is not None:
        if not (g.dtype == torch.int64 and g.is_contiguous() and g.shape[0] == R):
            _fail("g is the gathered exchange [R, row_len]")
        if not (tir is not None and before is not None and spos is not None and rank_prefix is not None
                and chan_prefix is not None):
            _fail("a fresh pack needs tir, before, spos and the matrices")
        C = chan_prefix.shape[1]
    tail = _sync_tail(sync)
    if T == 0 and g is None and not tail[-1]:   # a fresh pack still writes the matrices
        return None
    fresh = g is not None
    return (FAMILY, "inter_pack_kernel", grid(T), THREADS,
            [g.data_ptr() if fresh else 0, g.shape[1] if fresh else 0, n_sig, me, T, R, M, P, Kc, ring, C,
             tir.data_ptr() if fresh else 0, before.data_ptr() if fresh else 0, spos.data_ptr() if fresh else 0,
             slot.data_ptr(), send_head.data_ptr(), rank_prefix.data_ptr() if fresh else 0,
             chan_prefix.data_ptr() if fresh else 0, x.data_ptr(), x_bytes, 0 if scales is None else scales.data_ptr(),
             s_bytes, 0 if topk is None else topk.data_ptr(), 0 if w is None else w.data_ptr(), K, send.data_ptr(),
             send.shape[1]] + tail, 4 * (R + Kc * M + M))


def land(rows_addr: int, n: int, row_stride: int, pos_off: int, x_out: torch.Tensor, s_out=None,
         src_out=None, topk_out=None, w_out=None, *, K: int = 0, expert_lo: int = 0, num_local: int = 0,
         pos_out=None) -> None:
    """``n`` rows from device address ``rows_addr`` (stride ``row_stride`` bytes: a landing buffer or
    the forwarder's area) into the outputs at row = the int32 at byte ``pos_off`` of the row (-1: the
    row's index). The rows carry scales exactly when ``s_out`` is given; expert ids are made local
    ([expert_lo, expert_lo + num_local) -> 0.., else -1), weights of other ranks' experts 0.
    ``pos_out`` (int32 [n]) gets each row's output row. The row layout is the dispatch packer's."""
    launch(land_spec(rows_addr, n, row_stride, pos_off, x_out, s_out, src_out, topk_out, w_out, K=K,
                     expert_lo=expert_lo, num_local=num_local, pos_out=pos_out))


def land_spec(rows_addr: int, n: int, row_stride: int, pos_off: int, x_out: torch.Tensor, s_out=None,
              src_out=None, topk_out=None, w_out=None, *, K: int = 0, expert_lo: int = 0, num_local: int = 0,
              pos_out=None):
    """``land``'s checks, then its launch (None: no rows)."""
    if not (x_out.is_contiguous() and x_out.dim() == 2):
        _fail("x_out must be contiguous [N, H]")
    x_bytes = x_out.shape[1] * x_out.element_size()
    s_bytes = s_out.shape[1] * 4 if s_out is not None else 0   # rows carry scales exactly when x_out has them
    if not (x_bytes % 4 == 0 and s_bytes % 4 == 0 and row_stride % 4 == 0 and rows_addr % 4 == 0):
        _fail("row geometry must be 4-byte aligned")
    if not (s_out is None or (s_out.dtype == torch.float32 and s_out.is_contiguous())):
        _fail("scales out: contiguous float32")
    if not (topk_out is None or (topk_out.dtype == torch.int64 and topk_out.is_contiguous())):
        _fail("ids out: int64")
    if not (w_out is None or (w_out.dtype == torch.float32 and w_out.is_contiguous())):
        _fail("weights out: float32")
    if n == 0:
        return None
    return (FAMILY, "inter_land_kernel", grid(n), THREADS,
            [int(rows_addr), n, row_stride, pos_off, x_out.shape[0], x_out.data_ptr(), x_bytes,
             0 if s_out is None else s_out.data_ptr(), s_bytes, 0 if src_out is None else src_out.data_ptr(),
             0 if topk_out is None else topk_out.data_ptr(), 0 if w_out is None else w_out.data_ptr(), K,
             int(w_out is not None), expert_lo, num_local, 0 if pos_out is None else pos_out.data_ptr()], 0)


def recv_chan(src_idx: torch.Tensor, g: torch.Tensor, out: torch.Tensor, *, n_sig: int, me: int) -> None:
    """The handle's recv_channel_prefix_matrix ``out`` [R, C] int32 from the landed source indices."""
    launch(recv_chan_spec(src_idx, g, out, n_sig=n_sig, me=me))


def recv_chan_spec(src_idx: torch.Tensor, g: torch.Tensor, out: torch.Tensor, *, n_sig: int, me: int) -> tuple:
    """``recv_chan``'s checks, then its launch."""
    R, C = out.shape
    if not (src_idx.dtype == torch.int32 and out.dtype == torch.int32 and out.is_contiguous()):
        _fail("int32 in and out")
    return (FAMILY, "inter_recv_chan_kernel", 1, RECV_CHAN_THREADS,
            [src_idx.data_ptr(), g.data_ptr(), g.shape[1], n_sig, me, R, C, out.data_ptr()], 0)


def rows(pos, n: int, y: torch.Tensor, w, out_addr: int, out_stride: int, sync=None, max_ctas: int = MAX_CTAS) -> None:
    """Combine rows at device address ``out_addr`` (stride ``out_stride``): row j = y row pos[j] | w row
    pos[j] (``pos`` None: row j); ``sync``, ``max_ctas``: rows_spec's."""
    launch(rows_spec(pos, n, y, w, out_addr, out_stride, sync, max_ctas))


def rows_spec(pos, n: int, y: torch.Tensor, w, out_addr: int, out_stride: int, sync=None, max_ctas: int = MAX_CTAS):
    """``rows``' checks, then its launch (None: no rows and no sync). ``sync``: into the forwarder's area,
    the node barrier's arguments with its flags (fanout.NodeFanout.sync_args; argument ROWS_SYNC the
    flags), with which it runs even with no rows; None: none. ``max_ctas``: its grid's bound (a synced
    one: synced_ctas)."""
    if not (y.dtype == torch.bfloat16 and y.is_contiguous()):
        _fail("combine x must be contiguous bf16")
    K = w.shape[1] if w is not None else 0
    if not (w is None or (w.dtype == torch.float32 and w.is_contiguous())):
        _fail("combine weights: contiguous float32")
    if not (out_stride % 4 == 0 and out_addr % 4 == 0 and (2 * y.shape[1]) % 4 == 0
            and out_stride >= 2 * y.shape[1] + 4 * K):
        _fail("4-byte aligned rows wide enough for y and w")
    if not (pos is None or (pos.dtype == torch.int32 and pos.is_contiguous())):
        _fail("pos must be contiguous int32")
    tail = _sync_tail(sync)
    if n == 0 and not tail[-1]:
        return None
    return (FAMILY, "inter_rows_kernel", grid(n, max_ctas), THREADS,
            [0 if pos is None else pos.data_ptr(), n, y.data_ptr(), 2 * y.shape[1], 0 if w is None else w.data_ptr(),
             K, int(out_addr), out_stride] + tail, 0)


def home(back: torch.Tensor, slot: torch.Tensor, biases: list, out_y: torch.Tensor, out_w, *, H: int, K: int) -> None:
    """Combine at home: per token 0 + the (bf16, [T, H]) biases, then the node partials (``back`` rows
    at ``slot`` [T, M]) in node order, into bf16 ``out_y`` [T, H] and float32 ``out_w`` [T, K]."""
    launch(home_spec(back, slot, biases, out_y, out_w, H=H, K=K))


def home_spec(back: torch.Tensor, slot: torch.Tensor, biases: list, out_y: torch.Tensor, out_w, *, H: int, K: int):
    """``home``'s checks, then its launch (None: no tokens)."""
    T, M = slot.shape
    if not (H % 2 == 0 and out_y.dtype == torch.bfloat16 and out_y.is_contiguous()):
        _fail("out_y: contiguous bf16, H even")
    if not (len(biases) <= 2 and all(b.dtype == torch.bfloat16 and b.is_contiguous() and tuple(b.shape) == (T, H)
                                     for b in biases)):
        _fail("at most two contiguous bf16 [T, H] biases")
    if not (back.stride(0) % 4 == 0 and back.data_ptr() % 4 == 0):
        _fail("4-byte aligned back rows")
    if T == 0:
        return None
    b = list(biases) + [None, None]
    return (FAMILY, "inter_home_kernel", grid(T), THREADS,
            [back.data_ptr(), back.stride(0), slot.data_ptr(), T, M, H, K, 0 if b[0] is None else b[0].data_ptr(),
             0 if b[1] is None else b[1].data_ptr(), out_y.data_ptr(), 0 if out_w is None else out_w.data_ptr()], 0)
