"""Raw-loop integration: explicit calls that a hand-written (``torchrun``) loop makes.

The reference quickstart's calls are kept as they are::

    adapter = DDPAdapter(rt, rank=dist.get_rank(), world_size=dist.get_world_size())
    adapter.on_train_begin(model, optimizer, train_loader)
    for epoch in range(num_epochs):
        adapter.on_epoch_begin(epoch)
        for step, batch in enumerate(train_loader):
            adapter.on_train_step_begin(model, batch, step)
            loss = train_one_step(model, batch, optimizer)
            adapter.on_optimizer_step(optimizer)
        adapter.on_epoch_end(epoch, model, optimizer, metrics={"train_loss": loss})
    adapter.on_train_end(model)

and the rest of the vocabulary is there too (backward, zero-grad, validation, checkpoints,
errors).  The adapter counts optimizer steps and keeps the epoch, so every event carries
``step`` and ``epoch``.  For loops that let the runtime own the step, :meth:`backward` and
:meth:`step` do the coordinated calls and emit the events around them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from sakura import events as ev
from sakura.loop import LoopContext, MetricReporter
from sakura.options import check_bool, check_int, option_error
from sakura.runtime import SakuraRuntime
from sakura_adapters.emitted import events_emitted

__all__ = ["DDPAdapter"]

_OWNER = "DDPAdapter"


def _int(option: str, value: Any, minimum: int) -> int:
    return int(check_int(option, value, minimum=minimum, owner=_OWNER))


def _output_dir(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, (str, os.PathLike)):
        path = os.fspath(value)
        if isinstance(path, str) and path:
            return os.path.abspath(path)
    raise option_error(
        "output_dir", value, "a directory path (str or os.PathLike) or None", owner=_OWNER
    )


def _reporter(value: Any) -> MetricReporter | None:
    if value is None or callable(value):
        return value  # type: ignore[no-any-return]
    raise option_error(
        "report_metrics", value, "a callable report(metrics, epoch, step) or None", owner=_OWNER
    )


class DDPAdapter:
    """Explicit event calls for raw ``torch.distributed`` (or single-process) loops.

    ``rank``/``world_size`` default to the initialised process group's, else the
    runtime's.  They are written to the runtime, so every event carries them.

    ``strict_resume`` is the default of :meth:`on_load_checkpoint`'s ``strict``: whether a
    checkpoint whose services' state does not match the installed services is an error
    (False: a new stateful service starts fresh with a warning, state of a service no
    longer installed is kept and saved again; see :mod:`sakura.resume`).

    What the loop offers services, published on ``OnTrainBegin.loop`` (a
    :class:`sakura.loop.LoopContext` with ``framework="raw"``): ``output_dir``, the run's
    output directory (services that write files, such as ``AsyncCheckpoint``, default to a
    folder inside it), and ``report_metrics``, a callable ``report(metrics, epoch, step)``
    that receives metrics computed outside the loop (``AsyncEval``'s results).  When the
    model given to :meth:`on_train_begin` is a ``DistributedDataParallel``, it is the
    loop's ``wrapped_model``.
    """

    def __init__(
        self,
        rt: SakuraRuntime,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        strict_resume: bool = False,
        output_dir: str | os.PathLike[str] | None = None,
        report_metrics: Callable[[Mapping[str, Any], int, int], None] | None = None,
    ) -> None:
        if not isinstance(rt, SakuraRuntime):
            raise TypeError(f"rt must be a sakura.SakuraRuntime, got {type(rt).__name__}")
        if rank is None or world_size is None:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                rank = dist.get_rank() if rank is None else rank
                world_size = dist.get_world_size() if world_size is None else world_size
        rank = rt.rank if rank is None else _int("rank", rank, 0)
        world_size = rt.world_size if world_size is None else _int("world_size", world_size, 1)
        if rank >= world_size:
            raise option_error(
                "rank", rank, f"an int in [0, world_size={world_size})", owner=_OWNER
            )
        self.strict_resume = check_bool("strict_resume", strict_resume, owner=_OWNER)
        self.output_dir: str | None = _output_dir(output_dir)
        """The run's output directory (absolute), published on ``OnTrainBegin.loop``."""
        self.report_metrics: MetricReporter | None = _reporter(report_metrics)
        self.rt = rt
        rt.rank, rt.world_size = rank, world_size
        self.global_step = 0
        self.epoch = 0
        self.model: Any = None
        self.optimizer: Any = None

    @classmethod
    def emitted_events(cls) -> frozenset[type[ev.Event]] | None:
        """The events this adapter's methods emit, read from the code (see
        :mod:`sakura_adapters.emitted`).  A raw loop calls these methods itself and may
        emit any other event with ``rt.emit``, so unlike the framework adapters this one
        warns about nothing."""
        return events_emitted(cls)

    @property
    def rank(self) -> int:
        return self.rt.rank

    @property
    def world_size(self) -> int:
        return self.rt.world_size

    def _emit(self, cls: type[ev.Event], **fields: Any) -> Any:
        return self.rt.emit(cls, step=self.global_step, epoch=self.epoch, **fields)

    # --- lifecycle --------------------------------------------------------------------

    def on_setup(self, model: Any = None, stage: str = "fit") -> None:
        self._emit(ev.OnSetup, stage=stage, model=model)

    def on_teardown(self, model: Any = None, stage: str = "fit") -> None:
        self._emit(ev.OnTeardown, stage=stage, model=model)

    def on_train_begin(
        self,
        model: Any,
        optimizer: Any = None,
        train_loader: Any = None,
        accumulation_steps: int | None = None,
    ) -> None:
        """``accumulation_steps``: the loop's backward passes per optimizer step, for the
        services that need it (``OnTrainBegin.accumulation_steps``); None: not said."""
        steps = check_int(
            "accumulation_steps",
            accumulation_steps,
            minimum=1,
            allow_none=True,
            owner="DDPAdapter.on_train_begin",
        )
        self.model, self.optimizer = model, optimizer
        self._emit(
            ev.OnTrainBegin,
            model=model,
            optimizer=optimizer,
            train_loader=train_loader,
            accumulation_steps=steps,
            loop=self.loop_context(model),
        )

    def loop_context(self, model: Any = None) -> LoopContext:
        """What this loop offers services (published on ``OnTrainBegin.loop``)."""
        from torch.nn.parallel import DistributedDataParallel

        wrapped = model if isinstance(model, DistributedDataParallel) else None
        return LoopContext(
            framework="raw",
            output_dir=self.output_dir,
            report_metrics=self.report_metrics,
            wrapped_model=None if wrapped is None else (lambda: wrapped),
        )

    def on_train_end(self, model: Any = None, metrics: Mapping[str, Any] | None = None) -> None:
        self._emit(ev.OnTrainEnd, model=model or self.model, metrics=metrics)

    def on_epoch_begin(self, epoch: int, model: Any = None) -> None:
        self.epoch = _int("epoch", epoch, 0)
        self._emit(ev.OnEpochBegin, model=model or self.model)

    def on_epoch_end(
        self,
        epoch: int,
        model: Any = None,
        optimizer: Any = None,
        metrics: Mapping[str, Any] | None = None,
    ) -> None:
        self.epoch = _int("epoch", epoch, 0)
        self._emit(
            ev.OnEpochEnd,
            model=model or self.model,
            optimizer=optimizer or self.optimizer,
            metrics=metrics,
        )

    # --- per step ---------------------------------------------------------------------

    def on_train_step_begin(self, model: Any, batch: Any, step: int) -> None:
        """``step`` is the batch index within the epoch, as in the reference quickstart."""
        self._emit(ev.OnTrainStepBegin, model=model, batch=batch, batch_idx=step)

    def on_train_step_end(
        self, model: Any, batch: Any, step: int, loss: Any = None, outputs: Any = None
    ) -> None:
        self._emit(
            ev.OnTrainStepEnd, model=model, batch=batch, batch_idx=step, loss=loss, outputs=outputs
        )

    def on_substep_end(self, model: Any = None, step: int = 0) -> None:
        self._emit(ev.OnSubstepEnd, model=model or self.model, batch_idx=step)

    def on_before_backward(self, loss: Any, model: Any = None) -> None:
        self._emit(ev.OnBeforeBackward, model=model or self.model, loss=loss)

    def on_after_backward(self, model: Any = None, loss: Any = None) -> None:
        self._emit(ev.OnAfterBackward, model=model or self.model, loss=loss)

    def on_before_optimizer_step(self, optimizer: Any, model: Any = None) -> None:
        self._emit(ev.OnBeforeOptimizerStep, model=model or self.model, optimizer=optimizer)

    def on_optimizer_step(self, optimizer: Any, model: Any = None) -> None:
        """Call after the optimizer stepped: counts the step and emits OnOptimizerStep
        (``skipped`` from ``rt.last_step_skipped``: a service owned the step and skipped it)."""
        self.global_step += 1
        self._emit(
            ev.OnOptimizerStep,
            model=model or self.model,
            optimizer=optimizer,
            skipped=self.rt.last_step_skipped,
        )

    def on_before_zero_grad(self, optimizer: Any, model: Any = None) -> None:
        self._emit(ev.OnBeforeZeroGrad, model=model or self.model, optimizer=optimizer)

    def on_log(self, logs: Mapping[str, Any]) -> None:
        self._emit(ev.OnLog, logs=logs)

    def backward(self, loss: Any, model: Any = None, **kwargs: Any) -> None:
        """Emit OnBeforeBackward, run ``rt.backward(loss)`` (services may scale the loss),
        emit OnAfterBackward."""
        model = model or self.model
        self._emit(ev.OnBeforeBackward, model=model, loss=loss)
        self.rt.backward(loss, **kwargs)
        self._emit(ev.OnAfterBackward, model=model, loss=loss)

    def step(self, optimizer: Any, model: Any = None) -> bool:
        """Emit OnBeforeOptimizerStep, offer the step to the services (``optimizer.step()``
        when none owns it), count it and emit OnOptimizerStep.  Returns True when a
        service owned the step; ``rt.last_step_skipped`` then says whether it skipped it
        (leave the LR scheduler alone then, as the Hugging Face Trainer does)."""
        model = model or self.model
        self._emit(ev.OnBeforeOptimizerStep, model=model, optimizer=optimizer)
        owned = self.rt.optimizer_step(optimizer)
        if not owned:
            optimizer.step()
        self.on_optimizer_step(optimizer, model)
        return owned

    # --- evaluation -------------------------------------------------------------------

    def on_validation_begin(self, model: Any = None) -> None:
        self._emit(ev.OnValidationBegin, model=model or self.model)

    def on_validation_batch_begin(
        self, model: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._emit(
            ev.OnValidationBatchBegin,
            model=model,
            batch=batch,
            batch_idx=batch_idx,
            dataloader_idx=dataloader_idx,
        )

    def on_validation_batch_end(
        self, model: Any, batch: Any, batch_idx: int, outputs: Any = None, dataloader_idx: int = 0
    ) -> None:
        self._emit(
            ev.OnValidationBatchEnd,
            model=model,
            batch=batch,
            batch_idx=batch_idx,
            dataloader_idx=dataloader_idx,
            outputs=outputs,
        )

    def on_validation_end(
        self, model: Any = None, metrics: Mapping[str, Any] | None = None
    ) -> None:
        self._emit(ev.OnValidationEnd, model=model or self.model, metrics=metrics)

    def on_test_begin(self, model: Any = None) -> None:
        self._emit(ev.OnTestBegin, model=model or self.model)

    def on_test_end(self, model: Any = None, metrics: Mapping[str, Any] | None = None) -> None:
        self._emit(ev.OnTestEnd, model=model or self.model, metrics=metrics)

    # --- checkpoints and errors -----------------------------------------------------------

    def on_save_checkpoint(
        self, checkpoint: dict[str, Any] | None = None, path: str | None = None, model: Any = None
    ) -> dict[str, Any] | None:
        """Add the services' state to ``checkpoint`` under ``"sakura"`` (when a dict is
        given), emit OnSaveCheckpoint, and return the checkpoint."""
        if checkpoint is not None:
            checkpoint["sakura"] = self.rt.state_dict()
        self._emit(
            ev.OnSaveCheckpoint,
            model=model or self.model,
            checkpoint=checkpoint,
            path=None if path is None else str(path),
        )
        return checkpoint

    def on_load_checkpoint(
        self,
        checkpoint: Mapping[str, Any],
        path: str | None = None,
        model: Any = None,
        *,
        strict: bool | None = None,
    ) -> None:
        """Restore the services' state from ``checkpoint["sakura"]`` and emit
        OnLoadCheckpoint; the step counter resumes from ``checkpoint["global_step"]``.

        ``strict`` (default: the adapter's ``strict_resume``) is passed to
        ``rt.load_state_dict``.  A checkpoint without a ``"sakura"`` entry leaves every
        stateful service fresh (a warning; an error when strict)."""
        strict = (
            self.strict_resume if strict is None else check_bool("strict", strict, owner=_OWNER)
        )
        self.rt.load_state_dict(checkpoint.get("sakura") or {}, strict=strict)
        if "global_step" in checkpoint:
            self.global_step = _int("checkpoint['global_step']", checkpoint["global_step"], 0)
        self._emit(
            ev.OnLoadCheckpoint,
            model=model or self.model,
            checkpoint=dict(checkpoint),
            path=None if path is None else str(path),
        )

    def on_error(self, exception: BaseException) -> None:
        self._emit(ev.OnError, exception=exception, source="training loop")
