"""The RunReport: one JSON file per ``sakura-bench run``.

Layout (``schema_version`` 1)::

    {
      "schema": "sakura-bench/run-report", "schema_version": 1, "created": ISO time,
      "workload": {name, scale, data, seed, config, epochs, batch_size, samples_per_epoch,
                   params, trainable_params, provided_by},
      "runner": "baseline" | "sakura", "framework": NAME, "services": [SPEC, ...],
      "settings": {trials, epochs, seed, scale, threads, device, warmup_steps, isolation, nproc,
                   schedule},
      "trials": [ {trial, wall_s, setup_s, finish_s, process_s, steps, warmup_steps_excluded,
                   step_time_s: {median, min, max, mean, spread, n},
                   samples_per_s, train_samples_per_s, tokens_per_s,
                   epochs: [{epoch, train_s, eval_s, steps, train_loss, eval}],
                   final_metrics, memory: {peak_rss_mib, peak_rss_children_mib, cpu_s, cpu_children_s, cuda},
                   errors, load_average} ],
      "summary": {wall_s, step_time_s, samples_per_s, tokens_per_s, train_epoch_s,
                  eval_epoch_s: {median, min, max, mean, spread, n}, final_metrics,
                  metrics_agree, peak_rss_mib, peak_rss_children_mib, cpu_s, cpu_children_s,
                  peak_cuda_allocated_mib, errors},
      "environment": {versions, platform, cpu, cores, memory, threads, device, gpu, git,
                      load_average}
    }

Times are seconds.  ``wall_s`` is one trial's training, first step to last (warm-up and
any wait for pending asynchronous evaluations included; process start, imports and data
building excluded: see ``setup_s`` and ``process_s``).  ``step_time_s`` covers the steps
after the warm-up.  Summaries are over trials (the step time over the trials' medians).
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sakura.fileio import atomic_writer
from sakura_bench.errors import BenchError
from sakura_bench.measure import stats

__all__ = [
    "SCHEMA",
    "SCHEMA_VERSION",
    "build_report",
    "load_report",
    "report_filename",
    "validate_report",
    "write_report",
]

SCHEMA = "sakura-bench/run-report"
SCHEMA_VERSION = 1
_REQUIRED = (
    "workload",
    "runner",
    "framework",
    "services",
    "settings",
    "trials",
    "summary",
    "environment",
)


def report_filename(workload: str, runner: str, framework: str, variant: str | None = None) -> str:
    """``<workload>-<runner>-<framework>.json``; with a workload variant
    ``<workload>-<runner>-<variant>-<framework>.json``."""
    if variant:
        return f"{workload}-{runner}-{variant}-{framework}.json"
    return f"{workload}-{runner}-{framework}.json"


def _values(trials: Sequence[Mapping[str, Any]], key: str) -> list[float]:
    return [float(t[key]) for t in trials if isinstance(t.get(key), (int, float))]


def _metrics_agree(finals: list[Mapping[str, float] | None], rel: float = 1e-6) -> bool:
    present = [f for f in finals if f]
    if len(present) < 2:
        return True
    first = present[0]
    for other in present[1:]:
        if set(other) != set(first):
            return False
        for key, value in first.items():
            if not math.isclose(value, other[key], rel_tol=rel, abs_tol=1e-9):
                return False
    return True


def summarize(trials: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Medians and spreads over trials."""
    step_medians = [
        t["step_time_s"]["median"] for t in trials if isinstance(t.get("step_time_s"), Mapping)
    ]
    train_epochs = [e["train_s"] for t in trials for e in t["epochs"]]
    eval_epochs = [e["eval_s"] for t in trials for e in t["epochs"] if e.get("eval_s") is not None]
    finals = [t.get("final_metrics") for t in trials]
    last = next((f for f in reversed(finals) if f), None)
    cuda = [
        t["memory"]["cuda"]["peak_allocated_mib"] for t in trials if t.get("memory", {}).get("cuda")
    ]
    return {
        "wall_s": stats(_values(trials, "wall_s")),
        "step_time_s": stats(step_medians),
        "samples_per_s": stats(_values(trials, "samples_per_s")),
        "train_samples_per_s": stats(_values(trials, "train_samples_per_s")),
        "tokens_per_s": stats(_values(trials, "tokens_per_s")),
        "train_epoch_s": stats(train_epochs),
        "eval_epoch_s": stats(eval_epochs),
        "final_metrics": last,
        "metrics_agree": _metrics_agree(finals),
        "peak_rss_mib": max((t["memory"]["peak_rss_mib"] for t in trials), default=None),
        "peak_rss_children_mib": max(
            (t["memory"]["peak_rss_children_mib"] or 0.0 for t in trials), default=None
        )
        or None,
        "peak_cuda_allocated_mib": max(cuda, default=None),
        "cpu_s": stats([t["memory"]["cpu_s"] for t in trials if "cpu_s" in t.get("memory", {})]),
        "cpu_children_s": stats(
            [
                t["memory"]["cpu_children_s"]
                for t in trials
                if t.get("memory", {}).get("cpu_children_s")
            ]
        ),
        "errors": sorted({e for t in trials for e in t.get("errors", [])}),
    }


def build_report(
    *,
    workload: str,
    runner: str,
    framework: str,
    services: Sequence[str],
    settings: Mapping[str, Any],
    trials: Sequence[Mapping[str, Any]],
    provided_by: Mapping[str, str | None],
) -> dict[str, Any]:
    """A RunReport from the trials' results (each as :func:`sakura_bench.trial.run_trial`
    returned it)."""
    if not trials:
        raise BenchError("a report needs at least one trial")
    first = trials[0]
    described = dict(first["workload"])
    described.update(
        {
            "epochs": first["epochs_setting"],
            "batch_size": described.get("config", {}).get("batch_size"),
            "samples_per_epoch": first["samples_per_epoch"],
            "params": first["params"],
            "trainable_params": first["trainable_params"],
            "provided_by": provided_by.get("workload"),
        }
    )
    environment = dict(first["environment"])
    environment["load_average_per_trial"] = [
        t.get("environment", {}).get("load_average") for t in trials
    ]
    kept = []
    for t in trials:
        entry = {
            k: v for k, v in t.items() if k not in ("environment", "workload", "epochs_setting")
        }
        entry["load_average"] = t.get("environment", {}).get("load_average")
        kept.append(entry)
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "workload": described,
        "runner": runner,
        "framework": framework,
        "framework_provided_by": provided_by.get("framework"),
        "services": list(services),
        "settings": dict(settings),
        "trials": kept,
        "summary": summarize(trials),
        "environment": environment,
    }


def validate_report(report: Any) -> list[str]:
    """What is wrong with ``report`` as a RunReport (empty when it is valid)."""
    if not isinstance(report, Mapping):
        return [f"a report is a JSON object, got {type(report).__name__}"]
    problems = []
    if report.get("schema") != SCHEMA:
        problems.append(f"schema is {report.get('schema')!r}, expected {SCHEMA!r}")
    version = report.get("schema_version")
    if version != SCHEMA_VERSION:
        problems.append(f"schema_version is {version!r}; this sakura-bench reads {SCHEMA_VERSION}")
    for key in _REQUIRED:
        if key not in report:
            problems.append(f"missing {key!r}")
    trials = report.get("trials")
    if isinstance(trials, list):
        if not trials:
            problems.append("no trials")
        for i, trial in enumerate(trials):
            if not isinstance(trial, Mapping) or not isinstance(trial.get("wall_s"), (int, float)):
                problems.append(f"trial {i} has no wall_s")
    elif "trials" in report:
        problems.append("trials is not a list")
    return problems


def write_report(report: Mapping[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write ``report`` atomically and durably (:func:`sakura.fileio.atomic_writer`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_writer(path, "w") as f:
        f.write(json.dumps(report, indent=2, sort_keys=False) + "\n")
    return path


def load_report(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and validate a RunReport; BenchError naming the file and the problem."""
    path = Path(path)
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BenchError(f"{path}: no such report file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BenchError(f"{path} is not a readable JSON report: {exc}") from None
    problems = validate_report(report)
    if problems:
        raise BenchError(f"{path} is not a sakura-bench run report: {'; '.join(problems)}")
    report["_path"] = str(path)
    return report  # type: ignore[no-any-return]
