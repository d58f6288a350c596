"""Stand-ins for the NVLink engine's device side, so its host path runs on a CPU-only machine: a
backend built without CUDA, kernel launches recorded (their arguments checked against the kernels'
C signatures), the host words the notify kernel would write. Used by tests/gpu/test_gpu_reliability.py
(its CPU-side part) and tests/test_callpath.py."""
import ctypes
import struct
import types

import torch


class FakeTopology:
    def __init__(self, rank, num_ranks):
        self.rank, self.num_ranks, self.num_nodes = rank, num_ranks, 1
        self.ranks_per_node = num_ranks


def fake_backend(rank=0, R=2):
    from commlib.backends.nvlink.engine import NVLinkBackend
    from commlib.cuda import loader as K

    be = NVLinkBackend.__new__(NVLinkBackend)
    be.topology = FakeTopology(rank, R)
    be.counters = {"internode_rows": 0, "intranode_rows": 0, "local_rows": 0}
    be.rank, be.num_ranks, be.device = rank, R, torch.device("cpu")
    be._dev_index = -1   # Tensor.get_device() of a CPU tensor
    be.failed, be._base = None, 1
    be.num_bytes, be.region_bytes = 1 << 26, 1 << 25
    be.part_bytes, be._ring_channels = (1 << 26) // R, None   # the rings' staging per source rank
    be.peer_bases = torch.zeros(R, dtype=torch.int64)
    be.seq_counters = torch.zeros(3 * 2 * 128, dtype=torch.int64)
    be.timeout_ns = 10**9
    be._smids, be._smid_slots = None, 1
    be._smid_count = {"notify": 0, "dispatch": 0, "combine": 0}
    be._smid_grids = {kind: [0] for kind in be._smid_count}
    be._ce = None  # COMMLIB_CE_BYTES unset: the SM data kernels
    be.ctx = types.SimpleNamespace(out_stream=None, comm_stream=None)
    be._out, be._blocks, be.last_wait_ns = None, [], 0
    be.init_host_words(K.notify_slot_words(R), pinned=False)
    return be


class Calls(list):
    """(kernel, args) per launch; .builds: (kernel, grid, variant_key) per launch."""

    def __init__(self) -> None:
        super().__init__()
        self.builds = []


def mock_launch(monkeypatch, on_notify=None, fail=False):
    from commlib.cuda import loader as K

    calls = Calls()
    builds = calls.builds  # (kernel, grid, variant_key) per launch

    def launch(family, name, grid, block, args, shared_mem=0, variant_key=None):
        codes = K.kernel_signature(family, name)
        assert len(args) == len(codes), f"{name}: {len(args)} arguments, the kernel takes {len(codes)}"
        struct.pack("@" + codes, *[int(a) for a in args])  # every value fits its C type
        if fail:
            from commlib.utils.errors import KernelLaunchError
            raise KernelLaunchError("cuLaunchKernel failed: CUDA_ERROR_ILLEGAL_INSTRUCTION (715)", 715)
        calls.append((name, list(args)))
        builds.append((name, grid, variant_key))
        if name == "notify_kernel" and on_notify is not None:
            on_notify(list(args))

    monkeypatch.setattr(K, "launch", launch)
    return calls


def dispatch_req(T=8, H=256, E=8, Kk=2, fp8=False, num_sms=4, worst=0):
    from commlib.backends.base import DispatchRequest
    from commlib.config import Config
    from commlib.layout import Layout

    x = torch.zeros(T, H, dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16)
    scales = torch.ones(T, H // 128) if fp8 else None
    idx = torch.zeros(T, Kk, dtype=torch.int64)
    w = torch.ones(T, Kk)
    lay = Layout(torch.zeros(2, dtype=torch.int32), None, torch.zeros(E, dtype=torch.int32),
                 torch.zeros(T, 2, dtype=torch.bool))
    return DispatchRequest(x, scales, idx, w, lay, None, E, 1, worst, Config(num_sms, 8, 64, 64, 1024))


def fill_counts(args, values: dict):
    """Write host_counts the way notify.cu would (args[10] = host_counts pointer, CPU tensor), then
    raise the host flag (the last two arguments: its address and the call's value)."""
    from commlib.cuda import loader as K

    n = K.HOST_COUNTS_EXPERT
    words = (ctypes.c_int32 * n).from_address(int(args[10]))
    for i in range(n):
        words[i] = 0
    words[K.HOST_COUNTS["bad_rank"]] = -1
    words[K.HOST_COUNTS["sig_rank"]] = -1
    for k, v in values.items():
        if isinstance(v, list):
            for j, x in enumerate(v):
                words[K.HOST_COUNTS[k] + j] = x
        else:
            words[K.HOST_COUNTS[k]] = v
    if int(args[-2]):
        ctypes.c_int64.from_address(int(args[-2])).value = int(args[-1])
