"""The device operations one call of the internode engine's kernel path issues (launches, copies,
allocations, event ops, collectives), counted by the probe on CPU without a GPU: the kernels'
launches, the collectives and their stream waits are stand-ins that report what the real ones do
(their own torch work hidden from the count), the engine's torch work is counted as it is. The
counts are the issue's budget: a non-cached dispatch <= 20, a cached dispatch and a combine <= 10,
one more per extra network chunk (one rank per node); with the forwarder kernel (2 x 2) the
barriers, the forward / reduce launches and the landed positions come on top."""
from __future__ import annotations

import ctypes
import math

import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes

from commlib import Config, layout as L
from commlib.backends.base import CombineRequest, DispatchRequest
from commlib.backends.internode import device
from commlib.backends.internode.exchange import N_SIG, exchange_digest, exchange_row
from commlib.backends.internode.network import NetworkStep, RailStep, stream
from commlib.backends.internode.node import ForwarderNode, LocalNode
from commlib.backends.internode.wiring import Wiring
from commlib.backends.probe import RecordingProbe
from commlib.cuda import loader
from commlib.topology import Topology
from commlib.utils.dist import direct_collective

T, H, K, E_PER_RANK = 64, 256, 4, 4
SIG = list(range(1, N_SIG))


class _LoopNet(NetworkStep):
    """NCCL's grouped all-to-all as the engine sees it (RailStep): one collective per post, one stream
    wait per land, none where ``stream`` let the chunks run on the current stream (``sync``)."""

    ordered = True
    two_streams = True   # as RailStep with NCCL: a cached dispatch's chunks on two streams, a fork and a join

    def __init__(self, probe) -> None:
        self.probe = probe

    def fork(self):
        self.probe.op("event_ops")

    def join(self):
        self.probe.op("event_ops")

    def use(self, side):
        pass

    def done(self):
        pass

    def post(self, send, send_splits, recv_splits, out=None):
        self.probe.op("collectives")
        if out is None:   # RailStep allocates the landing rows where the caller gives none
            out = torch.empty(sum(recv_splits), *send.shape[1:], dtype=send.dtype, device=send.device)
        return out

    def land(self, posted, what):
        if not self.sync:
            self.probe.op("event_ops")
        return posted


class _Fan:
    """NodeFanout's host side with nothing behind it (the launches are counted by ForwarderNode)."""

    capacity, local_rank = 0, 0

    def reserve(self, rows, row_bytes):
        self.capacity = max(self.capacity, rows * row_bytes)

    def barrier(self):
        pass

    def forward(self, landed, W, row_bytes, window=None, pos_out=None, sync=0):
        pass

    def reduce(self, pos, H, K, out, row_bytes, sync=0):
        pass

    def data_address(self):
        return 0

    # the launch specs kept calls issue (through the patched loader.launch): a spec per launch
    def barrier_spec(self):
        return ("fanout", "barrier", 1, 32, [0] * 5, 0)

    def forward_spec(self, landed, W, row_bytes, window=None, pos_out=None, sync=0):
        return ("fanout", "forward", 1, 32, [0] * 15, 0) if landed.shape[0] or sync else None

    def reduce_spec(self, pos, H, K, out, row_bytes, sync=0):
        return ("fanout", "reduce", 1, 32, [0] * 14, 0) if pos.shape[0] or sync else None

    def sync_args(self, sync):
        return [0, 0, 2, 0, 0, sync]

    def grid(self, J):
        return 1


def _at(addr: int, shape: tuple, dtype) -> torch.Tensor:
    """The host tensor at a kernel argument's address (what a stand-in reads and writes)."""
    n = math.prod(shape) * dtype.itemsize
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer((ctypes.c_byte * n).from_address(addr), dtype=dtype).view(shape)


def _launch(family, name, grid, block, args, shared_mem=0, variant_key=None):
    """The kernels' launches: their torch specs where the host reads what they write (meta's row, the
    digest), nothing elsewhere; their own torch work hidden from the count."""
    with _disable_current_modes():
        if name == "inter_meta_kernel":
            tir, topk, experts_in, head, n_head, T, R, M, P, E, K, Kc, ring, max_nodes, row, _, _ = args
            row_t = exchange_row(_at(head, (n_head,), torch.int64), _at(tir, (T, R), torch.bool),
                                 _at(topk, (T, K), torch.int64) if topk else None,
                                 _at(experts_in, (E,), torch.int32) if experts_in else None,
                                 M=M, P=P, E=E, Kc=Kc, ring=ring, max_nodes=max_nodes)[0]
            _at(row, (row_t.numel(),), torch.int64).copy_(row_t)
        elif name == "inter_digest_kernel":
            g, n_row, n_sig, me, node, loc, R, M, P, Kc, ring, Lx, out = args
            d = exchange_digest(_at(g, (R, n_row), torch.int64), n_sig=n_sig, me=me, node=node, loc=loc, M=M, P=P,
                                Kc=Kc, ring=ring, Lx=Lx)
            _at(out, (d.numel(),), torch.int64).copy_(d)


@pytest.fixture
def kernels(monkeypatch):
    """Every launch through the stand-in (``_launch``): the engine's kept launches (kept.keep) issue
    through loader.launch where there is no driver."""
    monkeypatch.setattr(loader, "launch", _launch)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)   # no CUDA here


def _wiring(M: int, P: int, Kc: int, probe) -> Wiring:
    topo = Topology(rank=0, num_ranks=M * P, ranks_per_node=P)
    if P == 1:
        node = LocalNode(None, 0, 1, torch.device("cpu"), None)
    else:
        node = ForwarderNode.__new__(ForwarderNode)
        node.fan, node.P, node.device, node.probe, node.Wd = _Fan(), P, torch.device("cpu"), probe, 0
        node.budget, node._told = 1 << 40, False

    def gather(row, out=None):   # every rank's row equal to this one (a symmetric world); on the current stream
        probe.op("collectives")
        with _disable_current_modes():
            out = out.view(topo.num_ranks, -1)
            out.copy_(row.view(1, -1).expand_as(out))
        return out
    return Wiring(topology=topo, device=torch.device("cpu"), nccl=True, network=_LoopNet(probe), node=node,
                  probe=probe, counters={"internode_rows": 0, "intranode_rows": 0, "local_rows": 0}, max_chunks=Kc,
                  max_nodes=8, gather=gather, gather_into=lambda row, out: gather(row, out), phase=lambda what: None)


def _calls(M: int, P: int, Kc: int, config, default_device=None) -> dict:
    """Device operations of a dispatch, a cached dispatch and a combine (each the second call of its
    kind); ``default_device``: torch's default device while the engine runs (inputs made before)."""
    probe = RecordingProbe(count_ops=True, copy=torch.Tensor.clone)   # the read: one copy, as on a GPU
    w = _wiring(M, P, Kc, probe)
    R, E = M * P, E_PER_RANK * M * P
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    idx = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
    wts = torch.rand(T, K, generator=gen)
    lay = L.dispatch_layout(idx, E, w.topology)
    head = device.HeadRow()
    req = DispatchRequest(x, None, idx, wts, lay, None, E, 1, 0, config)
    counts = {}
    comb_rows = torch.zeros(T * M * P, H, dtype=torch.bfloat16), torch.zeros(T * M * P, K)
    if default_device is not None:
        torch.set_default_device(default_device)
    try:
        return _run(w, head, probe, req, x, config, counts, comb_rows)
    finally:
        if default_device is not None:
            torch.set_default_device(None)


def _run(w, head, probe, req, x, config, counts, comb_rows) -> dict:
    def counted(name, fn):
        fn()
        head.released()
        with probe.call(name):
            out = fn()
        head.released()
        counts[name] = probe.last_ops()
        return out
    scratch = device.Scratch()
    res = counted("dispatch", lambda: device.dispatch(w, head, scratch, req, SIG, 1, "internode"))
    plan = res.handle.extra["plan"]
    cached = DispatchRequest(x, None, None, None, None, res.handle, 0, 1, 0, config)
    counted("cached dispatch", lambda: device.dispatch_cached(w, cached, plan))
    comb = CombineRequest(comb_rows[0][:plan.num_recv], res.handle, comb_rows[1][:plan.num_recv], [], config)
    counted("combine", lambda: device.combine(w, comb, plan))
    counts["chunks"] = plan.num_chunks
    return counts


ONE_ROW_RING = Config(2, 4, 8, 1, 2)   # one row per chunk slot: the chunk cap decides the chunks


def test_one_rank_per_node_meets_the_budget(kernels):
    c = _calls(2, 1, 1, ONE_ROW_RING)
    assert c["chunks"] == 1
    assert c["dispatch"]["total"] <= 20, c["dispatch"]
    assert c["cached dispatch"]["total"] <= 10, c["cached dispatch"]
    assert c["combine"]["total"] <= 10, c["combine"]
    assert c["dispatch"]["collectives"] == 2 and c["combine"]["collectives"] == 1, c


def test_each_extra_chunk_costs_one_collective(kernels):
    one, four = _calls(2, 1, 1, ONE_ROW_RING), _calls(2, 1, 4, ONE_ROW_RING)
    assert four["chunks"] == 4
    for op in ("dispatch", "cached dispatch", "combine"):
        extra = {k: four[op][k] - one[op][k] for k in one[op]}
        assert extra["total"] == 3 and extra["collectives"] == 3, (op, one[op], four[op])


def test_forwarder_path_counts(kernels):
    """2 x 2 through the forwarder: the same budget at one chunk (the two barriers and the forward /
    reduce launch inside it, the collective on the current stream); with more chunks, so that the node
    step of one overlaps the next on the wire, per extra chunk: a dispatch's (fresh or cached) collective
    and forward, each chunk on one of two streams, and the side stream's fork and join once; a combine's
    reduce and collective, and the wait for the last. Within the budget at four chunks (one more per extra
    chunk): a dispatch 20 of 23, a cached dispatch 13 of 13, a combine 12 of 13."""
    one, three, four = (_calls(2, 2, k, ONE_ROW_RING) for k in (1, 3, 4))
    assert one["chunks"] == 1 and three["chunks"] == 3 and four["chunks"] == 4
    assert one["dispatch"]["total"] <= 20, one["dispatch"]
    assert one["cached dispatch"]["total"] <= 10 and one["combine"]["total"] <= 10, one
    for op in ("dispatch", "cached dispatch", "combine"):
        assert one[op]["event_ops"] == 0, (op, one[op])
    for op, per_chunk, once in (("dispatch", 2, 2), ("cached dispatch", 2, 2), ("combine", 2, 1)):
        assert three[op]["total"] - one[op]["total"] == 2 * per_chunk + once, (op, one[op], three[op])
        assert four[op]["total"] - one[op]["total"] == 3 * per_chunk + once, (op, one[op], four[op])
        assert four[op]["total"] <= (20 if op == "dispatch" else 10) + 3, (op, four[op])
    for op in ("dispatch", "cached dispatch"):
        assert three[op]["event_ops"] == four[op]["event_ops"] == 2, (op, three, four)
    # the landed rows' positions (combine's sources) are stored by the forward kernel: no copy beside the
    # one rank per node path's (the digest's read)
    local = _calls(2, 1, 1, ONE_ROW_RING)
    assert one["dispatch"]["copies"] == three["dispatch"]["copies"] == local["dispatch"]["copies"], (one, three)


@pytest.mark.parametrize("P", [1, 2])
def test_kernel_path_names_every_device(kernels, P):
    """The kernel path under ``torch.set_default_device("meta")``: a tensor it made without naming its
    device would land on meta and fail (DeepEP's tests run with a CUDA default device)."""
    assert _calls(2, P, 2, ONE_ROW_RING, default_device="meta") == _calls(2, P, 2, ONE_ROW_RING)


def test_forwarder_area_beyond_num_nvl_bytes_warns_once():
    """The forwarder's landing areas stand for the Buffer's num_nvl_bytes: growing past it warns, once."""
    from commlib.backends.internode.geometry import Plan
    node = ForwarderNode.__new__(ForwarderNode)
    node.fan, node.P, node.device, node.probe, node.Wd = _Fan(), 2, torch.device("cpu"), RecordingProbe(), 0
    node.budget, node._told = 1000, False
    import warnings
    told = []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for rows in (10, 20, 40):   # 960 bytes fit; 1920 and 3840 do not
            node._reserve(Plan(path="device", num_chunks=1, num_recv=rows, area_row=96, node_rows=rows))
            told.append(sum("exceeds the Buffer's num_nvl_bytes" in str(w.message) for w in seen))
    assert told == [0, 1, 1], told


class _Group:
    """A process group's all-to-all as ``direct_collective`` finds it (loopback rows): records each
    call's asyncOp; an async call returns a work whose waits are counted, a sync one none (torch's
    NCCL runs it on the current stream)."""

    def __init__(self) -> None:
        self.modes, self.waits = [], 0

    def alltoall_base(self, out, inp, out_splits, in_splits, opts):
        self.modes.append(opts.asyncOp)
        out.copy_(inp)
        if not opts.asyncOp:
            return None
        group = self

        class _Work:
            def wait(self) -> None:
                group.waits += 1
        return _Work()


@pytest.mark.parametrize("n, node_step, sync", [(1, "after", True), (3, None, True), (3, "after", False),
                                                (3, "before", False), (1, "before", True)])
def test_rail_chunks_on_the_current_stream_where_nothing_overlaps(n, node_step, sync):
    """The rail all-to-all runs on the current stream (no work, no wait) where no node step would
    overlap a chunk on the wire; else on the group's stream, each chunk waited for as the node step
    needs it (``before``: the last only, NCCL being ordered)."""
    group = _Group()
    if direct_collective(group, "all_to_all_single", async_op=False) is None:
        pytest.skip("this torch's AllToAllOptions has no asyncOp")
    net = RailStep(group, lambda work, what: work.wait(), RecordingProbe(), True, 0)
    send = torch.arange(12, dtype=torch.float32).view(6, 2)
    landed = []
    hooks = {"after": dict(after=lambda k, rows: landed.append(k)), "before": dict(before=lambda k: None)}
    stream(net, n, lambda k: net.post(send, [3, 3], [3, 3]), "dispatch", **hooks.get(node_step, {}))
    assert group.modes == [not sync] * n
    assert group.waits == (0 if sync else n if node_step == "after" else 1)
    assert landed == (list(range(n)) if node_step == "after" else [])
