"""Lightning integration: a real ``lightning.pytorch.Callback`` plus a precision plugin.

``LightningAdapter(rt)`` maps every callback hook to a sakura event.  Services that own part
of the step (autocast, loss scaling, unscaling before clipping, the optimizer step, model
and optimizer wrapping) act through Lightning's own extension point for exactly that, the
``Precision`` plugin API: at ``setup`` the adapter hands the strategy a
:class:`SakuraPrecision` that wraps the precision plugin the Trainer configured.

================================  ===========================================================
Lightning calls                   SakuraPrecision does
================================  ===========================================================
``convert_module(module)``        the inner plugin's conversion, then ``rt.wrap_model``
``connect(model, optimizers, …)`` the inner plugin's, then ``rt.wrap_optimizer`` on each
``forward_context()``             the inner context and ``rt.autocast()``
``pre_backward(loss)``            the inner hook (callbacks see the unscaled loss), then
                                  ``rt.scale_loss``
``clip_gradients(...)``           ``rt.unscale_gradients`` (idempotent), then clipping
``optimizer_step(...)``           when a service owns the step: closure, unscale, Lightning's
                                  before-step hooks and clipping, ``rt.optimizer_step``;
                                  then ``OnOptimizerStep``
================================  ===========================================================

Service state is saved in Lightning checkpoints under the ``"sakura"`` key and restored
on resume (``trainer.fit(..., ckpt_path=...)``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

from sakura import events as ev
from sakura.options import check_bool
from sakura.runtime import SakuraRuntime
from sakura_adapters.emitted import events_emitted, warn_unemitted

__all__ = ["CHECKPOINT_KEY", "LightningAdapter", "SakuraPrecision"]

CHECKPOINT_KEY = "sakura"

# Coordinated calls that only the precision plugin can carry out under Lightning.
_PRECISION_CALLS = ("autocast", "wrap_loss", "unscale_gradients", "optimizer_step")
_ALL_CALLS = (*_PRECISION_CALLS, "wrap_model", "wrap_optimizer")
_SUPPORTED_STRATEGIES = (SingleDeviceStrategy, DDPStrategy)
# The hooks the Trainer calls on every callback (lightning.Callback's public methods).
_CALLBACK_HOOKS = tuple(
    name for name, value in vars(Callback).items() if not name.startswith("_") and callable(value)
)
_NO_SUCH_MOMENT = (
    "the lightning.Trainer has no such moment: handle an event it emits instead "
    "(LightningAdapter.emitted_events() lists them)"
)


def _check_runtime(rt: Any) -> SakuraRuntime:
    if not isinstance(rt, SakuraRuntime):
        raise TypeError(f"rt must be a sakura.SakuraRuntime, got {type(rt).__name__}")
    return rt


def _metrics(trainer: pl.Trainer) -> dict[str, Any]:
    return dict(trainer.callback_metrics)


class SakuraPrecision(Precision):
    """A Lightning precision plugin that routes the step through a SakuraRuntime.

    ``inner`` is the precision plugin it wraps (the Trainer's own, e.g. for
    ``precision="bf16-true"``); everything sakura's services do not take over is delegated
    to it.  Normally installed by :class:`LightningAdapter`; pass it yourself with
    ``Trainer(plugins=[SakuraPrecision(rt)])`` to use the runtime without the callback.
    """

    inner: Precision
    """The precision plugin this one wraps and delegates to."""

    def __init__(self, rt: SakuraRuntime, inner: Precision | None = None) -> None:
        super().__init__()
        self.rt = _check_runtime(rt)
        if inner is not None and not isinstance(inner, Precision):
            raise TypeError(
                f"inner must be a lightning Precision plugin, got {type(inner).__name__}"
            )
        if isinstance(inner, SakuraPrecision):
            inner = inner.inner
        self.inner = inner if inner is not None else Precision()
        self.precision = self.inner.precision

    # --- setup ------------------------------------------------------------------------

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        module = self.inner.convert_module(module)
        wrapped = self.rt.wrap_model(module)
        if isinstance(module, pl.LightningModule) and wrapped is not module:
            raise TypeError(
                f"under Lightning, wrap_model must modify the LightningModule in place and return "
                f"it (services {list(self.rt.implements('wrap_model'))} returned a "
                f"{type(wrapped).__name__}); Lightning drives the module it was given"
            )
        return wrapped  # type: ignore[no-any-return]

    def connect(
        self, model: torch.nn.Module, optimizers: list[Any], lr_schedulers: list[Any]
    ) -> tuple[torch.nn.Module, list[Any], list[Any]]:
        model, optimizers, lr_schedulers = self.inner.connect(model, optimizers, lr_schedulers)
        return model, [self.rt.wrap_optimizer(opt) for opt in optimizers], lr_schedulers

    # --- contexts ---------------------------------------------------------------------

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        if not self.rt.implements("autocast"):
            return self.inner.forward_context()  # nothing to add: no extra generator frame
        return self._stacked_forward_context()

    @contextlib.contextmanager
    def _stacked_forward_context(self) -> Generator[None, None, None]:
        with self.inner.forward_context(), self.rt.autocast():
            yield

    def tensor_init_context(self) -> contextlib.AbstractContextManager[Any]:
        return self.inner.tensor_init_context()

    def module_init_context(self) -> contextlib.AbstractContextManager[Any]:
        return self.inner.module_init_context()

    def convert_input(self, data: Any) -> Any:
        return self.inner.convert_input(data)

    def convert_output(self, data: Any) -> Any:
        return self.inner.convert_output(data)

    # --- backward and step ---------------------------------------------------------------

    def pre_backward(self, tensor: torch.Tensor, module: pl.LightningModule) -> torch.Tensor:  # type: ignore[override]
        tensor = self.inner.pre_backward(tensor, module)
        return self.rt.scale_loss(tensor)  # type: ignore[no-any-return]

    def backward(  # type: ignore[override]
        self,
        tensor: torch.Tensor,
        model: pl.LightningModule,
        optimizer: Any,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        self.inner.backward(tensor, model, optimizer, *args, **kwargs)

    def post_backward(self, tensor: torch.Tensor, module: pl.LightningModule) -> torch.Tensor:  # type: ignore[override]
        return self.inner.post_backward(tensor, module)

    def clip_gradients(
        self, optimizer: Any, clip_val: float = 0.0, gradient_clip_algorithm: Any = None
    ) -> None:
        if clip_val is None or clip_val <= 0:
            return
        # Manual optimization hands clip_gradients a LightningOptimizer while optimizer_step
        # gets the torch optimizer: services keyed by the optimizer must see the same object.
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        self.rt.unscale_gradients(optimizer)
        if gradient_clip_algorithm is None:
            self.inner.clip_gradients(optimizer, clip_val)
        else:
            self.inner.clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Any,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        if not self.rt.implements("optimizer_step"):
            result = self.inner.optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        else:
            if isinstance(optimizer, torch.optim.LBFGS):
                raise TypeError(
                    f"sakura services {list(self.rt.implements('optimizer_step'))} own the optimizer "
                    f"step, which cannot re-evaluate an LBFGS closure; use another optimizer"
                )
            result = closure()
            skipped = result is None and getattr(model, "automatic_optimization", True)
            if not skipped:
                self.rt.unscale_gradients(optimizer)
            self._after_closure(model, optimizer)
            if skipped:
                return result
            if not self.rt.optimizer_step(optimizer):
                optimizer.step(**kwargs)
        trainer = getattr(model, "_trainer", None)
        if trainer is not None and self.rt.handles(ev.OnOptimizerStep):
            self.rt.emit(
                ev.OnOptimizerStep,
                step=trainer.global_step + 1,
                epoch=trainer.current_epoch,
                model=model,
                optimizer=optimizer,
                skipped=self.rt.last_step_skipped,
            )
        return result

    # --- state --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)

    def teardown(self) -> None:
        self.inner.teardown()


class LightningAdapter(Callback):
    """Drive a :class:`~sakura.SakuraRuntime` from ``lightning.Trainer``.

    Pass it as a callback: ``Trainer(callbacks=[LightningAdapter(rt)])``.  Rank and world
    size come from the trainer; metrics from ``trainer.callback_metrics``.  At setup the
    adapter installs :class:`SakuraPrecision` around the Trainer's precision plugin so
    services that own part of the step take effect.  A Trainer precision setting that
    would conflict with a service that also controls precision is an error at setup.

    ``strict_resume``: when resuming (``trainer.fit(..., ckpt_path=...)``), whether a
    checkpoint whose services' state does not match the installed services is an error.
    By default (False) a newly installed stateful service starts fresh with a warning and
    the state of a service that is no longer installed is kept and saved again in the
    next checkpoint (see :mod:`sakura.resume`); True raises
    :class:`~sakura.resume.ServiceStateError` instead.
    """

    def __init__(self, rt: SakuraRuntime, *, strict_resume: bool = False) -> None:
        super().__init__()
        self.rt = _check_runtime(rt)
        self.strict_resume = check_bool("strict_resume", strict_resume, owner="LightningAdapter")
        self._last_loss: Any = None

    @property
    def state_key(self) -> str:
        return "SakuraLightningAdapter"

    @classmethod
    def emitted_events(cls, *, precision_plugin: bool = True) -> frozenset[type[ev.Event]] | None:
        """The events this adapter can emit, read from the code (see
        :mod:`sakura_adapters.emitted`): those of the ``Callback`` hooks, plus those of
        :class:`SakuraPrecision` when it could be installed (``precision_plugin``; it is
        not for unsupported strategies).  None when the source is not available."""
        ours = events_emitted(cls, _CALLBACK_HOOKS, stop_at=Callback)
        if not precision_plugin or ours is None:
            return ours
        plugin = events_emitted(SakuraPrecision, None, stop_at=Precision)
        return None if plugin is None else ours | plugin

    def _warn_unemitted(self, trainer: pl.Trainer) -> None:
        """Warn about every installed service's handler for an event never emitted here."""
        strategy = trainer.strategy
        installed = isinstance(strategy.precision_plugin, SakuraPrecision)
        with_plugin = self.emitted_events() or frozenset()
        supported = ", ".join(s.__name__ for s in _SUPPORTED_STRATEGIES)

        def fix(event: type[ev.Event]) -> str:
            if not installed and event in with_plugin:
                return (
                    f"it is emitted by LightningAdapter's precision plugin, which does not "
                    f"support strategy {type(strategy).__name__} (supported: {supported})"
                )
            return _NO_SUCH_MOMENT

        warn_unemitted(
            self.rt,
            self.emitted_events(precision_plugin=installed),
            where="LightningAdapter under the lightning.Trainer",
            fix=fix,
        )

    # --- helpers ----------------------------------------------------------------------

    def _emit(self, cls: type[ev.Event], trainer: pl.Trainer, /, **fields: Any) -> None:
        if not self.rt.handles(cls):  # skip the trainer's property chain for unhandled events
            return
        self.rt.emit(cls, step=trainer.global_step, epoch=trainer.current_epoch, **fields)

    def _install_precision(self, trainer: pl.Trainer) -> None:
        strategy = trainer.strategy
        current = strategy.precision_plugin
        if isinstance(current, SakuraPrecision):
            return
        needed = [name for call in _ALL_CALLS for name in self.rt.implements(call)]
        precision_services = sorted(
            {n for call in _PRECISION_CALLS for n in self.rt.implements(call)}
        )
        if precision_services and type(current) is not Precision:
            raise ValueError(
                f"Trainer(precision={trainer.precision!r}) and the sakura service(s) "
                f"{precision_services} both control precision, autocast or the optimizer step; "
                f"use one: remove the Trainer's precision argument (sakura's MixedPrecision "
                f"accepts the same strings) or uninstall the service"
            )
        if not isinstance(strategy, _SUPPORTED_STRATEGIES):
            if needed:
                raise ValueError(
                    f"the sakura service(s) {sorted(set(needed))} need LightningAdapter's precision "
                    f"plugin, which does not support strategy {type(strategy).__name__}; "
                    f"supported: {', '.join(s.__name__ for s in _SUPPORTED_STRATEGIES)}"
                )
            return
        strategy.precision_plugin = SakuraPrecision(self.rt, current)

    # --- lifecycle ----------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.rt.rank = trainer.global_rank
        self.rt.world_size = trainer.world_size
        self._install_precision(trainer)
        if stage == "fit":
            self._warn_unemitted(trainer)
        self._emit(ev.OnSetup, trainer, stage=stage, model=pl_module)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._emit(ev.OnTeardown, trainer, stage=stage, model=pl_module)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._emit(ev.OnFitBegin, trainer, model=pl_module)

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._emit(ev.OnFitEnd, trainer, model=pl_module)

    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._emit(ev.OnSanityCheckBegin, trainer, model=pl_module)

    def on_sanity_check_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._emit(ev.OnSanityCheckEnd, trainer, model=pl_module)

    # --- training ----------------------------------------------------------------------

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        optimizers = trainer.optimizers
        self._emit(
            ev.OnTrainBegin,
            trainer,
            model=pl_module,
            optimizer=optimizers[0] if optimizers else None,
            train_loader=trainer.train_dataloader,
            trainer=trainer,
        )

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._emit(ev.OnTrainEnd, trainer, model=pl_module, metrics=_metrics(trainer))

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._emit(ev.OnEpochBegin, trainer, model=pl_module)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        optimizers = trainer.optimizers
        self._emit(
            ev.OnEpochEnd,
            trainer,
            model=pl_module,
            optimizer=optimizers[0] if optimizers else None,
            metrics=_metrics(trainer),
        )

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._emit(ev.OnTrainStepBegin, trainer, model=pl_module, batch=batch, batch_idx=batch_idx)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        self._emit(
            ev.OnTrainStepEnd,
            trainer,
            model=pl_module,
            batch=batch,
            batch_idx=batch_idx,
            loss=loss,
            outputs=outputs,
        )

    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        self._last_loss = loss
        self._emit(ev.OnBeforeBackward, trainer, model=pl_module, loss=loss)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loss, self._last_loss = self._last_loss, None
        self._emit(ev.OnAfterBackward, trainer, model=pl_module, loss=loss)

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        self._emit(ev.OnBeforeOptimizerStep, trainer, model=pl_module, optimizer=optimizer)

    def on_before_zero_grad(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        self._emit(ev.OnBeforeZeroGrad, trainer, model=pl_module, optimizer=optimizer)

    # --- validation / test / predict ---------------------------------------------------

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._emit(ev.OnValidationBegin, trainer, model=pl_module)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._emit(ev.OnValidationEnd, trainer, model=pl_module, metrics=_metrics(trainer))

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._emit(ev.OnValidationEpochBegin, trainer, model=pl_module)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._emit(ev.OnValidationEpochEnd, trainer, model=pl_module, metrics=_metrics(trainer))

    def on_validation_batch_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._emit(
            ev.OnValidationBatchBegin,
            trainer,
            model=pl_module,
            batch=batch,
            batch_idx=batch_idx,
            dataloader_idx=dataloader_idx,
        )

    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._emit(
            ev.OnValidationBatchEnd,
            trainer,
            model=pl_module,
            batch=batch,
            batch_idx=batch_idx,
            dataloader_idx=dataloader_idx,
            outputs=outputs,
        )

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._emit(ev.OnTestBegin, trainer, model=pl_module)

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._emit(ev.OnTestEnd, trainer, model=pl_module, metrics=_metrics(trainer))

    def on_test_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._emit(ev.OnTestEpochBegin, trainer, model=pl_module)

    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._emit(ev.OnTestEpochEnd, trainer, model=pl_module, metrics=_metrics(trainer))

    def on_test_batch_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._emit(
            ev.OnTestBatchBegin,
            trainer,
            model=pl_module,
            batch=batch,
            batch_idx=batch_idx,
            dataloader_idx=dataloader_idx,
        )

    def on_test_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._emit(
            ev.OnTestBatchEnd,
            trainer,
            model=pl_module,
            batch=batch,
            batch_idx=batch_idx,
            dataloader_idx=dataloader_idx,
            outputs=outputs,
        )

    def on_predict_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._emit(ev.OnPredictBegin, trainer, model=pl_module)

    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._emit(ev.OnPredictEnd, trainer, model=pl_module, metrics=_metrics(trainer))

    def on_predict_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._emit(ev.OnPredictEpochBegin, trainer, model=pl_module)

    def on_predict_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._emit(ev.OnPredictEpochEnd, trainer, model=pl_module)

    def on_predict_batch_start(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._emit(
            ev.OnPredictBatchBegin,
            trainer,
            model=pl_module,
            batch=batch,
            batch_idx=batch_idx,
            dataloader_idx=dataloader_idx,
        )

    def on_predict_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._emit(
            ev.OnPredictBatchEnd,
            trainer,
            model=pl_module,
            batch=batch,
            batch_idx=batch_idx,
            dataloader_idx=dataloader_idx,
            outputs=outputs,
        )

    # --- checkpoints and errors ---------------------------------------------------------

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        checkpoint[CHECKPOINT_KEY] = self.rt.state_dict()
        self._emit(ev.OnSaveCheckpoint, trainer, model=pl_module, checkpoint=checkpoint)

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # A checkpoint written without the adapter has no entry: every stateful service
        # then starts fresh (a warning, or an error with strict_resume).
        self.rt.load_state_dict(checkpoint.get(CHECKPOINT_KEY) or {}, strict=self.strict_resume)
        self._emit(
            ev.OnLoadCheckpoint,
            trainer,
            model=pl_module,
            checkpoint=checkpoint,
            path=getattr(trainer, "ckpt_path", None),
        )

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._emit(ev.OnError, trainer, exception=exception, source="lightning")
