"""The dual-vs-sequential check of every measured phase: the dual schedule's outputs and gradients
against those of the same work run one micro-batch after the other. A wrong result makes
``python -m benchmarks.bench_overlap`` exit non-zero; a result not compared says so (``"checked":
false``, "N/A" in the table)."""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

GPU_TOLERANCE = 1e-2   # relative L2 error: float atomics reorder sums; a missing wait gives errors ~1
NOT_CHECKED = {"checked": False, "ok": None}


def compare(model: torch.nn.Module, run: Callable, device: torch.device, phase: str) -> dict:
    """Run one phase sequentially and dual, and compare outputs and parameter gradients.

    Args:
      model: the benchmark's model; its gradients are cleared before and after each run.
      run: run(overlap: bool) -> the phase's outputs (a tensor or a sequence of tensors, any dtype).
      device: CPU (every result must be bit-identical) or CUDA (``GPU_TOLERANCE``).
      phase: the phase's name, for the printed line.
    Returns:
      {"checked": True, "max_relative_error": float, "worst": the tensor with it, "compared": how many
      tensors, "tolerance": float, "ok": bool}: the worst over all ranks, the same on every rank.
    """
    def once(overlap: bool) -> dict:
        model.zero_grad(set_to_none=True)
        outs = run(overlap)
        outs = [outs] if isinstance(outs, torch.Tensor) else list(outs)
        got = {f"out{i}": o.detach().clone() for i, o in enumerate(outs)}
        got.update({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        model.zero_grad(set_to_none=True)
        return got

    ref, dual = once(False), once(True)
    worst, worst_name = 0.0, None
    if ref.keys() != dual.keys():
        worst, worst_name = float("inf"), sorted(ref.keys() ^ dual.keys())[0]
    else:
        for name, r in ref.items():
            err = ((dual[name].float() - r.float()).norm() / r.float().norm().clamp_min(1e-30)).item()
            err = err if err == err else float("inf")   # NaN: as wrong as it gets
            if err > worst:
                worst, worst_name = err, name
    tol = 0.0 if device.type == "cpu" else GPU_TOLERANCE
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (worst, worst_name))
    worst, worst_name = max(everyone, key=lambda x: x[0])
    ok = worst <= tol
    if dist.get_rank() == 0:
        where = f" ({worst_name})" if worst_name else ""
        print(f"[overlap] check {phase}: dual vs sequential, {len(ref)} tensors (outputs + gradients): max relative "
              f"error {worst:.3e}{where} {'ok' if ok else 'WRONG'} (tolerance {tol})")
    return {"checked": True, "max_relative_error": worst, "worst": worst_name, "compared": len(ref),
            "tolerance": tol, "ok": ok}


def summarize(phases: dict) -> dict:
    """The run's check from its phases' (``compare`` or ``NOT_CHECKED``): ok when every compared phase
    is ok (None when none was compared), the worst error among them, and the phases themselves."""
    checked = {n: c for n, c in phases.items() if c["checked"]}
    worst = max(checked.items(), key=lambda kv: kv[1]["max_relative_error"], default=(None, None))
    return {"checked": bool(checked), "ok": all(c["ok"] for c in checked.values()) if checked else None,
            "max_relative_error": worst[1]["max_relative_error"] if worst[1] else None,
            "worst": f"{worst[0]}: {worst[1]['worst']}" if worst[1] and worst[1]["worst"] else None,
            "tolerance": max((c["tolerance"] for c in checked.values()), default=None), "phases": phases}


def status(check: dict) -> str:
    """'ok', 'WRONG' or 'N/A' (not compared)."""
    if not check.get("checked"):
        return "N/A"
    return "ok" if check["ok"] else "WRONG"


def exit_code(result: dict) -> int:
    """1 where a compared result was wrong, else 0 (also when nothing was compared)."""
    return 1 if ((result or {}).get("check") or {}).get("ok") is False else 0
