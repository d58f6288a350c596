"""Every kernel the library builds compiles: the families, defines and default variants of
commlib.cuda.loader.default_builds(), the list the library itself compiles from.

With NVRTC through CuPy where CuPy imports (what the library uses), else with nvcc where it is on
PATH (the CI machine: the same text and -D defines, device code only, as NVRTC compiles it), else
skipped. No GPU is needed.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from commlib.cuda import loader


def _nvrtc():
    try:
        from cupy.cuda import nvrtc

        nvrtc.getVersion()
    except Exception:  # noqa: BLE001 - no CuPy, or no libnvrtc behind it
        return None
    return nvrtc


def _label(build) -> str:
    return f"{build.family} ({build.variant}, {'plain' if build.plain else 'hinted'} ld/st)"


def _compile_nvrtc(nvrtc, build) -> str:
    # CuPy's RawModule adds -ftz=true to the library's options (tests/gpu/nvrtc_compile.py)
    prog = nvrtc.createProgram(build.source, f"{build.family}.cu", [], [])
    try:
        nvrtc.compileProgram(prog, list(build.options) + ["-ftz=true"])
    except Exception as e:  # noqa: BLE001 - report the log
        return f"{_label(build)}: {e}\n{nvrtc.getProgramLog(prog)}"
    return ""


def _compile_nvcc(nvcc: str, build, folder: Path) -> str:
    stem = f"{build.family}_{build.variant}_{int(build.plain)}"
    src = folder / f"{stem}.cu"
    src.write_text(build.source)
    # -cubin: the device compile NVRTC does (cicc + ptxas), without a host pass NVRTC never runs
    cmd = [nvcc, *build.options, "-cubin", "-o", str(folder / f"{stem}.cubin"), str(src)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    if r.returncode:
        return f"{_label(build)}: {' '.join(cmd)}\n{r.stderr[-4000:]}"
    return ""


def test_families_cover_every_source():
    """loader.FAMILIES (what the library builds and this test compiles) names every csrc/*.cu."""
    files = {p.stem for p in loader.CSRC.glob("*.cu")}
    assert set(loader.FAMILIES) == files, (
        f"csrc/*.cu without a family in loader.FAMILIES: {sorted(files - set(loader.FAMILIES))}; "
        f"families without a file: {sorted(set(loader.FAMILIES) - files)}")
    builds = loader.default_builds()
    for plain in (False, True):  # both load / store modes are built (COMMLIB_PLAIN_LDST, set_plain)
        assert {b.family for b in builds if b.plain == plain} == files
    for b in builds:
        assert f"-DCL_PLAIN={int(b.plain)}" in b.options and "#include" not in b.source.replace(
            "#include <cstdio>", ""), _label(b)
        assert not any(o.startswith("-DCOMMLIB_") for o in b.options), _label(b)  # macros are CL_, env vars COMMLIB_


def test_default_builds_compile(tmp_path):
    builds = loader.default_builds()
    nvrtc = _nvrtc()
    nvcc = shutil.which("nvcc")
    if nvrtc is not None:
        errors = [_compile_nvrtc(nvrtc, b) for b in builds]
    elif nvcc is not None:
        with ThreadPoolExecutor(max(2, os.cpu_count() or 2)) as pool:
            errors = list(pool.map(lambda b: _compile_nvcc(nvcc, b, tmp_path), builds))
    else:
        pytest.skip("no compiler: neither CuPy's NVRTC nor nvcc on PATH")
    failed = [e for e in errors if e]
    assert not failed, f"{len(failed)} of {len(builds)} kernel builds failed:\n" + "\n\n".join(failed)
