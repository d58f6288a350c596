"""What the recorded step spans say: the figures of a phase and its verdicts against the targets, the
schedule's own bound, the halves floor, where the gap to max(comm, compute) goes, comm-kernel traces."""
from __future__ import annotations

import re

BALANCED_RANGE = (0.75, 4 / 3)          # "comm ~ compute": comm / compute within this range
TARGET_DUAL_OVER_MAX, TARGET_SPEEDUP = 1.15, 1.3


def sum_spans(spans, stream) -> float:
    return sum(s["end_ms"] - s["start_ms"] for s in spans if s["stream"] == stream)


def schedule_bound_ms(spans_seq: list, spans_dual: list) -> float:
    """The dual run replayed with every step at its sequential duration: each step starts when the
    step before it on its stream (the dual run's order) and the step before it in its micro-batch
    (label prefix "0." / "1.", the dual run's order) have ended. No interference, no host delay:
    what the schedule's pairing alone costs (two micro-batches in lockstep pay max(comm, compute)
    per pair, not per run)."""
    seq = {(s["label"], s["stream"]): s["end_ms"] - s["start_ms"] for s in spans_seq}
    last_stream: dict = {}
    last_chain: dict = {}
    end = 0.0
    for s in sorted(spans_dual, key=lambda s: s["start_ms"]):
        chain = s["label"].split(".", 1)[0]
        t0 = max(last_stream.get(s["stream"], 0.0), last_chain.get(chain, 0.0))
        t1 = t0 + seq.get((s["label"], s["stream"]), s["end_ms"] - s["start_ms"])
        last_stream[s["stream"]] = last_chain[chain] = t1
        end = max(end, t1)
    return end


def stage_means_ms(spans: list) -> dict:
    """Mean span per stage kind: the label without its micro-batch and layer number ("0.F.attn1"
    -> "F.attn", "1.B.experts0" -> "B.experts"): the sizes of the steps the dual schedule pairs."""
    by_kind: dict = {}
    for s in spans:
        kind = re.sub(r"\d+$", "", s["label"].split(".", 1)[-1])
        by_kind.setdefault(kind, []).append(s["end_ms"] - s["start_ms"])
    return {k: sum(v) / len(v) for k, v in sorted(by_kind.items())}


def halves_floor_ms(spans_seq: list) -> float:
    """Two forwards, then two backwards: no backward step can start before the forwards' last steps,
    so the dual run takes at least max(comm, compute) of the forward half plus the same of the
    backward half (sequential spans; labels "m.F.*" / "m.B.*"). Approximate by one step: micro-batch
    0's backward may start while micro-batch 1's last forward step runs."""
    def half(tag: str) -> float:
        part = [s for s in spans_seq if f".{tag}." in s["label"]]
        return max(sum_spans(part, "comm"), sum_spans(part, "compute"))
    return half("F") + half("B")


def gap_split(spans_seq: list, spans_dual: list, busiest_ms: float) -> dict:
    """Where dual / max(comm, compute) goes, from one rank's recorded spans: the schedule's own
    bound (``schedule_bound_ms``), each stream's busy time in the dual run against the sequential
    one (interference: the same steps take longer while the other stream runs), and each stream's
    idle share of the dual run."""
    busy = {w: {k: sum_spans(spans, k) for k in ("comm", "compute")}
            for w, spans in (("seq", spans_seq), ("dual", spans_dual))}
    span = (max(s["end_ms"] for s in spans_dual) - min(s["start_ms"] for s in spans_dual)) if spans_dual else 0.0
    bound = schedule_bound_ms(spans_seq, spans_dual)
    return {
        "schedule_bound_ms": bound,
        "schedule_bound_over_max": bound / max(busiest_ms, 1e-9),
        "dual_busy_over_sequential": {k: busy["dual"][k] / max(busy["seq"][k], 1e-9) for k in ("comm", "compute")},
        "dual_idle_share": {k: 1 - busy["dual"][k] / max(span, 1e-9) for k in ("comm", "compute")},
        "sequential_stage_ms": stage_means_ms(spans_seq),
    }


COMM_TRACE_SLOTS = 512  # trace slots per kernel kind: more than the comm launches of one timeline run
COMM_TRACE_SUMMARY = {  # summary key -> what it is (ms, summed over the comm steps of a run)
    "span_ms": "comm steps' spans (CUDA events on the comm stream)",
    "kernel_ms": "data kernels' own time: first CTA start to last CTA end",
    "lead_ms": "span start to the kernel's first CTA (notify, host wait, launch, SMs), least step as 0",
    "skew_ms": "first to last CTA start inside each kernel (SMs taken late)",
}


def _comm_kernel_kind(label: str) -> str:
    """The data kernel a comm step runs: forward dispatch and combine' (a cached dispatch of the
    gradients) the dispatch kernel; forward combine and dispatch' (a combine) the combine kernel."""
    fwd = ".F." in label
    if "dispatch" in label.rsplit(".", 1)[-1]:
        return "dispatch" if fwd else "combine"
    return "combine" if fwd else "dispatch"


def comm_trace_steps(spans: list, history: dict) -> list:
    """Match a timeline run's comm steps (in comm-stream order) with its data kernels' traces (launch
    order per kind; ``backend.trace_history``) and time each step: its span, the kernel's own time,
    how far its CTAs' starts spread, and when its first CTA started after the span began. The last
    compares %globaltimer with CUDA events, so it is relative: the step whose kernel started soonest
    after its span began counts 0."""
    steps, used = [], {k: 0 for k in history}
    for s in sorted((s for s in spans if s["stream"] == "comm"), key=lambda s: s["start_ms"]):
        kind = _comm_kernel_kind(s["label"])
        if used[kind] >= len(history[kind]):
            raise RuntimeError(f"comm trace: no {kind} launch left for step {s['label']}")
        ctas = history[kind][used[kind]]
        used[kind] += 1
        starts, ends = [c[0] for c in ctas], [c[2] for c in ctas]
        steps.append({"label": s["label"], "kernel": kind, "span_ms": s["end_ms"] - s["start_ms"],
                      "kernel_ms": (max(ends) - min(starts)) / 1e6, "skew_ms": (max(starts) - min(starts)) / 1e6,
                      "_offset_ms": min(starts) / 1e6 - s["start_ms"]})
    extra = {k: len(history[k]) - n for k, n in used.items() if len(history[k]) != n}
    if extra:
        raise RuntimeError(f"comm trace: launches without a comm step: {extra}")
    base = min((st["_offset_ms"] for st in steps), default=0.0)
    for st in steps:
        st["lead_ms"] = st.pop("_offset_ms") - base
    return steps


def comm_trace_summary(rank_steps: dict) -> dict:
    """Per schedule: COMM_TRACE_SUMMARY's sums over the comm steps."""
    return {sched: {k: sum(st[k] for st in steps) for k in COMM_TRACE_SUMMARY} for sched, steps in rank_steps.items()}


def figures(seq_ms: float, dual_ms: float, comm_ms: float, compute_ms: float) -> dict:
    """One phase's figures and its verdicts against the issue's targets."""
    busiest = max(comm_ms, compute_ms, 1e-9)
    ratio = comm_ms / max(compute_ms, 1e-9)
    dual_over_max = dual_ms / busiest
    speedup = seq_ms / max(dual_ms, 1e-9)
    balanced = BALANCED_RANGE[0] <= ratio <= BALANCED_RANGE[1]
    return {
        "sequential_ms": seq_ms, "dual_ms": dual_ms, "comm_ms": comm_ms, "compute_ms": compute_ms,
        "comm_over_compute": ratio,
        "dual_over_max_comm_compute": dual_over_max,
        "speedup_over_sequential": speedup,
        # What a perfect overlap gives against a sequential run without gaps: (comm + compute) / max.
        "speedup_bound_comm_plus_compute_over_max": (comm_ms + compute_ms) / busiest,
        "verdict": {
            "dual_over_max_ok": dual_over_max <= TARGET_DUAL_OVER_MAX,
            "comm_about_equal_compute": balanced,
            "speedup_target_applies": balanced,
            "speedup_ok": speedup >= TARGET_SPEEDUP,
        },
    }


def verdict_text(v: dict) -> str:
    return (f"dual/max {'ok' if v['dual_over_max_ok'] else 'MISSED'}; speedup "
            + (("ok" if v["speedup_ok"] else "MISSED") if v["speedup_target_applies"] else "n/a (comm !~ compute)"))

