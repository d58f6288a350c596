"""scripts/gpu_check.sh on CPU: it parses, its dry run names only files and modules that exist, its
presets pick the stages they say, every pytest stage selects tests, and (with fake nvidia-smi and
nvidia-cuda-mps-control on PATH) a stage with more ranks than GPUs runs under MPS, the daemon is
stopped on exit, and a stage past its timeout is reported as one."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
GROUPS = {"setup", "nvlink", "internode", "ll", "training", "peers"}
PRESETS = ("quick", "nvlink", "internode", "ll", "training", "all")


def run_script(out: Path, only: str, dry: bool = True, extra_env: dict | None = None):
    env = dict(os.environ, GPU_CHECK_ONLY=only, GPU_CHECK_DRY="1" if dry else "0", GPU_CHECK_GPUS="1",
               PYTHON=sys.executable)
    env.update(extra_env or {})
    return subprocess.run(["bash", str(SCRIPT), str(out)], capture_output=True, text=True, env=env,
                          timeout=120, cwd=ROOT)


def dry_stages(tmp_path, only="all") -> list:
    """[(name, group, ranks, mps, argv)] of the dry run's lines (ranks written Nt, time-sliced: -N)."""
    proc = run_script(tmp_path / "out", only)
    assert proc.returncode == 0, proc.stderr
    stages = []
    for line in proc.stdout.splitlines():
        assert line.startswith("[dry] "), line
        head, _, cmd = line[len("[dry] "):].partition(" :: ")
        name, *fields = head.split()
        kv = dict(f.split("=", 1) for f in fields)
        ranks = -int(kv["ranks"][:-1]) if kv["ranks"].endswith("t") else int(kv["ranks"])
        stages.append((name, kv["group"], ranks, int(kv["mps"]), shlex.split(cmd)))
    assert stages, proc.stdout
    return stages


def module_exists(mod: str) -> bool:
    base = ROOT / mod.replace(".", "/")
    return base.with_suffix(".py").is_file() or (base / "__main__.py").is_file()


def test_script_parses():
    proc = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_dry_run_names_files_that_exist(tmp_path):
    stages = dry_stages(tmp_path)
    names = [s[0] for s in stages]
    assert len(names) == len(set(names)), "stage names repeat"
    assert not any(n.startswith("hier") for n in names), names  # the engine's old name is gone
    assert {s[1] for s in stages} == GROUPS
    for name, _group, ranks, mps, argv in stages:
        assert "MISSING-FUNCTION" not in argv, name
        assert mps == int(ranks > 1), (name, ranks, mps)  # GPU_CHECK_GPUS=1: more ranks than GPUs -> MPS, not Nt
        assert not any("hier" in w for w in argv), (name, argv)
        for i, word in enumerate(argv):
            if word == "-m" and argv[i + 1] != "pytest":
                assert module_exists(argv[i + 1]), f"stage {name}: no module {argv[i + 1]}"
            elif word.endswith((".py", ".sh")) and "/" in word and not word.startswith("/"):
                assert (ROOT / word).is_file(), f"stage {name}: no file {word}"


def test_presets_pick_their_stages(tmp_path):
    every = dry_stages(tmp_path, "all")
    group_of = {s[0]: s[1] for s in every}
    for preset in PRESETS:
        picked = [s[0] for s in dry_stages(tmp_path, preset)]
        order = [n for n in group_of if n in picked]
        assert picked == order, f"{preset}: not in table order"
        if preset in GROUPS:
            assert picked[:2] == ["env", "compile"], preset
            assert set(picked) - {"env", "compile"} == {n for n, g in group_of.items() if g == preset}, preset
    assert [s[0] for s in dry_stages(tmp_path, "all")] == list(group_of)
    assert {group_of[n] for n in (s[0] for s in dry_stages(tmp_path, "quick"))} >= {"nvlink", "internode", "ll"}
    assert [s[0] for s in dry_stages(tmp_path, "compile,inworlds")] == ["compile", "inworlds"]
    for bad in ("hier", "hierworst", "x2internode-typo"):
        proc = run_script(tmp_path / "out", bad)
        assert proc.returncode == 2 and f"unknown stage, group or preset '{bad}'" in proc.stderr, proc.stderr


def test_every_pytest_stage_selects_tests(tmp_path):
    """A stage's file and -k expression collect at least one test (a renamed test would otherwise
    make the stage select nothing)."""
    picks = []
    for name, _g, _r, _m, argv in dry_stages(tmp_path):
        if "pytest" in argv:
            files = [w for w in argv if w.startswith("tests/") and w.endswith(".py")]
            k = argv[argv.index("-k") + 1] if "-k" in argv else ""
            picks.append((name, files, k))
    assert len(picks) >= 10, picks
    code = (
        "import json, sys, pytest\n"
        "class Count:\n"
        "    n = 0\n"
        "    def pytest_collection_finish(self, session):\n"
        "        Count.n = len(session.items)\n"
        "out = {}\n"
        "for name, files, k in json.loads(sys.argv[1]):\n"
        "    c = Count()\n"
        "    pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', *(['-k', k] if k else []), *files],"
        " plugins=[c])\n"
        "    out[name] = Count.n\n"
        "print('COUNTS' + json.dumps(out))\n")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(picks)], capture_output=True, text=True,
                          cwd=ROOT, timeout=600, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    line = [x for x in proc.stdout.splitlines() if x.startswith("COUNTS")]
    assert line, proc.stdout[-3000:] + proc.stderr[-3000:]
    counts = json.loads(line[-1][len("COUNTS"):])
    empty = sorted(n for n, c in counts.items() if c == 0)
    assert not empty, f"stages selecting no test: {empty}"


def test_mps_for_shared_gpu_stages_and_timeouts(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/bash\necho 'GPU 0: Fake (UUID: GPU-0)'\n")
    (fake / "nvidia-cuda-mps-control").write_text(
        "#!/bin/bash\n{ echo \"args=$* pipe=$CUDA_MPS_PIPE_DIRECTORY\"; "
        "[ \"$1\" = -d ] || echo \"stdin=$(cat)\"; } >> \"$FAKE_MPS_LOG\"\n")
    for f in fake.iterdir():
        f.chmod(0o755)
    mps_log = tmp_path / "mps.log"
    extra = "one | x | 1 | 20 | env\ntwo | x | 2 | 20 | env\nsliced | x | 2t | 20 | env\nslow | x | 0 | 1 | sleep 30"
    out = tmp_path / "out"
    proc = run_script(out, "one,two,sliced,slow", dry=False, extra_env={
        "PATH": f"{fake}:{os.environ['PATH']}", "FAKE_MPS_LOG": str(mps_log), "GPU_CHECK_EXTRA": extra})
    assert proc.returncode == 1, proc.stdout + proc.stderr  # a stage timed out
    summary = {s["stage"]: s for s in json.loads((out / "gpu_check.json").read_text())["stages"]}
    assert [(summary[n]["mps"], summary[n]["status"]) for n in ("one", "two", "sliced", "slow")] == [
        (0, "ok"), (1, "ok"), (0, "ok"), (0, "timeout")]
    one, two, sliced = ((out / "logs" / f"{n}.log").read_text() for n in ("one", "two", "sliced"))
    assert "CUDA_MPS_PIPE_DIRECTORY" not in sliced  # ranks written 2t: time-sliced though they share a GPU
    for text in (one, two):  # NVLink multicast off in everything the script starts
        assert all(f"{v}\n" in text for v in ("NCCL_NVLS_ENABLE=0", "TORCH_SYMM_MEM_DISABLE_MULTICAST=1",
                                              "NVSHMEM_DISABLE_NVLS=1")), text
    assert "CUDA_MPS_PIPE_DIRECTORY" not in one and "CUDA_MPS_PIPE_DIRECTORY=/tmp/" in two
    calls = mps_log.read_text().splitlines()
    assert calls[0].startswith("args=-d pipe=/tmp/") and calls[-1] == "stdin=quit", calls
    pipe = calls[0].split("pipe=")[1]
    assert f"CUDA_MPS_PIPE_DIRECTORY={pipe}\n" in two and not Path(pipe).exists()  # its folder removed


def test_peers_stages_dry_run(tmp_path):
    """The DeepEP-beside-commlib stages: the build alone (no ranks, no MPS; its recipe lives in the
    carried .peers/, never in the repository) and the bench (4 ranks on one GPU: under MPS), writing
    JSON to the run's results folder."""
    stages = {s[0]: s for s in dry_stages(tmp_path, "peerbuild,peerbench")}
    assert list(stages) == ["peerbuild", "peerbench"]
    _, group, ranks, mps, argv = stages["peerbuild"]
    assert (group, ranks, mps) == ("peers", 0, 0) and argv[-3:] == ["bash", "-c", "peer_build"]
    _, group, ranks, mps, argv = stages["peerbench"]
    assert (group, ranks, mps) == ("peers", 4, 1)
    assert argv[-4:] == ["-m", "benchmarks.peers.bench_peers", "--json", str(tmp_path / "out" / "results")]
    extra = {s[0]: s for s in dry_stages(tmp_path, "peers")}
    assert {"peerbuild", "peerbench"} <= set(extra)


def test_peer_build_calls_the_carried_recipe_or_says_it_is_missing(tmp_path):
    """peerbuild runs .peers/build_deepep.sh with the source, the build folder and $OUT/peers; with
    no recipe there it fails with a line that says where the recipe is kept."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/bash\necho 'GPU 0: Fake (UUID: GPU-0)'\n")
    (fake / "nvidia-smi").chmod(0o755)
    peers = tmp_path / "peers"
    peers.mkdir()
    env = {"PATH": f"{fake}:{os.environ['PATH']}", "PEERS_DIR": str(peers)}
    proc = run_script(tmp_path / "none", "peerbuild", dry=False, extra_env=env)
    log = (tmp_path / "none" / "logs" / "peerbuild.log").read_text()
    assert proc.returncode == 1 and "kept out of the repository by policy" in log, log
    (peers / "build_deepep.sh").write_text('echo "recipe args: $*"; echo "python: $PYTHON"\n')
    proc = run_script(tmp_path / "out", "peerbuild", dry=False, extra_env=env)
    log = (tmp_path / "out" / "logs" / "peerbuild.log").read_text()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"recipe args: {peers}/DeepEP {ROOT}/.peers_build/DeepEP {tmp_path}/out/peers" in log, log
    assert f"python: {sys.executable}" in log, log
