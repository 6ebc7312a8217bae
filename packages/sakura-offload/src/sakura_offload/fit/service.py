"""The ``fit`` service: ``wrap``'s decisions under ``rt.prepare`` (raw loops, Lightning's
``LightningAdapter``, sakura's ``SakuraTrainer``).

``wrap_model`` measures the model, decides (assuming the loop's optimizer is an AdamW: two
moments per trainable parameter) and applies the model's part of the plan (a fit choice,
weight streaming, the activation planner); ``wrap_optimizer`` hands the optimizer to an
:class:`~sakura_offload.OffloadAdamWService` when the plan puts it on the host (that
service's accumulation and skipped-step handling come with it).  An optimizer that is not
an AdamW under a plan that needs the host optimizer is an error naming the plan.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from sakura import Service
from sakura.options import check_number
from sakura_offload.fit.wrap import FitState, apply_fit, fit_options, plan_fit

__all__ = ["FitService"]

_OWNER = "FitService"


class FitService(Service):
    """Spec ``fit[:device_budget][,host_budget=..,disk_offload=..,choices=..,moment_dtype=..,
    activations=..,activation_reserve=..,prefetch=..,cost_trials=..,report=..,blocks=..]``,
    e.g. ``fit:device_budget=2GiB,host_budget=8GiB,disk_offload=/tmp/x``.  The options are
    :func:`sakura_offload.wrap`'s."""

    name = "fit"
    priority: float = 55

    def __init__(self, device_budget: Any = None, *, priority: float | None = None, **options: Any):
        self.options = fit_options(device_budget=device_budget, owner=_OWNER, **options)
        if priority is not None:
            self.priority = check_number("priority", priority, owner=_OWNER)
        self.state: FitState | None = None
        self._adamw: Any = None

    def wrap_model(self, model: Any) -> Any:
        if not isinstance(model, nn.Module):
            raise TypeError(f"FitService needs a torch.nn.Module, got {type(model).__name__}")
        if self.state is not None:
            return model
        plan, choices, budgets = plan_fit(model, None, self.options, assume_adamw=True)
        self.state = apply_fit(model, None, plan, choices, budgets, self.options)
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
        self._adamw = OffloadAdamWService(moment_dtype=state.plan.moment_dtype)
        state.optimizer = self._adamw.wrap_optimizer(optimizer)
        return state.optimizer

    def on_train_begin(self, event: Any) -> None:
        if self._adamw is not None:
            self._adamw.on_train_begin(event)

    def on_optimizer_step(self, event: Any) -> None:
        if self._adamw is not None:
            self._adamw.on_optimizer_step(event)

    def teardown(self) -> None:
        if self._adamw is not None:
            self._adamw.teardown()
