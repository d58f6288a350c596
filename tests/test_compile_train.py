"""scripts/train_moe.py --compile: the expert-parallel model compiled with fullgraph=True (aot_eager:
the eager kernels) trains on 2 CPU gloo ranks to the eager run's losses, bit for bit, step by step.
(inductor fuses and reorders float32 sums, so its losses agree only to rounding; not run here.)"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from commlib.utils.launch import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "train_moe.py")
STEPS = 4


def _torchrun(args, out):
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=ROOT)
    for _ in range(2):  # a port taken between free_port() and torchrun's bind gets one retry
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), SCRIPT, "--steps", str(STEPS), "--json", str(out), *args]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        text = proc.stdout + proc.stderr
        if proc.returncode == 0 or not any(m in text for m in ("EADDRINUSE", "address already in use",
                                                               "DistNetworkError")):
            break
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())["losses"]["sequential"]


def test_compiled_training_matches_eager(tmp_path):
    eager = _torchrun([], tmp_path / "eager.json")
    compiled = _torchrun(["--compile", "--compile-backend", "aot_eager"], tmp_path / "compiled.json")
    assert len(eager) == len(compiled) == STEPS
    assert compiled == eager, f"compiled vs eager losses: {list(zip(compiled, eager))}"
    assert eager[-1] < eager[0], f"the model did not learn: {eager}"
