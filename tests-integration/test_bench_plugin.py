"""A third-party workload package, installed from its wheel, is listed by sakura-bench and
runs through the baseline and through sakura with an asynchronous evaluation in a worker
process (which finds the workload through the installed plugins too)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

Run = Callable[..., subprocess.CompletedProcess[str]]  # the ``run`` fixture of conftest.py


def console_script(name: str) -> str:
    """The console script ``name`` installed next to the interpreter running the tests."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        pytest.fail(f"console script {name!r} is not installed next to {sys.executable}")
    return str(path)


COMMON = ["--workload", "example-xor", "--framework", "pytorch-ddp", "--scale", "tiny",
          "--epochs", "2", "--threads", "1", "--output", "reports"]  # fmt: skip


def test_the_example_workload_is_listed(run: Run) -> None:
    bench = console_script("sakura-bench")
    data = json.loads(run([bench, "list", "--json"]).stdout)
    workloads = {w["name"]: w for w in data["workloads"]}
    example = workloads["example-xor"]
    assert example["provided_by"] == "sakura-bench-example-workload"
    assert example["description"] == "noisy XOR of two inputs, learned by a small MLP"
    assert example["frameworks"] == ["lightning", "pytorch-ddp"]
    assert example["scales"] == ["tiny", "full"]
    assert workloads["mnist-mlp"]["provided_by"] == "sakura-bench"
    assert data["failures"] == []
    table = run([bench, "list"]).stdout
    assert "example-xor" in table and "sakura-bench-example-workload" in table


def test_the_example_workload_runs_and_compares(run: Run, tmp_path: Path) -> None:
    bench = console_script("sakura-bench")
    run([bench, "run", *COMMON, "--runner", "baseline", "--trials", "2"])
    run(
        [
            bench,
            "run",
            *COMMON,
            "--runner",
            "sakura",
            "--service",
            "async_eval:process",
            "--trials",
            "1",
        ]
    )
    reports = tmp_path / "reports"
    base = json.loads((reports / "example-xor-baseline-pytorch-ddp.json").read_text())
    sak = json.loads((reports / "example-xor-sakura-pytorch-ddp.json").read_text())
    assert base["workload"]["provided_by"] == "sakura-bench-example-workload"
    assert [len(base["trials"]), len(sak["trials"])] == [2, 1]
    assert sak["trials"][0]["errors"] == []
    # The worker process evaluated each epoch's weights: the baseline's own evaluation.
    for b, s in zip(base["trials"][0]["epochs"], sak["trials"][0]["epochs"], strict=True):
        assert set(s["eval"]) == {"val_loss", "val_acc"}
        for key, value in b["eval"].items():
            assert abs(s["eval"][key] - value) <= 1e-5 * max(1.0, abs(value))
    comparison = json.loads(
        run(
            [
                bench,
                "compare",
                str(reports / base_name(base)),
                str(reports / base_name(sak)),
                "--json",
            ]
        ).stdout
    )
    assert comparison["metrics_agree"] is True and comparison["trials"] == [2, 1]


def base_name(report: dict[str, object]) -> str:
    return f"example-xor-{report['runner']}-pytorch-ddp.json"
