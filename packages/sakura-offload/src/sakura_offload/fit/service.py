"""The ``fit`` service: ``wrap``'s decisions under ``rt.prepare`` (raw loops, Lightning's
``LightningAdapter``, sakura's ``SakuraTrainer``).

``wrap_model`` measures the model, decides (assuming the loop's optimizer is an AdamW: two
moments per trainable parameter) and applies the model's part of the plan (a fit choice,
weight streaming, the activation planner); ``wrap_optimizer`` hands the optimizer to an
:class:`~sakura_offload.OffloadAdamWService` when the plan puts it on the host (that
service's accumulation and skipped-step handling come with it: the loop's backward passes
per step, ``OnTrainBegin.accumulation_steps``, or the ``accumulation_steps`` option for a
loop that does not say).  An optimizer that is not an AdamW under a plan that needs the
host optimizer is an error naming the plan.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from sakura import Service
from sakura.events import OnLog
from sakura.options import check_number
from sakura_offload.fit.heap import trim_heap
from sakura_offload.fit.metrics import FitMetrics
from sakura_offload.fit.wrap import FitState, apply_fit, fit_options, plan_fit, trims_heap

__all__ = ["Fit"]

_OWNER = "Fit"


class Fit(Service):
    """Spec ``fit[:device_budget][,host_budget=..,host_reserve=..,disk_offload=..,choices=..,moment_dtype=..,
    activations=..,activation_reserve=..,prefetch=..,cost_trials=..,report=..,blocks=..,
    replan=..,accumulation_steps=..,log_every=..]``, e.g.
    ``fit:device_budget=2GiB,host_budget=8GiB,disk_offload=/tmp/x``.  The options are
    :func:`sakura_offload.wrap`'s (``accumulation_steps``: ``None`` reads the loop's setting
    when training starts, as the ``offload_adamw`` service does), and ``log_every``
    (default 50, 0: never):
    every that many optimizer steps the ``sakura_*`` metrics of
    :mod:`sakura_offload.fit.metrics` go to the loop's ``report_metrics`` (Lightning's
    loggers, the HF Trainer's ``log_history``), or as an ``OnLog`` event (a raw loop's
    ``Telemetry``) when the loop offers none."""

    name = "fit"
    priority: float = 55

    def __init__(
        self,
        device_budget: Any = None,
        *,
        priority: float | None = None,
        log_every: Any = 50,
        **options: Any,
    ):
        self.metrics = FitMetrics(log_every, owner=_OWNER)
        self.options = fit_options(device_budget=device_budget, owner=_OWNER, **options)
        if priority is not None:
            self.priority = check_number("priority", priority, owner=_OWNER)
        self.state: FitState | None = None
        self._adamw: Any = None
        self._rt: Any = None

    def wrap_model(self, model: Any) -> Any:
        if not isinstance(model, nn.Module):
            raise TypeError(f"Fit needs a torch.nn.Module, got {type(model).__name__}")
        if self.state is not None:
            return model
        plan, choices, budgets = plan_fit(model, None, self.options, assume_adamw=True)
        self.state = apply_fit(model, None, plan, choices, budgets, self.options)
        self.metrics.model = model
        return model

    def wrap_optimizer(self, optimizer: Any) -> Any:
        from sakura_offload.fit.wrap import _adamw_like
        from sakura_offload.host_optimizer.service import OffloadAdamWService

        state = self.state
        if state is None or state.plan.optimizer != "host":
            if state is not None:
                state.optimizer = optimizer
            return optimizer
        if not _adamw_like(optimizer):
            raise TypeError(
                f"fit: the plan ({state.plan.summary()}) needs the optimizer in host RAM, "
                f"which takes a torch.optim.AdamW (or Adam without weight decay); got "
                f"{type(optimizer).__name__}"
            )
        self._adamw = OffloadAdamWService(
            moment_dtype=state.plan.moment_dtype,
            accumulation_steps=self.options["accumulation_steps"],
        )
        state.optimizer = self._adamw.wrap_optimizer(optimizer)
        return state.optimizer

    def setup(self, runtime: Any) -> None:
        self._rt = runtime  # emits the metrics as OnLog when the loop cannot report them

    def on_train_begin(self, event: Any) -> None:
        loop = getattr(event, "loop", None)
        self.metrics.begin(getattr(loop, "report_metrics", None))
        if self._adamw is not None:
            self._adamw.on_train_begin(event)

    def on_optimizer_step(self, event: Any) -> None:
        if self._adamw is not None:
            self._adamw.on_optimizer_step(event)
        if self.state is not None and self.state.replanner is not None:
            self.state.replanner.after_step()  # measures the first step; may re-plan once
        if self.state is not None and self.options["trim_heap"] and trims_heap(self.state.plan):
            trim_heap()  # the step's freed pages back to the OS (fit.heap)
        self.metrics.step(event.epoch, event.step, self._emit_log)

    def _emit_log(self, metrics: Any, epoch: int, step: int) -> None:
        if self._rt is not None:
            self._rt.emit(OnLog, step=step, epoch=epoch, logs=metrics)

    def teardown(self) -> None:
        if self._adamw is not None:
            self._adamw.teardown()
