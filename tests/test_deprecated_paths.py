"""The old import paths stay for one release: each still imports, warns with a DeprecationWarning
naming its new home, and exposes the same objects as that new home."""
from __future__ import annotations

import importlib
import sys

import pytest

ALIASES = [
    ("commlib.pipeline", "commlib.training.pipeline",
     ["dual_forward", "dual_backward", "dual_forward_backward", "overlapped_forward_backward", "StagedModule",
      "ComputeStage", "DispatchStage", "CombineStage", "Timeline", "sm_carveout", "resolve_sm_carveout"]),
    ("commlib.moe", "commlib.training.moe",
     ["MoEConfig", "MoELayer", "MoEModel", "MoEBlock", "Router", "Experts", "routed_experts", "linear"]),
    ("commlib.overlap", "commlib.training.pipeline",
     ["StagedModule", "dual_forward", "dual_backward", "dual_forward_backward", "overlapped_forward_backward"]),
    ("commlib.tune", "commlib.tuning.autotune", ["autotune", "cached_config", "get_config", "main", "search"]),
]


@pytest.mark.parametrize("old, new, names", ALIASES, ids=[a[0] for a in ALIASES])
def test_old_path_imports_warns_and_exposes_the_new_objects(old, new, names):
    sys.modules.pop(old, None)   # the warning is raised when the alias module runs
    with pytest.warns(DeprecationWarning, match=new.replace(".", r"\.")):
        alias = importlib.import_module(old)
    target = importlib.import_module(new)
    for name in names:
        assert getattr(alias, name) is getattr(target, name), f"{old}.{name} is not {new}.{name}"


def test_old_from_imports_still_work():
    with pytest.warns(DeprecationWarning):
        sys.modules.pop("commlib.pipeline", None)
        from commlib.pipeline import dual_forward
    with pytest.warns(DeprecationWarning):
        sys.modules.pop("commlib.moe", None)
        from commlib.moe import MoELayer
    with pytest.warns(DeprecationWarning):
        sys.modules.pop("commlib.overlap", None)
        from commlib.overlap import EventOverlap
    from commlib.training.moe import MoELayer as new_layer
    from commlib.training.pipeline import dual_forward as new_forward
    from commlib.utils.event import EventOverlap as new_event
    assert (dual_forward, MoELayer, EventOverlap) == (new_forward, new_layer, new_event)
