"""Row packing of the internode engine: the byte layout of a dispatch row and of a combine row,
the forwarder areas' row size, and small tensor helpers. Engine-free.

A dispatch row (``dispatch_packer``): x [H] (bf16 or FP8) | scales [H / 128] float32 (FP8) |
source token index int32 | top-k ids [K] int64 | top-k weights [K] float32; on the wire each row
is followed by its final row on every rank of the destination node (int32 [P]). A combine row
(``combine_packer``): y [H] bf16 | weights [K] float32.

Legend: T tokens, H hidden, K top-k, P ranks per node, W bytes of a packed row.
"""
from __future__ import annotations

import functools
import math

import torch

from commlib.backends.common import Packer
from commlib.utils.math import align_up


def dispatch_packer(x: torch.Tensor, scales, K: int, has_w: bool) -> Packer:
    """The packer of a dispatch's rows (``K`` = 0: cached dispatch, no routing columns); one per
    row layout, kept (a Packer is never changed after it is made)."""
    return _packer(x.dtype, x.shape[1], scales.shape[1] if scales is not None else -1, K, has_w)


@functools.lru_cache(maxsize=64)
def _packer(dtype, H: int, S: int, K: int, has_w: bool) -> Packer:
    cols = [("x", dtype, (H,))]
    if S >= 0:
        cols.append(("scales", torch.float32, (S,)))
    cols.append(("src_idx", torch.int32, ()))
    if K:
        cols.append(("topk_idx", torch.int64, (K,)))
        if has_w:
            cols.append(("topk_w", torch.float32, (K,)))
    return Packer(cols)


def combine_packer(H: int, K: int) -> Packer:
    """The packer of a combine's rows (and of a forwarder's node partials)."""
    return Packer([("y", torch.bfloat16, (H,))] + ([("w", torch.float32, (K,))] if K else []))


def payload(x: torch.Tensor, scales, topk, weights, dev) -> tuple:
    """The rows a dispatch moves, as (packer, per-column tensors on ``dev``): x, its scales, the
    source token index and, with ``topk`` (the ids on ``dev``), the ids and weights. Cached dispatch
    passes None: its rows carry no routing."""
    K = topk.shape[1] if topk is not None else 0
    has_w = K > 0 and weights is not None
    tensors = [x.to(dev)] + ([scales.to(dev)] if scales is not None else []) + \
        [torch.arange(x.shape[0], dtype=torch.int32, device=dev)]
    if K:
        tensors.append(topk)
        if has_w:
            tensors.append(weights.to(dev))
    return dispatch_packer(x, scales, K, has_w), tensors


def area_row(packer: Packer, H: int, K: int) -> int:
    """Bytes per row of the forwarder's landing areas for a dispatch (``packer``: its rows) and its
    cached dispatch and combine (bf16 [H] + float32 [K]): the widest, 16-byte aligned, so no later
    call of the handle grows the areas (growing is collective and syncs the host). The same on every
    rank of a node (the ranks agree on the call)."""
    return max(align_up(packer.row_bytes, 16), align_up(2 * H + 4 * K, 16))


def fill_ids(out: torch.Tensor, packer: Packer) -> None:
    """Rows nothing lands on read as the reference's padding: -1 source index and expert ids."""
    offset = 0
    for (name, _, _), w in zip(packer.columns, packer.widths):
        if name in ("src_idx", "topk_idx"):
            out[:, offset:offset + w] = 0xFF
        offset += w


def here(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` contiguous on ``device``: ``t`` itself where it is so already (no dispatcher call)."""
    return t if t.device == device and t.is_contiguous() else t.to(device).contiguous()


def rows_on(t: torch.Tensor, n: int, device) -> torch.Tensor:
    """The first ``n`` rows of ``t``, contiguous on ``device`` (``t`` itself where it already is)."""
    return here(t if t.shape[0] == n else t[:n], device)


def typed_views(device, *parts) -> list:
    """Tensors of ``parts`` ((dtype, shape) each), views of one allocation, each 8-byte aligned
    (one allocator call for scratch of several dtypes)."""
    sizes = [align_up(math.prod(shape) * dtype.itemsize, 8) for dtype, shape in parts]
    block = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
    out, at = [], 0
    for (dtype, shape), size in zip(parts, sizes):
        n = math.prod(shape) * dtype.itemsize
        out.append(block[at:at + n].view(dtype).view(shape))
        at += size
    return out


OUT_ALIGN = 256   # the outputs' byte boundary in their one allocation (csrc/callpath.h Outputs: the same)


def output_layout(specs) -> tuple:
    """Where a call's outputs of ``specs`` ((shape, dtype) each, 2-D, or None) lie in one allocation:
    (its bytes, per spec (dtype, shape, strides, offset in elements) or None), each at an OUT_ALIGN
    boundary in spec order. A kept call computes it once, a non-cached dispatch per call."""
    at, parts = 0, []
    for sp in specs:
        if sp is None:
            parts.append(None)
            continue
        (n, m), dtype = sp
        parts.append((dtype, (n, m), (m, 1), at // dtype.itemsize))
        at += -(-n * m * dtype.itemsize // OUT_ALIGN) * OUT_ALIGN
    return at, parts


def output_views(block: torch.Tensor, layout: tuple) -> list:
    """The outputs of ``layout`` (``output_layout``) as views of ``block`` (uint8 of its bytes): a call's
    outputs from one allocator call, any one of them keeping it alive (two C calls per output)."""
    return [None if p is None else block.view(p[0]).as_strided(p[1], p[2], p[3]) for p in layout[1]]


def int32_len(*shapes) -> tuple:
    """The shape of one int32 block that holds tensors of ``shapes`` (``int32_views``)."""
    return (sum([math.prod(s) for s in shapes]),)


def int32_views(device, *shapes, block=None) -> list:
    """int32 tensors of ``shapes``, views of one allocation (one allocator call, one stream record):
    ``block`` (int32 of ``int32_len(*shapes)``, made with other tensors in one call), else a new one."""
    if block is None:
        block = torch.empty(int32_len(*shapes), dtype=torch.int32, device=device)
    # one view operation per tensor, each of the same kind (a split then a view per 2-D tensor is two
    # kinds and more calls: on a host whose caches a call's rows flushed, each kind costs its code)
    out, at = [], block.storage_offset()
    for s in shapes:
        d = len(s)
        if d == 2:
            out.append(block.as_strided(s, (s[1], 1), at))
            at += s[0] * s[1]
        elif d == 1:
            out.append(block.as_strided(s, (1,), at))
            at += s[0]
        else:
            strides = [1]
            for n in reversed(s[1:]):
                strides.append(strides[-1] * n)
            out.append(block.as_strided(s, strides[::-1], at))
            at += math.prod(s)
    return out


def with_positions(rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """uint8 [n, W] rows followed by their int32 [n, P] positions: uint8 [n, W + 4 P]."""
    return torch.cat([rows, pos.contiguous().view(torch.uint8).view(-1, 4 * pos.shape[1])], dim=1)


__all__ = ["dispatch_packer", "combine_packer", "payload", "area_row", "fill_ids", "here", "rows_on", "typed_views",
           "output_layout", "output_views", "OUT_ALIGN", "int32_len", "int32_views", "with_positions"]
