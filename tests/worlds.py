"""Run many test cases inside one spawned world (spawning ranks costs seconds each on 2 cores).

``run_world(world_size, module, names)`` spawns the ranks once; every rank runs each named case
function ``module.case_<name>(ctx)``. After each case the ranks exchange their outcome (None or the
traceback) through the group's store, not through a collective: a rank that failed must not enter
a collective its peers are not in. A case's failure on any rank is collected (with the rank and
traceback) and the world moves on to the next case. Returns {name: None | error text}.

A case that fails on some ranks only can leave the others blocked in a collective the failed rank
left. A rank that failed a case therefore waits at most ``failed_wait_s`` for its peers to finish
it (a rank that passed, ``case_timeout_s``); the rank that gives up raises with the ranks still
missing and its own traceback, and the launcher stops the world and raises with that text, instead
of waiting for the run's timeout.
"""
from __future__ import annotations

import datetime
import importlib
import os
import time
import traceback

import torch.distributed as dist

from commlib.utils.launch import parallel_launch

# The most a rank waits for its peers to finish a case it has finished. Ranks run in step, so a
# peer that is this late is blocked, most likely in a collective a failed rank never entered.
FAILED_WAIT_S = 15.0      # this rank failed the case
CASE_TIMEOUT_S = 120.0    # this rank passed it (a peer may still fail, or hang)


class CaseStuck(RuntimeError):
    """Some ranks did not finish a case within the case timeout after this rank did."""


def _worker(ctx, module_name: str, names: list[str], case_timeout_s: float, failed_wait_s: float):
    module = importlib.import_module(module_name)
    R, me = ctx.world_size, ctx.rank
    results = {}
    times = os.environ.get("COMMLIB_TEST_CASE_TIMES")   # a file: rank 0 appends each case's seconds
    for i, name in enumerate(names):
        t0 = time.perf_counter()
        try:
            getattr(module, f"case_{name}")(ctx)
            err = None
        except Exception:  # noqa: BLE001 - reported to the parent per case
            err = f"rank {me}:\n{traceback.format_exc()}"
        keys = [f"worlds/case{i}/rank{r}" for r in range(R)]
        ctx.store.set(keys[me], err or "")
        wait_s = failed_wait_s if err else case_timeout_s
        try:
            ctx.store.wait(keys, datetime.timedelta(seconds=wait_s))
        except dist.DistError as e:  # the wait timed out: which ranks are missing is the report
            missing = [r for r in range(R) if not ctx.store.check([keys[r]])]
            if missing:  # (none: they arrived just after the timeout)
                own = f"\nrank {me} failed the case:\n{err}" if err else f"\nrank {me} passed the case."
                raise CaseStuck(f"case {name!r}: ranks {missing} did not finish it within {wait_s:g} s "
                                f"after rank {me} did (blocked in a collective a failed rank left?){own}") from e
        errs = [ctx.store.get(k).decode() for k in keys]
        errs = [e for e in errs if e]
        results[name] = "\n".join(errs) if errs else None
        if times and me == 0:
            with open(times, "a") as f:
                f.write(f"{module_name} {R} {name} {time.perf_counter() - t0:.1f}\n")
    return results


def expect_raises(exc_type, words, fn) -> None:
    """``fn()`` must raise ``exc_type`` whose message mentions every one of ``words``."""
    try:
        fn()
    except exc_type as e:
        for word in words:
            assert word in str(e), f"error {e!r} does not mention {word!r}"
        return
    raise AssertionError(f"expected {exc_type.__name__} mentioning {words}")


def run_world(world_size: int, module_name: str, names: list[str], case_timeout_s: float = CASE_TIMEOUT_S,
              failed_wait_s: float = FAILED_WAIT_S, **kwargs) -> dict:
    return parallel_launch(world_size, _worker, module_name, names, case_timeout_s, failed_wait_s, **kwargs)


def case_tests(module_name: str, cases: dict, timeout_s: float = 600):
    """A module-scoped ``world`` fixture (one spawned world per size in ``cases``: {size: [names]}) and
    ``test_case`` (one test per case name), for a test module to bind at module level:
    ``world, test_case = case_tests("cases_x", CASES)``."""
    import pytest

    @pytest.fixture(scope="module", params=sorted(cases))
    def world(request):
        size = request.param
        return size, run_world(size, module_name, cases[size], timeout_s=timeout_s)

    @pytest.mark.parametrize("case", sorted({c for cs in cases.values() for c in cs}))
    def test_case(world, case):
        size, results = world
        if case not in results:
            pytest.skip(f"not run at world size {size}")
        assert results[case] is None, results[case]

    return world, test_case

