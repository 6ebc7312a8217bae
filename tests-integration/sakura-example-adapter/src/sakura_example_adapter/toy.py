"""``ToyTrainer``: a tiny trainer Sakura has never heard of.

It has what real frameworks have, in miniature: its own checkpoint layout, its own metric
log, an optimizer proxy that it hands out in place of the user's optimizer, and step hooks
that a callback may take over (as Lightning's precision plugin can).  Nothing here knows
Sakura; :mod:`sakura_example_adapter.adapter` is the bridge.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["CHECKPOINT_FORMAT", "ToyOptimizer", "ToyTrainer"]

CHECKPOINT_FORMAT = "toy-1"
"""The name of the layout :meth:`ToyTrainer.checkpoint` returns."""


class ToyOptimizer:
    """The proxy ToyTrainer hands out around the user's optimizer: it counts steps and
    shares the optimizer's ``param_groups``."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.inner = inner
        self.steps = 0

    @property
    def param_groups(self) -> Any:
        return self.inner.param_groups

    @property
    def state(self) -> Any:
        return self.inner.state

    def step(self) -> None:
        self.steps += 1
        self.inner.step()

    def zero_grad(self) -> None:
        self.inner.zero_grad(set_to_none=True)


class ToyTrainer:
    """``fit(batches, loss_fn)`` runs ``epochs`` passes over ``batches`` of ``(x, y)``.

    Callbacks get ``on_fit_start(trainer)``, ``on_epoch_start(trainer)``,
    ``on_step_end(trainer, loss)``, ``on_epoch_end(trainer, metrics)`` and
    ``on_fit_end(trainer)``.  The first callback that has one of the step hooks
    ``forward_context()``, ``backward(loss)``, ``clip_gradients(optimizer, max_norm)`` or
    ``optimizer_step(optimizer)`` takes that part of the step over; ``clip_gradients`` gets
    the :class:`ToyOptimizer` the user sees, ``optimizer_step`` the user's optimizer.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        epochs: int = 1,
        run_dir: str,
        clip: float | None = None,
        callbacks: Sequence[Any] = (),
    ) -> None:
        self.model = model
        self.optimizer = ToyOptimizer(optimizer)
        self.epochs = epochs
        self.run_dir = run_dir
        self.clip = clip
        self.callbacks = list(callbacks)
        self.epoch = 0
        self.global_step = 0
        self.metrics_log: list[dict[str, Any]] = []
        """The trainer's own metric log: one entry per metric, with its epoch and step."""
        self.grads_after_clip: list[list[torch.Tensor]] = []

    # --- its own logging and checkpoints --------------------------------------------------

    def log(self, name: str, value: float, *, epoch: int, step: int, source: str) -> None:
        self.metrics_log.append(
            {"name": name, "value": float(value), "epoch": epoch, "step": step, "source": source}
        )

    def checkpoint(self) -> dict[str, Any]:
        """The trainer's full checkpoint, in its own layout."""
        return {
            "format": CHECKPOINT_FORMAT,
            "weights": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
            "optimizer": copy.deepcopy(self.optimizer.inner.state_dict()),
            "progress": {"epoch": self.epoch, "global_step": self.global_step},
            "optimizer_steps": self.optimizer.steps,
        }

    def restore(self, state: dict[str, Any]) -> None:
        if state.get("format") != CHECKPOINT_FORMAT:
            raise ValueError(f"not a {CHECKPOINT_FORMAT} checkpoint: {state.get('format')!r}")
        self.model.load_state_dict(state["weights"])
        self.optimizer.inner.load_state_dict(state["optimizer"])
        self.epoch = int(state["progress"]["epoch"])
        self.global_step = int(state["progress"]["global_step"])
        self.optimizer.steps = int(state["optimizer_steps"])

    # --- the loop -------------------------------------------------------------------------

    def _hook(self, name: str) -> Callable[..., Any] | None:
        for callback in self.callbacks:
            hook = getattr(callback, name, None)
            if callable(hook):
                return hook  # type: ignore[no-any-return]
        return None

    def _call(self, name: str, *args: Any) -> None:
        for callback in self.callbacks:
            hook = getattr(callback, name, None)
            if callable(hook):
                hook(self, *args)

    def fit(
        self,
        batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> None:
        batches = list(batches)
        forward_context = self._hook("forward_context") or contextlib.nullcontext
        backward = self._hook("backward") or (lambda loss: loss.backward())
        clip_hook = self._hook("clip_gradients")
        step_hook = self._hook("optimizer_step")
        self._call("on_fit_start")
        for epoch in range(self.epoch, self.epochs):
            self.epoch = epoch
            self._call("on_epoch_start")
            total = 0.0
            for x, y in batches:
                with forward_context():
                    loss = loss_fn(self.model(x), y)
                backward(loss)
                if self.clip is not None:
                    if clip_hook is not None:
                        clip_hook(self.optimizer, self.clip)
                    else:
                        nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
                    self.grads_after_clip.append(
                        [
                            p.grad.detach().clone()
                            for p in self.model.parameters()
                            if p.grad is not None
                        ]
                    )
                if step_hook is not None:
                    step_hook(self.optimizer.inner)
                    self.optimizer.steps += 1
                else:
                    self.optimizer.step()
                self.optimizer.zero_grad()
                self.global_step += 1
                total += float(loss.detach())
                self._call("on_step_end", loss.detach())
            metrics = {"train_loss": total / max(len(batches), 1)}
            self.log(
                "train_loss",
                metrics["train_loss"],
                epoch=epoch,
                step=self.global_step,
                source="toy",
            )
            self._call("on_epoch_end", metrics)
        self.epoch = self.epochs
        self._call("on_fit_end")
