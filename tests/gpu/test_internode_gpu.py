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
    2: ["matches_reference", "chunk_boundaries", "without_topk", "worst_no_read", "random_stalls", "bad_expert_ids",
        "no_host_sync", "graph_capture", "random_routings"],
    4: ["matches_reference", "worst_no_read", "random_stalls", "no_host_sync", "graph_capture", "random_routings"],
}


@pytest.mark.parametrize("world_size", sorted(CASES))
def test_internode_matches_reference(world_size):
    from worlds import run_world
    os.environ.setdefault("COMMLIB_TIMEOUT_S", "120")
    os.environ["INTERNODE_TEST_ROUNDS"] = os.environ.get(f"INTERNODE_TEST_ROUNDS_{world_size}",
                                                      "1000" if world_size == 2 else "100")
    results = run_world(world_size, "cases_internode", CASES[world_size], use_gpu=True, group_backend="nccl",
                        emulate_hosts=True, ranks_per_node=1, timeout_s=900, case_timeout_s=600)
    failed = {k: v for k, v in results.items() if v is not None}
    assert not failed, "\n".join(f"{k}:\n{v}" for k, v in failed.items())


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
