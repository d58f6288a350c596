"""bench_overlap's printed table (nccl-tests style: '#' lines and data rows) and its timeline plot."""
from __future__ import annotations

from benchmarks.overlap.analysis import BALANCED_RANGE, TARGET_DUAL_OVER_MAX, TARGET_SPEEDUP, verdict_text
from benchmarks.overlap.check import NOT_CHECKED, status

def print_table(result: dict) -> None:
    sh = result["shapes"]
    print(f"[overlap] device={result['device']} ranks={result['num_ranks']} backend={result['backend']} "
          f"tokens/micro-batch={sh['tokens']} hidden={sh['hidden']} experts={sh['experts']} "
          f"({sh['experts'] // result['num_ranks']}/rank) top-{sh['topk']} expert_hidden={sh['expert_hidden']} "
          f"heads={sh['heads']}x{sh['head_dim']} layers={sh['layers']} fp8={sh['fp8']} "
          f"issue_order={result['issue_order']} comm_priority={result['comm_stream_priority']} "
          f"sm_carveout={result['sm_carveout']['sms']} defer_wgrad={result['defer_weight_grads']} "
          f"moe_row_kernel={result.get('moe_row_kernel')} ce_bytes={result.get('ce_bytes')} ce_staging={result.get('ce_staging')} comm_sms={result['comm_sms']} ({result['comm_sms_source']})")
    print(f"#{'phase':>18} {'sequential':>11} {'dual':>9} {'comm':>9} {'compute':>9} {'comm/comp':>9} "
          f"{'dual/max':>9} {'speedup':>8} {'bound':>6} {'check':>6}  verdict")
    print(f"#{'':>18} {'(ms)':>11} {'(ms)':>9} {'(ms)':>9} {'(ms)':>9} {'':>9} {'':>9} {'':>8} {'':>6} {'':>6}")
    checks = result["check"]["phases"]
    for name, f in result["figures"].items():
        verdict = verdict_text(f["verdict"])
        print(f" {name:>18} {f['sequential_ms']:11.3f} {f['dual_ms']:9.3f} {f['comm_ms']:9.3f} "
              f"{f['compute_ms']:9.3f} {f['comm_over_compute']:9.2f} {f['dual_over_max_comm_compute']:9.3f} "
              f"{f['speedup_over_sequential']:8.3f} {f['speedup_bound_comm_plus_compute_over_max']:6.2f} "
              f"{status(checks.get(name, NOT_CHECKED)):>6}  {verdict}")
    for name, f in result["figures"].items():
        if "schedule_bound_over_max" in f:
            b, i = f["dual_busy_over_sequential"], f["dual_idle_share"]
            halves = (f"; forward half + backward half {f['halves_floor_over_max']:.3f} x max"
                      if "halves_floor_over_max" in f else "")
            print(f"# {name:>18}: schedule bound {f['schedule_bound_over_max']:.3f} x max{halves}; dual busy / "
                  f"sequential: comm {b['comm']:.2f}, compute {b['compute']:.2f}; idle share: comm {i['comm']:.2f}, "
                  f"compute {i['compute']:.2f}")
            if "compute_dense_ms" in f:
                print(f"# {name:>18}: compute dense (transfers replayed) {f['compute_dense_ms']:.3f} ms = "
                      f"{f['compute_dense_over_sequential']:.3f} x sequential compute; dual / max(comm, dense "
                      f"compute) {f['dual_over_max_comm_compute_dense']:.3f}, comm / dense compute "
                      f"{f['comm_over_compute_dense']:.2f}: {verdict_text(f['verdict_dense'])}; outputs not checked "
                      "(transfers replayed)")
            print(f"# {name:>18}: sequential step means (ms): "
                  + ", ".join(f"{k} {v:.2f}" for k, v in f.get("sequential_stage_ms", {}).items()))
    for window, gpus in (result.get("gpu_clocks") or {}).items():
        print(f"# clocks {window:>29}: " + "; ".join(
            f"gpu{g} {c['sm_mhz_mean']:.0f} MHz (min {c['sm_mhz_min']:.0f}), "
            + (f"{c['power_w_mean']:.0f} W, " if c["power_w_mean"] is not None else "")
            + f"power cap {100 * c['power_cap_share']:.0f}% of {c['samples']} samples" for g, c in gpus.items()))
    c = result["check"]
    print(f"# check (dual vs sequential: outputs + gradients): {status(c)}"
          + (f", max relative error {c['max_relative_error']:.3e}" + (f" ({c['worst']})" if c["worst"] else "")
             + f", tolerance {c['tolerance']}"
             if c["checked"] else " (no phase compared)"))
    print(f"# targets: dual/max(comm, compute) <= {TARGET_DUAL_OVER_MAX}; speedup >= {TARGET_SPEEDUP} where comm ~ "
          f"compute ({BALANCED_RANGE[0]:.2f} <= comm/compute <= {BALANCED_RANGE[1]:.2f}); bound = (comm + compute) / max")


def plot_timeline(result: dict, path: str) -> None:
    """One panel per phase and schedule; two rows (compute, comm); colour = micro-batch."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(name, sched, f[f"spans_{sched}"], f) for name, f in result["figures"].items()
              for sched in ("sequential", "dual")]
    fig, axes = plt.subplots(len(panels), 1, figsize=(14, 1.6 * len(panels)), squeeze=False)
    colours = {"0": "tab:blue", "1": "tab:orange"}
    for ax, (name, sched, spans, fig_) in zip(axes[:, 0], panels):
        for s in spans:
            row = 1 if s["stream"] == "compute" else 0
            mb = s["label"].split(".")[0]
            width = max(s["end_ms"] - s["start_ms"], 1e-6)
            ax.broken_barh([(s["start_ms"], width)], (row - 0.4, 0.8), facecolors=colours.get(mb, "grey"),
                           edgecolor="black", linewidth=0.3, alpha=0.85 if ".B." in s["label"] else 1.0,
                           hatch="//" if ".B." in s["label"] else None)
            if width > 0.04 * max(x["end_ms"] for x in spans):
                ax.text(s["start_ms"] + width / 2, row, s["label"].split(".", 1)[1], ha="center", va="center",
                        fontsize=6)
        ax.set_yticks([0, 1], ["comm", "compute"])
        ms = fig_[f"{sched}_ms"]
        extra = (f"  (comm {fig_['comm_ms']:.2f} / compute {fig_['compute_ms']:.2f} ms = "
                 f"{fig_['comm_over_compute']:.2f})" if sched == "sequential" else
                 f"  (dual / max {fig_['dual_over_max_comm_compute']:.3f}, speedup "
                 f"{fig_['speedup_over_sequential']:.3f}"
                 + (f"; compute alone, back to back: {fig_['compute_dense_ms']:.2f} ms, dual / max "
                    f"{fig_['dual_over_max_comm_compute_dense']:.3f}" if "compute_dense_ms" in fig_ else "") + ")")
        ax.set_title(f"{name}: {sched}, {ms:.2f} ms{extra}", fontsize=8, loc="left")
        ax.set_xlabel("ms", fontsize=7)
    fig.suptitle(f"commlib dual pipeline on {result['device']} x{result['num_ranks']}, preset "
                 f"{result['shapes']['preset']}, issue order {result.get('issue_order', 'auto')}, "
                 f"comm SMs {result.get('comm_sms')} "
                 "(blue: micro-batch 0, orange: 1, hatched: backward)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)

