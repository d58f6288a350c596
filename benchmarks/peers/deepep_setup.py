"""Runs DeepEP v1's own ``setup.py build_ext --inplace`` in the current folder, as build_deepep.sh needs:

* NVSHMEM hidden: ``setup.py`` looks in ``NVSHMEM_DIR`` and then for the pip package
  ``nvidia.nvshmem``; with neither it builds the intranode kernels only (``DISABLE_NVSHMEM``).
  build_deepep.sh unsets the variable, ``hide_nvshmem`` makes the package invisible.
* a device-link step: on sm_90 ``setup.py`` compiles with ``-rdc=true`` but adds the ``-dlink``
  step only with NVSHMEM, so an intranode-only build leaves ``__cudaRegisterLinkedBinary_*``
  undefined and the extension fails to import. ``with_device_link`` adds the step DeepEP's
  NVSHMEM build has (torch's ``nvcc_dlink``), leaving every compile flag as DeepEP sets it.

Nothing of DeepEP's source is changed: both are patches of the functions ``setup.py`` calls.
"""
from __future__ import annotations

import importlib.util
import runpy
import sys
from typing import Callable


def hide_nvshmem() -> None:
    """``importlib.util.find_spec`` answers None for ``nvidia.nvshmem`` (and its submodules)."""
    find_spec = importlib.util.find_spec

    def find(name, *args, **kwargs):
        return None if name.split(".")[:2] == ["nvidia", "nvshmem"] else find_spec(name, *args, **kwargs)
    importlib.util.find_spec = find


def with_device_link(make: Callable) -> Callable:
    """``make`` (torch's CUDAExtension) with ``nvcc_dlink = ['-dlink']`` added when the nvcc flags
    ask for relocatable device code and no device-link flags are given."""
    def extension(name, sources, *args, **kwargs):
        flags = kwargs.setdefault("extra_compile_args", {})
        if isinstance(flags, dict) and "-rdc=true" in flags.get("nvcc", []) and "nvcc_dlink" not in flags:
            flags["nvcc_dlink"] = ["-dlink"]
        return make(name, sources, *args, **kwargs)
    return extension


def main() -> None:
    import torch.utils.cpp_extension as cpp_extension

    hide_nvshmem()
    cpp_extension.CUDAExtension = with_device_link(cpp_extension.CUDAExtension)
    sys.argv = ["setup.py", "build_ext", "--inplace"]
    runpy.run_path("setup.py", run_name="__main__")


if __name__ == "__main__":
    main()
