"""OnCheckpointDurable for a full-state checkpoint (in one process): what it carries, who
receives it, a subscriber that raises, and AsyncCheckpoint.resume of the newest one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from sakura import OnError, SakuraRuntime
from sakura.options import OptionError
from sakura.testing import RecordingService
from sakura_async import AsyncCheckpoint, OnCheckpointDurable
from sakura_async.checkpoint import find_checkpoints, verify


def test_each_durable_checkpoint_is_announced_to_its_subscribers(
    world: Any, tmp_path: Path
) -> None:
    subscriber = RecordingService("subscriber", event_types={OnCheckpointDurable})
    catch_all = RecordingService("catch_all")  # event_types None: core events only
    with SakuraRuntime(strict=True) as rt:
        ckpt = rt.install(AsyncCheckpoint(tmp_path, every=1, keep=None, dispatcher="thread"))
        rt.install(subscriber)
        rt.install(catch_all)
        world.train(rt, 3)
    events = [e for e in subscriber.events if isinstance(e, OnCheckpointDurable)]
    steps_per_epoch = len(world.train_batches())
    assert [(e.step, e.epoch) for e in events] == [(steps_per_epoch * (i + 1), i) for i in range(3)]
    assert [e.path for e in events] == ckpt.saved  # in completion order
    found = {c.path: c for c in find_checkpoints(tmp_path)}
    for event in events:
        assert event.format == "torch" and not event.sharded
        assert event.source == "async_checkpoint" and event.rank == 0
        assert verify(found[event.path]) is None  # durable and complete when announced
    assert not any(isinstance(e, OnCheckpointDurable) for e in catch_all.events)


def test_a_subscriber_that_raises_is_isolated(world: Any, tmp_path: Path) -> None:
    failing = RecordingService(
        "failing", event_types={OnCheckpointDurable}, fail_on={"OnCheckpointDurable"}
    )
    errors = RecordingService("errors", event_types={OnError})
    with SakuraRuntime() as rt:
        ckpt = rt.install(AsyncCheckpoint(tmp_path, every=1, dispatcher="thread"))
        rt.install(failing)
        rt.install(errors)
        world.train(rt, 2)
    assert len(ckpt.saved) == 2 and ckpt.errors == []  # the checkpoints are unaffected
    assert [e.service for e in rt.errors] == ["failing", "failing"]
    reported = [e for e in errors.events if isinstance(e, OnError)]
    assert [e.source for e in reported] == ["failing", "failing"]
    assert all(isinstance(e.event, OnCheckpointDurable) for e in reported)


def test_a_subscriber_that_raises_under_strict_raises(world: Any, tmp_path: Path) -> None:
    failing = RecordingService(
        "failing", event_types={OnCheckpointDurable}, fail_on={"OnCheckpointDurable"}
    )
    with pytest.raises(RuntimeError), SakuraRuntime(strict=True) as rt:
        rt.install(AsyncCheckpoint(tmp_path, every=1, dispatcher="inthread"))
        rt.install(failing)
        world.train(rt, 1)


def test_resume_loads_the_newest_checkpoint(world: Any, tmp_path: Path) -> None:
    seen: list[dict[str, torch.Tensor]] = []
    with SakuraRuntime(strict=True) as rt:
        rt.install(AsyncCheckpoint(tmp_path, every=1, dispatcher="thread"))
        world.train(
            rt,
            2,
            after_epoch=lambda e, m: seen.append({k: v.clone() for k, v in m.state_dict().items()}),
        )
    model = world.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    assert AsyncCheckpoint(tmp_path).resume(model, optimizer) == 2 * len(world.train_batches())
    for key, value in model.state_dict().items():
        assert torch.equal(value, seen[-1][key]), key
    assert optimizer.param_groups[0]["lr"] == 0.2  # the optimizer's state came back too
    assert AsyncCheckpoint(tmp_path / "empty").resume(model) is None
    with pytest.raises(OptionError, match="dir"):
        AsyncCheckpoint().resume(model)


def test_timeout_s_is_validated() -> None:
    for bad in (0, -1.0, "60", True):
        with pytest.raises(OptionError, match="timeout_s"):
            AsyncCheckpoint("x", timeout_s=bad)
    assert AsyncCheckpoint("x", timeout_s=5).timeout_s == 5
