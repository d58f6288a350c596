"""The internode engine on the device over NCCL, against the reference backend (tests/cases_internode.py).

Every rank is its own emulated host (its own NCCL_HOSTID), so processes sharing one GPU run NCCL
between them over its socket transport: correctness only, never timing (the GPU is time-sliced).
2 ranks: 2 nodes x 1; 4 ranks: 2 x 2 and 4 x 1 as commlib sees them (2 x 2: the forwarder kernel
passes rows between the two local ranks over CUDA IPC, both processes on the one GPU).
"""
import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]

CASES = {
    2: ["matches_reference", "callpath", "callpath_dispatch", "chunk_boundaries", "without_topk", "worst_no_read", "random_stalls", "bad_expert_ids",
        "no_host_sync", "graph_capture", "default_device_meta", "random_routings", "host_ahead_memory"],
    4: ["matches_reference", "callpath", "callpath_dispatch", "worst_no_read", "random_stalls", "no_host_sync", "graph_capture", "default_device_meta",
        "random_routings", "host_ahead_memory"],
}


@pytest.mark.parametrize("world_size", sorted(CASES))
def test_internode_matches_reference(world_size):
    from worlds import run_world
    os.environ.setdefault("COMMLIB_TIMEOUT_S", "120")
    os.environ["INTERNODE_TEST_ROUNDS"] = os.environ.get(f"INTERNODE_TEST_ROUNDS_{world_size}",
                                                      "1000" if world_size == 2 else "100")
    names = CASES[world_size]
    only = os.environ.get("COMMLIB_TEST_CASES")   # a comma list: those cases only
    if only:
        names = [n for n in names if n in only.split(",")]
    results = run_world(world_size, "cases_internode", names, use_gpu=True, group_backend="nccl",
                        emulate_hosts=True, ranks_per_node=1, timeout_s=900, case_timeout_s=600)
    failed = {k: v for k, v in results.items() if v is not None}
    assert not failed, "\n".join(f"{k}:\n{v}" for k, v in failed.items())


def test_internode_worst_windows():
    """num_worst_tokens dispatches landed a few final rows per forwarder window (2 x 2: the forwarder
    kernel between the two local ranks; cases_internode.worst_windows) against the reference."""
    from worlds import run_world
    os.environ.setdefault("COMMLIB_TIMEOUT_S", "120")
    results = run_world(4, "cases_internode", ["worst_windows"], use_gpu=True, group_backend="nccl",
                        emulate_hosts=True, ranks_per_node=1, timeout_s=300, case_timeout_s=240)
    assert results["worst_windows"] is None, results["worst_windows"]


def test_internode_worst_mode_stops_on_bad_ids(capfd):
    """num_worst_tokens (no host read) with an expert id out of range on one rank: every rank stops on
    the engine's device-side assert (the NCCL watchdog then ends the process), nothing hangs and no
    rank returns rows."""
    from commlib.utils.launch import parallel_launch
    from worlds import _worker
    os.environ.setdefault("COMMLIB_TIMEOUT_S", "60")
    with pytest.raises(RuntimeError) as failed:
        parallel_launch(2, _worker, "cases_internode", ["worst_device_assert"], 60.0, 15.0, use_gpu=True,
                        group_backend="nccl", emulate_hosts=True, ranks_per_node=1, timeout_s=90)
    text = str(failed.value)
    assert "timed out" not in text and "died" in text, text[-2000:]
    out = capfd.readouterr()
    assert "Assertion `commlib internode dispatch (num_worst_tokens)" in out.err + out.out, (out.err + out.out)[-3000:]


@pytest.mark.parametrize("M,P,Kc,E,ring", [(2, 1, 1, 256, 1), (2, 2, 4, 64, 3), (4, 2, 2, 32, 1000),
                                           (8, 8, 4, 256, 7), (32, 8, 4, 256, 64)])
def test_digest_kernel_matches_its_spec(M, P, Kc, E, ring):
    """The digest kernel (one launch after the count exchange) against exchange_digest, its torch spec
    (itself held to a plain-Python read of the whole rows in tests/test_internode_kernels.py), for every
    rank, with each kind of error set in one rank's row, up to 256 ranks."""
    from commlib.backends.internode import kernels as IK
    from commlib.backends.internode.exchange import exchange_digest
    from commlib.buffer import _cupy_available
    if not _cupy_available():
        pytest.skip("the kernels load through CuPy")
    gen = torch.Generator().manual_seed(M * 100 + P)
    R, n_sig, Lx = M * P, 13, E // (M * P)
    g = torch.randint(0, 5000, (R, n_sig + R + 2 + M + M * Kc * P + E + 1), generator=gen, dtype=torch.int64)
    g[:, 0], g[:, 1:n_sig], g[:, n_sig + R:n_sig + R + 2], g[:, n_sig + R + 2] = 0, torch.arange(1, n_sig), 0, 0
    variants = [g]
    for col, value in [(0, 1), (4, 99), (n_sig + R, 2), (n_sig + R + 1, 1)]:
        bad = g.clone()
        bad[R // 2, col] = value
        variants.append(bad)
    for rows in variants:
        rows = rows.cuda()
        for me in sorted({0, 1 % R, R // 2, R - 1}):
            kw = dict(n_sig=n_sig, me=me, node=me // P, loc=me % P, M=M, P=P, Kc=Kc, ring=ring, Lx=Lx)
            out = torch.full((IK.digest_len(M, P, Kc, Lx),), -7, dtype=torch.int64, device="cuda")
            IK.digest(rows, out, **kw)
            assert out.tolist() == exchange_digest(rows, **kw).tolist(), (me, rows[R // 2, :n_sig + R + 2].tolist())
