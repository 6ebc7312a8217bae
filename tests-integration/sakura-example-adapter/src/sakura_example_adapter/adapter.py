"""``ToyAdapter``: drives a Sakura runtime from :class:`~sakura_example_adapter.toy.ToyTrainer`.

Built from Sakura's "Writing an adapter" page only: events for the trainer's moments, the
runtime's coordinated calls in the trainer's step hooks, a ``sakura.loop.LoopContext`` on
``OnTrainBegin.loop`` (what only the loop knows), and the trainer's optimizer proxy
registered with ``sakura.proxies``.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager
from typing import Any

from torch import nn

from sakura import SakuraRuntime
from sakura import events as ev
from sakura.loop import LoopContext
from sakura.proxies import register_optimizer_proxy
from sakura_example_adapter.toy import CHECKPOINT_FORMAT, ToyOptimizer, ToyTrainer

__all__ = ["ToyAdapter"]

# ToyTrainer hands out a ToyOptimizer around the user's optimizer: services that keep
# per-optimizer state must see the two as one.
register_optimizer_proxy(ToyOptimizer, "inner")


class ToyAdapter:
    """Pass it as a callback: ``ToyTrainer(..., callbacks=[ToyAdapter(rt)])``."""

    def __init__(self, rt: SakuraRuntime) -> None:
        if not isinstance(rt, SakuraRuntime):
            raise TypeError(f"ToyAdapter: rt must be a sakura.SakuraRuntime, got {rt!r}")
        self.rt = rt

    def _emit(self, cls: type[ev.Event], trainer: ToyTrainer, /, **fields: Any) -> None:
        if self.rt.handles(cls):
            self.rt.emit(cls, step=trainer.global_step, epoch=trainer.epoch, **fields)

    def loop_context(self, trainer: ToyTrainer) -> LoopContext:
        """What the toy loop offers services."""

        def report(metrics: Mapping[str, Any], epoch: int, step: int) -> None:
            for name, value in metrics.items():
                if isinstance(value, (int, float)):
                    trainer.log(name, float(value), epoch=epoch, step=step, source="sakura")

        return LoopContext(
            framework="toy",
            output_dir=trainer.run_dir,
            checkpoint_state=trainer.checkpoint,
            checkpoint_format=CHECKPOINT_FORMAT,
            report_metrics=report,
        )

    # --- the trainer's moments ------------------------------------------------------------

    def on_fit_start(self, trainer: ToyTrainer) -> None:
        model = self.rt.wrap_model(trainer.model)
        if not isinstance(model, nn.Module):
            raise TypeError(f"ToyAdapter: wrap_model returned {type(model).__name__}")
        trainer.model = model
        self._emit(
            ev.OnTrainBegin,
            trainer,
            model=model,
            optimizer=trainer.optimizer.inner,
            trainer=trainer,
            loop=self.loop_context(trainer),
        )

    def on_epoch_start(self, trainer: ToyTrainer) -> None:
        self._emit(ev.OnEpochBegin, trainer, model=trainer.model)

    def on_step_end(self, trainer: ToyTrainer, loss: Any) -> None:
        self._emit(ev.OnTrainStepEnd, trainer, model=trainer.model, loss=loss)

    def on_epoch_end(self, trainer: ToyTrainer, metrics: Mapping[str, Any]) -> None:
        self._emit(ev.OnEpochEnd, trainer, model=trainer.model, metrics=dict(metrics))

    def on_fit_end(self, trainer: ToyTrainer) -> None:
        self._emit(ev.OnTrainEnd, trainer, model=trainer.model)

    # --- the step hooks: the runtime's coordinated calls ---------------------------------

    def forward_context(self) -> AbstractContextManager[Any]:
        return self.rt.autocast()

    def backward(self, loss: Any) -> None:
        self.rt.scale_loss(loss).backward()

    def clip_gradients(self, optimizer: ToyOptimizer, max_norm: float) -> None:
        self.rt.unscale_gradients(optimizer)  # the proxy: seen through by the services
        params = [p for group in optimizer.param_groups for p in group["params"]]
        nn.utils.clip_grad_norm_(params, max_norm)

    def optimizer_step(self, optimizer: Any) -> None:
        rt = self.rt
        rt.unscale_gradients(optimizer)
        if not rt.optimizer_step(optimizer):
            optimizer.step()
