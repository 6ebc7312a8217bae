"""sakura.testing: the pytest fixtures (loaded through the pytest11 entry point) and the
conformance checks, run against a real service and against deliberately broken ones."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from sakura import OnEpochEnd, OnTrainStepEnd, SakuraRuntime, Service, Telemetry
from sakura.testing import (
    RecordingService,
    ServiceConformance,
    check_exceptions_isolated,
    check_hooks_valid,
    check_no_work_on_unhandled_events,
    check_state_round_trip,
    expected_event_names,
)


def test_fixtures_drive_a_tiny_loop(
    sakura_runtime: SakuraRuntime, recording_service: RecordingService, tiny_loop: Any
) -> None:
    assert sakura_runtime.running and sakura_runtime.strict
    sakura_runtime.install(recording_service)
    result = tiny_loop(sakura_runtime, epochs=2, steps_per_epoch=4, val_batches=1)
    assert recording_service.names == expected_event_names(2, 4, 1)
    assert result.steps == 8 and len(result.losses) == 8 and len(result.checkpoints) == 2
    assert result.losses[-1] < result.losses[0]  # it really trains


def test_tiny_loop_is_deterministic_and_validates(tiny_loop: Any) -> None:
    with SakuraRuntime() as a, SakuraRuntime() as b:
        assert tiny_loop(a, seed=3).losses == tiny_loop(b, seed=3).losses
    with pytest.raises(ValueError, match="epochs must be a positive int"), SakuraRuntime() as rt:
        tiny_loop(rt, epochs=0)


def test_sakura_plugins_fixture_restricts_loading(sakura_plugins: Any) -> None:
    from sakura.plugins import get_plugin_manager

    sakura_plugins([])
    assert set(get_plugin_manager().registry("service")) == {"telemetry"}


class TestTelemetryConformance(ServiceConformance):
    @pytest.fixture(autouse=True)
    def _tmp(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path

    def make_service(self) -> Telemetry:
        return Telemetry(self.tmp_path / "conformance.jsonl")


class Counter(Service):
    def __init__(self) -> None:
        self.count = 0

    def on_train_step_end(self, event: OnTrainStepEnd) -> None:
        self.count += 1

    def state_dict(self) -> dict[str, int]:
        return {"count": self.count}

    def load_state_dict(self, state: Any) -> None:
        self.count = state["count"]


class TestCounterConformance(ServiceConformance):
    def make_service(self) -> Counter:
        return Counter()


def test_conformance_catches_a_state_that_does_not_round_trip() -> None:
    class Forgetful(Counter):
        def load_state_dict(self, state: Any) -> None:
            pass

    with pytest.raises(AssertionError, match="differs from the one loaded"):
        check_state_round_trip(Forgetful)


def test_conformance_catches_a_handler_that_cannot_take_on_error() -> None:
    class Fragile(Service):
        def on_error(self, event: Any) -> None:
            raise RuntimeError("cannot cope")

    with pytest.raises(AssertionError, match="'fragile' raised"):
        check_exceptions_isolated(Fragile)


def test_conformance_catches_work_on_unhandled_events() -> None:
    class Busy(Service):
        event_types = frozenset({OnEpochEnd})

        def on_event(self, event: Any) -> None:
            self.helper()

        def helper(self) -> None:
            pass

    check_no_work_on_unhandled_events(Busy)  # subscribed only to OnEpochEnd: fine

    class Greedy(Busy):
        event_types = None  # type: ignore[assignment]

    # subscribing to everything is allowed: the work is then on handled events
    check_no_work_on_unhandled_events(Greedy)


def test_conformance_catches_invalid_hooks() -> None:
    class Empty(Service):
        pass

    with pytest.raises(AssertionError, match="implements no sakura hook"):
        check_hooks_valid(Empty())


def test_the_tiny_loop_without_torch_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib

    from sakura.testing.loop import TESTING_EXTRA, run_tiny_loop

    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    assert TESTING_EXTRA == "sakura-core[testing]"
    assert [r for r in extras["testing"] if r.startswith("torch")] == ["torch>=2.4"]

    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now fails, as uninstalled
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'sakura-core\[testing\]'"):
        run_tiny_loop(SakuraRuntime(), epochs=1, steps_per_epoch=1)
