from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from sakura import OnEpochEnd, OnTrainStepEnd, SakuraRuntime, Telemetry
from sakura.cli import main


def test_plugins_lists_the_builtin_plugin(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "sakura-core" in out and "services: telemetry" in out
    assert main(["plugins", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plugins"][0]["provides"] == {"service": ["telemetry"]} and data["failures"] == []


def test_plugins_reports_failures_with_nonzero_exit(
    make_distribution: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    make_distribution("sakura-broken", "sakura_broken_cli", "raise RuntimeError('kaputt')\n")
    with pytest.warns(RuntimeWarning):
        assert main(["plugins"]) == 1
    assert (
        "FAILED  plugin 'sakura-broken' from sakura-broken failed to load: RuntimeError('kaputt')"
        in (capsys.readouterr().err)
    )


def test_services_dispatchers_adapters(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SAKURA_DISABLE_PLUGIN_AUTOLOAD", "1")  # only what sakura-core provides
    assert main(["services"]) == 0
    out = capsys.readouterr().out
    assert "telemetry  Telemetry  sakura-core" in out
    assert main(["services", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["class"] == "Telemetry"
    assert main(["dispatchers"]) == 0
    assert "(none)" in capsys.readouterr().out
    assert main(["adapters", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []


def test_hooks_lists_every_signature(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["hooks"]) == 0
    out = capsys.readouterr().out
    assert "on_train_begin(event: OnTrainBegin) -> None" in out
    assert "sakura_register_services(register: Register) -> None" in out
    assert main(["hooks", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)) == 57


def test_telemetry_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    with SakuraRuntime([Telemetry(path)]) as rt:
        rt.emit(OnTrainStepEnd, loss=2.0)
        rt.emit(OnEpochEnd)
    assert main(["telemetry", str(path)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (
        summary["events"] == {"OnTrainStepEnd": 1, "OnEpochEnd": 1} and summary["last_loss"] == 2.0
    )
    assert main(["telemetry", str(tmp_path / "missing.jsonl")]) == 2
    assert "No such file" in capsys.readouterr().err


def test_console_script_and_usage_errors() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "sakura.cli", "servces"], capture_output=True, text=True
    )
    assert result.returncode == 2 and "invalid choice: 'servces'" in result.stderr
    ok = subprocess.run(
        [sys.executable, "-m", "sakura.cli", "services"], capture_output=True, text=True, check=True
    )
    assert "telemetry" in ok.stdout
