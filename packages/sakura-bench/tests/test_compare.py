"""compare's arithmetic and verdicts, and the report schema checks, on reports built here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sakura_bench.compare import compare_reports
from sakura_bench.errors import BenchError
from sakura_bench.report import build_report, load_report, validate_report, write_report


def fake_trial(
    wall: float, *, train: float = 1.0, evals: float | None = 0.5, acc: float = 0.9
) -> dict[str, Any]:
    return {
        "trial": 0,
        "rank": 0,
        "world_size": 1,
        "epochs_run": 1,
        "wall_s": wall,
        "setup_s": 0.1,
        "finish_s": 0.0,
        "epochs": [
            {
                "epoch": 0,
                "train_s": train,
                "eval_s": evals,
                "steps": 10,
                "train_loss": 0.5,
                "eval": {"val_acc": acc},
            }
        ],
        "steps": 10,
        "warmup_steps_excluded": 5,
        "step_time_s": {
            "median": wall / 10,
            "min": wall / 10,
            "max": wall / 10,
            "mean": wall / 10,
            "spread": 0.0,
            "n": 5,
        },
        "samples_per_epoch": 100,
        "samples_per_s": 100 / wall,
        "train_samples_per_s": 100 / train,
        "tokens_per_s": None,
        "final_metrics": {"val_acc": acc},
        "params": 10,
        "trainable_params": 10,
        "memory": {"peak_rss_mib": 100.0, "peak_rss_children_mib": None, "cuda": None},
        "errors": [],
        "workload": {
            "name": "w",
            "scale": "tiny",
            "data": "synthetic",
            "seed": 0,
            "config": {"batch_size": 10},
        },
        "epochs_setting": 1,
        "environment": {
            "cpu": "cpu",
            "torch_threads": 1,
            "versions": {"torch": "2"},
            "cpu_logical_cores": 64,
            "load_average": [0.0, 0.0, 0.0],
        },
        "process_s": wall + 1,
    }


def fake_report(
    walls: list[float], runner: str = "baseline", services: tuple[str, ...] = (), **kw: Any
) -> dict[str, Any]:
    settings = {"threads": 1, "device": "cpu", "warmup_steps": 5, "nproc": 1}
    return build_report(
        workload="w",
        runner=runner,
        framework="pytorch-ddp",
        services=list(services),
        settings=settings,
        trials=[fake_trial(w, **kw) for w in walls],
        provided_by={"workload": "x", "framework": "y"},
    )


def test_a_win_beyond_the_spread() -> None:
    a = fake_report([3.0, 3.2, 3.1], train=1.0, evals=0.8)
    b = fake_report([2.0, 2.1, 1.9], runner="sakura", services=("async_eval:thread",))
    result = compare_reports(a, b)
    assert result["speedup"] == pytest.approx(3.1 / 2.0)
    assert result["speedup_range"] == pytest.approx([3.0 / 2.1, 3.2 / 1.9])
    assert result["verdict"] == "B is faster, beyond the spread"
    assert result["ideal_overlap_speedup"] == pytest.approx((1.0 + 0.8) / 1.0)
    assert result["advice"] == [] and result["notes"] == [] and result["metrics_agree"] is True
    wall = next(r for r in result["rows"] if r["key"] == "wall_s")
    assert wall["b_over_a"] == pytest.approx(2.0 / 3.1)


def test_overlapping_trials_are_no_win() -> None:
    result = compare_reports(
        fake_report([3.0, 2.5, 2.0]), fake_report([2.2, 2.4, 3.1], runner="sakura")
    )
    assert result["verdict"] == "within the spread: no win either way"
    assert result["ideal_overlap_speedup"] is None  # B has no asynchronous evaluation


def test_slower_b_and_advice_when_close() -> None:
    result = compare_reports(fake_report([1.0, 1.01, 1.02]), fake_report([1.05, 1.06, 1.07]))
    assert result["verdict"] == "A is faster, beyond the spread"
    assert result["advice"] == ["the medians are within 10 %: rerun both with --trials 5 or more"]


def test_notes_on_differences_and_load() -> None:
    a = fake_report([1.0, 1.0, 1.0], acc=0.9)
    b = fake_report([1.0, 1.0, 1.0], acc=0.5)
    b["settings"]["threads"] = 2
    b["environment"]["load_average_per_trial"] = [[40.0, 1, 1]]
    result = compare_reports(a, b)
    assert "different threads: 1 vs 2" in result["notes"]
    assert any(
        "B: the machine was busy (1-minute load average up to 40.00 on 64 cores" in n
        for n in result["notes"]
    )
    assert result["metrics_agree"] is False


def test_summary_medians_and_metric_agreement() -> None:
    report = fake_report([3.0, 1.0, 2.0, 10.0])
    wall = report["summary"]["wall_s"]
    assert (wall["median"], wall["min"], wall["max"], wall["spread"], wall["n"]) == (
        2.5,
        1.0,
        10.0,
        9.0,
        4,
    )
    assert report["summary"]["metrics_agree"] is True
    report = build_report(
        workload="w", runner="baseline", framework="f", services=[], settings={},
        trials=[fake_trial(1.0, acc=0.9), fake_trial(1.0, acc=0.8)], provided_by={},
    )  # fmt: skip
    assert report["summary"]["metrics_agree"] is False


def test_report_round_trip_and_validation(tmp_path: Path) -> None:
    report = fake_report([1.0])
    path = write_report(report, tmp_path / "r.json")
    assert not (tmp_path / "r.json.tmp").exists()
    assert load_report(path)["summary"]["wall_s"]["median"] == 1.0
    assert validate_report({"schema": "sakura-bench/run-report", "schema_version": 99}) == [
        "schema_version is 99; this sakura-bench reads 1",
        *(
            f"missing {k!r}"
            for k in (
                "workload",
                "runner",
                "framework",
                "services",
                "settings",
                "trials",
                "summary",
                "environment",
            )
        ),
    ]
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(BenchError, match=r"bad\.json is not a readable JSON report"):
        load_report(tmp_path / "bad.json")
    (tmp_path / "list.json").write_text(json.dumps([1, 2]))
    with pytest.raises(BenchError, match="a report is a JSON object, got list"):
        load_report(tmp_path / "list.json")
