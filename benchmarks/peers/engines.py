"""The engines bench_peers runs side by side in one process, each loaded from a folder by path.

Three packages share DeepEP v1's ``Buffer`` API: commlib at this checkout (``import commlib``),
commlib at an older commit (an exported tree, loaded as ``commlib_<commit>``) and DeepEP v1 built
on the GPU machine (loaded as ``deep_ep_v1`` with its extension ``deep_ep_cpp``). commlib ships a
top-level ``deep_ep`` of its own, so DeepEP's package is never imported under that name and
nothing is installed: ``import_package`` executes a package folder under an alias (its relative
imports resolve inside the alias), ``import_extension`` a compiled module from a file or folder.
DeepEP's build recipe is not in this repository (docs/peers.md).

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


def extension_files(name: str, places) -> list:
    """The compiled modules ``name*.so`` (any extension suffix) that ``places`` hold: each place a
    file (taken as it is when it exists) or a folder (searched, not recursively), in order."""
    found = []
    for place in places:
        place = Path(place)
        if place.is_file():
            found.append(place.resolve())
        elif place.is_dir():
            found += sorted(p.resolve() for suffix in importlib.machinery.EXTENSION_SUFFIXES
                            for p in place.glob(name + suffix))
    return found


def import_extension(name: str, places) -> ModuleType:
    """Load the module ``name`` from the first file ``extension_files(name, places)`` finds (a
    compiled ``.so``; the loader follows the file's suffix) as ``name``. ``places``: a path or a list."""
    places = [places] if isinstance(places, (str, Path)) else list(places)
    found = extension_files(name, places)
    if not found:
        raise ImportError(f"import_extension: no {name}{importlib.machinery.EXTENSION_SUFFIXES[0]} in "
                          f"{', '.join(str(p) for p in places)} (DeepEP is built on the GPU machine by "
                          ".peers/build_deepep.sh, kept out of the repository: docs/peers.md)")
    have = sys.modules.get(name)
    if have is not None:
        if Path(getattr(have, "__file__", "") or "").resolve() == found[0]:
            return have
        raise ImportError(f"import_extension: {name!r} is already loaded from {getattr(have, '__file__', have)!r}")
    spec = importlib.util.spec_from_file_location(name, found[0])
    if spec is None:
        raise ImportError(f"import_extension: {found[0]} is not a module file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


@dataclasses.dataclass
class Engine:
    """One engine under test: a package with DeepEP v1's ``Buffer`` and ``Config``."""
    name: str                 # "head", "917fdc0", "deepep"
    label: str                # what the tables print
    module: Any               # the package
    # Config for (kind, num_sms, num_tokens) at a fixed SM count; kind: "dispatch" | "combine"
    config: Callable[[str, int, int], Any]
    # Config(num_sms, send chunk, ring) of the tuning sweep, or None: in the tuned setting the engine
    # gets config=None (its own pick)
    candidate: Optional[Callable[[int, int, int], Any]] = None


# DeepEP's Config (a pybind class) exposes no fields: every Config made here is kept with the arguments
# it was built from, by id (the object kept alive beside them), for the tables and the JSON
_ARGS: dict = {}
CONFIG_FIELDS = ("num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
                 "num_max_rdma_chunked_send_tokens", "num_max_rdma_chunked_recv_tokens")


def make_config(module, *args: int):
    """``module.Config(*args)``, its arguments remembered for ``config_fields``."""
    cfg = module.Config(*args)
    _ARGS[id(cfg)] = (cfg, tuple(int(a) for a in args))
    return cfg


def config_fields(cfg) -> Optional[dict]:
    """The fields of a Config made here, or read from one that has them; None for None (the engine's pick)."""
    if cfg is None:
        return None
    kept = _ARGS.get(id(cfg))
    if kept is not None and kept[0] is cfg:
        return dict(zip(CONFIG_FIELDS, kept[1]))
    return {n: int(getattr(cfg, n)) for n in CONFIG_FIELDS if hasattr(cfg, n)}


def _table_args(module, kind: str, R: int) -> tuple:
    """The arguments ``module.Buffer``'s own table builds its Config for R with: read as attributes where
    the Config has them (commlib), else by watching the table's getter build it (DeepEP's pybind Config)."""
    getter = module.Buffer.get_dispatch_config if kind == "dispatch" else module.Buffer.get_combine_config
    home = sys.modules[module.Buffer.__module__]
    real, built = getattr(home, "Config", None), []
    if real is None:
        return tuple(int(getattr(getter(R), n)) for n in CONFIG_FIELDS)

    def watch(*args):
        cfg = real(*args)
        built.append((cfg, args))
        return cfg

    home.Config = watch
    try:
        base = getter(R)
    finally:
        home.Config = real
    for cfg, args in built:
        if cfg is base:
            return tuple(int(a) for a in args)
    return tuple(int(getattr(base, n)) for n in CONFIG_FIELDS)


def _table_config(module, R: int) -> Callable[[str, int, int], Any]:
    """Config(num_sms, chunk, ring, ...) with the chunk and ring sizes of ``module.Buffer``'s tables for R."""
    def make(kind: str, num_sms: int, num_tokens: int):
        return make_config(module, num_sms, *_table_args(module, kind, R)[1:])
    return make


def _candidate(module, R: int) -> Callable[[int, int, int], Any]:
    """Config(num_sms, chunk, ring) with the RDMA fields of the dispatch table (unused intranode)."""
    def make(num_sms: int, chunk: int, ring: int):
        rdma = _table_args(module, "dispatch", R)[3:]
        return make_config(module, num_sms, chunk, ring, *rdma)
    return make


def deepep_engine(package_dir: str | Path, extension, R: int) -> Engine:
    """DeepEP v1: its extension from ``extension`` (a built ``deep_ep_cpp*.so``, or a list of files
    and folders to look in: ``import_extension``) and its Python package from ``package_dir/deep_ep``.
    Fixed SM settings use its own tables' chunk and ring sizes at that SM count; the tuned setting
    sweeps chunk sizes (bench_peers)."""
    import torch  # noqa: F401 - deep_ep_cpp links against libtorch: torch must be loaded first

    import_extension(DEEPEP_EXTENSION, extension)
    mod = import_package(DEEPEP_ALIAS, Path(package_dir) / "deep_ep")
    return Engine("deepep", "DeepEP v1", mod, _table_config(mod, R), _candidate(mod, R))


def commlib_engine(R: int) -> Engine:
    """commlib at this checkout, with the same Configs as DeepEP (its tables are DeepEP's) and the
    same tuning sweep."""
    import commlib

    return Engine("head", "commlib HEAD", commlib, _table_config(commlib, R), _candidate(commlib, R))


def old_commlib_engine(tree: str | Path, commit: str) -> Engine:
    """commlib at ``commit`` from an exported tree (``commlib/`` and ``csrc/``), as ``commlib_<commit>``.
    Before the streaming rings a channel had to hold all of its tokens: fixed SM settings get a
    capacity of ceil(tokens / channels) (its own benchmark's rule); tuned: config=None (its table)."""
    mod = import_package(f"commlib_{commit}", Path(tree) / "commlib")

    def config(kind: str, num_sms: int, num_tokens: int):
        chunk = 32
        cap = max(chunk, -(-num_tokens // (num_sms // 2)))
        return mod.Config(num_sms, chunk, cap, 64, 1024)
    return Engine(commit, f"commlib {commit}", mod, config)
