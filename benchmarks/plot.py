"""Plot bandwidth vs tokens per rank from the JSON that ``benchmarks.alltoall_perf`` / ``python -m commlib.bench`` write.

    python -m benchmarks.plot benchmarks/results/alltoall_perf_*.json [--out benchmarks/results/plots]

One PNG per JSON file, three panels (dispatch BF16, dispatch FP8, combine), each with:
  commlib (full call; dispatch BF16 also the cached-handle call), the all_to_all_single
  baseline of the same run, and DeepEP's published figures on 2 x H200 at 4096 tokens/rank
  (dispatch BF16 339 GB/s, FP8 246, combine 287; logical bandwidth, cached mode) as markers
  (GPU results only, unless --deepep on).
Bandwidth is algbw (logical: bytes received or sent back per rank / time) unless --metric busbw.
Needs matplotlib (``pip install matplotlib``); everything else is the JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Same numbers as commlib.bench.main.DEEPEP_2XH200_GBPS; repeated so plotting needs no torch.
DEEPEP_2XH200_GBPS = {"dispatch_bf16": 339.0, "dispatch_fp8": 246.0, "combine": 287.0}
DEEPEP_TOKENS = 4096

PANELS = [
    ("dispatch BF16", [("dispatch_bf16", "commlib", "-o"), ("dispatch_bf16_cached", "commlib (cached handle)", "--o"),
                       ("a2a_dispatch_bf16", "all_to_all_single baseline", ":s")], "dispatch_bf16"),
    ("dispatch FP8", [("dispatch_fp8", "commlib", "-o"), ("a2a_dispatch_fp8", "all_to_all_single baseline", ":s")],
     "dispatch_fp8"),
    ("combine BF16", [("combine", "commlib", "-o"), ("a2a_combine", "all_to_all_single baseline", ":s")], "combine"),
]


def series(doc: dict, op: str, metric: str) -> tuple[list, list]:
    rows = sorted((r for r in doc.get("rows", []) if r.get("op") == op), key=lambda r: r["tokens"])
    return [r["tokens"] for r in rows], [r[f"{metric}_gbps"] for r in rows]


def title_of(doc: dict) -> str:
    dev = doc.get("device", {})
    dev = dev.get("description", dev) if isinstance(dev, dict) else dev
    wl = doc.get("workload", {})
    nodes = doc.get("num_nodes", 1)
    commit = (doc.get("git", {}) or {}).get("commit", "unknown")[:10]
    return (f"{doc.get('tool', '?')}: {doc.get('world_size', '?')} ranks ({nodes} node(s)), {dev}, "
            f"backend {doc.get('backend', '?')}, hidden {wl.get('hidden', '?')}, top-{wl.get('num_topk', '?')} "
            f"of {wl.get('num_experts', '?')} | git {commit}")


def plot_file(path: Path, out_dir: Path, metric: str, deepep: str = "auto") -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.loads(path.read_text())
    dev = doc.get("device", {})
    on_gpu = isinstance(dev, dict) and dev.get("kind") == "cuda"
    show_deepep = deepep == "on" or (deepep == "auto" and on_gpu)
    fig, axes = plt.subplots(1, len(PANELS), figsize=(6 * len(PANELS), 4.6), squeeze=False)
    for ax, (name, lines, deepep_key) in zip(axes[0], PANELS):
        for op, label, style in lines:
            xs, ys = series(doc, op, metric)
            if xs:
                ax.plot(xs, ys, style, label=label)
        if show_deepep and metric == "algbw":
            ax.plot([DEEPEP_TOKENS], [DEEPEP_2XH200_GBPS[deepep_key]], "r*", markersize=14,
                    label=f"DeepEP, 2xH200 ({DEEPEP_2XH200_GBPS[deepep_key]:.0f} GB/s)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel(f"{metric} (GB/s)")
        ax.set_title(name)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title_of(doc), fontsize=9)
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{path.stem}_{metric}.png"
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", nargs="+", type=Path, help="result files from alltoall_perf.py --json or commlib.bench.main --json")
    p.add_argument("--out", type=Path, default=None, help="folder for the PNGs (default: <json folder>/plots)")
    p.add_argument("--metric", choices=("algbw", "busbw"), default="algbw")
    p.add_argument("--deepep", choices=("auto", "on", "off"), default="auto",
                   help="DeepEP's H200 markers (auto: only for GPU results, they would flatten a CPU plot)")
    args = p.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("[plot] matplotlib is missing: pip install matplotlib", file=sys.stderr)
        return 2
    for path in args.json:
        out = plot_file(path, args.out or path.parent / "plots", args.metric, args.deepep)
        print(f"[plot] {path} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
