"""The example plugin is found through its entry point, as any third-party plugin is."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

import pytest

Run = Callable[..., subprocess.CompletedProcess[str]]  # the fixtures of conftest.py


def _example(plugins: list[dict[str, object]]) -> dict[str, object]:
    found = [p for p in plugins if p["distribution"] == "sakura-example-plugin"]
    assert len(found) == 1, f"sakura-example-plugin not listed once: {plugins}"
    return found[0]


def test_sakura_plugins_json_lists_the_example(sakura_cli: Run) -> None:
    report = json.loads(sakura_cli(["plugins", "--json"]).stdout)
    assert report["failures"] == []
    example = _example(report["plugins"])
    assert example == {
        "name": "example",
        "distribution": "sakura-example-plugin",
        "version": "0.1.0",
        "module": "sakura_example_plugin.plugin",
        "provides": {"service": ["event_log"]},
    }
    core = [p for p in report["plugins"] if p["distribution"] == "sakura-core"]
    assert core and core[0]["provides"]["service"] == ["telemetry"]


def test_sakura_plugins_table(sakura_cli: Run) -> None:
    result = sakura_cli(["plugins"])
    line = next(line for line in result.stdout.splitlines() if "sakura-example-plugin" in line)
    assert line.split()[:3] == ["example", "sakura-example-plugin", "0.1.0"]
    assert "services: event_log" in line
    assert result.stderr == ""


def test_sakura_services_lists_event_log(sakura_cli: Run) -> None:
    result = sakura_cli(["services"])
    line = next(line for line in result.stdout.splitlines() if line.startswith("event_log "))
    assert "EventLog" in line
    assert "sakura-example-plugin" in line
    assert "Record the order of training events into a JSON file" in line

    services = {s["name"]: s for s in json.loads(sakura_cli(["services", "--json"]).stdout)}
    assert services["event_log"] == {
        "name": "event_log",
        "class": "EventLog",
        "distribution": "sakura-example-plugin",
        "plugin": "example",
        "description": "Record the order of training events into a JSON file",
    }
    assert services["telemetry"]["distribution"] == "sakura-core"


@pytest.mark.parametrize("name", ["sakura-example-plugin", "example"])
def test_disabled_plugin_is_not_listed(sakura_cli: Run, name: str) -> None:
    env = {"SAKURA_DISABLED_PLUGINS": name}
    plugins = json.loads(sakura_cli(["plugins", "--json"], env=env).stdout)["plugins"]
    distributions = [p["distribution"] for p in plugins]
    assert "sakura-core" in distributions
    assert "sakura-example-plugin" not in distributions
    services = [s["name"] for s in json.loads(sakura_cli(["services", "--json"], env=env).stdout)]
    assert "telemetry" in services
    assert "event_log" not in services


def test_autoload_off_loads_only_the_named_plugins(sakura_cli: Run) -> None:
    off = {"SAKURA_DISABLE_PLUGIN_AUTOLOAD": "1"}
    services = json.loads(sakura_cli(["services", "--json"], env=off).stdout)
    assert [s["name"] for s in services] == ["telemetry"]  # sakura-core's own, always loaded

    named = {**off, "SAKURA_PLUGINS": "sakura-example-plugin"}
    services = json.loads(sakura_cli(["services", "--json"], env=named).stdout)
    assert sorted(s["name"] for s in services) == ["event_log", "telemetry"]


def test_services_facade_exports_the_class(run: Run) -> None:
    code = (
        "from sakura.services import EventLog\n"
        "import sakura_example_plugin\n"
        "assert EventLog is sakura_example_plugin.EventLog, EventLog\n"
        "print(EventLog.__module__)\n"
    )
    assert run([sys.executable, "-c", code]).stdout.strip() == "sakura_example_plugin.service"
