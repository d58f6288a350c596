"""CPU stand-ins for what the internode engine's num_worst_tokens kernel route (backends/internode/
padded.py) runs on a GPU: its kernels (pack, land, rows, home: csrc/internode.cu) as plain torch from
the contracts in that file's comments, and the forwarder node step (node.ForwarderNode over
csrc/fanout.cu) as collectives on the node group, its landing areas ordinary tensors that keep the
bytes of earlier calls (filled with 0xA5 when they grow, so a row the route forgets to pad shows).
Nothing here is shared with the engine. tests/cases_internode.py ``worst_kernel_route`` runs the
route on them against the reference backend; on a GPU ``worst_no_read`` runs the real ones.

Legend: T tokens, H hidden, K top-k, M nodes, P ranks per node, W bytes of a packed row, Wd the
areas' row stride.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from commlib.backends.internode import kernels as IK

STALE = 0xA5
_AREAS: dict = {}            # address -> the uint8 tensor there (the kernels take raw addresses)
CALLS: dict = {}             # kernel name -> launches, so a case can tell the route ran


def _count(name: str) -> None:
    CALLS[name] = CALLS.get(name, 0) + 1


def _u8(t: torch.Tensor) -> torch.Tensor:
    """A tensor's rows as bytes: [n, bytes per row]."""
    per = t.element_size()
    for n in t.shape[1:]:
        per *= n
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], per)


def _word(row: torch.Tensor, at: int, dtype) -> torch.Tensor:
    """The bytes of ``row`` from ``at`` read as ``dtype`` (copied: a slice keeps its byte offset)."""
    return row[at:].clone().view(dtype)


def _rows_at(addr: int, n: int, stride: int) -> torch.Tensor:
    """``n`` rows of ``stride`` bytes at ``addr``, inside one of the areas (a window's rows start past
    its first byte)."""
    base = next((b for b, a in _AREAS.items() if b <= addr < b + max(1, a.numel())), None)
    assert base is not None, f"address {addr} is in no area"
    area, at = _AREAS[base], addr - base
    assert at + n * stride <= area.numel(), (at, n, stride, area.numel())
    return area[at:at + n * stride].view(n, stride)


def pack(g, send, slot, send_head, x, scales, topk, w, *, me, M, P, Kc, ring, **_):
    """Row of (t, m) at send[slot[t, m]] (slot -1: none): x | scales | t (int32) | ids | weights |
    send_head[t, m * P:(m + 1) * P]. Only the cached form (g None): the route makes its own slots."""
    _count("pack")
    assert g is None
    T = x.shape[0]
    cols = [_u8(x)] + ([_u8(scales)] if scales is not None else [])
    cols.append(_u8(torch.arange(T, dtype=torch.int32).view(T, 1)))
    if topk is not None:
        cols.append(_u8(topk))
        if w is not None:
            cols.append(_u8(w))
    W = sum(c.shape[1] for c in cols)
    assert send.shape[1] == W + 4 * P
    for t in range(T):
        row = torch.cat([c[t] for c in cols])
        for m in range(M):
            s = int(slot[t, m])
            if s >= 0:
                send[s, :W] = row
                send[s, W:] = send_head[t, m * P:(m + 1) * P].clone().view(torch.uint8)


def land(rows_addr, n, row_stride, pos_off, x_out, s_out=None, src_out=None, topk_out=None, w_out=None, *, K=0,
         expert_lo=0, num_local=0, pos_out=None):
    """Row i to output row d (the int32 at pos_off, or i), skipped outside [0, len(x_out)); ids made
    local to [expert_lo, expert_lo + num_local) (else -1), weights of other experts 0."""
    _count("land")
    rows = _rows_at(rows_addr, n, row_stride)
    xb = x_out.shape[1] * x_out.element_size()
    sb = s_out.shape[1] * 4 if s_out is not None else 0
    for i in range(n):
        r = rows[i]
        d = i if pos_off < 0 else int(_word(r, pos_off, torch.int32)[0])
        if pos_out is not None:
            pos_out[i] = d
        if not 0 <= d < x_out.shape[0]:
            continue
        x_out.view(torch.uint8).view(x_out.shape[0], -1)[d] = r[:xb]
        if s_out is not None:
            s_out[d] = _word(r[:xb + sb], xb, torch.float32)
        if src_out is not None:
            src_out[d] = _word(r, xb + sb, torch.int32)[0]
        if topk_out is not None:
            at = xb + sb + 4
            ids = _word(r[:at + 8 * K], at, torch.int64)
            local = ids - expert_lo
            keep = (ids >= 0) & (local >= 0) & (local < num_local)
            topk_out[d] = torch.where(keep, local, torch.full_like(local, -1))
            if w_out is not None:
                ws = _word(r[:at + 12 * K], at + 8 * K, torch.float32)
                w_out[d] = torch.where(keep, ws, torch.zeros_like(ws))


def rows(pos, n, y, w, out_addr, out_stride, sync=None, max_ctas=None):
    """out row j = y row d | w row d, d = pos[j] (or j); ``sync`` (the node barrier's pieces) and
    ``max_ctas``: the stand-in forwarder lines its ranks up itself (its gathers), no grid here."""
    _count("rows")
    out = _rows_at(out_addr, n, out_stride)
    yb = _u8(y)
    wb = _u8(w) if w is not None else None
    for j in range(n):
        d = int(pos[j]) if pos is not None else j
        out[j, :yb.shape[1]] = yb[d]
        if wb is not None:
            out[j, yb.shape[1]:yb.shape[1] + wb.shape[1]] = wb[d]


def home(back, slot, biases, out_y, out_w, *, H, K):
    """Token t: float32 from +0, the biases, then back rows slot[t, m] >= 0 in node order; one bf16
    rounding. Weights: their float32 sum from 0."""
    _count("home")
    T, M = slot.shape
    for t in range(T):
        acc = torch.zeros(H, dtype=torch.float32)
        for b in biases:
            acc = acc + b[t].float()
        acc_w = torch.zeros(K, dtype=torch.float32)
        for m in range(M):
            s = int(slot[t, m])
            if s < 0:
                continue
            acc = acc + _word(back[s, :2 * H], 0, torch.bfloat16).float()
            if K:
                acc_w = acc_w + _word(back[s, :2 * H + 4 * K], 2 * H, torch.float32)
        out_y[t] = acc.to(torch.bfloat16)
        if K:
            out_w[t] = acc_w


class Forwarder:
    """node.ForwarderNode's contract on CPU ranks: each local rank's landed chunk reaches every rank
    of the node (the node group's all-gather), which stores the rows whose position for it is set at
    that row of its area; combine sums, per landed row, the local ranks' rows at its positions in
    ascending local rank from +0 (float32, one bf16 rounding; weights float32). A windowed dispatch
    (``window_rows`` > 0 and fewer than the rows to land): the area holds 2 x window_rows rows, and a
    window [lo, hi) stores only positions in it, at area row at + pos - lo."""

    name = "kernel"
    in_area = True
    gpu_share = 1

    def __init__(self, group, loc: int, P: int, window_rows: int = 0) -> None:
        self.group, self.loc, self.P = group, loc, P
        self.area = torch.empty(0, dtype=torch.uint8)
        self.Wd = 16
        self._peers = None
        self.window_rows = window_rows
        self.windows = 0   # windows landed since made (a case checks that several ran)

    def _reserve(self, rows: int, row_bytes: int) -> None:
        if rows * row_bytes > self.area.numel():
            _AREAS.pop(self.area.data_ptr(), None)
            self.area = torch.full((rows * row_bytes,), STALE, dtype=torch.uint8)
            _AREAS[self.area.data_ptr()] = self.area

    def _gather(self, t: torch.Tensor) -> list:
        out = [torch.empty_like(t) for _ in range(self.P)]
        dist.all_gather(out, t.contiguous(), group=self.group)
        return out

    def dispatch_begin(self, plan, W, packer):
        self.Wd = -(-W // 16) * 16
        self._reserve(plan.node_rows, plan.area_row)

    def windows_begin(self, plan, W):
        self.Wd = -(-W // 16) * 16
        n, win = plan.num_recv, self.window_rows
        if not win or win >= n:
            self._reserve(plan.node_rows, plan.area_row)
            return max(n, 1)
        self._reserve(2 * win, self.Wd)
        return win

    def dispatch_chunk(self, k, landed, plan, W, cached, hi=None):
        P = self.P
        if not cached:
            plan.landed_pos.append(landed[:, W:W + 4 * P].clone().view(torch.int32))
        self._store(landed, W, 0, hi, 0)

    def dispatch_window(self, landed, W, lo, hi, at):
        self._store(landed, W, lo, hi, at)

    def _store(self, landed, W, lo, hi, at):
        area = self.area[:(self.area.numel() // self.Wd) * self.Wd].view(-1, self.Wd)
        self.windows += 1
        for got in self._gather(landed):
            pos = got[:, W + 4 * self.loc:W + 4 * self.loc + 4].clone().view(torch.int32).flatten()
            for j in range(got.shape[0]):
                d = int(pos[j])
                if d >= lo and (hi is None or d < hi):
                    area[at + d - lo, :W] = got[j, :W]

    def finish_forward(self) -> None:
        pass

    def address(self) -> tuple:
        return self.area.data_ptr(), self.Wd

    def combine_begin(self, rows_fn, plan, row_bytes):
        self.Wd = -(-row_bytes // 16) * 16
        self._reserve(plan.node_rows, plan.area_row)
        rows_fn(self.area.data_ptr(), self.Wd, None)
        self._peers = [a[:(a.numel() // self.Wd) * self.Wd].view(-1, self.Wd) for a in self._gather(self.area)]

    def combine_chunk(self, k, plan, packer, H, K, out=None):
        pos = plan.landed_pos[k]
        J = pos.shape[0]
        if out is None:
            out = torch.empty(J, 2 * H + 4 * K, dtype=torch.uint8)
        for j in range(J):
            acc = torch.zeros(H, dtype=torch.float32)
            acc_w = torch.zeros(K, dtype=torch.float32)
            for p in range(self.P):
                d = int(pos[j, p])
                if d < 0:
                    continue
                row = self._peers[p][d]
                acc = acc + _word(row[:2 * H], 0, torch.bfloat16).float()
                if K:
                    acc_w = acc_w + _word(row[:2 * H + 4 * K], 2 * H, torch.float32)
            out[j, :2 * H] = acc.to(torch.bfloat16).view(torch.uint8)
            if K:
                out[j, 2 * H:2 * H + 4 * K] = acc_w.view(torch.uint8)
        return out

    def close(self) -> None:
        _AREAS.pop(self.area.data_ptr(), None)


@contextlib.contextmanager
def installed():
    """The kernels the route launches replaced by the stand-ins above, for the block's duration."""
    saved = {name: getattr(IK, name) for name in ("pack", "land", "rows", "home")}
    for name in saved:
        setattr(IK, name, globals()[name])
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(IK, name, fn)


def use_forwarder(buf, window_rows: int = 0) -> Forwarder:
    """Give ``buf``'s internode engine the stand-in forwarder on its node group, with its kernel
    steps on (a CPU world has neither): only num_worst_tokens calls may follow (the other paths'
    kernels have no stand-ins). ``window_rows``: rows per window of a dispatch (0: one window)."""
    be = buf.backend
    topo = be.topology
    fw = Forwarder(be.node_group, topo.local_rank, topo.ranks_per_node, window_rows)
    be.node = be.wiring.node = fw
    be.device_steps = True
    return fw
