"""Host time of two engines measured in one run: ``bench_internode --host`` JSONs of a baseline and of
a change, alternated on the same machine (gpu_check stages such as base_a, fused_a, base_b, fused_b).

    python -m benchmarks.host_compare --base A.json B.json --new C.json D.json --json OUT.json

Per op present in every file: each file's own and whole host time (mean over the ranks, and the
slowest rank's), their mean over the baseline's files and over the change's, and the ratio change /
baseline. The inputs must come from one device; the output names them (path, commit, command).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys


def _per_op(doc: dict) -> dict:
    """op -> {own_mean, host_mean, own_slowest, host_slowest} (us) of one bench_internode --host JSON:
    the means over its ranks (``by_rank`` [host, own, ...]) and the slowest rank's figures."""
    out = {}
    for row in doc["rows"]:
        ranks = row.get("by_rank")
        if not ranks:
            continue
        out[row["op"] + (f" cap {row['chunk_cap']}" if row.get("chunk_cap", 1) != 1 else "")] = {
            "own_mean": statistics.fmean(r[1] for r in ranks), "host_mean": statistics.fmean(r[0] for r in ranks),
            "own_slowest": row["own_us"], "host_slowest": row["host_us"]}
    return out


def compare(base: list, new: list) -> tuple:
    """(rows, ratios) for the baseline's and the change's documents (lists of parsed JSONs)."""
    runs = [_per_op(d) for d in base + new]
    ops = [op for op in runs[0] if all(op in r for r in runs)]
    rows, ratios = [], []
    for op in ops:
        row = {"op": op}
        for key in ("own_mean", "host_mean", "own_slowest", "host_slowest"):
            b = [r[op][key] for r in runs[:len(base)]]
            n = [r[op][key] for r in runs[len(base):]]
            row[key] = {"base": b, "new": n, "base_mean": statistics.fmean(b), "new_mean": statistics.fmean(n),
                        "ratio": statistics.fmean(n) / statistics.fmean(b)}
        rows.append(row)
        ratios.append({"op": op, "baseline_op": op + " (base)",
                       "own_mean_ratio": round(row["own_mean"]["ratio"], 4),
                       "host_mean_ratio": round(row["host_mean"]["ratio"], 4)})
    return rows, ratios


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", nargs="+", required=True, help="the baseline's bench_internode --host JSONs")
    ap.add_argument("--new", nargs="+", required=True, help="the change's, from the same run")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the comparison here")
    a = ap.parse_args(argv)
    docs = {}
    for path in a.base + a.new:
        with open(path) as f:
            docs[path] = json.load(f)
    devices = {json.dumps(d.get("device"), sort_keys=True) for d in docs.values()}
    if len(devices) != 1:
        raise SystemExit(f"host_compare: the inputs come from different devices: {sorted(devices)}")
    rows, ratios = compare([docs[p] for p in a.base], [docs[p] for p in a.new])
    if not rows:
        raise SystemExit("host_compare: no op with per-rank figures in every input")
    print("# host_compare: us, mean of the inputs (base -> new, ratio); own / whole, mean over ranks")
    for r in rows:
        print(f"  {r['op']:<22} own {r['own_mean']['base_mean']:7.1f} -> {r['own_mean']['new_mean']:7.1f} "
              f"({r['own_mean']['ratio']:.2f})   whole {r['host_mean']['base_mean']:7.1f} -> "
              f"{r['host_mean']['new_mean']:7.1f} ({r['host_mean']['ratio']:.2f})")
    if a.json:
        from commlib.bench import results
        cmd = "python -m benchmarks.host_compare " + " ".join(argv if argv is not None else sys.argv[1:])
        doc = results.result_document("host_compare", cmd.strip(), rows, ratios=ratios)
        doc["device"] = next(iter(docs.values())).get("device")   # the inputs' device, not this machine's
        doc["inputs"] = [{"path": p, "role": "base" if p in a.base else "new", "git": d.get("git"),
                          "command": d.get("command")} for p, d in docs.items()]
        with open(a.json, "w") as f:
            f.write(json.dumps(doc, indent=2, default=str) + "\n")
        print(f"# wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
