"""A wheel built from the checkout holds every module and every CUDA source, and the kernel loader
of the installed copy finds its sources inside the package (not beside a checkout)."""
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
    for extra in ("deep_ep",):
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


def test_wheel_has_every_module_and_cuda_source(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {p.relative_to(ROOT).as_posix() for p in (ROOT / "commlib").rglob("*")
               if p.suffix in (".py", ".cu", ".cuh") and "__pycache__" not in p.parts}
    assert any(s.endswith(".cu") for s in sources)
    missing = sorted(sources - names)
    assert not missing, f"not in the wheel: {missing}"
    assert not any(n.startswith(("tests/", "benchmarks/", "experiments/")) for n in names)


def test_installed_loader_finds_its_sources(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    wanted = sorted(p.name for p in (ROOT / "commlib" / "cuda" / "csrc").iterdir() if p.suffix in (".cu", ".cuh"))
    code = ("import commlib.cuda.loader as L, sys; print(L.CSRC); "
            f"sys.exit(0 if all((L.CSRC / n).is_file() for n in {wanted!r}) else 3)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert Path(proc.stdout.strip()).is_relative_to(site), proc.stdout
