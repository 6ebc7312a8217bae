"""The ``offload_adamw`` service: swaps the loop's AdamW for :class:`OffloadAdamW`.

It acts in ``wrap_optimizer``, which ``rt.prepare(model, optimizer)`` calls for raw loops,
Lightning's ``LightningAdapter`` calls on every optimizer of the Trainer, and sakura's
``SakuraTrainer`` calls on the Hugging Face Trainer's optimizer.  The new optimizer shares
the old one's param-group dicts (LR schedulers built on the old one keep driving it), takes
over its hyper-parameters and state (moved to host RAM in ``moment_dtype``) and the old
optimizer's state is released.  The loop must use the optimizer that ``rt.prepare``
returns; the reference quickstart's flow, where the loop keeps its own optimizer object and
never calls ``rt.prepare``, cannot be swapped and raises at ``OnTrainBegin``.

Gradient accumulation: the backward passes per step come from the loop, as its adapter
publishes them on ``OnTrainBegin.accumulation_steps`` (Lightning's
``accumulate_grad_batches``, the Trainer's ``gradient_accumulation_steps``,
``DDPAdapter.on_train_begin(..., accumulation_steps=)``); the ``accumulation_steps`` option
is for loops that do not say.  A step the loop reports skipped (``OnOptimizerStep(skipped=
True)``: a loss scaler found inf/NaN gradients) ends the accumulation window as a taken
step does (:meth:`OffloadAdamW.skip_step`).

Eager updates: ``eager=None`` means off under the service (unlike a bare
:class:`OffloadAdamW`, where it means on when nothing clips).  The service runs under loops
that may clip, unscale (a loss scaler) or all-reduce the gradients between backward and the
step, through the framework or another service, which the optimizer cannot see before the
step.  ``eager=True`` turns it on for a loop that does none of that; a loop that says it
clips (``LoopContext.gradient_clipping``) then gets an error when training starts.
"""

from __future__ import annotations

import warnings
from typing import Any

from sakura import Service
from sakura.options import check_int, check_number, option_error
from sakura_offload.host_optimizer.options import check_optimizer_options

__all__ = ["OffloadAdamWService"]

_OWNER = "OffloadAdamWService"


class OffloadAdamWService(Service):
    """Spec ``offload_adamw[:moment_dtype][,max_grad_norm=..,accumulation_steps=..,eager=..,
    backend=..,seed=..,pin_moments=..,host_budget=..]``, e.g. ``offload_adamw:bf16`` or
    ``offload_adamw:auto,host_budget=8GiB``.  The options are
    :class:`~sakura_offload.OffloadAdamW`'s, except ``eager=None``, which means off here
    (see the module docstring)."""

    name = "offload_adamw"
    priority: float = 80

    def __init__(
        self,
        moment_dtype: Any = "float32",
        *,
        max_grad_norm: float | None = None,
        accumulation_steps: int | None = None,
        eager: bool | None = None,
        backend: str = "auto",
        seed: int = 0,
        pin_moments: bool | None = None,
        host_budget: int | str | None = None,
        priority: float | None = None,
    ) -> None:
        self.accumulation_steps: int | None = check_int(
            "accumulation_steps", accumulation_steps, minimum=1, allow_none=True, owner=_OWNER
        )
        """As given: None reads the loop's setting at train begin (1 if it says nothing)."""
        checked = check_optimizer_options(
            moment_dtype=moment_dtype,
            max_grad_norm=max_grad_norm,
            accumulation_steps=accumulation_steps or 1,
            eager=eager,
            backend=backend,
            seed=seed,
            pin_moments=pin_moments,
            host_budget=host_budget,
            owner=_OWNER,
        )
        self.eager: bool | None = eager
        """As given: None means off under the service."""
        self.options: dict[str, Any] = {
            "moment_dtype": moment_dtype,
            "max_grad_norm": max_grad_norm,
            "accumulation_steps": accumulation_steps or 1,
            "eager": bool(eager),
            "backend": backend,
            "seed": seed,
            "pin_moments": pin_moments,
            "host_budget": checked["host_budget"],
        }
        if priority is not None:
            self.priority = check_number("priority", priority, owner=_OWNER)
        self.optimizers: list[Any] = []

    def wrap_optimizer(self, optimizer: Any) -> Any:
        """``optimizer`` (a torch AdamW, or Adam without weight decay) as an OffloadAdamW."""
        from sakura_offload.host_optimizer.optimizer import OffloadAdamW

        offload = OffloadAdamW.from_optimizer(optimizer, **self.options)
        if offload is not optimizer:  # (one the loop built itself keeps its own settings)
            if self.eager is None:
                offload.eager_reason = (
                    "offload_adamw service with eager=None: the loop may clip, unscale or "
                    "all-reduce gradients after backward"
                )
            given = self.accumulation_steps
            offload.set_accumulation_steps(
                given or 1, advice=_NOT_SAID if given is None else _GIVEN
            )
        self.optimizers.append(offload)
        return offload

    def on_train_begin(self, event: Any) -> None:
        """Take the loop's accumulation setting (``event.accumulation_steps``), and warn
        when training starts with an optimizer that was never swapped (the loop kept its
        own object instead of the one ``rt.prepare`` returned)."""
        steps = getattr(event, "accumulation_steps", None)
        if steps is not None:
            self._take_accumulation(steps)
        loop = getattr(event, "loop", None)
        clipping = getattr(loop, "gradient_clipping", None)
        if self.eager is True and clipping is not None:
            raise option_error(
                "eager",
                True,
                f"None or False when the loop clips gradients itself ({clipping}): the "
                "eager updates would run on the unclipped gradients",
                owner=_OWNER,
            )
        optimizer = _offload_adamw(getattr(event, "optimizer", None))
        if optimizer is None and getattr(event, "optimizer", None) is not None:
            warnings.warn(
                "offload_adamw: training started with an optimizer that is not an "
                "OffloadAdamW; pass it through rt.prepare(model, optimizer) and use the "
                "optimizer that returns",
                RuntimeWarning,
                stacklevel=2,
            )

    def on_optimizer_step(self, event: Any) -> None:
        """A skipped step (a loss scaler's) ends the accumulation window, as a taken one."""
        if getattr(event, "skipped", False):
            optimizer = _offload_adamw(getattr(event, "optimizer", None))
            if optimizer is not None:
                optimizer.skip_step()

    def _take_accumulation(self, steps: int) -> None:
        if self.accumulation_steps is not None and self.accumulation_steps != steps:
            raise option_error(
                "accumulation_steps",
                self.accumulation_steps,
                f"None (the loop's own setting is read) or the loop's {steps} backward "
                "passes per optimizer step (OnTrainBegin.accumulation_steps)",
                owner=_OWNER,
            )
        advice = (
            f"run no backward pass outside the loop's training step: the loop declared {steps} "
            "per optimizer step (OnTrainBegin.accumulation_steps), which offload_adamw applied"
        )
        for optimizer in self.optimizers:
            optimizer.set_accumulation_steps(steps, advice=advice)

    def teardown(self) -> None:
        for optimizer in self.optimizers:
            optimizer.detach()
        self.optimizers.clear()


_NOT_SAID = (
    "let the loop say how many: LightningAdapter, SakuraTrainer and HFAdapter publish the "
    "framework's setting, DDPAdapter.on_train_begin(..., accumulation_steps=N) yours; "
    "or install OffloadAdamWService(accumulation_steps=<backward passes per step>)"
)

_GIVEN = (
    "install OffloadAdamWService(accumulation_steps=<backward passes per step>); under "
    "LightningAdapter, SakuraTrainer or HFAdapter leave it unset: the framework's setting is read"
)


def _offload_adamw(optimizer: Any) -> Any:
    """The OffloadAdamW under a framework's optimizer wrappers (their public ``optimizer``
    attribute: Lightning's and accelerate's, SakuraTrainer's proxy), or None."""
    from sakura_offload.host_optimizer.optimizer import OffloadAdamW

    while optimizer is not None and not isinstance(optimizer, OffloadAdamW):
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer
