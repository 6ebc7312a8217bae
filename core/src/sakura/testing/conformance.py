"""Conformance checks a plugin author runs against their own service.

Either call the ``check_*`` functions with a factory that builds a fresh service, or
subclass :class:`ServiceConformance` in a test module and implement ``make_service``::

    from sakura.testing import ServiceConformance


    class TestMyService(ServiceConformance):
        def make_service(self):
            return MyService(option=1)
"""

from __future__ import annotations

import importlib.util
import logging
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from types import FrameType
from typing import Any

from sakura.events import EVENT_TYPES, Event, event_type
from sakura.runtime import SakuraRuntime
from sakura.service import EVENT_HOOKS, implemented_hooks, validate_service
from sakura.testing.recording import RecordingService

__all__ = [
    "ServiceConformance",
    "check_exceptions_isolated",
    "check_hooks_valid",
    "check_no_work_on_unhandled_events",
    "check_state_round_trip",
]

Factory = Callable[[], Any]


def check_hooks_valid(service: Any) -> None:
    """The service passes install-time validation and implements at least one hook."""
    validate_service(service)
    if not implemented_hooks(service):
        raise AssertionError(f"service {service.name!r} implements no sakura hook")


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if type(a).__module__.startswith("torch") and hasattr(a, "shape"):
        import torch

        return isinstance(b, torch.Tensor) and a.shape == b.shape and bool(torch.equal(a, b))
    return bool(a == b)


def check_state_round_trip(factory: Factory, *, train: bool = True) -> None:
    """``state_dict`` -> ``load_state_dict`` on a fresh service -> the same ``state_dict``.

    With ``train=True`` the first service is run through the tiny loop first (or, where
    torch is not installed, through the same sequence of events with default fields), so
    the state is not just the initial one.  The state is loaded with ``strict=True``.
    No-op for stateless services.
    """
    first = factory()
    if not hasattr(first, "state_dict"):
        return
    if not hasattr(first, "load_state_dict"):
        raise AssertionError(f"service {first.name!r} has state_dict() but no load_state_dict()")
    with SakuraRuntime(strict=True) as rt:
        rt.install(first)
        if train:
            _train_briefly(rt)
        saved = rt.state_dict()
    second = factory()
    with SakuraRuntime(strict=True) as rt2:
        rt2.install(second)
        rt2.load_state_dict(saved, strict=True)
        again = rt2.state_dict()
    if not _equal(saved, again):
        raise AssertionError(
            f"service {first.name!r}: state_dict after load_state_dict differs from the one "
            f"loaded:\n saved={saved!r}\n again={again!r}"
        )


def _train_briefly(rt: SakuraRuntime) -> None:
    """One epoch of two steps through ``rt``: the tiny loop with torch, else its events."""
    from sakura.testing.loop import expected_event_names, run_tiny_loop

    if importlib.util.find_spec("torch") is not None:
        run_tiny_loop(rt, epochs=1, steps_per_epoch=2)
        return
    step = 0
    for name in expected_event_names(epochs=1, steps_per_epoch=2, val_batches=1):
        if name == "OnOptimizerStep":
            step += 1
        rt.emit(event_type(name), step=step)


class _FailEverywhere:
    name = "conformance_failer"
    priority = -1_000_000

    def on_event(self, event: Event) -> None:
        raise RuntimeError(f"injected failure on {type(event).__name__}")


def check_exceptions_isolated(factory: Factory) -> None:
    """A sibling service that raises on every event must not stop this service, and this
    service must accept the resulting OnError events without raising."""
    service = factory()
    recorder = RecordingService("conformance_recorder", priority=10**9)
    rt = SakuraRuntime(strict=False)
    rt.install(_FailEverywhere())
    rt.install(service)
    rt.install(recorder)
    sakura_logger = logging.getLogger("sakura")
    level = sakura_logger.level
    sakura_logger.setLevel(logging.CRITICAL)  # the injected failures are expected
    try:
        with rt:
            for event_cls in EVENT_TYPES:
                rt.emit(event_cls)
    finally:
        sakura_logger.setLevel(level)
    own = [e for e in rt.errors if e.service == service.name]
    if own:
        raise AssertionError(
            f"service {service.name!r} raised while handling events with default fields or the "
            f"OnError reports of a failing sibling: {own[0].exception!r}"
        )
    if len(recorder.events) < len(EVENT_TYPES):
        raise AssertionError("events stopped reaching later services after a failure")


def check_no_work_on_unhandled_events(factory: Factory) -> None:
    """Emitting an event the service does not handle runs none of its code."""
    service = factory()
    handled = {name for name in implemented_hooks(service) if name in EVENT_HOOKS}
    catch_all = hasattr(service, "on_event")
    subscribed = getattr(service, "event_types", None)
    unhandled = [
        cls
        for cls in EVENT_TYPES
        if cls.hook not in handled and not (catch_all and (subscribed is None or cls in subscribed))
    ]
    calls: list[str] = []

    def profiler(frame: FrameType, what: str, arg: Any) -> None:
        if what == "call" and frame.f_locals.get("self") is service:
            calls.append(frame.f_code.co_name)

    with SakuraRuntime(strict=True) as rt:
        rt.install(service)
        previous = sys.getprofile()
        sys.setprofile(profiler)
        try:
            for cls in unhandled:
                rt.emit(cls)
        finally:
            sys.setprofile(previous)
    if calls:
        raise AssertionError(
            f"service {service.name!r} ran {sorted(set(calls))} on events it does not handle"
        )


class ServiceConformance:
    """Base class of a pytest test class checking one service.  Implement ``make_service``.

    ``self.tmp_path`` is a fresh temporary directory per test (pytest's ``tmp_path``), for
    services that write files.
    """

    tmp_path: Path

    try:
        import pytest as _pytest
    except ImportError:  # pragma: no cover - the base class is only useful under pytest
        pass
    else:

        @_pytest.fixture(autouse=True)
        def _sakura_tmp_path(self, tmp_path: Path) -> None:
            self.tmp_path = tmp_path

        del _pytest

    def make_service(self) -> Any:
        raise NotImplementedError("implement make_service() to return a fresh service")

    def test_hooks_valid(self) -> None:
        check_hooks_valid(self.make_service())

    def test_state_round_trip(self) -> None:
        check_state_round_trip(self.make_service)

    def test_exceptions_isolated(self) -> None:
        check_exceptions_isolated(self.make_service)

    def test_no_work_on_unhandled_events(self) -> None:
        check_no_work_on_unhandled_events(self.make_service)

    def test_runs_in_tiny_loop(self) -> None:
        if importlib.util.find_spec("torch") is None:
            import pytest

            pytest.skip("torch is not installed")
        from sakura.testing.loop import run_tiny_loop

        with SakuraRuntime(strict=True) as rt:
            rt.install(self.make_service())
            result = run_tiny_loop(rt, epochs=1, steps_per_epoch=2)
        if result.steps != 2:
            raise AssertionError(f"the tiny loop ran {result.steps} steps instead of 2")
