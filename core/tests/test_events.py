from __future__ import annotations

import dataclasses
import pickle
import re

import pytest

import sakura
from sakura.events import (
    EVENT_TYPES,
    Event,
    OnEpochEnd,
    OnError,
    OnTrainStepBegin,
    event_fields,
    event_type,
)

LIGHTNING_PARITY_MINIMUM = [
    "OnTrainBegin",
    "OnEpochBegin",
    "OnTrainStepBegin",
    "OnBeforeBackward",
    "OnAfterBackward",
    "OnOptimizerStep",
    "OnTrainStepEnd",
    "OnValidationBegin",
    "OnValidationEnd",
    "OnEpochEnd",
    "OnSaveCheckpoint",
    "OnLoadCheckpoint",
    "OnTrainEnd",
    "OnError",
]


def test_design_minimum_vocabulary_exists() -> None:
    names = {cls.__name__ for cls in EVENT_TYPES}
    assert set(LIGHTNING_PARITY_MINIMUM) <= names
    assert len(EVENT_TYPES) == len(names) == 41


@pytest.mark.parametrize("cls", EVENT_TYPES, ids=lambda c: c.__name__)
def test_every_event_is_frozen_slotted_and_carries_rank(cls: type[Event]) -> None:
    event = cls(rank=1, world_size=2, step=5, epoch=3)
    assert (event.rank, event.world_size, event.step, event.epoch) == (1, 2, 5, 3)
    assert not hasattr(event, "__dict__")
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.rank = 0  # type: ignore[misc]
    # hook name follows the class name: OnTrainStepBegin -> on_train_step_begin
    snake = "on_" + re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__[2:]).lower()
    assert cls.hook == snake
    assert pickle.loads(pickle.dumps(event)) == event
    assert event_type(cls.__name__) is cls and event_type(cls.hook) is cls


def test_fast_init_keeps_dataclass_semantics() -> None:
    event = OnTrainStepBegin(step=3, batch="b", batch_idx=2)
    assert event == OnTrainStepBegin(
        rank=0, world_size=1, step=3, epoch=0, model=None, batch="b", batch_idx=2
    )
    assert repr(event).startswith("OnTrainStepBegin(rank=0, world_size=1, step=3")
    assert event_fields(event)["batch"] == "b"
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        OnTrainStepBegin(bogus=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        OnTrainStepBegin(1)  # type: ignore[misc]  # keyword-only
    assert dataclasses.replace(event, step=4).step == 4


def test_defaults_are_per_field() -> None:
    assert OnEpochEnd().metrics is None
    assert OnError().source == "" and OnError().exception is None
    assert sakura.OnSetup().stage == "fit"


def test_unknown_event_name_suggests() -> None:
    with pytest.raises(KeyError, match="did you mean 'OnEpochEnd'"):
        event_type("OnEpochEdn")
