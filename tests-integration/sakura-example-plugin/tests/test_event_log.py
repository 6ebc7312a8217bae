"""Tests of the event_log service, with the fixtures and checks of sakura.testing."""

import json

import pytest

from sakura import EVENT_TYPES, SakuraRuntime
from sakura.testing import ServiceConformance, expected_event_names
from sakura_example_plugin import EventLog

# The events EventLog has a hook for, by class name.
HANDLED = {cls.__name__ for cls in EVENT_TYPES if hasattr(EventLog, cls.hook)}


class TestEventLogConformance(ServiceConformance):
    """The checks every service should pass: valid hooks, state round trip, failure
    isolation, no work on unhandled events, a run through the tiny loop."""

    @pytest.fixture(autouse=True)
    def _tmp(self, tmp_path):
        self.tmp_path = tmp_path

    def make_service(self):
        return EventLog(path=self.tmp_path / "events.json")


def test_records_the_documented_order(sakura_runtime, tiny_loop, tmp_path):
    log = sakura_runtime.install(EventLog(path=tmp_path / "events.json"))
    result = tiny_loop(sakura_runtime, epochs=2, steps_per_epoch=3, val_batches=2)
    sakura_runtime.uninstall("event_log")  # tears the service down: the file is written

    data = json.loads((tmp_path / "events.json").read_text())
    expected = [name for name in expected_event_names(2, 3, 2) if name in HANDLED]
    assert [e["event"] for e in data["events"]] == expected
    assert data["optimizer_steps"] == result.steps == log.optimizer_steps == 6


def test_sees_what_a_recording_service_sees(sakura_runtime, recording_service, tiny_loop, tmp_path):
    log = sakura_runtime.install(EventLog(path=tmp_path / "events.json"))
    sakura_runtime.install(recording_service)
    tiny_loop(sakura_runtime, epochs=1, steps_per_epoch=2)
    seen = [name for name in recording_service.names if name in HANDLED]
    assert [e["event"] for e in log.events] == seen


def test_step_count_resumes_from_a_checkpoint(tiny_loop, tmp_path):
    with SakuraRuntime(strict=True) as rt:
        rt.install(EventLog(path=tmp_path / "first.json"))
        first = tiny_loop(rt, epochs=1, steps_per_epoch=4)
    checkpoint = first.checkpoints[-1]["sakura"]
    assert checkpoint == {"event_log": {"optimizer_steps": 4}}

    with SakuraRuntime(strict=True) as rt:
        log = rt.install(EventLog(path=tmp_path / "second.json"))
        rt.load_state_dict(checkpoint)
        tiny_loop(rt, epochs=1, steps_per_epoch=2)
    assert log.optimizer_steps == 6
    assert json.loads((tmp_path / "second.json").read_text())["optimizer_steps"] == 6


def test_rank_in_the_path(tmp_path):
    with SakuraRuntime([EventLog(path=tmp_path / "events.{rank}.json")], rank=1, world_size=2):
        pass
    assert json.loads((tmp_path / "events.1.json").read_text())["rank"] == 1


def test_bad_input_is_refused_clearly():
    with pytest.raises(ValueError, match="path must be a non-empty file path"):
        EventLog(path="")
    with pytest.raises(ValueError, match="'optimizer_steps' as an int >= 0"):
        EventLog().load_state_dict({"optimizer_steps": -1})


def test_installed_by_its_spec_name(tmp_path):
    service = SakuraRuntime().install(f"event_log:path={tmp_path / 'x.json'}")
    assert isinstance(service, EventLog)
    assert service.path_template == str(tmp_path / "x.json")
