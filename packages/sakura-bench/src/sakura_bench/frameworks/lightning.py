"""``lightning``: the workload in a ``LightningModule`` under a vanilla ``lightning.Trainer``,
and the same Trainer with sakura's ``LightningAdapter`` callback.

Both runs use the same Trainer settings (one device, no logger, no checkpointing, no
progress bar, no sanity check, Lightning's own ``inference_mode`` validation) and the same
timing callbacks.  With an evaluating service (``async_eval``) the Trainer gets no
validation data: the service evaluates each epoch's weights and reports the metrics to
the Trainer (``trainer.callback_metrics``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from sakura_bench.framework import Framework, TrialContext

__all__ = ["LightningFramework"]


def _lightning() -> Any:
    try:
        import lightning.pytorch as pl
    except ImportError as exc:
        raise ImportError(
            "--framework lightning needs lightning: pip install 'sakura-bench[lightning]'"
        ) from exc
    return pl


class LightningFramework(Framework):
    description = "lightning.Trainer (LightningAdapter for the sakura runner)"

    def run(self, ctx: TrialContext) -> None:
        pl = _lightning()
        w, rec = ctx.workload, ctx.recorder
        module = _make_module(pl, w, w.make_model())
        ctx.model = module.bench_model
        train = w.train_batches(ctx.train_split)
        evals = w.eval_batches(ctx.eval_split) if ctx.loop_evaluates else None
        start, end = _timers(pl, rec)
        callbacks: list[Any] = [start]
        if ctx.runtime is not None:
            from sakura_adapters.lightning import LightningAdapter

            callbacks.append(LightningAdapter(ctx.runtime))
        callbacks.append(end)
        trainer = pl.Trainer(
            max_epochs=ctx.epochs,
            accelerator="gpu" if ctx.device.type == "cuda" else "cpu",
            devices=[ctx.device.index or 0] if ctx.device.type == "cuda" else 1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            gradient_clip_val=w.grad_clip,
            use_distributed_sampler=False,
            limit_val_batches=None if evals is not None else 0,
            callbacks=callbacks,
            default_root_dir=str(ctx.output_dir or ctx.workdir),
        )
        rec.train_begin()
        trainer.fit(module, train_dataloaders=train, val_dataloaders=evals)
        rec.train_end()


def _make_module(pl: Any, workload: Any, model: torch.nn.Module) -> Any:
    class BenchModule(pl.LightningModule):  # type: ignore[misc]
        """The workload's model, loss, evaluation sums and optimizer for Lightning."""

        def __init__(self) -> None:
            super().__init__()
            self.bench_model = model
            self.loss_sum: torch.Tensor | None = None
            self.steps = 0
            self.totals: dict[str, torch.Tensor] = {}
            self.last_eval: dict[str, float] | None = None

        def on_train_epoch_start(self) -> None:
            self.loss_sum = torch.zeros((), device=self.device)
            self.steps = 0

        def training_step(self, batch: Mapping[str, Any], batch_idx: int) -> torch.Tensor:
            loss = workload.loss(self.bench_model, batch)
            self.loss_sum = loss.detach() + (self.loss_sum if self.loss_sum is not None else 0)
            self.steps += 1
            return loss  # type: ignore[no-any-return]

        def epoch_train_loss(self) -> float | None:
            if self.loss_sum is None or not self.steps:
                return None
            return float(self.loss_sum / self.steps)

        def on_validation_epoch_start(self) -> None:
            self.totals = {}

        def validation_step(self, batch: Mapping[str, Any], batch_idx: int) -> None:
            for key, value in workload.eval_batch(self.bench_model, batch).items():
                value = value.detach().to(torch.float64)
                self.totals[key] = self.totals[key] + value if key in self.totals else value

        def on_validation_epoch_end(self) -> None:
            metrics = workload.eval_metrics(self.totals)
            self.last_eval = metrics
            self.log_dict(metrics)

        def configure_optimizers(self) -> Any:
            return workload.make_optimizer(self.bench_model)

    return BenchModule()


def _timers(pl: Any, rec: Any) -> tuple[Any, Any]:
    """Two callbacks around the adapter: the first closes the training phase of an epoch,
    the second closes the epoch after the adapter's ``OnEpochEnd`` (where an evaluating
    service snapshots the weights)."""

    class EpochStart(pl.Callback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.in_train_phase = False

        def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
            rec.epoch_begin(trainer.current_epoch)
            self.in_train_phase = True

        def on_train_batch_end(self, *args: Any) -> None:
            rec.step()

        def _close_train_phase(self, module: Any) -> None:
            if self.in_train_phase:
                rec.train_phase_end(module.epoch_train_loss())
                self.in_train_phase = False

        def on_validation_start(self, trainer: Any, module: Any) -> None:
            if trainer.training or self.in_train_phase:
                self._close_train_phase(module)
                rec.eval_begin()

        def on_validation_end(self, trainer: Any, module: Any) -> None:
            rec.eval_end(module.last_eval)

        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            if self.in_train_phase:  # no validation ran: an evaluating service follows
                self._close_train_phase(module)
                rec.eval_begin()
                end.pending = True

        def on_train_end(self, trainer: Any, module: Any) -> None:
            rec.finish_begin()

    class EpochEnd(pl.Callback):  # type: ignore[misc]
        pending = False

        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            if self.pending:
                rec.eval_end(None)
                self.pending = False
            rec.epoch_end(trainer.current_epoch)

    end = EpochEnd()
    return EpochStart(), end
