"""A user's run: services chosen in a config file, a training script, the event log written.

The script and the ``sakura.toml`` are the example plugin's ``examples/`` files, the same
ones docs/writing-a-plugin.md shows.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from sakura import EVENT_TYPES
from sakura.testing import expected_event_names
from sakura_example_plugin import EventLog

Run = Callable[..., subprocess.CompletedProcess[str]]  # the `run` fixture of conftest.py

EXAMPLES = Path(__file__).resolve().parent / "sakura-example-plugin" / "examples"
EPOCHS, STEPS, VAL_BATCHES = 2, 3, 2  # what examples/train.py runs
HANDLED = {cls.__name__ for cls in EVENT_TYPES if hasattr(EventLog, cls.hook)}
EXPECTED = [name for name in expected_event_names(EPOCHS, STEPS, VAL_BATCHES) if name in HANDLED]


def _write_config(where: str, workdir: Path) -> dict[str, str]:
    """Put the example config where ``where`` says; return the environment it needs."""
    services = (EXAMPLES / "sakura.toml").read_text()
    if where == "sakura.toml":
        shutil.copy(EXAMPLES / "sakura.toml", workdir / "sakura.toml")
        return {}
    if where == "pyproject.toml":
        (workdir / "pyproject.toml").write_text(
            f"[project]\nname = 'a-run'\n\n[tool.sakura]\n{services}"
        )
        return {}
    elsewhere = workdir / "conf" / "run.toml"
    elsewhere.parent.mkdir()
    shutil.copy(EXAMPLES / "sakura.toml", elsewhere)
    return {"SAKURA_CONFIG": str(elsewhere)}


def _train(
    run: Run, workdir: Path, env: dict[str, str], **kwargs: object
) -> subprocess.CompletedProcess[str]:
    shutil.copy(EXAMPLES / "train.py", workdir / "train.py")
    return run([sys.executable, "train.py"], cwd=workdir, env=env, **kwargs)


def test_expected_order_is_not_trivial() -> None:
    subscribed = {
        "OnTrainBegin",
        "OnEpochBegin",
        "OnOptimizerStep",
        "OnValidationEnd",
        "OnEpochEnd",
        "OnTrainEnd",
        "OnError",
    }
    assert subscribed == HANDLED
    assert EXPECTED.count("OnOptimizerStep") == EPOCHS * STEPS
    assert EXPECTED[0] == "OnTrainBegin" and EXPECTED[-1] == "OnTrainEnd"


@pytest.mark.parametrize("where", ["sakura.toml", "pyproject.toml", "SAKURA_CONFIG"])
def test_config_installs_event_log_and_the_log_holds_the_documented_order(
    run: Run, tmp_path: Path, where: str
) -> None:
    env = _write_config(where, tmp_path)
    result = _train(run, tmp_path, env)
    assert "services: event_log" in result.stdout
    assert f"trained {EPOCHS * STEPS} steps" in result.stdout

    log = json.loads((tmp_path / "events.json").read_text())
    assert [e["event"] for e in log["events"]] == EXPECTED
    assert log["optimizer_steps"] == EPOCHS * STEPS
    assert log["rank"] == 0
    steps = [e["step"] for e in log["events"] if e["event"] == "OnOptimizerStep"]
    assert steps == list(range(1, EPOCHS * STEPS + 1))
    epochs = [e["epoch"] for e in log["events"] if e["event"] == "OnEpochEnd"]
    assert epochs == list(range(EPOCHS))
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("events")) == [
        "events.json"  # no partial file left behind
    ]


@pytest.mark.parametrize(
    "env",
    [
        {"SAKURA_DISABLED_PLUGINS": "sakura-example-plugin"},
        {"SAKURA_DISABLED_PLUGINS": "example"},
        {"SAKURA_DISABLE_PLUGIN_AUTOLOAD": "1"},
    ],
    ids=["disabled-by-distribution", "disabled-by-entry-point", "autoload-off"],
)
def test_without_the_plugin_event_log_is_unknown(
    run: Run, tmp_path: Path, env: dict[str, str]
) -> None:
    _write_config("sakura.toml", tmp_path)
    result = _train(run, tmp_path, env, check=False)
    assert result.returncode != 0
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("sakura.errors.UnknownNameError: unknown service 'event_log'.")
    assert "Available services: " in error
    available = error.split("Available services: ", 1)[1].split(".")[0].split(", ")
    assert "telemetry" in available
    assert "event_log" not in available
    assert not (tmp_path / "events.json").exists()


def test_disabled_in_the_config_file(run: Run, tmp_path: Path) -> None:
    _write_config("sakura.toml", tmp_path)
    with (tmp_path / "sakura.toml").open("a") as config:
        config.write('disabled_plugins = ["sakura-example-plugin"]\n')
    result = _train(run, tmp_path, {}, check=False)
    assert "unknown service 'event_log'" in result.stderr


def test_named_plugin_loads_with_autoload_off(run: Run, tmp_path: Path) -> None:
    _write_config("sakura.toml", tmp_path)
    env = {"SAKURA_DISABLE_PLUGIN_AUTOLOAD": "1", "SAKURA_PLUGINS": "sakura-example-plugin"}
    _train(run, tmp_path, env)
    log = json.loads((tmp_path / "events.json").read_text())
    assert [e["event"] for e in log["events"]] == EXPECTED


def test_bad_spec_argument_names_the_accepted_ones(run: Run, tmp_path: Path) -> None:
    (tmp_path / "sakura.toml").write_text('services = ["event_log:file=events.json"]\n')
    result = _train(run, tmp_path, {}, check=False)
    assert result.returncode != 0
    error = result.stderr.strip().splitlines()[-1]
    assert "SpecError" in error
    assert "'event_log' (from sakura-example-plugin)" in error
    assert "accepted arguments: event_log(path" in error


def test_installed_in_code_without_a_config_file(run: Run, tmp_path: Path) -> None:
    shutil.copy(EXAMPLES / "train_in_code.py", tmp_path / "train_in_code.py")
    result = run([sys.executable, "train_in_code.py"], cwd=tmp_path)
    assert f"trained {EPOCHS * STEPS} steps" in result.stdout
    log = json.loads((tmp_path / "events.json").read_text())
    assert [e["event"] for e in log["events"]] == EXPECTED
