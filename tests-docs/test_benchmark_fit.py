"""``benchmarks/fit.py --quick`` end to end, on the source tree: its printed structure, and
that ``fit`` trained within both budgets (never its timings: the machine is shared).

The benchmark is issue 21's proof that ``fit`` trains a model whose frozen weights exceed
the device and host budgets; this runs it at its tiny ``--quick`` size (a few hand-made
plans, one trial) in a subprocess, as ``nox -s bench`` would, and reads both its table and
its ``--json`` results.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "fit.py"


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("fit-bench") / "result.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAKURA_")}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout, json.loads(out.read_text(encoding="utf-8"))


def test_prints_every_section(quick: tuple[str, dict[str, Any]]) -> None:
    text, _ = quick
    for line in (
        "## fit against the hand-made plans",
        "| fit |",
        "fit within the device budget: ",
        "## a model that fits: fit with device",
        "| plain |",
        "| fit (generous) |",
        "fit / plain: ",
        "CPU: ",
        "uptime before: ",
        "uptime after: ",
    ):
        assert line in text, f"{line!r} missing from:\n{text}"
    assert "(target <= 1.02)" in text
    assert "Not run (" in text


def test_model_exceeds_the_budgets(quick: tuple[str, dict[str, Any]]) -> None:
    _, result = quick
    config = result["config"]
    assert result["frozen_bytes"] >= 3 * config["device_budget"]
    assert result["frozen_bytes"] >= 1.5 * config["host_budget"]


def test_fit_stays_within_both_budgets(quick: tuple[str, dict[str, Any]]) -> None:
    """Tracked device peak and host state, and the process's peak anonymous RSS against
    host + device budget (streamed copies mapped on their own, the heap trimmed: fit.heap)."""
    text, result = quick
    config = result["config"]
    fit = result["variants"]["fit"]
    assert fit["error"] is None, fit["error"]
    assert 0 < fit["device_peak"] <= config["device_budget"]
    assert fit["host_state_peak"] <= config["host_budget"]
    assert fit["rss_peak"] <= config["host_budget"] + config["device_budget"]
    assert result["verdicts"]["fit_device"] == "PASS"
    assert result["verdicts"]["fit_host"] == "PASS"
    assert "fit within the device budget: PASS; within the host budget: PASS" in text


def test_fit_is_compared_within_its_precision_class(quick: tuple[str, dict[str, Any]]) -> None:
    """fit against the fastest hand-made plan of its base's format, and fit with
    ``quantize="nf4"`` against the fastest nf4 plan (ratios printed, never asserted)."""
    text, result = quick
    forced = result["variants"]["fit (quantize=nf4)"]
    assert forced["error"] is None, forced["error"]
    assert forced["same_by_hand"].startswith("nf4/"), forced["same_by_hand"]
    by_class = result["fastest_by_class"]
    assert by_class.get("nf4", "nf4/").startswith("nf4/")
    fit_class = result["variants"]["fit"]["same_by_hand"].split("/")[0]
    for name, klass in (("fit", fit_class), ("fit (quantize=nf4)", "nf4")):
        if klass in by_class:
            assert f"{name} / fastest feasible hand-made {klass} plan ({by_class[klass]}): " in text
            assert "(target <= 1.10)" in text
        else:
            assert f"no hand-made {klass} plan passed both budgets" in text


def test_fit_trains_as_its_choices_by_hand(quick: tuple[str, dict[str, Any]]) -> None:
    """The hand-made twin of fit's plan, on the same batches, ends at the same loss (the
    parts are exact: streaming, host moments and activation choices change no value)."""
    _, result = quick
    fit = result["variants"]["fit"]
    twin = result["variants"].get(fit["same_by_hand"])
    if twin is None:
        assert fit["same_by_hand"] in result["infeasible"], fit["same_by_hand"]
        pytest.skip(f"fit's plan by hand is not run: {result['infeasible'][fit['same_by_hand']]}")
    assert twin["error"] is None, twin["error"]
    assert fit["final_loss"] == pytest.approx(twin["final_loss"], rel=1e-5, abs=1e-6)


def test_hand_made_plans_reported(quick: tuple[str, dict[str, Any]]) -> None:
    _, result = quick
    ran = [name for name in result["variants"] if name != "fit"]
    assert ran, "no feasible hand-made plan ran"
    assert result["fastest_hand_made"] in ran
    for name, why in result["infeasible"].items():
        assert name.count("/") == 3 and why, (name, why)
    anyway = result["fits_anyway"]
    assert anyway["plain"]["error"] is None and anyway["fit (generous)"]["error"] is None
    # A model that fits: same training, same loss.
    assert anyway["fit (generous)"]["final_loss"] == pytest.approx(
        anyway["plain"]["final_loss"], rel=1e-6, abs=1e-6
    )
