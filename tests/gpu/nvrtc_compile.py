"""Compile every kernel family with NVRTC the way commlib/kernels.py does, without a GPU.

``python tests/gpu/nvrtc_compile.py`` needs only CuPy's NVRTC binding and libnvrtc (no driver),
so kernel syntax errors show up before any device time is spent. Prints one line per build.
"""
from __future__ import annotations

import sys
import time


def compile_family(family: str, plain: bool) -> tuple[int, str]:
    from cupy.cuda import nvrtc

    from commlib.cuda import loader as kernels

    opts = list(kernels.options(plain)) + ["-arch=sm_90", "-ftz=true", "--device-as-default-execution-space"]
    prog = nvrtc.createProgram(kernels.source(family), f"{family}.cu", [], [])
    try:
        nvrtc.compileProgram(prog, opts)
    except Exception as e:  # noqa: BLE001 - report the log
        raise RuntimeError(f"NVRTC failed for {family} (plain={plain}): {e}\n{nvrtc.getProgramLog(prog)}") from e
    return len(nvrtc.getCUBIN(prog)), nvrtc.getProgramLog(prog)


def main() -> int:
    from commlib.cuda.loader import FAMILIES

    for plain in (False, True):
        for family in FAMILIES:
            t0 = time.perf_counter()
            size, log = compile_family(family, plain)
            print(f"[nvrtc] {family:9s} plain={int(plain)} cubin {size} bytes in {time.perf_counter() - t0:.2f} s")
            if log.strip() and "precompiled header" not in log:
                print(log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
