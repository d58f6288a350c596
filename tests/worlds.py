"""Run many test cases inside one spawned world (spawning ranks costs seconds each on 2 cores).

``run_world(world_size, module, names)`` spawns the ranks once; every rank runs each named case
function ``module.case_<name>(ctx)``; a case's failure on any rank is collected (with the rank
and traceback) and the world moves on to the next case. Returns {name: None | error text}.
"""
from __future__ import annotations

import importlib
import traceback

import torch.distributed as dist

from commlib.utils.launch import parallel_launch


def _worker(ctx, module_name: str, names: list[str]):
    module = importlib.import_module(module_name)
    results = {}
    for name in names:
        try:
            getattr(module, f"case_{name}")(ctx)
            err = None
        except Exception:  # noqa: BLE001 - reported to the parent per case
            err = f"rank {ctx.rank}:\n{traceback.format_exc()}"
        gathered = [None] * ctx.world_size
        dist.all_gather_object(gathered, err)
        errs = [e for e in gathered if e]
        results[name] = "\n".join(errs) if errs else None
    return results


def run_world(world_size: int, module_name: str, names: list[str], **kwargs) -> dict:
    return parallel_launch(world_size, _worker, module_name, names, **kwargs)
