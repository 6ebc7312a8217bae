""":class:`HFAdapter`: the ``transformers.TrainerCallback`` that drives a sakura runtime.

Every callback event becomes the matching sakura event (the table is in
``docs/events.md``).  Under the stock Trainer it also applies the services' in-place
wraps and autocast (:mod:`.wrapping`); under :class:`~sakura_adapters.hf.SakuraTrainer`
it is bound to the trainer, which routes the rest of the step through the runtime.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from transformers import Trainer, TrainerCallback

from sakura import events as ev
from sakura.loop import LoopContext
from sakura.options import check_bool
from sakura.runtime import SakuraRuntime
from sakura_adapters.emitted import events_emitted, warn_unemitted
from sakura_adapters.hf.checks import (
    USE_SAKURA_TRAINER,
    check_runtime,
    check_services,
    check_single_compiler,
    is_compiled,
    warn_if_fsdp_fell_back,
)
from sakura_adapters.hf.optimizer import mark_step_skipped, service_optimizer
from sakura_adapters.hf.state import checkpoint_dir, find_checkpoint, load_state, save_state
from sakura_adapters.hf.wrapping import WrapRecord, patch_autocast
from sakura_adapters.metrics import numeric_metrics

__all__ = ["HFAdapter"]


class BoundTrainer(Protocol):
    """What the adapter uses of the :class:`~sakura_adapters.hf.SakuraTrainer` bound to it
    (this module does not import the trainer module, which imports this one)."""

    model: Any
    model_wrapped: Any
    args: Any
    state: Any
    control: Any
    callback_handler: Any

    def _sakura_install_hooks(self) -> None: ...


# The hooks the Trainer calls on every callback (TrainerCallback's on_* methods).
_CALLBACK_HOOKS = tuple(
    name
    for name, value in vars(TrainerCallback).items()
    if name.startswith("on_") and callable(value)
)
_NO_SUCH_MOMENT = (
    "the transformers.Trainer has no such moment: handle an event it emits instead "
    "(HFAdapter.emitted_events() lists them)"
)


def monitored_metrics(args: Any, control: Any) -> frozenset[str]:
    """The metric that the Trainer's best-model selection (``load_best_model_at_end``,
    ``save_strategy="best"``), ``EarlyStoppingCallback`` and a ReduceLROnPlateau scheduler
    read after this epoch's evaluation: ``metric_for_best_model``, under both of its names
    (the Trainer adds ``eval_``), when the Trainer evaluates at this epoch end (its flow
    callback ran before ours and set ``control.should_evaluate``)."""
    metric = getattr(args, "metric_for_best_model", None)
    if not metric or not getattr(control, "should_evaluate", False):
        return frozenset()
    base = metric.removeprefix("eval_")
    return frozenset({base, f"eval_{base}"})


def reported_for(state: Any, start: int) -> tuple[int, dict[str, Any]]:
    """The metrics that services appended to ``state.log_history`` since ``start`` for the
    weights of this step (AsyncEval's report: ``{**metrics, "epoch", "step"}``)."""
    reported: dict[str, Any] = {}
    for entry in state.log_history[start:]:
        if isinstance(entry, Mapping) and entry.get("step") == state.global_step:
            reported.update(entry)
    reported.pop("epoch", None)
    reported.pop("step", None)
    return state.global_step, reported


class HFAdapter(TrainerCallback):
    """Drive a :class:`~sakura.SakuraRuntime` from the Hugging Face ``Trainer``.

    Pass it as a callback: ``Trainer(..., callbacks=[HFAdapter(rt)])``, or use
    :class:`SakuraTrainer`, which adds one itself.  ``rank``/``world_size`` come from
    ``args.process_index``/``args.world_size`` and are written to the runtime; ``step`` is
    ``state.global_step`` (``+ 1`` once the optimizer stepped, as for Lightning) and
    ``epoch`` the epoch the Trainer is in, counted from 0.

    On the stock Trainer, services take effect where a callback can make them (see
    :mod:`sakura_adapters.hf`); a service that needs :class:`SakuraTrainer` (loss scaling,
    unscaling, owning the optimizer step, wrapping into a new object) stops training at
    its start with :class:`SakuraTrainerRequiredError`, naming the service.  A sakura service
    that controls precision together with the Trainer's own ``fp16``/``bf16`` is a
    ValueError.

    ``strict_resume``: when resuming, whether a checkpoint whose services' state does not
    match the installed services is an error.  By default (False) a newly installed
    stateful service starts fresh with a warning and the state of a service that is no
    longer installed is kept and saved again in the next checkpoint (see
    :mod:`sakura.resume`); True raises :class:`~sakura.resume.ServiceStateError` instead.
    """

    def __init__(self, rt: SakuraRuntime, *, strict_resume: bool = False) -> None:
        super().__init__()
        self.rt = check_runtime(rt, "HFAdapter(rt=...)")
        self.strict_resume = check_bool("strict_resume", strict_resume, owner="HFAdapter")
        self._trainer_ref: Callable[[], Any] | None = None
        self._epoch = 0
        self._batch_idx = 0
        self._eval_idx = 0
        self._epoch_log_start = 0
        self._marked_skip = False  # accelerate's step_was_skipped set by us, to clear
        self._step_loss: Any = None
        self._predicting = False
        self._resume_path: str | None = None
        self._wraps = WrapRecord(self.rt)
        self._reported: tuple[int, dict[str, Any]] = (-1, {})
        """(step, metrics) that services reported at the last monitored epoch end."""

    def __repr__(self) -> str:
        mode = "SakuraTrainer" if self._trainer is not None else "callback"
        return f"<HFAdapter ({mode}) {self.rt!r}>"

    @classmethod
    def emitted_events(cls, trainer_cls: type | None = None) -> frozenset[type[ev.Event]] | None:
        """The events this adapter can emit, read from the code (see
        :mod:`sakura_adapters.emitted`): under the stock Trainer (``trainer_cls`` None) those
        of the ``TrainerCallback`` hooks; under a :class:`SakuraTrainer` (sub)class also
        those the trainer emits itself (backward, evaluation and prediction begin, errors).
        None when the source is not available."""
        if trainer_cls is None:
            return events_emitted(cls, _CALLBACK_HOOKS, stop_at=TrainerCallback)
        ours = events_emitted(cls, None, stop_at=TrainerCallback)
        trainers = events_emitted(trainer_cls, None, stop_at=Trainer)
        return None if ours is None or trainers is None else ours | trainers

    def _warn_unemitted(self) -> None:
        """Warn about every installed service's handler for an event never emitted here."""
        trainer = self._trainer
        if trainer is not None:
            warn_unemitted(
                self.rt,
                self.emitted_events(type(trainer)),
                where=f"{type(trainer).__name__} (a transformers.Trainer)",
                fix=lambda event: _NO_SUCH_MOMENT,
            )
            return
        # Every event the SakuraTrainer emits goes through one of this adapter's methods
        # (_backward, _begin_eval, _train_failed), so all of them are what it adds.
        with_trainer = events_emitted(type(self), None, stop_at=TrainerCallback) or frozenset()
        warn_unemitted(
            self.rt,
            self.emitted_events(),
            where="HFAdapter under the stock transformers.Trainer",
            fix=lambda event: (
                f"{USE_SAKURA_TRAINER}, which emits it"
                if event in with_trainer
                else _NO_SUCH_MOMENT
            ),
        )

    # --- helpers ----------------------------------------------------------------------

    @property
    def _trainer(self) -> BoundTrainer | None:
        """The SakuraTrainer this adapter belongs to; None under the stock Trainer."""
        return self._trainer_ref() if self._trainer_ref is not None else None

    def _bind(self, trainer: BoundTrainer) -> None:
        self._trainer_ref = weakref.ref(trainer)

    def _emit(self, cls: type[ev.Event], state: Any, **fields: Any) -> None:
        if self.rt.handles(cls):  # unhandled events cost one lookup, nothing is built
            self.rt.emit(cls, step=state.global_step, epoch=self._epoch, **fields)

    def _set_rank(self, args: Any) -> None:
        self.rt.rank = int(args.process_index)
        self.rt.world_size = int(args.world_size)

    def _restore(self, args: Any, state: Any, model: Any) -> None:
        if self._trainer is not None:
            path, self._resume_path = self._resume_path, None
        else:
            path = find_checkpoint(self.rt, args, state)
        if path is not None and load_state(self.rt, path, strict=self.strict_resume):
            self._emit(ev.OnLoadCheckpoint, state, model=model, checkpoint=None, path=path)

    def _add_loss(self, loss: Any) -> None:
        """SakuraTrainer: sum the micro-batch losses of the step for OnTrainStepEnd."""
        if self.rt.handles(ev.OnTrainStepEnd):
            loss = loss.detach()
            self._step_loss = loss if self._step_loss is None else self._step_loss + loss

    def _begin_eval(self, state: Any, model: Any, *, predicting: bool) -> None:
        self._eval_idx = 0
        self._predicting = predicting
        self._emit(ev.OnPredictBegin if predicting else ev.OnValidationBegin, state, model=model)

    def _backward(
        self,
        state: Any,
        model: Any,
        backward: Callable[..., Any],
        loss: Any,
        kwargs: Mapping[str, Any],
    ) -> Any:
        """SakuraTrainer's ``accelerator.backward``: the events around the backward of
        ``rt.scale_loss(loss)``."""
        self._emit(ev.OnBeforeBackward, state, model=model, loss=loss)
        result = backward(self.rt.scale_loss(loss), **kwargs)
        self._emit(ev.OnAfterBackward, state, model=model, loss=loss)
        self._add_loss(loss)
        return result

    def _train_failed(self, state: Any, exc: BaseException) -> None:
        """SakuraTrainer: ``train`` raised ``exc``; the services hear of it first."""
        self.rt.emit(
            ev.OnError,
            step=state.global_step,
            epoch=self._epoch,
            exception=exc,
            source="transformers",
        )

    def _loop_context(self, args: Any, state: Any) -> LoopContext:
        """What the Trainer's loop offers services (``OnTrainBegin.loop``): its output
        directory, metric reporting into ``state.log_history`` (and, under SakuraTrainer,
        the callbacks' ``on_log``, so ``report_to`` integrations see the metrics), and
        SakuraTrainer's wrapped model."""
        trainer = self._trainer

        def report(metrics: Mapping[str, Any], epoch: int, step: int) -> None:
            scalars = numeric_metrics(metrics)
            # The Trainer counts epochs completed.
            state.log_history.append({**scalars, "epoch": float(epoch + 1), "step": step})
            if trainer is not None:
                trainer.callback_handler.on_log(
                    trainer.args, trainer.state, trainer.control, dict(scalars)
                )

        output_dir = getattr(args, "output_dir", None)
        return LoopContext(
            framework="transformers",
            output_dir=str(output_dir) if output_dir else None,
            report_metrics=report,
            wrapped_model=None if trainer is None else (lambda: trainer.model_wrapped),
            # The Trainer clips in its loop (accelerator.clip_grad_norm_), outside the runtime.
            gradient_clipping=(
                f"TrainingArguments(max_grad_norm={args.max_grad_norm!r})"
                if getattr(args, "max_grad_norm", None)
                else None
            ),
        )

    # --- lifecycle ----------------------------------------------------------------------

    def on_init_end(
        self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any
    ) -> None:
        self._set_rank(args)
        self._epoch = 0
        check_services(self.rt, args, self._trainer)
        if self._trainer is None:
            was = bool(getattr(args, "torch_compile", False)) and is_compiled(model)
            self._wraps.wrap_model_in_place(model)
            check_single_compiler(args, self.rt.implements("wrap_model"), was, model)
            patch_autocast(self.rt, model)
        self._emit(ev.OnSetup, state, stage="init", model=model)

    def on_train_begin(
        self,
        args: Any,
        state: Any,
        control: Any,
        model: Any = None,
        optimizer: Any = None,
        train_dataloader: Any = None,
        **kwargs: Any,
    ) -> None:
        self._set_rank(args)
        trainer = self._trainer
        check_services(self.rt, args, trainer)
        warn_if_fsdp_fell_back(args, model)
        self._warn_unemitted()
        if trainer is None:
            self._wraps.check_model_wrapped(model, sakura_trainer=False)
            patch_autocast(self.rt, model)
            self._wraps.wrap_optimizer_in_place(optimizer)
        else:
            self._wraps.check_model_wrapped(trainer.model, sakura_trainer=True)
            trainer._sakura_install_hooks()
        self._epoch = int(state.epoch or 0)
        self._batch_idx = 0
        self._step_loss = None
        self._restore(args, state, model)
        self._emit(ev.OnFitBegin, state, model=model)
        self._emit(
            ev.OnTrainBegin,
            state,
            model=model,
            optimizer=service_optimizer(optimizer),
            train_loader=train_dataloader,
            # SakuraTrainer binds itself; a callback on the stock Trainer only has its state.
            trainer=state if trainer is None else trainer,
            accumulation_steps=int(args.gradient_accumulation_steps),
            loop=self._loop_context(args, state),
        )

    def on_train_end(
        self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any
    ) -> None:
        if self.rt.handles(ev.OnTrainEnd):
            metrics = dict(state.log_history[-1]) if state.log_history else {}
            self._emit(ev.OnTrainEnd, state, model=model, metrics=metrics)
        self._emit(ev.OnFitEnd, state, model=model)

    def on_epoch_begin(
        self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any
    ) -> None:
        self._epoch = int(state.epoch or 0)
        self._batch_idx = 0
        self._epoch_log_start = len(state.log_history)
        self._emit(ev.OnEpochBegin, state, model=model)

    def on_epoch_end(
        self,
        args: Any,
        state: Any,
        control: Any,
        model: Any = None,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
        if not self.rt.handles(ev.OnEpochEnd):
            return
        metrics: dict[str, Any] = {}
        for entry in state.log_history[self._epoch_log_start :]:
            metrics.update(entry)
        monitored = monitored_metrics(args, control)
        reported_from = len(state.log_history)
        self._emit(
            ev.OnEpochEnd,
            state,
            model=model,
            optimizer=service_optimizer(optimizer),
            metrics=metrics,
            monitored=monitored,
        )
        if monitored:  # what services reported for this epoch joins its evaluation
            self._reported = reported_for(state, reported_from)

    def _join_evaluation(self, state: Any, logs: Any) -> None:
        """Add the metrics services reported at this epoch end (AsyncEval's, awaited because
        a monitor reads them) to the Trainer's evaluation metrics, as ``eval_<name>``:
        ``logs`` is the dict that the Trainer's best-model selection, ReduceLROnPlateau and
        ``EarlyStoppingCallback`` read after ``on_log``, so they decide on them."""
        step, reported = self._reported
        if step != state.global_step or not isinstance(logs, dict):
            return
        if not any(isinstance(k, str) and k.startswith("eval_") for k in logs):
            return  # not the evaluation's log
        joined = {k if k.startswith("eval_") else f"eval_{k}": v for k, v in reported.items()}
        history = state.log_history
        entry = history[-1] if history else None  # the copy Trainer.log just appended
        if isinstance(entry, dict) and entry.keys() - {"step"} == logs.keys():
            entry.update(joined)
        logs.update(joined)

    # --- training steps -----------------------------------------------------------------

    def on_step_begin(
        self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any
    ) -> None:
        trainer = self._trainer
        if trainer is not None:
            trainer._sakura_install_hooks()
        self._step_loss = None
        self._emit(ev.OnTrainStepBegin, state, model=model, batch=None, batch_idx=self._batch_idx)

    def on_substep_end(
        self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any
    ) -> None:
        self._emit(ev.OnSubstepEnd, state, model=model, batch_idx=self._batch_idx)
        self._batch_idx += 1

    def on_pre_optimizer_step(
        self,
        args: Any,
        state: Any,
        control: Any,
        model: Any = None,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
        if self.rt.handles(ev.OnBeforeOptimizerStep):
            self._emit(
                ev.OnBeforeOptimizerStep,
                state,
                model=model,
                optimizer=service_optimizer(optimizer),
            )

    def on_optimizer_step(
        self,
        args: Any,
        state: Any,
        control: Any,
        model: Any = None,
        optimizer: Any = None,
        **kwargs: Any,
    ) -> None:
        # The Trainer calls this after the step and before zero_grad (its documented
        # contract), so it is also the moment of OnBeforeZeroGrad.
        step = state.global_step + 1
        rt = self.rt
        skipped = rt.last_step_skipped
        if skipped or self._marked_skip:
            self._marked_skip = mark_step_skipped(optimizer, skipped) and skipped
        if rt.handles(ev.OnOptimizerStep) or rt.handles(ev.OnBeforeZeroGrad):
            opt = service_optimizer(optimizer)
            rt.emit(
                ev.OnOptimizerStep,
                step=step,
                epoch=self._epoch,
                model=model,
                optimizer=opt,
                skipped=skipped,
            )
            rt.emit(ev.OnBeforeZeroGrad, step=step, epoch=self._epoch, model=model, optimizer=opt)

    def on_step_end(
        self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any
    ) -> None:
        loss, self._step_loss = self._step_loss, None
        self._emit(
            ev.OnTrainStepEnd,
            state,
            model=model,
            batch=None,
            batch_idx=self._batch_idx,
            loss=loss,
            outputs=None,
        )
        self._batch_idx += 1

    def on_log(
        self,
        args: Any,
        state: Any,
        control: Any,
        logs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        if self._reported[1]:
            self._join_evaluation(state, logs)
        self._emit(ev.OnLog, state, logs=logs)

    # --- evaluation and prediction ------------------------------------------------------

    def on_prediction_step(
        self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any
    ) -> None:
        cls = ev.OnPredictBatchEnd if self._predicting else ev.OnValidationBatchEnd
        self._emit(cls, state, model=model, batch=None, batch_idx=self._eval_idx, outputs=None)
        self._eval_idx += 1

    def on_evaluate(
        self,
        args: Any,
        state: Any,
        control: Any,
        metrics: Mapping[str, Any] | None = None,
        model: Any = None,
        **kwargs: Any,
    ) -> None:
        self._eval_idx = 0
        self._emit(ev.OnValidationEnd, state, model=model, metrics=metrics)

    def on_predict(
        self,
        args: Any,
        state: Any,
        control: Any,
        metrics: Mapping[str, Any] | None = None,
        model: Any = None,
        **kwargs: Any,
    ) -> None:
        self._eval_idx = 0
        self._predicting = False
        self._emit(ev.OnPredictEnd, state, model=model, metrics=metrics)

    # --- checkpoints and publishing -----------------------------------------------------

    def on_save(
        self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any
    ) -> None:
        path = checkpoint_dir(args, state.global_step)
        save_state(self.rt, path)
        self._emit(ev.OnSaveCheckpoint, state, model=model, checkpoint=None, path=path)

    def on_push_begin(
        self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any
    ) -> None:
        self._emit(ev.OnPushBegin, state, model=model, path=args.output_dir)
