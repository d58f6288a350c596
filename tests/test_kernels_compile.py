"""Every kernel the library builds compiles: the families, defines and default variants of
commlib.cuda.loader.default_builds(), the list the library itself compiles from; each build's cubin
holds every kernel of its family under the C++ name loader.FAMILIES gives it, and the dispatch /
combine kernels of both modes carry the names DeepEP's profiler-based tests look for.

With NVRTC through CuPy where CuPy imports (what the library uses), else with nvcc where it is on
PATH (the CI machine: the same text and -D defines, device code only, as NVRTC compiles it), else
skipped. No GPU is needed. Kernel names are read from the cubin's ELF symbol table and demangled
here (Itanium nested names), sharing nothing with the loader.
"""
from __future__ import annotations

import os
import re
import shutil
import struct
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


def elf_global_functions(cubin: bytes) -> set:
    """Names of the global function symbols an ELF64 cubin defines (its kernels; not vprintf & co)."""
    assert cubin[:4] == b"\x7fELF" and cubin[4] == 2, "not an ELF64 file"
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", cubin, 0x3A)
    # section header: name type flags addr offset size link info addralign entsize
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names = set()
    for sh in sections:
        if sh[1] != 2:  # SHT_SYMTAB
            continue
        strtab_offset, offset, size, entsize = sections[sh[6]][4], sh[4], sh[5], sh[9]
        for k in range(size // entsize):
            st_name, st_info, _other, st_shndx = struct.unpack_from("<IBBH", cubin, offset + k * entsize)
            if st_info & 0xF == 2 and st_info >> 4 == 1 and st_shndx:  # STT_FUNC, STB_GLOBAL, defined here
                s = strtab_offset + st_name
                names.add(cubin[s:cubin.index(b"\0", s)].decode())
    return names


def demangle(symbol: str) -> str:
    """The qualified name of an Itanium-mangled function (``_ZN7commlib3ns4nameE...`` ->
    ``commlib::ns::name``, ``_Z4name...`` -> ``name``); an unmangled (extern "C") symbol as itself."""
    if symbol.startswith("_ZN"):
        parts, i = [], 3
        while symbol[i] != "E":
            m = re.match(r"\d+", symbol[i:])
            n = int(m.group())
            i += len(m.group())
            parts.append(symbol[i:i + n])
            i += n
        return "::".join(parts)
    m = re.match(r"_Z(\d+)", symbol)
    return symbol[len(m.group()):len(m.group()) + int(m.group(1))] if m else symbol


def _compile_nvrtc(nvrtc, build) -> tuple:
    # CuPy's RawModule adds -ftz=true to the library's options (tests/gpu/nvrtc_compile.py)
    prog = nvrtc.createProgram(build.source, f"{build.family}.cu", [], [])
    try:
        nvrtc.compileProgram(prog, list(build.options) + ["-ftz=true"])
    except Exception as e:  # noqa: BLE001 - report the log
        return f"{_label(build)}: {e}\n{nvrtc.getProgramLog(prog)}", set()
    return "", elf_global_functions(nvrtc.getCUBIN(prog))


def _compile_nvcc(nvcc: str, build, folder: Path) -> tuple:
    stem = f"{build.family}_{build.variant}_{int(build.plain)}"
    src = folder / f"{stem}.cu"
    src.write_text(build.source)
    # -cubin: the device compile NVRTC does (cicc + ptxas), without a host pass NVRTC never runs
    cmd = [nvcc, *build.options, "-cubin", "-o", str(folder / f"{stem}.cubin"), str(src)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    if r.returncode:
        return f"{_label(build)}: {' '.join(cmd)}\n{r.stderr[-4000:]}", set()
    return "", elf_global_functions((folder / f"{stem}.cubin").read_bytes())


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """[(build, error, {demangled kernel names})] for every default build, or None without a compiler."""
    builds = loader.default_builds()
    nvrtc = _nvrtc()
    nvcc = shutil.which("nvcc")
    if nvrtc is not None:
        results = [_compile_nvrtc(nvrtc, b) for b in builds]
    elif nvcc is not None:
        folder = tmp_path_factory.mktemp("cubins")
        with ThreadPoolExecutor(max(2, os.cpu_count() or 2)) as pool:
            results = list(pool.map(lambda b: _compile_nvcc(nvcc, b, folder), builds))
    else:
        return None
    return [(b, err, {demangle(s) for s in symbols}) for b, (err, symbols) in zip(builds, results)]


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


def test_families_list_every_kernel():
    """Every __global__ of csrc/<family>.cu is in loader.FAMILIES[family] (a kernel missing there is
    never compiled ahead of a graph capture, nor found by name), and none is extern "C"."""
    for family, names in loader.FAMILIES.items():
        text = (loader.CSRC / f"{family}.cu").read_text()
        assert 'extern "C"' not in text, family
        declared = set(re.findall(r"__global__\s+void\s+(?:\w+\s+)?(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(",
                                  text))
        assert declared == {loader.kernel_name(family, n).rpartition("::")[2] for n in names}, family


def test_default_builds_compile(compiled):
    if compiled is None:
        pytest.skip("no compiler: neither CuPy's NVRTC nor nvcc on PATH")
    failed = [err for _b, err, _names in compiled if err]
    assert not failed, f"{len(failed)} of {len(compiled)} kernel builds failed:\n" + "\n\n".join(failed)
    for build, _err, names in compiled:  # each kernel under its C++ name, as the loader looks it up
        wanted = {loader.kernel_name(build.family, n) for n in loader.FAMILIES[build.family]}
        assert names == wanted, f"{_label(build)}: kernels {sorted(names)}, expected {sorted(wanted)}"


NORMAL = {"dispatch": ("dispatch", "dispatch_kernel"), "combine": ("combine", "combine_kernel")}
LOW_LATENCY = {"dispatch": ("low_latency", "ll_dispatch_kernel"), "combine": ("low_latency", "ll_combine_kernel")}


def test_dispatch_and_combine_names_as_deepeps(compiled):
    """A profiler shows the normal and the low-latency dispatch / combine kernels with ``::dispatch``
    / ``::combine`` in their demangled names (DeepEP's bench_kineto picks trace events that way), and
    so do the internode forwarder's (``commlib::fanout::dispatch`` / ``combine``); no other kernel's
    name has ``dispatch`` / ``combine`` in it (its table check wants one line each, and one call runs
    one engine's kernels).
    Names from the compiled cubins where a compiler runs, else from the declarations in csrc/."""
    if compiled is not None:
        by_family = {}
        for build, _err, names in compiled:
            by_family.setdefault(build.family, set()).update(names)
    else:  # the declarations (kernel_signature finds each inside its namespace)
        by_family = {f: {loader.kernel_name(f, n) for n in names if loader.kernel_signature(f, n)}
                     for f, names in loader.FAMILIES.items()}
    every = set().union(*by_family.values())
    for mode in (NORMAL, LOW_LATENCY):
        for op, (family, name) in mode.items():
            cxx = loader.kernel_name(family, name)
            assert cxx in by_family[family] and f"::{op}" in cxx and cxx.startswith("commlib::"), (family, cxx)
    for op in ("dispatch", "combine"):
        assert {n for n in every if op in n} == {loader.kernel_name(*NORMAL[op]), loader.kernel_name(*LOW_LATENCY[op]),
                                                  f"commlib::fanout::{op}"}
    assert all(n.startswith("commlib::") for n in every), sorted(every)


def test_overlap_profile_counts_the_comm_kernels_by_their_names():
    """benchmarks.bench_overlap's kernel profile puts every communication kernel, as a profiler names
    it (demangled, with its parameter list), in "comm", and the MoE expert stage's kernel outside it."""
    from benchmarks.overlap.profiling import _kernel_category

    for family, names in loader.FAMILIES.items():
        for name in names:
            shown = f"{loader.kernel_name(family, name)}(int4 const*, int, unsigned long long)"
            assert _kernel_category(shown) == ("other" if family == "moe_rows" else "comm"), shown
