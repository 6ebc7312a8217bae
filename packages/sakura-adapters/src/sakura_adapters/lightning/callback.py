""":class:`LightningAdapter`: the ``lightning.pytorch.Callback`` that drives a sakura runtime.

Every callback hook becomes the matching sakura event; at ``setup`` the adapter installs
:class:`~sakura_adapters.lightning.SakuraPrecision` around the Trainer's precision plugin
so that services owning part of the step take effect.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

from sakura import events as ev
from sakura.loop import LoopContext
from sakura.options import check_bool
from sakura.runtime import SakuraRuntime
from sakura_adapters.emitted import events_emitted, warn_unemitted
from sakura_adapters.lightning.precision import SakuraPrecision, check_runtime
from sakura_adapters.metrics import numeric_metrics

__all__ = ["CHECKPOINT_KEY", "LightningAdapter"]

CHECKPOINT_KEY = "sakura"
"""The key of the services' state in a Lightning checkpoint."""

# Coordinated calls that only the precision plugin can carry out under Lightning.
_PRECISION_CALLS = ("autocast", "wrap_loss", "unscale_gradients", "optimizer_step")
_ALL_CALLS = (*_PRECISION_CALLS, "wrap_model", "wrap_optimizer")
_SUPPORTED_STRATEGIES = (SingleDeviceStrategy, DDPStrategy, ModelParallelStrategy)
# The hooks the Trainer calls on every callback (lightning.Callback's public methods).
_CALLBACK_HOOKS = tuple(
    name for name, value in vars(Callback).items() if not name.startswith("_") and callable(value)
)
_NO_SUCH_MOMENT = (
    "the lightning.Trainer has no such moment: handle an event it emits instead "
    "(LightningAdapter.emitted_events() lists them)"
)


def _metrics(trainer: pl.Trainer) -> dict[str, Any]:
    return dict(trainer.callback_metrics)


def report_metrics(trainer: pl.Trainer, metrics: Mapping[str, Any], epoch: int, step: int) -> None:
    """Hand metrics computed outside the loop (AsyncEval's) to Lightning: they join
    ``trainer.callback_metrics`` and ``trainer.logged_metrics`` (so monitors, the progress
    bar and ``trainer.callback_metrics`` readers see them), and every logger gets
    ``log_metrics(metrics, step)`` with the step at which the evaluated weights were taken."""
    scalars = numeric_metrics(metrics)
    if not scalars:
        return
    tensors = {k: torch.tensor(v) for k, v in scalars.items()}
    trainer.callback_metrics.update(tensors)
    trainer.logged_metrics.update(tensors)
    for lg in trainer.loggers:
        lg.log_metrics(dict(scalars), step=step)


def loop_context(trainer: pl.Trainer) -> LoopContext:
    """What the Lightning loop offers services (``OnTrainBegin.loop``).

    The checkpoint is what ``Trainer.save_checkpoint`` writes, built by Lightning's own
    ``_checkpoint_connector.dump_checkpoint``: a private Lightning API, used here because
    framework knowledge lives in the adapter (services only call ``checkpoint_state``)."""

    def checkpoint_state() -> dict[str, Any]:
        return trainer._checkpoint_connector.dump_checkpoint(weights_only=False)

    def report(metrics: Mapping[str, Any], epoch: int, step: int) -> None:
        report_metrics(trainer, metrics, epoch, step)

    root = trainer.default_root_dir
    return LoopContext(
        framework="lightning",
        output_dir=str(root) if root else None,
        checkpoint_state=checkpoint_state,
        checkpoint_format="lightning",
        report_metrics=report,
        # Lightning's "possibly wrapped" model: a DistributedDataParallel under DDP.
        wrapped_model=lambda: trainer.model,
        # Lightning clips inside its optimizer closure, outside the runtime.
        gradient_clipping=(
            f"Trainer(gradient_clip_val={trainer.gradient_clip_val!r})"
            if trainer.gradient_clip_val
            else None
        ),
    )


def monitored_metrics(trainer: pl.Trainer) -> frozenset[str]:
    """The metrics Lightning's monitors read after the callbacks' ``on_train_epoch_end``:
    the ``monitor`` of every ``EarlyStopping`` and ``Checkpoint`` callback (they run after
    the other callbacks, as Lightning's "monitoring callbacks") and of every
    ``ReduceLROnPlateau`` scheduler config (stepped after them).  ``OnEpochEnd.monitored``
    carries them, so a service computing one (AsyncEval) delivers it before they decide."""
    callbacks = [*trainer.early_stopping_callbacks, *trainer.checkpoint_callbacks]
    names = {
        monitor for cb in callbacks if isinstance(monitor := getattr(cb, "monitor", None), str)
    }
    names.update(
        config.monitor
        for config in trainer.lr_scheduler_configs
        if config.reduce_on_plateau and config.monitor
    )
    return frozenset(names)


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
        self.rt = check_runtime(rt)
        self.strict_resume = check_bool("strict_resume", strict_resume, owner="LightningAdapter")
        self._last_loss: Any = None
        self._started = False

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
        # A runtime handed over without ``with`` / ``start()`` is started here and closed at
        # this stage's teardown: its services are set up before they wrap anything and torn
        # down after (a kernels service restores the modeling code it patched).
        self.rt.rank = trainer.global_rank
        self.rt.world_size = trainer.world_size
        if not self.rt.running:
            self.rt.start()
            self._started = True
        self._install_precision(trainer)
        if stage == "fit":
            self._warn_unemitted(trainer)
        self._emit(ev.OnSetup, trainer, stage=stage, model=pl_module)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._emit(ev.OnTeardown, trainer, stage=stage, model=pl_module)
        if self._started:
            self._started = False
            self.rt.close()

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
            loop=loop_context(trainer),
            # Lightning accumulates only under automatic optimization; a manual
            # training_step steps when it likes, so the loop says nothing then.
            accumulation_steps=(
                trainer.accumulate_grad_batches if pl_module.automatic_optimization else None
            ),
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
            monitored=monitored_metrics(trainer),
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
