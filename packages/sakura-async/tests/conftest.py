"""Shared pieces of the sakura-async tests: a tiny raw training loop driven through the
runtime (the events DDPAdapter emits), its data, and an evaluation function."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

import cloudpickle
import pytest
import torch

from sakura import OnEpochBegin, OnEpochEnd, OnTrainBegin, OnTrainEnd, OnTrainStepEnd, SakuraRuntime

# Functions defined in test files travel to worker processes by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

STEPS_PER_EPOCH = 4


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def train_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g))
        for _ in range(STEPS_PER_EPOCH)
    ]


def val_payload() -> dict[str, Any]:
    g = torch.Generator().manual_seed(2)
    return {"x": torch.randn(64, 8, generator=g), "y": torch.randint(0, 3, (64,), generator=g)}


def evaluate(model: torch.nn.Module, payload: dict[str, Any]) -> dict[str, float]:
    with torch.no_grad():
        logits = model(payload["x"])
        loss = torch.nn.functional.cross_entropy(logits, payload["y"])
        acc = (logits.argmax(-1) == payload["y"]).float().mean()
    return {"val_loss": loss.item(), "val_acc": acc.item()}


def eval_fn(epoch: int, task: Any) -> dict[str, float]:
    """The eval function the tests dispatch: a fresh model, the snapshot loaded into it."""
    return evaluate(task.load_into(make_model()), task.payload)


def train(
    rt: SakuraRuntime,
    epochs: int = 3,
    *,
    after_epoch: Callable[[int, torch.nn.Module], None] | None = None,
) -> tuple[torch.nn.Module, list[dict[str, float]]]:
    """Train with plain SGD, emitting the raw-loop events; return the model and the metrics
    a synchronous evaluation of each epoch's weights gives (the reference)."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    reference: list[dict[str, float]] = []
    step = 0
    rt.emit(OnTrainBegin, model=model, optimizer=optimizer, train_loader=None)
    for epoch in range(epochs):
        rt.emit(OnEpochBegin, epoch=epoch, step=step, model=model)
        for i, (x, y) in enumerate(train_batches()):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            rt.emit(OnTrainStepEnd, epoch=epoch, step=step, model=model, batch_idx=i, loss=loss)
        reference.append(evaluate(model, val_payload()))
        rt.emit(OnEpochEnd, epoch=epoch, step=step, model=model, optimizer=optimizer, metrics={})
        if after_epoch is not None:
            after_epoch(epoch, model)
    rt.emit(OnTrainEnd, epoch=epochs - 1, step=step, model=model, metrics={})
    return model, reference


@pytest.fixture(autouse=True)
def _quiet_frameworks() -> Any:
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    yield


@pytest.fixture
def world() -> Any:
    """This module: the tiny loop, its data and eval function, for the tests to use."""
    return sys.modules[__name__]
