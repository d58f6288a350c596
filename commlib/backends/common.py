"""Pieces the reference backend and the internode engine share: the row packer, the agreement
check, the gather / all-to-all of rows with a deadline, the summation every backend reproduces.

Engine-free: nothing here knows a backend. Every tensor made here names its device (a caller's
``torch.set_default_device`` must not move it).

Legend: R ranks, n rows, H hidden, K top-k.
"""
from __future__ import annotations

import datetime
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from commlib.validate import CommlibError

HOST = torch.device("cpu")
SUM_ORDER_SLOTS = 8   # ranks a sum order names: 4-bit names in a u32 (DispatchHandle.sum_order)

# What every rank must agree on before an op moves data (the first words of its agreement row).
SIG_FIELDS = ("op", "call", "hidden", "num_experts", "fp8", "topk", "topk_weights", "num_sms",
              "nvl_send_tokens", "nvl_recv_tokens")
OPS = {1: "dispatch", 2: "cached dispatch", 3: "combine", 4: "low_latency_dispatch", 5: "low_latency_combine"}


def signature(op: int, call: int, hidden: int, num_experts: int, fp8: bool, topk: int, weights: bool,
              config) -> list[int]:
    """The words of SIG_FIELDS for one call (ints)."""
    return [op, call, hidden, num_experts, int(fp8), topk, int(weights), config.num_sms,
            config.num_max_nvl_chunked_send_tokens, config.num_max_nvl_chunked_recv_tokens]


def check_agreement(me: int, rows: list, sig: list, fields: Sequence[str], n_sig: int) -> None:
    """Raise on every rank (they all hold the same ``rows``) when a rank refused its input (word 0 set)
    or the ranks' signatures (words 1 .. n_sig) differ from this rank's ``sig``. ``rows``: the
    gathered agreement rows as lists of ints."""
    refused = [r for r, row in enumerate(rows) if row[0]]
    op = OPS.get(sig[0], sig[0])
    if refused:
        raise ValueError(f"[commlib rank {me}] {op} aborted: rank(s) {refused} rejected their "
                         "input (see the error on those ranks); nothing was sent")
    for r, row in enumerate(rows):
        theirs = list(row[1:n_sig])
        if theirs != list(sig):
            name = lambda i, v: OPS.get(v, v) if i == 0 else v
            diffs = [f"{fields[i]}: rank {r} has {name(i, theirs[i])}, rank {me} has {name(i, sig[i])}"
                     for i in range(len(sig)) if theirs[i] != sig[i]]
            raise ValueError(f"[commlib rank {me}] ranks disagree on the op: " + "; ".join(diffs)
                             + " (every rank must make the same sequence of calls with the same shapes/config)")


def wait(work, timeout_s: float, rank: int, phase: str, call: int, on_fail: Optional[Callable] = None) -> None:
    """Wait for a collective at most ``timeout_s`` on the host; on a timeout or a dead peer raise
    CommlibError naming the rank, the ``phase`` of op #``call`` and the deadline (``on_fail(message)``
    first: a backend keeps it to refuse later calls)."""
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except Exception as e:  # noqa: BLE001 - gloo raises RuntimeError for timeouts and dead peers
        reason = "timed out" if "timed out" in str(e).lower() else f"failed ({str(e).strip()[:200]})"
        message = (f"[commlib rank {rank}] {phase} {reason} after waiting up to {timeout_s:g} s for collective of "
                   f"op #{call} (COMMLIB_TIMEOUT_S): a peer exited, skipped this call, or is stuck elsewhere")
        if on_fail is not None:
            on_fail(message)
        raise CommlibError(message) from e


def a2a_rows(rows: torch.Tensor, send_counts: list, recv_counts: list, group, device, wait_fn) -> torch.Tensor:
    """Rows to every rank of ``group``, ``send_counts`` rows each; returns the received rows on ``device``."""
    rows = rows.to(device).contiguous()
    out = torch.empty(sum(recv_counts), *rows.shape[1:], dtype=rows.dtype, device=device)
    wait_fn(dist.all_to_all_single(out, rows, recv_counts, send_counts, group=group, async_op=True))
    return out


def gather(row: torch.Tensor, group, device, wait_fn, out=None, issue=None) -> torch.Tensor:
    """[n] -> [ranks of ``group``, n] on ``device`` (row r from rank r); no host read. ``out``: where
    the rows land (contiguous, ranks x n elements of row's dtype), else a new tensor. ``issue(fn,
    *args, **kwargs)``: how the collective is issued (a probe's ``collective``; default: called)."""
    size = dist.get_world_size(group)
    row = row.to(device).contiguous()
    if out is None:
        out = torch.empty(size * row.numel(), dtype=row.dtype, device=device)
    out = out.view(-1)
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    wait_fn(fn(out, row, group=group, async_op=True) if issue is None else issue(fn, out, row, group=group,
                                                                                  async_op=True))
    return out.view(size, row.numel())


class Packer:
    """Packs several per-row tensors into one uint8 [n, row_bytes] matrix and back.

    ``columns``: (name, dtype, trailing shape) per column, in row order."""

    def __init__(self, columns: Sequence[tuple[str, torch.dtype, tuple]]):
        self.columns = list(columns)
        self.widths = []
        for _, dtype, shape in self.columns:
            n = 1
            for s in shape:
                n *= s
            self.widths.append(n * dtype.itemsize)   # no tensor made: this runs on every call
        self.row_bytes = sum(self.widths)

    def pack(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """One tensor per column ([n, *shape] each, one device) -> uint8 [n, row_bytes]."""
        n = tensors[0].shape[0]
        if n == 0:
            return torch.empty(0, self.row_bytes, dtype=torch.uint8, device=tensors[0].device)
        parts = [t.contiguous().reshape(n, -1).view(torch.uint8) for t in tensors]
        return torch.cat(parts, dim=1)

    def unpack(self, rows: torch.Tensor) -> dict:
        """uint8 [n, >= row_bytes] -> {name: [n, *shape] of its dtype} (copies)."""
        out, offset = {}, 0
        n = rows.shape[0]
        for (name, dtype, shape), w in zip(self.columns, self.widths):
            if n == 0:
                out[name] = torch.empty(0, *shape, dtype=dtype, device=rows.device)
            else:
                # a fresh buffer: a one-row slice counts as contiguous but keeps an offset and a
                # row stride the wider dtype cannot view
                chunk = torch.empty(n, w, dtype=torch.uint8, device=rows.device)
                chunk.copy_(rows[:, offset:offset + w])
                out[name] = chunk.view(dtype).reshape(n, *shape)
            offset += w
        return out


def int32_columns(rows: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Byte columns [start, stop) of uint8 ``rows`` read as int32 [n, (stop - start) / 4]. A copy: a
    one-row slice counts as contiguous but keeps its byte offset, which an int32 view refuses."""
    return rows[:, start:stop].clone(memory_format=torch.contiguous_format).view(torch.int32)


def check_counts(me: int, limit: int, node_excess, counts_all, worst: int) -> None:
    """Raise (on every rank: all of them read the same gathered counts) when some rank's tokens reach
    more than ``limit`` nodes (``node_excess`` [R]: tokens over it per rank, a tensor or list, or
    None), or when ``num_worst_tokens`` is below the rows some rank receives (``counts_all`` [R, R],
    or None)."""
    if node_excess is not None:
        values = node_excess.tolist() if isinstance(node_excess, torch.Tensor) else list(node_excess)
        bad = [(r, int(n)) for r, n in enumerate(values) if n > 0]
        if bad:
            raise ValueError(
                f"[commlib rank {me}] routing sends tokens to more than max_nodes_per_token={limit} nodes "
                f"(rank, tokens over the limit): {bad}; use a node-limited gate "
                "(commlib.routing.group_limited_topk) or raise the Buffer's max_nodes_per_token")
    if worst and counts_all is not None:
        totals = counts_all.sum(dim=0)
        over = [(r, int(totals[r])) for r in range(len(totals)) if totals[r] > worst]
        if over:
            raise ValueError(f"[commlib rank {me}] num_worst_tokens={worst} is smaller than the rows some "
                             f"ranks receive (rank, rows): {over}")


def bias_start(biases: Sequence[torch.Tensor], num_targets: int, hidden: int, device) -> torch.Tensor:
    """float32 [T, H]: 0 + bias0 + bias1 (bf16 [T, H] each, IEEE adds), where every combine sum
    starts (DeepEP's order: the biases before the rows)."""
    acc = torch.zeros(num_targets, hidden, dtype=torch.float32, device=device)
    for b in biases:
        acc += b.to(device).float()
    return acc


def sum_places(held: torch.Tensor, sum_order: Optional[torch.Tensor]) -> torch.Tensor:
    """[T, R] int64: the place of rank r's row in token t's sum (0 first), -1 where r holds no row.
    ``held`` [T, R] bool; ``sum_order`` [T] int32 or None (DispatchHandle.sum_order's rule: nibble i
    names the rank summed i-th, a rank's key is its first nibble, ranks no nibble names get 8 + rank;
    a held rank's place = the held ranks of smaller key). None: rank order."""
    T, R = held.shape
    dev = held.device
    ranks = torch.arange(R, device=dev)
    if sum_order is None:
        key = ranks.expand(T, R)
    else:
        slots = torch.arange(SUM_ORDER_SLOTS, device=dev)
        nib = (sum_order.to(dev, torch.int64).unsqueeze(1) >> (4 * slots)) & 15              # [T, 8]
        named = nib.unsqueeze(2) == ranks.view(1, 1, R)                                       # [T, 8, R]
        key = torch.where(named, slots.view(1, -1, 1), SUM_ORDER_SLOTS + ranks.view(1, 1, R)).amin(1)
    before = (key.unsqueeze(1) < key.unsqueeze(2)) & held.unsqueeze(1)                        # [T, r, r']
    return torch.where(held, before.sum(2), torch.full_like(key, -1))


def sum_rows(cols: dict, orders, num_targets: int, hidden: int, topk: int,
             init_y: Optional[torch.Tensor] = None, places: Optional[torch.Tensor] = None):
    """The summation every backend reproduces: rows ``cols["y"]`` (and weights ``cols["w"]``) come
    grouped as ``orders`` lists their targets (int64 index tensors, a target at most once per group),
    group after group; each is added in float32 to its target row in that group order, starting
    from ``init_y`` (float32 [num_targets, H], used in place; None: 0) for y and from 0 for the
    weights. ``places`` [num_targets, G] (sum_places): group g's row of target t is added at place
    places[t, g] instead (rows of one place in group order). Returns (float32 [num_targets, H],
    float32 [num_targets, K] or None)."""
    y, w = cols["y"], cols.get("w")
    device = y.device
    if places is not None:
        tgt = torch.cat(list(orders)) if len(orders) else torch.zeros(0, dtype=torch.int64, device=device)
        grp = torch.cat([torch.full((int(o.numel()),), g, dtype=torch.int64, device=device)
                         for g, o in enumerate(orders)]) if len(orders) else tgt
        at = places.to(device)[tgt, grp] if tgt.numel() else tgt
        picks = [torch.nonzero(at == q).flatten() for q in range(places.shape[1])]
        orders = [tgt[p] for p in picks]
        perm = torch.cat(picks) if picks else tgt
        y = y[perm]
        w = w[perm] if topk else None
    acc_y = init_y if init_y is not None else torch.zeros(num_targets, hidden, dtype=torch.float32, device=device)
    acc_w = torch.zeros(num_targets, topk, dtype=torch.float32, device=device) if topk else None
    start = 0
    for idx in orders:
        cnt = int(idx.numel())
        acc_y.index_add_(0, idx, y[start:start + cnt].float())
        if topk:
            acc_w.index_add_(0, idx, w[start:start + cnt])
        start += cnt
    return acc_y, acc_w


def pad_rows(t: torch.Tensor, rows: int, value) -> torch.Tensor:
    """``t`` [n, ...] with rows appended up to ``rows``, filled with ``value``."""
    if t.shape[0] >= rows:
        return t
    pad = torch.full((rows - t.shape[0], *t.shape[1:]), value, dtype=t.dtype, device=t.device)
    return torch.cat([t, pad])


__all__ = ["HOST", "SIG_FIELDS", "OPS", "signature", "check_agreement", "wait", "a2a_rows", "gather", "Packer",
           "int32_columns", "check_counts", "bias_start", "sum_places", "sum_rows",
           "pad_rows", "SUM_ORDER_SLOTS"]
