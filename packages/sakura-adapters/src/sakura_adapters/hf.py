"""Hugging Face Transformers integration: a real ``TrainerCallback`` and a ``Trainer`` subclass.

``HFAdapter(rt)`` is a :class:`transformers.TrainerCallback` that maps every callback event
to a sakura event (the table is in ``docs/events.md``).  Passed to the stock Trainer
(``Trainer(..., callbacks=[HFAdapter(rt)])``) it also makes the installed services take
effect wherever a callback can:

================================  ===========================================================
Service call                      Under the stock ``transformers.Trainer`` + ``HFAdapter``
================================  ===========================================================
``autocast()``                    entered around every forward pass: the model's ``forward``
                                  is wrapped once (as accelerate does for its own mixed
                                  precision), when the Trainer is built or at train start
``wrap_model(model)``             applied when the Trainer is built; it must modify the model
                                  in place, a new object is an error
``wrap_optimizer(optimizer)``     applied at train start; in place only, as above
``wrap_loss``,                    impossible from a callback: an error when the Trainer is
``unscale_gradients``,            built (or, for services installed later, when training
``optimizer_step``                starts) that names the services and says to use
                                  :class:`SakuraTrainer`
``state_dict`` / ``load_...``     saved in every checkpoint folder; restored on resume when
                                  the checkpoint is ``<output_dir>/checkpoint-<step>`` or
                                  ``args.resume_from_checkpoint``
================================  ===========================================================

:class:`SakuraTrainer` is a drop-in :class:`transformers.Trainer` (same constructor, plus
``runtime=``) that routes the whole step through the runtime:

================================  ===========================================================
Trainer moment                    SakuraTrainer does
================================  ===========================================================
construction                      ``rt.wrap_model`` once, after the Trainer placed the model
                                  (any ``nn.Module`` may come back); again for ``model_init``
``create_optimizer``              the Trainer's optimizer, then ``rt.wrap_optimizer``, then a
                                  thin proxy whose ``step()`` unscales and offers the step to
                                  ``rt.optimizer_step`` (falling back to ``optimizer.step()``)
``compute_loss_context_manager``  the Trainer's contexts plus ``rt.autocast()`` (training
                                  and evaluation forwards)
``accelerator.backward(loss)``    ``OnBeforeBackward``, backward of ``rt.scale_loss(loss)``,
                                  ``OnAfterBackward``; the logged loss stays unscaled
``accelerator.clip_grad_norm_``   ``rt.unscale_gradients`` first (also for the logged norm)
``train(resume_from_checkpoint)`` the services' state comes back from that checkpoint
``evaluate`` / ``predict``        ``OnValidationBegin`` / ``OnPredictBegin`` first
exceptions from ``train``         ``OnError(source="transformers")``, then re-raised
================================  ===========================================================

Service state is written to ``sakura_state.pt`` (``sakura_state_<rank>.pt`` when there are
several processes) in each checkpoint folder, atomically, and loaded with
``weights_only=True``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import extract_model_from_parallel
from torch import nn
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from sakura import events as ev
from sakura.errors import SakuraError
from sakura.runtime import SakuraRuntime

__all__ = [
    "STATE_FILE",
    "HFAdapter",
    "SakuraTrainer",
    "SakuraTrainerRequired",
    "state_file_name",
]

logger = logging.getLogger("sakura.adapters.hf")

STATE_FILE = "sakura_state.pt"
"""Name of the services' state file in a single-process checkpoint folder."""

# Coordinated calls a TrainerCallback cannot carry out on the stock Trainer.
_TRAINER_ONLY_CALLS = ("wrap_loss", "unscale_gradients", "optimizer_step")
# Calls that control precision: they conflict with the Trainer's own fp16/bf16.
_PRECISION_CALLS = ("autocast", "wrap_loss")
_AUTOCAST_MARK = "_sakura_autocast_runtime"


class SakuraTrainerRequired(SakuraError, RuntimeError):
    """An installed service needs :class:`SakuraTrainer`; the stock Trainer cannot honour it."""


def state_file_name(rank: int = 0, world_size: int = 1) -> str:
    """The services' state file of ``rank`` in a checkpoint folder (as the Trainer names its
    RNG state: one file for a single process, one per process otherwise)."""
    return STATE_FILE if world_size <= 1 else f"sakura_state_{rank}.pt"


def _check_runtime(rt: Any, option: str) -> SakuraRuntime:
    if not isinstance(rt, SakuraRuntime):
        raise TypeError(f"{option} must be a sakura.SakuraRuntime, got {type(rt).__name__}")
    return rt


def _service_optimizer(optimizer: Any) -> Any:
    """The optimizer the services know: without accelerate's wrapper and sakura's step proxy."""
    while isinstance(optimizer, (AcceleratedOptimizer, _RuntimeStepOptimizer)):
        optimizer = optimizer.optimizer
    return optimizer


def _by_service(rt: SakuraRuntime, calls: Iterable[str]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for call in calls:
        for name in rt.implements(call):
            found.setdefault(name, []).append(call)
    return found


def _describe(found: Mapping[str, list[str]]) -> str:
    return "; ".join(f"{name!r} implements {', '.join(calls)}" for name, calls in found.items())


_USE_TRAINER = (
    "use sakura_adapters.hf.SakuraTrainer, a drop-in replacement of transformers.Trainer "
    "(SakuraTrainer(model=..., args=..., runtime=rt), or keep callbacks=[HFAdapter(rt)] and "
    "only change the class)"
)


def _is_compiled(model: Any) -> bool:
    """Whether ``model`` is a ``torch.compile()``'d module or was compiled in place
    (``nn.Module.compile()`` and sakura's Compile set ``_compiled_call_impl``)."""
    return isinstance(model, torch._dynamo.eval_frame.OptimizedModule) or (
        isinstance(model, nn.Module) and model.__dict__.get("_compiled_call_impl") is not None
    )


def _check_single_compiler(args: Any, names: tuple[str, ...], was: bool, model: Any) -> None:
    """``TrainingArguments(torch_compile=True)`` makes accelerate compile the model that a
    sakura ``wrap_model`` service has just compiled: a nested compile (two graphs, twice
    the compile time, recompiles) with no benefit.  One compiler at a time."""
    if getattr(args, "torch_compile", False) and not was and _is_compiled(model):
        raise ValueError(
            f"TrainingArguments(torch_compile=True) and the sakura service(s) {list(names)} "
            f"both compile the model (the services' wrap_model compiled it); use one of them: "
            f"drop torch_compile from the TrainingArguments (sakura's Compile takes mode, "
            f"backend, per-block compilation and a compile cache) or uninstall the service(s)"
        )


def _hf_mixed_precision(args: Any, trainer: Any) -> str | None:
    for flag in ("fp16", "bf16"):
        if getattr(args, flag, False):
            return f"TrainingArguments({flag}=True)"
    accelerator = getattr(trainer, "accelerator", None) if trainer is not None else None
    mode = getattr(accelerator, "mixed_precision", None)
    if mode not in (None, "no"):
        return f"accelerate's mixed_precision={mode!r}"
    return None


def _mark_step_skipped(optimizer: Any, skipped: bool) -> bool:
    """Tell the Trainer that a service skipped the step, the way accelerate's own loss
    scaler does, so that it leaves the LR scheduler alone.

    Right after ``optimizer.step()`` the Trainer steps the scheduler only
    ``if not accelerator.optimizer_step_was_skipped``, which reads each
    ``AcceleratedOptimizer.step_was_skipped`` -- its ``_is_overflow``, set by accelerate's
    GradScaler path alone.  Our services' optimizer sits under that wrapper (SakuraTrainer's
    step proxy), and accelerate has no scaler then, so the flag is ours to keep: set on a
    skipped step, cleared on the next one.  Returns whether the flag could be set.
    """
    if (
        isinstance(optimizer, AcceleratedOptimizer)
        and isinstance(optimizer.optimizer, _RuntimeStepOptimizer)
        and getattr(optimizer, "scaler", None) is None
        and hasattr(optimizer, "_is_overflow")
    ):
        optimizer._is_overflow = skipped
        return True
    return False


class _RuntimeStepOptimizer(torch.optim.Optimizer):
    """A thin proxy that sends ``step()`` through the runtime.

    It is what :class:`SakuraTrainer` gives accelerate to wrap (accelerate only wraps
    ``torch.optim.Optimizer`` instances, hence the base class, whose ``__init__`` is
    deliberately not called).  ``param_groups``, ``state``, ``defaults``, ``state_dict``,
    ``load_state_dict``, ``zero_grad`` and every other attribute are the wrapped optimizer's,
    so LR schedulers and the Trainer's checkpointing see the real thing.  ``step()`` brings
    the gradients back to scale (``rt.unscale_gradients``, idempotent per step) and offers
    the step to ``rt.optimizer_step``; the wrapped optimizer steps itself only when no
    service owned the step.
    """

    def __init__(self, optimizer: Any, rt: SakuraRuntime) -> None:
        self.__dict__["optimizer"] = optimizer
        self.__dict__["rt"] = rt

    optimizer: Any
    rt: SakuraRuntime

    @property  # type: ignore[override]
    def param_groups(self) -> Any:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: Any) -> None:
        self.optimizer.param_groups = value

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property  # type: ignore[override]
    def defaults(self) -> Any:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: Any) -> None:
        self.optimizer.defaults = value

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        optimizer, rt = self.optimizer, self.rt
        if closure is None:
            rt.unscale_gradients(optimizer)
            if not rt.optimizer_step(optimizer):
                optimizer.step()
            return None
        if not (rt.implements("optimizer_step") or rt.implements("unscale_gradients")):
            return optimizer.step(closure)
        with torch.enable_grad():
            loss = closure()
        rt.unscale_gradients(optimizer)
        if not rt.optimizer_step(optimizer):
            optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()  # type: ignore[no-any-return]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def __getattr__(self, name: str) -> Any:
        try:
            inner = self.__dict__["optimizer"]
        except KeyError:
            raise AttributeError(name) from None
        return getattr(inner, name)

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"


class HFAdapter(TrainerCallback):
    """Drive a :class:`~sakura.SakuraRuntime` from the Hugging Face ``Trainer``.

    Pass it as a callback: ``Trainer(..., callbacks=[HFAdapter(rt)])``, or use
    :class:`SakuraTrainer`, which adds one itself.  ``rank``/``world_size`` come from
    ``args.process_index``/``args.world_size`` and are written to the runtime; ``step`` is
    ``state.global_step`` (``+ 1`` once the optimizer stepped, as for Lightning) and
    ``epoch`` the epoch the Trainer is in, counted from 0.

    On the stock Trainer, services take effect where a callback can make them (see the
    module docstring); a service that needs :class:`SakuraTrainer` (loss scaling,
    unscaling, owning the optimizer step, wrapping into a new object) stops training at
    its start with :class:`SakuraTrainerRequired`, naming the service.  A sakura service
    that controls precision together with the Trainer's own ``fp16``/``bf16`` is a
    ValueError.
    """

    def __init__(self, rt: SakuraRuntime) -> None:
        super().__init__()
        self.rt = _check_runtime(rt, "HFAdapter(rt=...)")
        self._trainer_ref: Callable[[], Any] | None = None
        self._epoch = 0
        self._batch_idx = 0
        self._eval_idx = 0
        self._epoch_log_start = 0
        self._marked_skip = False  # accelerate's step_was_skipped set by us, to clear
        self._step_loss: Any = None
        self._predicting = False
        self._resume_path: str | None = None
        self._model_ref: Callable[[], Any] | None = None
        self._model_wrappers: tuple[str, ...] = ()
        self._optimizer_ref: Callable[[], Any] | None = None
        self._optimizer_wrappers: tuple[str, ...] = ()

    def __repr__(self) -> str:
        mode = "SakuraTrainer" if self._trainer is not None else "callback"
        return f"<HFAdapter ({mode}) {self.rt!r}>"

    # --- helpers ----------------------------------------------------------------------

    @property
    def _trainer(self) -> SakuraTrainer | None:
        """The SakuraTrainer this adapter belongs to; None under the stock Trainer."""
        return self._trainer_ref() if self._trainer_ref is not None else None

    def _bind(self, trainer: SakuraTrainer) -> None:
        self._trainer_ref = weakref.ref(trainer)

    def _emit(self, cls: type[ev.Event], state: Any, **fields: Any) -> None:
        if self.rt.handles(cls):  # unhandled events cost one lookup, nothing is built
            self.rt.emit(cls, step=state.global_step, epoch=self._epoch, **fields)

    def _set_rank(self, args: Any) -> None:
        self.rt.rank = int(args.process_index)
        self.rt.world_size = int(args.world_size)

    def _check_services(self, args: Any) -> None:
        """Raise unless every installed service can take effect in this Trainer."""
        rt, trainer = self.rt, self._trainer
        hf_precision = _hf_mixed_precision(args, trainer)
        if hf_precision is not None:
            precision = _by_service(rt, _PRECISION_CALLS)
            if precision:
                raise ValueError(
                    f"{hf_precision} and the sakura service(s) {sorted(precision)} both control "
                    f"mixed precision ({_describe(precision)}); use one of them: drop fp16/bf16 "
                    f"from the TrainingArguments (sakura's MixedPrecision accepts 'bf16-mixed' "
                    f"and '16-mixed') or uninstall the service(s)"
                )
        if trainer is None:
            needs = _by_service(rt, _TRAINER_ONLY_CALLS)
            if needs:
                raise SakuraTrainerRequired(
                    f"the sakura service(s) {sorted(needs)} cannot take effect under the stock "
                    f"transformers.Trainer with only the HFAdapter callback ({_describe(needs)}): "
                    f"a TrainerCallback cannot change the loss given to backward, unscale "
                    f"gradients before clipping or take over the optimizer step. Training was "
                    f"not started; {_USE_TRAINER}"
                )

    def _wrap_model_in_place(self, model: Any) -> None:
        """Stock Trainer: apply ``wrap_model``; only in-place changes can reach the Trainer."""
        names = self.rt.implements("wrap_model")
        if not names or model is None:
            return
        wrapped = self.rt.wrap_model(model)
        if wrapped is not model:
            raise SakuraTrainerRequired(
                f"the sakura service(s) {list(names)} implement wrap_model and returned a new "
                f"{type(wrapped).__name__} instead of modifying the {type(model).__name__} in "
                f"place; the stock transformers.Trainer would keep training the unwrapped model "
                f"and a callback cannot hand it the new one; {_USE_TRAINER}"
            )
        self._model_ref = weakref.ref(model)
        self._model_wrappers = names

    def _check_model_wrapped(self, model: Any) -> None:
        """At train start: the model the Trainer trains went through every ``wrap_model``."""
        names = self.rt.implements("wrap_model")
        if not names:
            return
        current = self._model_ref() if self._model_ref is not None else None
        same_model = current is not None and (
            current is model
            or extract_model_from_parallel(model, keep_torch_compile=False) is current
        )
        if names == self._model_wrappers and (same_model or self._trainer is not None):
            return  # SakuraTrainer re-wraps a model_init model itself
        late = [n for n in names if n not in self._model_wrappers]
        why = (
            f"the sakura service(s) {late} were installed after the Trainer was built"
            if late and same_model
            else "the Trainer trains a model that sakura's wrap_model did not see "
            "(model_init re-created it, or services changed after the Trainer was built)"
        )
        fix = (
            "install every service before building the Trainer"
            if self._trainer is not None
            else f"install every service before building the Trainer, or {_USE_TRAINER}"
        )
        raise SakuraTrainerRequired(
            f"{why}; wrap_model of {list(names)} can only be applied when the Trainer is "
            f"built; {fix}"
        )

    def _wrap_optimizer_in_place(self, optimizer: Any) -> None:
        """Stock Trainer, at train start: apply ``wrap_optimizer`` in place."""
        names = self.rt.implements("wrap_optimizer")
        if not names or optimizer is None:
            return
        inner = _service_optimizer(optimizer)
        done = self._optimizer_ref() if self._optimizer_ref is not None else None
        if done is inner and names == self._optimizer_wrappers:
            return
        wrapped = self.rt.wrap_optimizer(inner)
        if wrapped is not inner:
            raise SakuraTrainerRequired(
                f"the sakura service(s) {list(names)} implement wrap_optimizer and returned a new "
                f"{type(wrapped).__name__} instead of modifying the {type(inner).__name__} in "
                f"place; a callback cannot hand the stock transformers.Trainer a new optimizer; "
                f"{_USE_TRAINER}"
            )
        self._optimizer_ref = weakref.ref(inner)
        self._optimizer_wrappers = names

    def _patch_autocast(self, model: Any) -> None:
        """Stock Trainer: enter ``rt.autocast()`` around every forward of ``model``.

        The Trainer offers a callback no autocast extension point, so the model's
        ``forward`` is wrapped in place, the way accelerate applies its own mixed precision.
        The wrapper asks the runtime for its context on every call (a service installed or
        removed later is honoured); ``functools.wraps`` keeps the signature the Trainer
        inspects.  Done once per model and runtime.
        """
        if model is None or not self.rt.implements("autocast"):
            return
        if model.__dict__.get(_AUTOCAST_MARK) is self.rt:
            return
        rt = self.rt
        original = model.forward

        @functools.wraps(original)
        def forward(*args: Any, **kwargs: Any) -> Any:
            with rt.autocast():
                return original(*args, **kwargs)

        model.forward = forward
        model.__dict__[_AUTOCAST_MARK] = rt

    def _find_checkpoint(self, args: Any, state: Any) -> str | None:
        """Stock Trainer: the folder this run resumed from.

        A callback is not told the path, but the resumed ``state.global_step`` names it:
        the Trainer writes ``<output_dir>/checkpoint-<global_step>``.  ``args.
        resume_from_checkpoint`` (the field the Trainer leaves to scripts) wins when set.
        """
        if state.global_step <= 0:
            return None  # a fresh run: the Trainer only loads a state when resuming
        candidates = []
        explicit = getattr(args, "resume_from_checkpoint", None)
        if isinstance(explicit, (str, os.PathLike)):
            candidates.append(os.fspath(explicit))
        candidates.append(
            os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        )
        for path in candidates:
            if os.path.isdir(path):
                return path
        stateful = self.rt.implements("load_state_dict")
        if stateful:
            logger.warning(
                "sakura: training resumes at step %d but HFAdapter cannot tell from which "
                "checkpoint (looked in %s); services %s start with fresh state. Use "
                "SakuraTrainer, or set TrainingArguments.resume_from_checkpoint to the folder.",
                state.global_step,
                candidates,
                list(stateful),
            )
        return None

    def _restore(self, args: Any, state: Any, model: Any) -> None:
        if self._trainer is not None:
            path, self._resume_path = self._resume_path, None
        else:
            path = self._find_checkpoint(args, state)
        if path is None:
            return
        file = os.path.join(path, state_file_name(self.rt.rank, self.rt.world_size))
        if not os.path.isfile(file):
            stateful = self.rt.implements("load_state_dict")
            if stateful:
                logger.warning(
                    "sakura: the checkpoint %s holds no %s; services %s start with fresh state",
                    path,
                    os.path.basename(file),
                    list(stateful),
                )
            return
        services_state = torch.load(file, map_location="cpu", weights_only=True)
        self.rt.load_state_dict(services_state)
        self._emit(ev.OnLoadCheckpoint, state, model=model, checkpoint=None, path=path)

    def _save_state(self, path: str) -> None:
        services_state = self.rt.state_dict()
        if not services_state:
            return
        os.makedirs(path, exist_ok=True)
        final = os.path.join(path, state_file_name(self.rt.rank, self.rt.world_size))
        tmp = f"{final}.tmp-{os.getpid()}"
        try:
            with open(tmp, "wb") as f:
                torch.save(services_state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise

    def _add_loss(self, loss: Any) -> None:
        """SakuraTrainer: sum the micro-batch losses of the step for OnTrainStepEnd."""
        if self.rt.handles(ev.OnTrainStepEnd):
            loss = loss.detach()
            self._step_loss = loss if self._step_loss is None else self._step_loss + loss

    def _begin_eval(self, state: Any, model: Any, *, predicting: bool) -> None:
        self._eval_idx = 0
        self._predicting = predicting
        self._emit(ev.OnPredictBegin if predicting else ev.OnValidationBegin, state, model=model)

    # --- lifecycle ----------------------------------------------------------------------

    def on_init_end(
        self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any
    ) -> None:
        self._set_rank(args)
        self._epoch = 0
        self._check_services(args)
        if self._trainer is None:
            was = bool(getattr(args, "torch_compile", False)) and _is_compiled(model)
            self._wrap_model_in_place(model)
            _check_single_compiler(args, self.rt.implements("wrap_model"), was, model)
            self._patch_autocast(model)
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
        self._check_services(args)
        trainer = self._trainer
        if trainer is None:
            self._check_model_wrapped(model)
            self._patch_autocast(model)
            self._wrap_optimizer_in_place(optimizer)
        else:
            self._check_model_wrapped(trainer.model)
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
            optimizer=_service_optimizer(optimizer),
            train_loader=train_dataloader,
            # SakuraTrainer binds itself; a callback on the stock Trainer only has its state.
            trainer=state if self._trainer is None else self._trainer,
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
        self._emit(
            ev.OnEpochEnd,
            state,
            model=model,
            optimizer=_service_optimizer(optimizer),
            metrics=metrics,
        )

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
                optimizer=_service_optimizer(optimizer),
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
            self._marked_skip = _mark_step_skipped(optimizer, skipped) and skipped
        if rt.handles(ev.OnOptimizerStep) or rt.handles(ev.OnBeforeZeroGrad):
            opt = _service_optimizer(optimizer)
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
        path = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        self._save_state(path)
        self._emit(ev.OnSaveCheckpoint, state, model=model, checkpoint=None, path=path)

    def on_push_begin(
        self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any
    ) -> None:
        self._emit(ev.OnPushBegin, state, model=model, path=args.output_dir)


_TRAINER_INIT = inspect.signature(Trainer.__init__)


class SakuraTrainer(Trainer):
    """A drop-in :class:`transformers.Trainer` that routes the step through a sakura runtime.

    Same constructor as ``Trainer`` plus ``runtime=`` (a :class:`~sakura.SakuraRuntime`).
    Without it, the runtime of the :class:`HFAdapter` in ``callbacks`` is used; without an
    ``HFAdapter`` there, one is added.  See the module docstring for what goes through the
    runtime.

    Loss scaling: the Trainer's ``training_step`` computes the loss, calls
    ``self.accelerator.backward(loss)`` and returns ``loss.detach()`` for logging.  Instead
    of re-implementing ``training_step`` (context parallelism, SageMaker, LOMO, DeepSpeed
    and gradient-accumulation normalisation all live there), SakuraTrainer gives its own
    accelerator instance a ``backward`` that emits ``OnBeforeBackward``, runs the original
    backward on ``rt.scale_loss(loss)`` and emits ``OnAfterBackward``; the loss the Trainer
    logs and returns stays unscaled.  A subclass that overrides ``training_step`` keeps the
    scaling as long as it calls ``self.accelerator.backward``.  The same instance gets a
    ``clip_grad_norm_`` that calls ``rt.unscale_gradients`` first, so clipping and the
    logged gradient norm see true gradients.  Both are (re)installed when training starts
    and at every step, so a replaced accelerator is covered too.

    Step ownership: :meth:`create_optimizer` wraps the optimizer with ``rt.wrap_optimizer``
    and then in a thin ``torch.optim.Optimizer`` proxy; accelerate wraps that proxy as usual.
    The proxy's ``step()`` calls ``rt.unscale_gradients`` and ``rt.optimizer_step`` with the
    services' optimizer and steps it itself only when no service owned the step.  Services
    always receive the optimizer ``rt.wrap_optimizer`` returned, never accelerate's wrapper.

    Resume: ``train(resume_from_checkpoint=...)`` tells the adapter the folder (``True``
    resolves to the last checkpoint in ``output_dir`` as the Trainer does); the services'
    state is loaded from it when training starts, after the Trainer restored the model,
    optimizer and scheduler and before ``OnFitBegin``, followed by ``OnLoadCheckpoint``.
    """

    def __init__(self, *args: Any, runtime: SakuraRuntime | None = None, **kwargs: Any) -> None:
        try:
            bound = _TRAINER_INIT.bind(self, *args, **kwargs)
        except TypeError as exc:
            raise TypeError(
                f"SakuraTrainer takes transformers.Trainer's arguments: {exc}"
            ) from None
        callbacks = list(bound.arguments.get("callbacks") or [])
        for cb in callbacks:
            if isinstance(cb, type) and issubclass(cb, HFAdapter):
                raise TypeError(
                    "callbacks holds the HFAdapter class; pass an instance, HFAdapter(rt), "
                    "or pass runtime=rt to SakuraTrainer"
                )
        adapters = [cb for cb in callbacks if isinstance(cb, HFAdapter)]
        if len(adapters) > 1:
            raise ValueError(f"callbacks holds {len(adapters)} HFAdapter instances; pass one")
        if runtime is None:
            if not adapters:
                raise TypeError(
                    "SakuraTrainer needs a sakura runtime: pass runtime=SakuraRuntime(...) or "
                    "callbacks=[HFAdapter(rt)]"
                )
            runtime = adapters[0].rt
        _check_runtime(runtime, "SakuraTrainer(runtime=...)")
        if adapters:
            adapter = adapters[0]
            if adapter.rt is not runtime:
                raise ValueError(
                    "runtime= and the HFAdapter in callbacks hold different SakuraRuntimes; "
                    "pass one runtime"
                )
        else:
            adapter = HFAdapter(runtime)
            callbacks.append(adapter)
        bound.arguments["callbacks"] = callbacks
        self.runtime: SakuraRuntime = runtime
        self.sakura_adapter: HFAdapter = adapter
        self._sakura_ready = False
        self._sakura_optimizer: _RuntimeStepOptimizer | None = None
        self._sakura_hooks_token = object()
        adapter._bind(self)
        super().__init__(*bound.args[1:], **bound.kwargs)
        model = self._sakura_wrap_model(self.model)
        if model is not self.model:
            if self.model_wrapped is self.model:
                self.model_wrapped = model
            self.model = model
            self.callback_handler.model = model
        self._sakura_install_hooks()
        self._sakura_ready = True

    # --- model and optimizer ------------------------------------------------------------

    def _sakura_wrap_model(self, model: Any) -> Any:
        rt, adapter = self.runtime, self.sakura_adapter
        names = rt.implements("wrap_model")
        if names:
            was = bool(getattr(self.args, "torch_compile", False)) and _is_compiled(model)
            wrapped = rt.wrap_model(model)
            _check_single_compiler(self.args, names, was, wrapped)
            if not isinstance(wrapped, nn.Module):
                raise TypeError(
                    f"wrap_model of the sakura service(s) {list(names)} returned a "
                    f"{type(wrapped).__name__}; the Trainer needs a torch.nn.Module whose "
                    f"forward(**batch) it can call"
                )
            model = wrapped
        adapter._model_ref = weakref.ref(model)
        adapter._model_wrappers = names
        return model

    def call_model_init(self, trial: Any = None) -> Any:
        """The Trainer's ``model_init`` result, through ``rt.wrap_model`` when ``train()``
        re-creates the model (the constructor wraps its model itself)."""
        model = super().call_model_init(trial)
        if getattr(self, "_sakura_ready", False):
            model = self._sakura_wrap_model(model)
        return model

    def create_optimizer(self, model: Any = None) -> Any:
        """The Trainer's optimizer, through ``rt.wrap_optimizer``, in the step proxy."""
        optimizer = (
            super().create_optimizer(model) if model is not None else super().create_optimizer()
        )
        if optimizer is None:
            return optimizer
        proxy = self._sakura_optimizer
        probe = optimizer
        while isinstance(probe, (AcceleratedOptimizer, _RuntimeStepOptimizer)):
            if probe is proxy:
                return optimizer  # already routed through the runtime
            probe = probe.optimizer
        proxy = _RuntimeStepOptimizer(self.runtime.wrap_optimizer(optimizer), self.runtime)
        self._sakura_optimizer = proxy
        self.optimizer = proxy
        return proxy

    # --- forward, backward, clipping ----------------------------------------------------

    def compute_loss_context_manager(self) -> Any:
        """The Trainer's contexts plus ``rt.autocast()`` (training and evaluation)."""
        if not self.runtime.implements("autocast"):  # nothing to add: no ExitStack per step
            return super().compute_loss_context_manager()
        stack = contextlib.ExitStack()
        stack.enter_context(super().compute_loss_context_manager())
        stack.enter_context(self.runtime.autocast())
        return stack

    def _sakura_install_hooks(self) -> None:
        """Give the accelerator a ``backward`` and ``clip_grad_norm_`` that go through the
        runtime (idempotent: one dict lookup when they are in place)."""
        accelerator = getattr(self, "accelerator", None)
        if accelerator is None:
            return
        token = self._sakura_hooks_token
        if accelerator.__dict__.get("_sakura_hooks") is token:
            return
        backward = accelerator.backward
        clip_grad_norm_ = accelerator.clip_grad_norm_
        accelerator.backward = functools.partial(self._sakura_backward, backward)
        accelerator.clip_grad_norm_ = functools.partial(
            self._sakura_clip_grad_norm, clip_grad_norm_
        )
        accelerator.__dict__["_sakura_hooks"] = token

    def _sakura_backward(self, backward: Callable[..., Any], loss: Any, **kwargs: Any) -> Any:
        rt, adapter, state = self.runtime, self.sakura_adapter, self.state
        adapter._emit(ev.OnBeforeBackward, state, model=self.model, loss=loss)
        result = backward(rt.scale_loss(loss), **kwargs)
        adapter._emit(ev.OnAfterBackward, state, model=self.model, loss=loss)
        adapter._add_loss(loss)
        return result

    def _sakura_clip_grad_norm(self, clip: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        optimizer = _service_optimizer(self.optimizer)
        if optimizer is not None:
            self.runtime.unscale_gradients(optimizer)
        return clip(*args, **kwargs)

    # --- entry points -------------------------------------------------------------------

    def train(  # type: ignore[override]
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> Any:
        """``Trainer.train``; restores the services' state when resuming and reports an
        exception to the services (``OnError``) before re-raising it."""
        path: Any = resume_from_checkpoint
        if path is True:
            path = get_last_checkpoint(self.args.output_dir)
        self.sakura_adapter._resume_path = os.fspath(path) if path else None
        try:
            return super().train(
                resume_from_checkpoint=resume_from_checkpoint,
                trial=trial,
                ignore_keys_for_eval=ignore_keys_for_eval,
                **kwargs,
            )
        except BaseException as exc:
            self.runtime.emit(
                ev.OnError,
                step=self.state.global_step,
                epoch=self.sakura_adapter._epoch,
                exception=exc,
                source="transformers",
            )
            raise
        finally:
            self.sakura_adapter._resume_path = None

    def evaluate(
        self,
        eval_dataset: Any = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> dict[str, float]:
        """``Trainer.evaluate``, preceded by ``OnValidationBegin`` (once per dataset)."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if not isinstance(dataset, dict):  # a dict re-enters evaluate() once per dataset
            self.sakura_adapter._begin_eval(self.state, self.model, predicting=False)
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)  # type: ignore[no-any-return]

    def predict(
        self,
        test_dataset: Any,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "test",
    ) -> Any:
        """``Trainer.predict``, preceded by ``OnPredictBegin``; its batches are reported as
        ``OnPredictBatchEnd``."""
        adapter = self.sakura_adapter
        adapter._begin_eval(self.state, self.model, predicting=True)
        try:
            return super().predict(test_dataset, ignore_keys, metric_key_prefix)
        finally:
            adapter._predicting = False
