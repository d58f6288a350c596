"""Compile every kernel build of commlib.cuda.loader.default_builds() with NVRTC, without a GPU.

``python tests/gpu/nvrtc_compile.py`` needs only CuPy's NVRTC binding and libnvrtc (no driver),
so kernel syntax errors show up before any device time is spent. Prints one line per build.
tests/test_kernels_compile.py compiles the same list (with nvcc where CuPy is missing).
"""
from __future__ import annotations

import sys
import time


def compile_build(build) -> tuple[int, str]:
    from cupy.cuda import nvrtc

    opts = list(build.options) + ["-arch=sm_90", "-ftz=true", "--device-as-default-execution-space"]
    prog = nvrtc.createProgram(build.source, f"{build.family}.cu", [], [])
    try:
        nvrtc.compileProgram(prog, opts)
    except Exception as e:  # noqa: BLE001 - report the log
        raise RuntimeError(f"NVRTC failed for {build.family} ({build.variant}, plain={build.plain}): {e}\n"
                           f"{nvrtc.getProgramLog(prog)}") from e
    return len(nvrtc.getCUBIN(prog)), nvrtc.getProgramLog(prog)


def compile_family(family: str, plain: bool) -> tuple[int, str]:
    """The default build of one family (tests/gpu/test_nvlink.py)."""
    from commlib.cuda import loader

    build = next(b for b in loader.default_builds()
                 if b.family == family and b.plain == plain and b.variant == "default")
    return compile_build(build)


def main() -> int:
    from commlib.cuda import loader

    for build in loader.default_builds():
        t0 = time.perf_counter()
        size, log = compile_build(build)
        print(f"[nvrtc] {build.family:11s} {build.variant:9s} plain={int(build.plain)} cubin {size} bytes "
              f"in {time.perf_counter() - t0:.2f} s")
        if log.strip() and "precompiled header" not in log:
            print(log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
