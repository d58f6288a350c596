"""Probes and models: optional, may import commlib and benchmarks; nothing imports them."""
from __future__ import annotations

import sys
from typing import Optional, Sequence


def write_json(tool: str, argv: Optional[Sequence[str]], rows: list, world_size: int, path: str,
               module: Optional[str] = None, **extra) -> None:
    """Write an experiment's result file (``results.result_document``: device, commit, command, rows) under
    ``path`` and say where. ``tool``: the module's name in experiments/; ``argv``: its arguments (None: the
    command line's); ``module``: the module run, where not experiments.<tool>."""
    from commlib.bench import results   # torch and commlib load only for a run that writes a file

    args = list(argv) if argv is not None else sys.argv[1:]
    doc = results.result_document(tool, " ".join([f"python -m {module or 'experiments.' + tool}"] + args), rows, world_size, **extra)
    print(f"# wrote {results.write_result(doc, path)}")
