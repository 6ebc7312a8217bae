"""Resuming services' state with a changed service list (sakura.resume)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest

from sakura import SakuraRuntime, Service
from sakura.resume import ServiceStateError, ServiceStateWarning


class Counter(Service):
    """A stateful service: counts the steps it saw."""

    def __init__(self, name: str, start: int = 0) -> None:
        self.name = name
        self.count = start
        self.loads = 0

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: Any) -> None:
        self.count = state["count"]
        self.loads += 1


class WriteOnly(Service):
    """Has state to save but cannot load it."""

    name = "write_only"

    def state_dict(self) -> dict[str, Any]:
        return {"x": 1}


def test_same_services_load_without_warnings() -> None:
    saved = SakuraRuntime([Counter("a", 5), Counter("b", 7)]).state_dict()
    a, b = Counter("a"), Counter("b")
    rt = SakuraRuntime([a, b])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rt.load_state_dict(saved)
    assert (a.count, b.count) == (5, 7)
    assert rt.orphaned_state == {}


def test_added_service_starts_fresh_with_a_warning_naming_it() -> None:
    saved = SakuraRuntime([Counter("a", 5)]).state_dict()
    a, monitor = Counter("a"), Counter("monitor", 3)
    rt = SakuraRuntime([a, monitor])
    with pytest.warns(ServiceStateWarning) as record:
        rt.load_state_dict(saved)
    messages = [str(w.message) for w in record]
    assert len(messages) == 1
    assert "no state for installed service(s) ['monitor']" in messages[0]
    assert "start fresh" in messages[0]
    assert record[0].filename == __file__  # points at the caller of load_state_dict
    assert (a.count, a.loads) == (5, 1)
    assert (monitor.count, monitor.loads) == (3, 0)  # untouched: starts fresh
    assert rt.state_dict() == {"a": {"count": 5}, "monitor": {"count": 3}}


def test_removed_service_state_is_kept_reported_and_saved_again(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    saved = SakuraRuntime([Counter("a", 5), Counter("ghost", 9)]).state_dict()
    path = tmp_path / "ckpt.pt"
    torch.save({"sakura": saved}, path)

    a = Counter("a")
    rt = SakuraRuntime([a])
    with pytest.warns(ServiceStateWarning, match=r"\['ghost'\] that are not installed") as record:
        rt.load_state_dict(torch.load(path, weights_only=True)["sakura"])
    assert len(record) == 1 and "rt.orphaned_state" in str(record[0].message)
    assert a.count == 5
    assert rt.orphaned_state == {"ghost": {"count": 9}}

    # the next checkpoint still carries it, next to the live services' state
    a.count = 6
    resaved = rt.state_dict()
    assert resaved == {"a": {"count": 6}, "ghost": {"count": 9}}
    torch.save({"sakura": resaved}, path)

    # a later run that installs the service again gets its state back, without warnings
    a2, ghost = Counter("a"), Counter("ghost")
    rt2 = SakuraRuntime([a2, ghost])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rt2.load_state_dict(torch.load(path, weights_only=True)["sakura"])
    assert (a2.count, ghost.count) == (6, 9)
    assert rt2.orphaned_state == {}


def test_live_service_state_wins_over_a_kept_entry_of_the_same_name() -> None:
    rt = SakuraRuntime([WriteOnly()])
    with pytest.warns(ServiceStateWarning, match="write_only"):
        rt.load_state_dict({"write_only": {"x": 0}})  # installed, but cannot load state
    assert rt.orphaned_state == {"write_only": {"x": 0}}
    assert rt.state_dict() == {"write_only": {"x": 1}}


def test_both_kinds_warn_once_each() -> None:
    rt = SakuraRuntime([Counter("new")])
    with pytest.warns(ServiceStateWarning) as record:
        rt.load_state_dict({"old": {"count": 1}})
    messages = [str(w.message) for w in record]
    assert len(messages) == 2
    assert "no state for installed service(s) ['new']" in messages[0]
    assert "state for service(s) ['old'] that are not installed" in messages[1]


def test_strict_raises_one_error_listing_both_kinds_and_loads_nothing() -> None:
    a, new = Counter("a"), Counter("new")
    rt = SakuraRuntime([a, new])
    with pytest.raises(ServiceStateError) as info:
        rt.load_state_dict({"a": {"count": 5}, "old": {"count": 1}}, strict=True)
    error = info.value
    assert isinstance(error, KeyError)  # what strict loading raised before
    assert (error.missing, error.orphaned) == (["new"], ["old"])
    message = str(error)
    assert "state for service(s) ['old'] that are not installed" in message
    assert "no state for installed service(s) ['new']" in message
    assert "strict=False" in message
    assert a.loads == 0 and rt.orphaned_state == {}


def test_strict_accepts_a_matching_checkpoint() -> None:
    a = Counter("a")
    SakuraRuntime([a]).load_state_dict({"a": {"count": 2}}, strict=True)
    assert a.count == 2


def test_a_new_load_replaces_the_kept_entries() -> None:
    rt = SakuraRuntime([Counter("a")])
    with pytest.warns(ServiceStateWarning):
        rt.load_state_dict({"a": {"count": 1}, "old": {}})
    rt.load_state_dict({"a": {"count": 2}})
    assert rt.orphaned_state == {}
    assert rt.state_dict() == {"a": {"count": 2}}


def test_strict_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="strict must be True or False, got 'yes'"):
        SakuraRuntime([Counter("a")]).load_state_dict({}, strict="yes")  # type: ignore[arg-type]
