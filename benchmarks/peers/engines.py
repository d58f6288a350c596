"""The engines bench_peers runs side by side in one process, each loaded from a folder by path.

Three packages share DeepEP v1's ``Buffer`` API: commlib at this checkout (``import commlib``),
commlib at an older commit (an exported tree, loaded as ``commlib_<commit>``) and DeepEP v1 built
from source (loaded as ``deep_ep_v1`` with its extension ``deep_ep_cpp``). commlib ships a
top-level ``deep_ep`` of its own, so DeepEP's package is never imported under that name and
nothing is installed: ``import_package`` executes a package folder under an alias (its relative
imports resolve inside the alias), ``import_extension`` a compiled module from a build folder.

Legend: none (no tensors here).
"""
from __future__ import annotations

import dataclasses
import importlib.machinery
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Optional

DEEPEP_ALIAS = "deep_ep_v1"
DEEPEP_EXTENSION = "deep_ep_cpp"   # the name DeepEP's setup.py gives its extension (and its buffer.py imports)


def import_package(alias: str, package_dir: str | Path) -> ModuleType:
    """Execute the package in ``package_dir`` (a folder with ``__init__.py``) as ``alias``.

    The folder's own name does not matter and no ``sys.path`` entry is added: a package whose
    modules import each other relatively loads beside one of the same name. Raises ImportError
    when the folder holds no package or ``alias`` is taken by another module."""
    package_dir = Path(package_dir).resolve()
    init = package_dir / "__init__.py"
    if not init.is_file():
        raise ImportError(f"import_package: no package at {package_dir} (no __init__.py)")
    have = sys.modules.get(alias)
    if have is not None:
        if Path(getattr(have, "__file__", "") or "").resolve() == init:
            return have
        raise ImportError(f"import_package: {alias!r} is already {getattr(have, '__file__', have)!r}, not {init}")
    spec = importlib.util.spec_from_file_location(alias, init, submodule_search_locations=[str(package_dir)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[alias] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        for name in [n for n in sys.modules if n == alias or n.startswith(alias + ".")]:
            del sys.modules[name]
        raise
    return module


def import_extension(name: str, folder: str | Path) -> ModuleType:
    """Load the compiled module ``name`` (``name*.so`` / ``.pyd``) from ``folder`` as ``name``."""
    folder = Path(folder).resolve()
    found = sorted(p for suffix in importlib.machinery.EXTENSION_SUFFIXES for p in folder.glob(name + suffix))
    if not found:
        raise ImportError(f"import_extension: no {name}{importlib.machinery.EXTENSION_SUFFIXES[0]} in {folder} "
                          "(build it with benchmarks/peers/build_deepep.sh)")
    have = sys.modules.get(name)
    if have is not None:
        if Path(getattr(have, "__file__", "") or "").resolve() == found[0]:
            return have
        raise ImportError(f"import_extension: {name!r} is already loaded from {getattr(have, '__file__', have)!r}")
    spec = importlib.util.spec_from_file_location(name, found[0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


@dataclasses.dataclass
class Engine:
    """One engine under test: a package with DeepEP v1's ``Buffer`` and ``Config``."""
    name: str                 # "head", "917fdc0", "deepep"
    label: str                # what the tables print
    module: Any               # the package
    # Config for (kind, num_sms, num_tokens), or None for the engine's own choice (its default table,
    # tuning cache ...); kind: "dispatch" | "combine" | "tuned_dispatch" | "tuned_combine"
    config: Callable[[str, int, int], Any]
    passes_config_none: bool = True   # config=None is accepted (the engine picks)


def _ring_config(module, table: Callable[[int], Any], R: int):
    """Config(num_sms, send chunk, ring, ...) from ``table(R)``'s chunk and ring sizes."""
    def make(kind: str, num_sms: int, num_tokens: int):
        base = table(R)
        return module.Config(num_sms, base.num_max_nvl_chunked_send_tokens, base.num_max_nvl_chunked_recv_tokens,
                             base.num_max_rdma_chunked_send_tokens, base.num_max_rdma_chunked_recv_tokens)
    return make


def deepep_engine(build_dir: str | Path, R: int) -> Engine:
    """DeepEP v1 from its build folder (``deep_ep/`` and ``deep_ep_cpp*.so`` side by side). Fixed SM
    settings use its own tables' chunk and ring sizes at that SM count; "tuned" is
    ``Buffer.get_dispatch_config / get_combine_config(R)`` as they stand."""
    import torch  # noqa: F401 - deep_ep_cpp links against libtorch: torch must be loaded first

    build_dir = Path(build_dir)
    import_extension(DEEPEP_EXTENSION, build_dir)
    mod = import_package(DEEPEP_ALIAS, build_dir / "deep_ep")
    disp = _ring_config(mod, mod.Buffer.get_dispatch_config, R)
    comb = _ring_config(mod, mod.Buffer.get_combine_config, R)

    def config(kind: str, num_sms: int, num_tokens: int):
        if kind == "tuned_dispatch":
            return mod.Buffer.get_dispatch_config(R)
        if kind == "tuned_combine":
            return mod.Buffer.get_combine_config(R)
        return (disp if kind == "dispatch" else comb)(kind, num_sms, num_tokens)
    return Engine("deepep", "DeepEP v1", mod, config, passes_config_none=False)


def commlib_engine(R: int) -> Engine:
    """commlib at this checkout. Fixed SM settings: the chunk and ring sizes of DeepEP's tables (the
    same Config for both engines); "tuned": config=None, commlib's own choice."""
    import commlib

    disp = _ring_config(commlib, commlib.Buffer.get_dispatch_config, R)
    comb = _ring_config(commlib, commlib.Buffer.get_combine_config, R)

    def config(kind: str, num_sms: int, num_tokens: int):
        if kind.startswith("tuned"):
            return None
        return (disp if kind == "dispatch" else comb)(kind, num_sms, num_tokens)
    return Engine("head", "commlib HEAD", commlib, config)


def old_commlib_engine(tree: str | Path, commit: str) -> Engine:
    """commlib at ``commit`` from an exported tree (``commlib/`` and ``csrc/``), as ``commlib_<commit>``.
    Before the streaming rings a channel had to hold all of its tokens: fixed SM settings get a
    capacity of ceil(tokens / channels) (its own benchmark's rule), "tuned" its default table."""
    mod = import_package(f"commlib_{commit}", Path(tree) / "commlib")

    def config(kind: str, num_sms: int, num_tokens: int):
        if kind.startswith("tuned"):
            return None
        chunk = 32
        cap = max(chunk, -(-num_tokens // (num_sms // 2)))
        return mod.Config(num_sms, chunk, cap, 64, 1024)
    return Engine(commit, f"commlib {commit}", mod, config)
