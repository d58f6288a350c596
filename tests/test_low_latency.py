"""Low-latency (decode) mode: reference transport vs an independent oracle, 2 and 4 CPU ranks; the
nvlink engine's host-side logic (LogFMT around the kernel, wait-time stats, masks) with stand-ins."""
import types

import pytest
import torch

from commlib.backends.low_latency.nvlink import RECV, SEND, NVLinkLowLatency, logfmt_launch_slots
from commlib.backends.low_latency.reference import rank_grouped_sum
from worlds import run_world

CASES = ["bf16", "fp8", "errors", "hook_halves", "roll_call"]


@pytest.mark.parametrize("world_size", [2, 4])
def test_low_latency(world_size):
    results = run_world(world_size, "cases_low_latency", CASES, timeout_s=600)
    failed = {k: v for k, v in results.items() if v}
    assert not failed, "\n\n".join(f"--- {k} ---\n{v}" for k, v in failed.items())


# ------------------------------------------------------------------ nvlink engine's host-side logic (no GPU)
def _routing(seed, T, K, R, L):
    g = torch.Generator().manual_seed(seed)
    idx = torch.rand(T, R * L, generator=g).topk(K, dim=1).indices
    idx[torch.rand(T, K, generator=g) < 0.2] = -1
    if T > 2:
        idx[1, 1] = max(int(idx[1, 0]), 0)                   # a repeated expert
        idx[2] = -1                                          # a token with no expert
    return idx


@pytest.mark.parametrize("R, L, K", [(2, 4, 4), (4, 2, 8), (8, 3, 2), (3, 1, 3)])
def test_logfmt_launch_slots(R, L, K):
    T = 11
    idx = _routing(R * 100 + K, T, K, R, L)
    launches = logfmt_launch_slots(idx, L, R)
    assert len(launches) == min(R, K)
    seen = torch.zeros_like(idx, dtype=torch.int64)
    for j, (slots, has) in enumerate(launches):
        kept = slots >= 0
        seen += kept
        assert torch.equal(slots[kept], idx[kept])           # a slot keeps its expert
        ranks = torch.where(kept, slots // L, torch.full_like(slots, -1))
        for t in range(T):
            mine = sorted({int(d) for d in ranks[t] if d >= 0})
            assert len(mine) <= 1                            # one expert rank per token and launch
            want = sorted({int(e) // L for e in idx[t] if e >= 0})
            assert bool(has[t]) == (len(want) > j)
            assert mine == ([want[j]] if len(want) > j else [])   # the j-th rank, in ascending order
    assert torch.equal(seen, (idx >= 0).to(torch.int64))     # every valid slot in exactly one launch


@pytest.mark.parametrize("R, L, K, scale", [(2, 4, 4, 1 / 64), (4, 2, 8, 1 / 16), (4, 2, 8, 4.0), (8, 1, 8, 1 / 8)])
def test_logfmt_combine_is_the_references(R, L, K, scale):
    """combine_logfmt around a stand-in for the kernel (what it computes: the rank-grouped bf16 sum,
    rank_grouped_sum without LogFMT, for the slots it is given) equals the reference's LogFMT combine
    bit for bit."""
    T, H = 9, 256
    idx = _routing(R + K, T, K, R, L)
    g = torch.Generator().manual_seed(7)
    vals = (torch.randn(T, K, H, generator=g) * scale).to(torch.bfloat16).float()
    vals[0, :, :128] = 0                                    # a zero block
    vals[3, 0, 128:] *= 64                                  # a block >= 1: travels as bf16
    w = torch.rand(T, K, generator=g)
    launches = []

    def kernel(phases, slots, into):
        launches.append((phases, slots.clone()))
        into.copy_(rank_grouped_sum(vals, slots, w, L, R))

    fake = types.SimpleNamespace(num_ranks=R, codec_device=lambda: torch.device("cpu"))
    result = torch.empty(T, H, dtype=torch.bfloat16)
    NVLinkLowLatency.combine_logfmt(fake, kernel, idx, L, result)
    want = rank_grouped_sum(vals, idx, w, L, R, logfmt=True)
    assert torch.equal(result.view(torch.int16), want.view(torch.int16))
    assert len(launches) == min(R, K) and all(p == SEND | RECV for p, _ in launches)
    # LogFMT changed something (encoded blocks), so the check above could fail
    if scale < 1:
        assert not torch.equal(want, rank_grouped_sum(vals, idx, w, L, R))


def test_nvlink_wait_stats_and_masks_on_the_host(monkeypatch):
    fake = types.SimpleNamespace(rank=1, device=torch.device("cuda", 0))

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing

        def record(self, stream):
            pass

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return 0.0123456    # ms

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    ran = []
    stats = torch.tensor([5, 0, 7], dtype=torch.int64)
    NVLinkLowLatency._timed(fake, stats, lambda: ran.append(1))
    assert ran == [1] and stats.tolist() == [5 + 12346, 12346, 7 + 12346]   # ns, to every source
    NVLinkLowLatency._timed(fake, None, lambda: ran.append(2))
    assert ran == [1, 2]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(ValueError, match="capturing"):
        NVLinkLowLatency._check_stats(fake, stats)
    NVLinkLowLatency._check_stats(fake, None)


def test_nvlink_device_mask_on_the_host(monkeypatch):
    """Shrink mode's mask for the kernels: None without shrink mode; a masked caller masks every rank;
    a rank masked earlier cannot be unmasked before the resync (barrier); the mask is not copied while
    hooks are pending or inside a capture."""
    def engine(rank):
        return types.SimpleNamespace(rank=rank, num_ranks=4, _mask_dev=torch.zeros(4, dtype=torch.int32),
                                     _mask_host=torch.zeros(4, dtype=torch.int32), _masked_seen=set(),
                                     _pending={"dispatch": [], "combine": []})

    def dm(e, bits):
        m = NVLinkLowLatency._device_mask(e, None if bits is None else torch.tensor(bits, dtype=torch.int32))
        return None if m is None else m.tolist()

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    e = engine(1)
    assert dm(e, None) is None
    assert dm(e, [0, 0, 0, 0]) == [0, 0, 0, 0]
    assert dm(e, [0, 0, 0, 1]) == [0, 0, 0, 1]
    assert dm(e, [0, 0, 1, 1]) == [0, 0, 1, 1]                   # more ranks masked: fine
    with pytest.raises(ValueError, match=r"rank\(s\) \[2, 3\] were masked"):
        dm(e, [0, 0, 0, 0])
    e._masked_seen = set()                                       # what barrier() does after the resync
    assert dm(e, [0, 0, 0, 0]) == [0, 0, 0, 0]
    assert dm(engine(3), [0, 0, 0, 1]) == [1, 1, 1, 1]           # the masked rank itself: moves nothing
    e = engine(0)
    e._pending["dispatch"].append(7)
    assert dm(e, [0, 0, 0, 0]) == [0, 0, 0, 0]                   # unchanged: no copy, pending hooks or not
    with pytest.raises(ValueError, match="hooks are pending"):
        dm(e, [0, 1, 0, 0])
    e._pending["dispatch"].clear()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert dm(e, [0, 0, 0, 0]) == [0, 0, 0, 0]                   # unchanged: fine inside a capture
    with pytest.raises(ValueError, match="capture"):
        dm(e, [0, 1, 0, 0])
