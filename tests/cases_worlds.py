"""Cases for the launcher's own tests (test_reliability.py): failures on some ranks only."""
from __future__ import annotations

import torch
import torch.distributed as dist


def case_passes(ctx):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert int(t) == ctx.world_size


def case_fails_on_rank_1_only(ctx):
    """Rank 1 fails; the other ranks then wait in a collective rank 1 never enters."""
    if ctx.rank == 1:
        raise AssertionError("planted failure on rank 1 only")
    dist.all_reduce(torch.ones(1))


def case_fails_on_every_rank(ctx):
    raise AssertionError(f"planted failure on rank {ctx.rank}")
