"""The dispatchers' timing and frame options are declared once (DispatchOptions) and checked
once, with the same text from every dispatcher; the dispatcher-ownership plumbing of the
services is one DispatcherSlot."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import pytest

from sakura.errors import SpecError
from sakura.options import OptionError
from sakura.plugins import get_plugin_manager
from sakura_async.dispatch import (
    ClusterDispatcher,
    InThreadDispatcher,
    LocalDispatcher,
    RemoteDispatcher,
    ThreadDispatcher,
)
from sakura_async.dispatch import options as dispatch_options
from sakura_async.dispatch.options import DispatchOptions
from sakura_async.dispatch.resolve import DispatcherSlot
from sakura_async.remote_server import RemoteWorkerServer

_URI = "tcp://127.0.0.1:1"


def _builders() -> dict[str, Any]:
    return {
        "ThreadDispatcher": lambda **kw: ThreadDispatcher(**kw),
        "LocalDispatcher": lambda **kw: LocalDispatcher(**kw),
        "RemoteDispatcher": lambda **kw: RemoteDispatcher(_URI, **kw),
        "ClusterDispatcher": lambda **kw: ClusterDispatcher(**kw),
    }


# (option, bad value, the dispatchers that take the option)
BAD = [
    (
        "max_pending",
        0,
        ("ThreadDispatcher", "LocalDispatcher", "RemoteDispatcher", "ClusterDispatcher"),
    ),
    (
        "task_timeout",
        0,
        ("ThreadDispatcher", "LocalDispatcher", "RemoteDispatcher", "ClusterDispatcher"),
    ),
    (
        "interrupt_grace",
        -1,
        ("ThreadDispatcher", "LocalDispatcher", "RemoteDispatcher", "ClusterDispatcher"),
    ),
    ("start_timeout", 0, ("LocalDispatcher", "ClusterDispatcher")),
    ("start_timeout", True, ("LocalDispatcher", "ClusterDispatcher")),
    ("connect_timeout", -1, ("RemoteDispatcher",)),
    ("liveness_timeout", 0, ("LocalDispatcher", "RemoteDispatcher")),
    ("max_frame_bytes", 10, ("LocalDispatcher", "RemoteDispatcher", "sakura-worker")),
]


@pytest.mark.parametrize(("option", "value", "owners"), BAD)
def test_every_dispatcher_rejects_a_bad_value_with_the_same_text(
    option: str, value: Any, owners: tuple[str, ...]
) -> None:
    builders = _builders()
    builders["sakura-worker"] = lambda **kw: RemoteWorkerServer(
        "127.0.0.1", 0, token=None, insecure_loopback=True, **kw
    )
    texts = set()
    for owner in owners:
        with pytest.raises(OptionError) as error:
            builders[owner](**{option: value})
        assert error.value.option == option and error.value.value is value
        text = str(error.value)
        assert text.startswith(f"{owner}: {option}={value!r} is not accepted; accepted: ")
        texts.add(text.removeprefix(f"{owner}: "))
    assert len(texts) == 1, texts


def test_a_dispatcher_checks_each_option_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: Counter[str] = Counter()
    rules = dict(dispatch_options._RULES)
    for name, rule in rules.items():

        def counted(o: str, v: Any, owner: str, rule: Any = rule) -> Any:
            calls[o] += 1
            return rule(o, v, owner)

        monkeypatch.setitem(dispatch_options._RULES, name, counted)
    local = LocalDispatcher(max_pending=3, liveness_timeout=5, max_frame_bytes=1 << 20)
    try:
        assert dict(calls) == {
            "max_pending": 1,
            "task_timeout": 1,
            "interrupt_grace": 1,
            "start_timeout": 1,
            "liveness_timeout": 1,
            "max_frame_bytes": 1,
        }
        assert local.options == DispatchOptions(
            max_pending=3, liveness_timeout=5.0, max_frame_bytes=1 << 20
        )
        assert (local.max_pending, local.liveness_timeout, local.max_frame_bytes) == (
            3,
            5.0,
            1 << 20,
        )
    finally:
        local.close()
    calls.clear()
    remote = RemoteDispatcher(_URI, connect_timeout=2)
    assert sum(calls.values()) == 6 and set(calls.values()) == {1}
    assert remote.connect_timeout == 2.0 and remote.options.connect_timeout == 2.0
    remote.close()


def test_spec_strings_reach_the_same_checks() -> None:
    manager = get_plugin_manager()
    with pytest.raises(OptionError) as direct:
        LocalDispatcher(liveness_timeout=0)
    with pytest.raises((SpecError, OptionError)) as error:
        manager.create("dispatcher", "process:liveness_timeout=0")
    assert str(direct.value) in str(error.value)
    with pytest.raises((SpecError, OptionError)) as error:
        manager.create("service", "async_checkpoint:process,dir=x,max_frame_bytes=10")
    assert "LocalDispatcher: max_frame_bytes=10 is not accepted" in str(error.value)


def test_options_are_frozen_and_unknown_ones_refused() -> None:
    options = DispatchOptions.from_kwargs(owner="X", task_timeout=None, max_pending=4)
    assert options.task_timeout is None and options.max_pending == 4
    assert options.liveness_timeout == 60.0  # a default, not read by dispatchers without it
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.max_pending = 1  # type: ignore[misc]
    with pytest.raises(TypeError, match="X: unknown dispatcher option"):
        DispatchOptions.from_kwargs(owner="X", heartbeat=1)
    assert {f.name for f in dataclasses.fields(DispatchOptions)} == set(dispatch_options._RULES)


def test_dispatcher_slot_owns_what_it_builds_and_only_that() -> None:
    built = DispatcherSlot(None, owner="S")
    assert built.dispatcher is None
    thread = built.acquire()
    assert isinstance(thread, ThreadDispatcher) and built.owned and built.acquire() is thread
    built.release()
    assert thread.closed and built.dispatcher is None
    again = built.acquire()  # a later setup builds a fresh one
    assert again is not thread
    built.release()

    mine = InThreadDispatcher()
    given = DispatcherSlot(mine, owner="S")
    assert given.dispatcher is mine and not given.owned
    given.release()
    assert not mine.closed and given.dispatcher is mine  # the caller's to close
    mine.close()

    for_service = InThreadDispatcher()
    for_service.owned_by_service = True  # built for the service alone (a spec string)
    slot = DispatcherSlot(for_service, owner="S")
    assert slot.owned
    slot.release()
    assert for_service.closed

    named = DispatcherSlot("inthread", owner="S")
    assert isinstance(named.acquire(), InThreadDispatcher) and named.owned
    named.release()
    with pytest.raises(OptionError, match=r"S: dispatcher='thred' .*did you mean 'thread'"):
        DispatcherSlot("thred", owner="S")
    with pytest.raises(TypeError, match="S: dispatcher must be"):
        DispatcherSlot(42, owner="S")
