"""``sakura-bench compare A.json B.json``: B against A, with the spread.

The speed-up is A's median wall time over B's.  Its range divides the extremes: from A's
fastest over B's slowest trial to A's slowest over B's fastest.  A win is counted only
when the two runs' trial ranges do not overlap; closer than that it is "within the
spread", whatever the medians say.  Fewer than three trials per side, or a speed-up
within 10 %, is flagged: rerun with more trials before reading anything into it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["QUANTITIES", "compare_reports", "label"]

QUANTITIES = (
    ("wall_s", "wall time per trial", "s", "lower"),
    ("step_time_s", "step time (median, after warm-up)", "s", "lower"),
    ("samples_per_s", "samples/s (end to end)", "", "higher"),
    ("tokens_per_s", "tokens/s (end to end)", "", "higher"),
    ("train_epoch_s", "training time per epoch", "s", "lower"),
    ("eval_epoch_s", "evaluation time per epoch (on the training thread)", "s", "lower"),
    ("cpu_s", "CPU time of the trial process (user + system)", "s", "lower"),
    ("cpu_children_s", "CPU time of its child processes", "s", "lower"),
)


def label(report: Mapping[str, Any]) -> str:
    """``mnist-mlp-multi · sakura · pytorch-ddp · async_eval:process``; a workload variant
    follows the runner: ``smollm2-qlora · baseline[peft-bnb] · hf-trainer``."""
    variant = report["workload"].get("variant")
    runner = report["runner"] + (f"[{variant}]" if variant else "")
    parts = [report["workload"]["name"], runner, report["framework"]]
    if report.get("services"):
        parts.append(" ".join(report["services"]))
    return " · ".join(parts)


def _comparability(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    notes = []
    keys = ("name", "scale", "data", "seed", "epochs", "batch_size", "samples_per_epoch", "config")
    for key in keys:
        if a["workload"].get(key) != b["workload"].get(key):
            notes.append(
                f"different workload {key}: {a['workload'].get(key)!r} vs {b['workload'].get(key)!r}"
            )
    for key in ("threads", "device", "warmup_steps", "nproc"):
        if a["settings"].get(key) != b["settings"].get(key):
            notes.append(
                f"different {key}: {a['settings'].get(key)!r} vs {b['settings'].get(key)!r}"
            )
    ea, eb = a["environment"], b["environment"]
    for key in ("cpu", "torch_threads"):
        if ea.get(key) != eb.get(key):
            notes.append(f"different {key}: {ea.get(key)!r} vs {eb.get(key)!r}")
    va, vb = ea.get("versions", {}), eb.get("versions", {})
    if va.get("torch") != vb.get("torch"):
        notes.append(f"different torch: {va.get('torch')} vs {vb.get('torch')}")
    for name, report in (("A", a), ("B", b)):
        cores = report["environment"].get("cpu_affinity") or report["environment"].get(
            "cpu_logical_cores"
        )
        loads = [
            load[0] for load in report["environment"].get("load_average_per_trial", []) if load
        ]
        if cores and loads and max(loads) > 0.5 * cores:
            notes.append(
                f"{name}: the machine was busy (1-minute load average up to {max(loads):.2f} on "
                f"{cores} cores while it ran)"
            )
    return notes


def compare_reports(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict[str, Any]:
    """The comparison of B against A as a JSON-serialisable dict."""
    sa, sb = a["summary"], b["summary"]
    rows = []
    for key, title, unit, better in QUANTITIES:
        qa, qb = sa.get(key), sb.get(key)
        if not qa and not qb:
            continue
        ratio = None
        if qa and qb and qa["median"] and qb["median"]:
            ratio = qb["median"] / qa["median"]
        rows.append(
            {
                "key": key,
                "title": title,
                "unit": unit,
                "better": better,
                "a": qa,
                "b": qb,
                "b_over_a": ratio,
            }
        )
    for key, title in (
        ("peak_rss_mib", "peak RSS, trial process (MiB)"),
        ("peak_rss_children_mib", "peak RSS, its child processes (MiB)"),
        ("peak_cuda_allocated_mib", "peak CUDA memory allocated (MiB)"),
    ):
        ma, mb = sa.get(key), sb.get(key)
        if ma is None and mb is None:
            continue
        rows.append(
            {"key": key, "title": title, "unit": "", "better": "lower", "a": ma, "b": mb,
             "b_over_a": mb / ma if ma and mb else None}
        )  # fmt: skip
    metrics = []
    fa, fb = sa.get("final_metrics") or {}, sb.get("final_metrics") or {}
    for key in sorted(set(fa) | set(fb)):
        metrics.append({"metric": key, "a": fa.get(key), "b": fb.get(key)})
    wall_a, wall_b = sa["wall_s"], sb["wall_s"]
    speedup = wall_a["median"] / wall_b["median"]
    low, high = wall_a["min"] / wall_b["max"], wall_a["max"] / wall_b["min"]
    if wall_b["max"] < wall_a["min"]:
        verdict = "B is faster, beyond the spread"
    elif wall_a["max"] < wall_b["min"]:
        verdict = "A is faster, beyond the spread"
    else:
        verdict = "within the spread: no win either way"
    advice = []
    trials = min(wall_a["n"], wall_b["n"])
    if trials < 3:
        advice.append(f"only {trials} trial(s) on one side: rerun both with --trials 3 or more")
    elif abs(speedup - 1.0) < 0.10 and trials < 5:
        advice.append("the medians are within 10 %: rerun both with --trials 5 or more")
    ideal = None
    ta, ea = sa.get("train_epoch_s"), sa.get("eval_epoch_s")
    if ta and ea and any(s.startswith("async_eval") for s in b.get("services", [])):
        ideal = (ta["median"] + ea["median"]) / max(ta["median"], ea["median"])
    return {
        "a": {"label": label(a), "path": a.get("_path")},
        "b": {"label": label(b), "path": b.get("_path")},
        "speedup": speedup,
        "speedup_range": [low, high],
        "verdict": verdict,
        "ideal_overlap_speedup": ideal,
        "trials": [wall_a["n"], wall_b["n"]],
        "rows": rows,
        "metrics": metrics,
        "metrics_agree": _agree(fa, fb),
        "notes": _comparability(a, b),
        "advice": advice,
        "errors": {"a": sa.get("errors", []), "b": sb.get("errors", [])},
    }


def _agree(fa: Mapping[str, float], fb: Mapping[str, float], rel: float = 1e-4) -> bool | None:
    common = set(fa) & set(fb)
    if not common:
        return None
    return all(abs(fa[k] - fb[k]) <= rel * max(1.0, abs(fa[k])) for k in common)
