from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

import pytest

from sakura import (
    ConfigError,
    InvalidServiceError,
    OnEpochBegin,
    OnEpochEnd,
    OnError,
    OnTrainBegin,
    OnTrainStepBegin,
    SakuraRuntime,
    Service,
)
from sakura.events import Event
from sakura.options import OptionError
from sakura.testing import RecordingService


class Log:
    """Shared journal of calls, to assert orders across services."""

    def __init__(self) -> None:
        self.calls: list[str] = []


class Lifecycle(Service):
    def __init__(self, name: str, log: Log, priority: float = 100, *, fail: str = "") -> None:
        self.name = name
        self.priority = priority
        self.log = log
        self.fail = fail

    def setup(self, runtime: SakuraRuntime) -> None:
        self.log.calls.append(f"setup:{self.name}")
        if self.fail == "setup":
            raise RuntimeError("setup failed")

    def drain(self) -> None:
        self.log.calls.append(f"drain:{self.name}")
        if self.fail == "drain":
            raise RuntimeError("drain failed")

    def teardown(self) -> None:
        self.log.calls.append(f"teardown:{self.name}")

    def on_epoch_begin(self, event: OnEpochBegin) -> None:
        self.log.calls.append(f"epoch:{self.name}")


# --- install / order ------------------------------------------------------------------


def test_handlers_run_in_priority_order_then_install_order() -> None:
    log = Log()
    rt = SakuraRuntime()
    rt.install(Lifecycle("late", log, priority=50))
    rt.install(Lifecycle("early", log, priority=-5))
    rt.install(Lifecycle("tie_first", log, priority=10))
    rt.install(Lifecycle("tie_second", log, priority=10))
    rt.emit(OnEpochBegin, epoch=0)
    assert log.calls == ["epoch:early", "epoch:tie_first", "epoch:tie_second", "epoch:late"]
    assert [s.name for s in rt.services] == ["early", "tie_first", "tie_second", "late"]


def test_install_returns_service_and_rejects_duplicates_and_classes() -> None:
    rt = SakuraRuntime()
    rec = rt.install(RecordingService("a"))
    assert rt.get("a") is rec and "a" in rt
    with pytest.raises(ValueError, match="already installed"):
        rt.install(RecordingService("a"))
    with pytest.raises(
        InvalidServiceError, match=r"did you mean rt.install\(RecordingService\(\)\)"
    ):
        rt.install(RecordingService)


def test_uninstall_stops_delivery_and_unknown_names_are_reported() -> None:
    rt = SakuraRuntime()
    rec = rt.install(RecordingService("rec"))
    rt.emit(OnEpochBegin)
    assert rt.uninstall("rec") is rec
    rt.emit(OnEpochBegin)
    assert len(rec.events) == 1
    with pytest.raises(KeyError, match="no service named 'rek'"):
        rt.uninstall("rek")
    rt.install(RecordingService("recorder"))
    with pytest.raises(KeyError, match="did you mean 'recorder'"):
        rt.get("recordr")


def test_misspelt_hook_fails_at_install_naming_the_nearest() -> None:
    class Typo(Service):
        def on_epoch_ned(self, event: Any) -> None: ...

    with pytest.raises(InvalidServiceError, match=r"'on_epoch_ned'.*did you mean 'on_epoch_end'"):
        SakuraRuntime().install(Typo())

    class TypoWrap(Service):
        def wrap_modle(self, model: Any) -> Any: ...

    with pytest.raises(InvalidServiceError, match="did you mean 'wrap_model'"):
        SakuraRuntime().install(TypoWrap())


def test_hook_with_wrong_signature_fails_at_install() -> None:
    class NoArg(Service):
        def on_epoch_end(self) -> None: ...

    with pytest.raises(InvalidServiceError, match=r"on_epoch_end\(self, event\)"):
        SakuraRuntime().install(NoArg())


@pytest.mark.parametrize(
    ("name", "priority", "message"),
    [
        ("", 1, "no valid 'name'"),
        (None, 1, "no valid 'name'"),
        ("x", "high", "'priority' must be"),
        ("x", float("nan"), "'priority' must be"),
        ("x", True, "'priority' must be"),
    ],
)
def test_invalid_name_or_priority(name: Any, priority: Any, message: str) -> None:
    class Odd:
        def on_epoch_end(self, event: Any) -> None: ...

    odd = Odd()
    odd.name = name  # type: ignore[attr-defined]
    odd.priority = priority  # type: ignore[attr-defined]
    with pytest.raises(InvalidServiceError, match=message):
        SakuraRuntime().install(odd)


def test_duck_typed_service_without_base_class() -> None:
    class Duck:
        name = "duck"

        def __init__(self) -> None:
            self.seen: list[int] = []

        def on_epoch_end(self, event: OnEpochEnd) -> None:
            self.seen.append(event.epoch)

    duck = Duck()
    rt = SakuraRuntime([duck])
    rt.emit(OnEpochEnd, epoch=4)
    assert duck.seen == [4]


def test_service_base_class_derives_a_name() -> None:
    class MyFancyService(Service):
        pass

    assert MyFancyService().name == "my_fancy_service"
    assert MyFancyService().priority == 100


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rank": -1}, "SakuraRuntime: rank=-1 is not accepted; accepted: an int >= 0"),
        ({"world_size": 0}, "world_size=0 is not accepted; accepted: an int >= 1"),
        (
            {"rank": 2, "world_size": 2},
            "rank=2 is not accepted; accepted: an int >= 0 and < world_size=2",
        ),
        ({"strict": "yes"}, "strict='yes' is not accepted; accepted: True or False"),
        ({"history": 1}, "history=1 is not accepted; accepted: True or False"),
    ],
)
def test_runtime_options_are_validated(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(OptionError, match=re.escape(message)):
        SakuraRuntime(**kwargs)


def test_rank_and_world_size_come_from_torchrun_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    rt = SakuraRuntime([RecordingService()])
    event = rt.emit(OnEpochBegin)
    assert (rt.rank, rt.world_size) == (1, 3)
    assert event is not None and (event.rank, event.world_size) == (1, 3)
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ConfigError, match=r"RANK='x' is not accepted; accepted: an integer >= 0"):
        SakuraRuntime()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "0")
    with pytest.raises(ConfigError, match=r"WORLD_SIZE='0' is not accepted"):
        SakuraRuntime()


# --- emit -------------------------------------------------------------------------------


def test_emit_builds_no_event_when_nobody_handles_it(monkeypatch: pytest.MonkeyPatch) -> None:
    rt = SakuraRuntime([RecordingService(event_types={OnEpochEnd})])

    def explode(self: Any, **kwargs: Any) -> None:
        raise AssertionError("event built although nobody handles it")

    monkeypatch.setattr(OnTrainStepBegin, "__init__", explode)
    assert rt.emit(OnTrainStepBegin, step=1, batch=object()) is None
    assert not rt.handles(OnTrainStepBegin) and rt.handles(OnEpochEnd)
    assert rt.event_counts == {}


def test_emit_accepts_a_built_event_and_fills_rank() -> None:
    rec = RecordingService()
    rt = SakuraRuntime([rec], rank=0, world_size=1)
    ready = OnEpochEnd(rank=0, world_size=1, epoch=2, metrics={"a": 1})
    assert rt.emit(ready) is ready
    built = rt.emit(OnTrainBegin, model="m")
    assert built is not None and built.model == "m" and built.world_size == 1
    assert rec.events == [ready, built]
    with pytest.raises(TypeError, match="field keywords only together with an event class"):
        rt.emit(ready, epoch=3)  # type: ignore[call-overload]


def test_history_counts_events_and_can_be_opted_out() -> None:
    with_history = SakuraRuntime([RecordingService()])
    without = SakuraRuntime([RecordingService()], history=False)
    for rt in (with_history, without):
        rt.emit(OnEpochBegin)
        rt.emit(OnEpochBegin)
        rt.emit(OnEpochEnd)
    assert with_history.event_counts == {"OnEpochBegin": 2, "OnEpochEnd": 1}
    assert without.event_counts == {}


def test_event_types_limits_catch_all_delivery() -> None:
    rec = RecordingService(event_types={OnEpochEnd})
    rt = SakuraRuntime([rec])
    rt.emit(OnEpochBegin)
    rt.emit(OnEpochEnd)
    assert rec.names == ["OnEpochEnd"]


@dataclass(frozen=True, slots=True, kw_only=True)
class OnThingDone(Event):
    """An event a package defines for itself (not one of the core's)."""

    path: str = ""


def test_a_package_event_reaches_the_services_that_name_it_in_priority_order() -> None:
    late = RecordingService("late", priority=50, event_types={OnThingDone, OnEpochEnd})
    early = RecordingService("early", priority=10, event_types={OnThingDone})
    catch_all = RecordingService("all", priority=0)  # the core's events only
    order: list[str] = []
    for rec in (late, early):
        rec.on_event = (lambda r: lambda e: (order.append(r.name), r.events.append(e)))(rec)  # type: ignore[method-assign]
    rt = SakuraRuntime([late, early, catch_all])
    delivered = rt.emit(OnThingDone, step=7, path="/x")
    rt.emit(OnEpochEnd)
    assert order == ["early", "late", "late"]
    assert delivered is not None and delivered.path == "/x" and delivered.step == 7
    assert delivered.rank == rt.rank and delivered.world_size == rt.world_size
    assert early.names == ["OnThingDone"]
    assert late.names == ["OnThingDone", "OnEpochEnd"]
    assert catch_all.names == ["OnEpochEnd"]


def test_a_package_event_nobody_names_is_not_built() -> None:
    rt = SakuraRuntime([RecordingService(event_types={OnEpochEnd}), RecordingService("all")])
    assert rt.emit(OnThingDone, path="/x") is None


def test_a_package_event_subscriber_that_raises_is_isolated(
    caplog: pytest.LogCaptureFixture,
) -> None:
    failing = RecordingService(
        "failing", priority=0, event_types={OnThingDone}, fail_on={"OnThingDone"}
    )
    watcher = RecordingService("watcher", priority=10, event_types={OnThingDone, OnError})
    rt = SakuraRuntime([failing, watcher])
    with caplog.at_level(logging.ERROR, logger="sakura"):
        rt.emit(OnThingDone, path="/x")
    assert watcher.names == ["OnError", "OnThingDone"]  # OnError as the failure happens
    assert [type(e.event).__name__ for e in rt.errors] == ["OnThingDone"]
    strict = SakuraRuntime(
        [RecordingService(event_types={OnThingDone}, fail_on={"OnThingDone"})], strict=True
    )
    with pytest.raises(RuntimeError):
        strict.emit(OnThingDone, path="/x")


def test_invalid_event_types_rejected() -> None:
    with pytest.raises(
        InvalidServiceError, match="'event_types' must be a collection of sakura event classes"
    ):
        SakuraRuntime([RecordingService(event_types=["OnEpochEnd"])])  # type: ignore[list-item]


# --- failure isolation -------------------------------------------------------------------


def test_handler_exception_is_isolated_and_reported_as_on_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    failing = RecordingService("failing", priority=0, fail_on={"OnEpochEnd"})
    watcher = RecordingService("watcher", priority=10)
    rt = SakuraRuntime([failing, watcher])
    with caplog.at_level(logging.ERROR, logger="sakura"):
        rt.emit(OnEpochEnd, epoch=7, step=70)
    # the later service still got the event, then the OnError report
    assert watcher.names == ["OnError", "OnEpochEnd"]
    report = watcher.of(OnError)[0]
    assert report.source == "failing"
    assert isinstance(report.event, OnEpochEnd) and report.event.epoch == 7
    assert isinstance(report.exception, RuntimeError)
    assert (report.step, report.epoch) == (70, 7)
    # the failing service does not receive its own failure report
    assert failing.names == ["OnEpochEnd"]
    assert [e.service for e in rt.errors] == ["failing"]
    assert "sakura service 'failing' raised in on_event(OnEpochEnd)" in caplog.text


def test_failing_on_error_handler_does_not_recurse(caplog: pytest.LogCaptureFixture) -> None:
    first = RecordingService("first", priority=0, fail_on={"OnEpochEnd"})
    second = RecordingService("second", priority=1, fail_on={"OnError"})
    rt = SakuraRuntime([first, second])
    with caplog.at_level(logging.CRITICAL, logger="sakura"):
        rt.emit(OnEpochEnd)
        rt.emit(OnError, source="x")
    assert second.names == ["OnError", "OnEpochEnd", "OnError"]
    assert [e.service for e in rt.errors] == ["first", "second"]


def test_strict_mode_reraises_naming_the_service() -> None:
    rt = SakuraRuntime([RecordingService("boom", fail_on={"OnEpochEnd"})], strict=True)
    with pytest.raises(RuntimeError, match="told to fail") as info:
        rt.emit(OnEpochEnd)
    assert any("sakura service 'boom'" in note for note in getattr(info.value, "__notes__", []))


def test_keyboard_interrupt_in_a_handler_is_not_swallowed() -> None:
    class Interrupt(Service):
        def on_epoch_end(self, event: Any) -> None:
            raise KeyboardInterrupt

    rt = SakuraRuntime([Interrupt()])
    with pytest.raises(KeyboardInterrupt):
        rt.emit(OnEpochEnd)


# --- lifecycle ---------------------------------------------------------------------------


def test_context_manager_sets_up_drains_and_tears_down_in_order() -> None:
    log = Log()
    rt = SakuraRuntime([Lifecycle("a", log, 1), Lifecycle("b", log, 2)])
    with rt:
        assert rt.running
        log.calls.append("body")
    assert not rt.running
    assert log.calls == [
        "setup:a",
        "setup:b",
        "body",
        "drain:a",
        "drain:b",
        "teardown:b",
        "teardown:a",
    ]


def test_exception_in_body_still_drains_and_tears_down_and_emits_on_error() -> None:
    log = Log()
    rec = RecordingService(event_types={OnError})
    with (
        pytest.raises(ValueError, match="training blew up"),
        SakuraRuntime([Lifecycle("a", log), rec]),
    ):
        raise ValueError("training blew up")
    assert log.calls == ["setup:a", "drain:a", "teardown:a"]
    assert rec.of(OnError)[0].source == "training loop"


def test_keyboard_interrupt_in_body_tears_everything_down() -> None:
    log = Log()
    with (
        pytest.raises(KeyboardInterrupt),
        SakuraRuntime([Lifecycle("a", log), Lifecycle("b", log)]),
    ):
        raise KeyboardInterrupt
    assert log.calls == ["setup:a", "setup:b", "drain:a", "drain:b", "teardown:b", "teardown:a"]


def test_failing_drain_still_tears_down_all_and_is_raised_after() -> None:
    log = Log()
    with (
        pytest.raises(RuntimeError, match="drain failed"),
        SakuraRuntime([Lifecycle("a", log, 1, fail="drain"), Lifecycle("b", log, 2)]),
    ):
        pass
    assert log.calls == ["setup:a", "setup:b", "drain:a", "drain:b", "teardown:b", "teardown:a"]


def test_failing_setup_tears_down_those_already_set_up() -> None:
    log = Log()
    rt = SakuraRuntime(
        [Lifecycle("a", log, 1), Lifecycle("b", log, 2, fail="setup"), Lifecycle("c", log, 3)]
    )
    with pytest.raises(RuntimeError, match="setup failed") as info, rt:
        pass
    assert log.calls == ["setup:a", "setup:b", "drain:a", "teardown:a"]
    assert "in setup()" in " ".join(getattr(info.value, "__notes__", []))
    assert not rt.running


def test_install_while_running_sets_up_and_uninstall_tears_down() -> None:
    log = Log()
    with SakuraRuntime() as rt:
        rt.install(Lifecycle("late", log))
        assert log.calls == ["setup:late"]
        rt.uninstall("late")
        assert log.calls == ["setup:late", "drain:late", "teardown:late"]
    assert log.calls == ["setup:late", "drain:late", "teardown:late"]


def test_runtime_cannot_start_twice_and_close_is_idempotent() -> None:
    rt = SakuraRuntime().start()
    with pytest.raises(Exception, match="already running"):
        rt.start()
    rt.close()
    rt.close()
    assert "stopped" in repr(rt)


def test_deliver_is_emit_for_ready_events_and_counts_survive_rebuilds() -> None:
    rec = RecordingService("a", event_types={OnEpochEnd})
    rt = SakuraRuntime([rec])
    ready = OnEpochEnd(epoch=1)
    rt.deliver(ready)
    rt.deliver(OnTrainStepBegin())  # nobody handles it: nothing happens
    rt.install(RecordingService("b"))  # rebuilds the dispatchers
    rt.emit(OnEpochEnd, epoch=2)
    assert rec.events[0] is ready and len(rec.events) == 2
    assert rt.event_counts == {"OnEpochEnd": 2}


def test_events_always_carry_the_runtime_rank() -> None:
    rec = RecordingService()
    rt = SakuraRuntime([rec], rank=1, world_size=4)
    event = rt.emit(OnEpochEnd, rank=3)  # the runtime is the authority on rank
    assert event is not None and (event.rank, event.world_size) == (1, 4)


def test_handler_order_with_many_services_and_strict_failure() -> None:
    log = Log()
    services = [Lifecycle(f"s{i}", log, priority=-i) for i in range(12)]
    rt = SakuraRuntime(services, strict=True)
    rt.emit(OnEpochBegin)
    assert log.calls == [f"epoch:s{i}" for i in reversed(range(12))]


def test_from_config_is_a_thin_wrapper_of_from_loaded_config(tmp_path: Any) -> None:
    # sakura.config only reads the configuration; the runtime builds itself from it (the
    # import arrow points one way, see test_layering.py)
    from sakura.config import load_config

    class MyRuntime(SakuraRuntime):
        pass

    (tmp_path / "sakura.toml").write_text(
        'services = [{name = "telemetry", path = "t.jsonl"}]\nstrict = true\n'
    )
    config = load_config(cwd=tmp_path)
    rt = MyRuntime.from_loaded_config(config, rank=1, world_size=2)
    assert type(rt) is MyRuntime and (rt.rank, rt.world_size, rt.strict) == (1, 2, True)
    assert [s.name for s in rt.services] == ["telemetry"]
    again = MyRuntime.from_loaded_config(config)
    assert type(again) is MyRuntime and [s.name for s in again.services] == ["telemetry"]
    assert type(SakuraRuntime.from_loaded_config(config)) is SakuraRuntime


def test_uninstall_failures_name_the_service_and_still_tear_down() -> None:
    log = Log()
    with SakuraRuntime([Lifecycle("flaky", log, fail="drain")]) as rt:
        with pytest.raises(RuntimeError, match="drain failed") as info:
            rt.uninstall("flaky")
        assert "raised by sakura service 'flaky' in drain()" in info.value.__notes__
        assert log.calls[-2:] == ["drain:flaky", "teardown:flaky"]
        assert "flaky" not in rt
