"""A wheel built from the checkout holds every module and every CUDA source (the top-level csrc/ as
commlib/_csrc), and the kernel loader of a copy installed outside the checkout reads every source
from inside that copy."""
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    # Built from a copy of what a clean checkout has (no build/ or egg-info left by an earlier build).
    src = tmp_path_factory.mktemp("src") / "commlib"
    shutil.copytree(ROOT / "commlib", src / "commlib", ignore=shutil.ignore_patterns("__pycache__"))
    for extra in ("deep_ep", "csrc"):
        if (ROOT / extra).is_dir():
            shutil.copytree(ROOT / extra, src / extra, ignore=shutil.ignore_patterns("__pycache__"))
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / f, src / f)
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(out), str(src)], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 and "No module named" in proc.stderr and "setuptools" in proc.stderr:
        pytest.skip("setuptools is not installed in this environment")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (whl,) = out.glob("commlib-*.whl")
    return whl


CUDA_SOURCES = sorted(p.name for p in (ROOT / "csrc").iterdir() if p.suffix in (".cu", ".cuh", ".cpp"))


def test_wheel_has_every_module_and_cuda_source(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "commlib").rglob("*.py")
               if "__pycache__" not in p.parts}
    sources = {f"commlib/_csrc/{n}" for n in CUDA_SOURCES}
    assert all(any(s.endswith(ext) for s in sources) for ext in (".cu", ".cuh", ".cpp"))
    missing = sorted((modules | sources) - names)
    assert not missing, f"not in the wheel: {missing}"
    assert not any(n.startswith(("tests/", "benchmarks/", "experiments/", "csrc/")) for n in names)


def test_installed_loader_reads_every_source_from_its_copy(wheel, tmp_path):
    """Installed outside the checkout (cwd and PYTHONPATH away from it), the loader's CSRC lies in
    the installed package, every csrc/ file is there byte for byte, and each family's NVRTC source
    (common.cuh pasted in) is built from those files, not the checkout's."""
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    marker = "// read from the installed copy"
    for name in CUDA_SOURCES:  # a line only the installed copy has: the source text must come from it
        path = site / "commlib" / "_csrc" / name
        path.write_text(path.read_text() + f"\n{marker} {name}\n")
    code = f"""
import json, sys
import commlib.cuda.loader as L
files = {{p.name: p.read_text() for p in L.CSRC.iterdir() if p.suffix in (".cu", ".cuh", ".cpp")}}
texts = {{f: L.source(f) for f in L.FAMILIES}}
sigs = {{f"{{f}}.{{n}}": L.kernel_signature(f, n) for f, names in L.FAMILIES.items() for n in names}}
import commlib.cuda.callpath as C
print(json.dumps({{"csrc": str(L.CSRC), "loader": L.__file__, "files": files, "texts": texts, "sigs": sigs,
                  "callpath": str(C.source_path())}}))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout)
    assert Path(out["loader"]).is_relative_to(site) and Path(out["csrc"]).is_relative_to(site), out["csrc"]
    assert sorted(out["files"]) == CUDA_SOURCES
    for name in CUDA_SOURCES:
        assert out["files"][name] == (ROOT / "csrc" / name).read_text() + f"\n{marker} {name}\n", name
    for family, text in out["texts"].items():
        assert f"{marker} {family}.cu" in text and f"{marker} common.cuh" in text, family
    assert all(out["sigs"].values()), out["sigs"]  # every kernel's declaration parsed from the copy
    assert Path(out["callpath"]).is_relative_to(site), out["callpath"]   # the C++ call path builds from the copy
