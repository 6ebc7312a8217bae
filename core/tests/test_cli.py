from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from sakura import OnEpochEnd, OnTrainStepEnd, SakuraRuntime, Telemetry, hookspecs
from sakura.cli import main
from sakura.service import SERVICE_HOOKS


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
    assert main(["plugins"]) == 1
    err = capsys.readouterr().err
    line = (
        "FAILED  plugin 'sakura-broken' from sakura-broken failed to load: RuntimeError('kaputt')"
    )
    assert line in err and err.count("kaputt") == 1
    assert main(["plugins", "--json"]) == 1  # scripts see the failure too
    captured = capsys.readouterr()
    [failure] = json.loads(captured.out)["failures"]
    assert failure == {
        "name": "sakura-broken",
        "distribution": "sakura-broken",
        "error": "RuntimeError('kaputt')",
    }
    assert "kaputt" not in captured.err


def _run_cli(site: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("SAKURA_")}
    environment.update(env, PYTHONPATH=str(site))
    return subprocess.run(
        [sys.executable, "-m", "sakura.cli", *args],
        capture_output=True,
        text=True,
        env=environment,
        timeout=120,
    )


def test_each_load_failure_is_printed_once_by_the_real_command(
    make_distribution: Callable[..., Path],
) -> None:
    site = make_distribution("sakura-broken", "sakura_broken_cli", "raise RuntimeError('kaputt')\n")
    for command in ("plugins", "services"):
        result = _run_cli(site, command)
        assert result.stderr.count("kaputt") == 1, result.stderr
        assert result.returncode == (1 if command == "plugins" else 0)


def test_plugins_lists_disabled_plugins_and_misspelt_filters(
    make_distribution: Callable[..., Path],
) -> None:
    site = make_distribution(
        "sakura-greeter",
        "sakura_greeter_cli",
        """
from sakura import hookimpl
from sakura.telemetry import Telemetry

@hookimpl
def sakura_register_services(register):
    register("greeter_sink", Telemetry)
""",
        version="2.3",
    )
    result = _run_cli(site, "plugins", "--json", SAKURA_DISABLED_PLUGINS="sakura-greeter")
    data = json.loads(result.stdout)
    assert result.returncode == 0 and data["problems"] == [] and data["failures"] == []
    [disabled] = [d for d in data["disabled"] if d["name"] == "sakura-greeter"]
    assert (disabled["version"], disabled["reason"]) == ("2.3", "disabled")
    assert "sakura-greeter" not in [p["name"] for p in data["plugins"]]
    table = _run_cli(site, "plugins", SAKURA_DISABLED_PLUGINS="sakura-greeter")
    [row] = [r for r in table.stdout.splitlines() if r.startswith("sakura-greeter ")]
    assert "2.3" in row and "disabled: disabled by SAKURA_DISABLED_PLUGINS" in row
    assert "not installed" not in table.stdout + table.stderr
    typo = _run_cli(site, "plugins", "--json", SAKURA_DISABLED_PLUGINS="sakura-greter")
    data = json.loads(typo.stdout)
    assert typo.returncode == 1
    [problem] = data["problems"]
    assert "'sakura-greter'" in problem and "did you mean 'sakura-greeter'?" in problem
    assert "sakura-greeter" in [p["name"] for p in data["plugins"]]
    assert typo.stderr.count("sakura-greter") == 0  # in the JSON, not printed again


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
    listed = [h["name"] for h in json.loads(capsys.readouterr().out) if "declared_in" not in h]
    plugin_hooks = {
        name
        for name, fn in vars(hookspecs).items()
        if name.startswith("sakura_") and hasattr(fn, "sakura_spec")
    }
    assert len(listed) == len(set(listed)) == len(SERVICE_HOOKS) + len(plugin_hooks) > 50
    assert set(listed) == set(SERVICE_HOOKS) | plugin_hooks


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


def test_a_bad_environment_value_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SAKURA_DISABLE_PLUGIN_AUTOLOAD", "maybe")
    assert main(["services"]) == 2
    assert capsys.readouterr().err == (
        "sakura: SAKURA_DISABLE_PLUGIN_AUTOLOAD='maybe' is not accepted; accepted: 1/0, "
        "true/false, yes/no, on/off\n"
    )


GADGETS = '''
from sakura import hookimpl, hookspec

class GadgetSpecs:
    @hookspec
    def sakura_register_gadgets(self, register):
        """Offer gadgets by name.  More text."""

@hookimpl
def sakura_add_hookspecs(pluginmanager):
    pluginmanager.add_hookspecs(GadgetSpecs)
'''


def test_hooks_lists_the_hooks_packages_declare(
    make_distribution: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    make_distribution("sakura-gadgets", "sakura_gadgets_cli", GADGETS)
    assert main(["hooks", "--json"]) == 0
    [gadgets] = [
        h for h in json.loads(capsys.readouterr().out) if h["name"] == "sakura_register_gadgets"
    ]
    assert gadgets == {
        "kind": "plugin",
        "name": "sakura_register_gadgets",
        "signature": "sakura_register_gadgets(register)",
        "doc": "Offer gadgets by name.  More text.",
        "declared_in": "sakura_gadgets_cli",
    }
    assert main(["hooks"]) == 0
    out = capsys.readouterr().out
    section = out[out.index("Plugin hooks declared by installed packages:") :]
    assert "sakura_register_gadgets(register)    [sakura_gadgets_cli]" in section
