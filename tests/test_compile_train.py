"""scripts/train_moe.py --compile: the expert-parallel model compiled with fullgraph=True (aot_eager:
the eager kernels) trains on 2 CPU gloo ranks to the eager run's losses, bit for bit, step by step.
Both runs share one spawned world (the script's ``train`` on a Buffer built as its ``main`` does).
(inductor fuses and reorders float32 sums, so its losses agree only to rounding; not run here.)"""
from __future__ import annotations

from test_train_moe import _load_script
from worlds import run_world

STEPS = 4


def case_train(ctx):
    from commlib import Buffer
    script = _load_script()
    R = ctx.world_size
    eager_args = script.parse_args(["--steps", str(STEPS), "--log-every", "1000"])
    compiled_args = script.parse_args(["--steps", str(STEPS), "--log-every", "1000", "--compile",
                                       "--compile-backend", "aot_eager"])
    cfg = Buffer.get_dispatch_config(R)
    buffer = Buffer(ctx.group, num_nvl_bytes=cfg.get_nvl_buffer_size_hint(eager_args.hidden * 2, R))
    eager = script.train(eager_args, "sequential", buffer, ctx.rank, R)
    compiled = script.train(compiled_args, "sequential", buffer, ctx.rank, R)
    assert len(eager) == len(compiled) == STEPS
    assert compiled == eager, f"compiled vs eager losses: {list(zip(compiled, eager))}"
    assert eager[-1] < eager[0], f"the model did not learn: {eager}"


def test_compiled_training_matches_eager():
    results = run_world(2, "test_compile_train", ["train"], case_timeout_s=300)
    assert results["train"] is None, results["train"]
