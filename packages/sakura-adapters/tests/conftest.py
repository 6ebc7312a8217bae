"""Shared test services for the adapter tests (all three frameworks use the same ones)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from sakura import Service


class StepOwner(Service):
    """Owns the step the way a loss scaler does: multiplies the loss by ``scale`` before
    backward, divides the gradients back (once per step, even if asked twice), then steps
    the optimizer itself.  With exact powers of two the result equals an unscaled loop."""

    name = "step_owner"

    def __init__(self, scale: float = 1024.0) -> None:
        self.scale = scale
        self.unscaled = False
        self.unscale_calls = 0
        self.steps = 0

    def wrap_loss(self, loss: Any) -> Any:
        self.unscaled = False
        return loss * self.scale

    def unscale_gradients(self, optimizer: Any) -> None:
        self.unscale_calls += 1
        if self.unscaled:
            return
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.div_(self.scale)
        self.unscaled = True

    def optimizer_step(self, optimizer: Any) -> bool:
        self.unscale_gradients(optimizer)
        optimizer.step()
        self.steps += 1
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state: Any) -> None:
        self.steps = int(state["steps"])


class StepCounter(Service):
    """Counts optimizer steps in its checkpointed state."""

    name = "step_counter"

    def __init__(self) -> None:
        self.count = 0
        self.loaded: int | None = None

    def on_optimizer_step(self, event: Any) -> None:
        self.count += 1

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count}

    def load_state_dict(self, state: Any) -> None:
        self.count = int(state["count"])
        self.loaded = self.count


class EpochCounter(Service):
    """A second stateful service: counts finished epochs (for resumes that add or drop it)."""

    name = "epoch_counter"

    def __init__(self) -> None:
        self.epochs = 0
        self.loaded: int | None = None

    def on_epoch_end(self, event: Any) -> None:
        self.epochs += 1

    def state_dict(self) -> dict[str, Any]:
        return {"epochs": self.epochs}

    def load_state_dict(self, state: Any) -> None:
        self.epochs = int(state["epochs"])
        self.loaded = self.epochs


@pytest.fixture
def epoch_counter() -> EpochCounter:
    return EpochCounter()


@pytest.fixture
def step_owner() -> StepOwner:
    return StepOwner()


@pytest.fixture
def step_counter() -> StepCounter:
    return StepCounter()


@pytest.fixture(autouse=True)
def _quiet_frameworks() -> Any:
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    yield
