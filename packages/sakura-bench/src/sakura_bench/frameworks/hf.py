"""``hf-trainer``: a vanilla ``transformers.Trainer`` on an HF-shaped workload, and the same
Trainer with sakura's ``HFAdapter`` (``SakuraTrainer`` when a service owns part of the
step: loss scaling, unscaling, the optimizer step, or wraps the optimizer).

Both use the same arguments: the workload's optimizer with a constant learning rate, its
batch sizes and gradient clipping, evaluation every epoch (``eval_strategy="epoch"``), the
training loss logged once per epoch, no checkpoints, no reporting integrations.  With an
evaluating service (``async_eval``) the Trainer does not evaluate; the service reports each
epoch's metrics to the Trainer's log history.  Metrics are renamed from the Trainer's
``eval_*`` to sakura-bench's ``val_*``.
"""

from __future__ import annotations

from typing import Any

from sakura_bench.framework import Framework, TrialContext
from sakura_bench.workload import Workload

__all__ = ["HFTrainerFramework", "rename_hf_metrics"]

_HF_BOOKKEEPING = ("runtime", "samples_per_second", "steps_per_second", "epoch")


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            "--framework hf-trainer needs transformers: pip install 'sakura-bench[hf]'"
        ) from exc
    return transformers


def rename_hf_metrics(metrics: dict[str, Any], workload: Workload) -> dict[str, float]:
    """``eval_loss`` -> ``val_loss``, ``eval_acc`` -> ``val_acc``; timing entries dropped."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if not key.startswith("eval_") or key[5:] in _HF_BOOKKEEPING:
            continue
        out["val_" + key[5:]] = float(value)
    return workload.complete_metrics(out)


class HFTrainerFramework(Framework):
    description = "transformers.Trainer (HFAdapter / SakuraTrainer for the sakura runner)"

    def incompatibility(self, workload: type[Workload]) -> str | None:
        if not workload.hf_shaped:
            return (
                "it needs an HF-shaped workload (make_model() returns a model whose "
                "forward(**batch) returns an output with .loss; batches are dicts with a "
                "'labels' key)"
            )
        return None

    def run(self, ctx: TrialContext) -> None:
        transformers = _transformers()
        from sakura_bench.batches import DictDataset

        w, rec = ctx.workload, ctx.recorder
        model = w.make_model()
        ctx.model = model
        optimizer = w.make_optimizer(model)
        has_metrics = type(w).hf_metrics is not Workload.hf_metrics
        args = transformers.TrainingArguments(
            output_dir=str(ctx.output_dir or ctx.workdir / "hf"),
            num_train_epochs=ctx.epochs,
            per_device_train_batch_size=w.batch_size,
            per_device_eval_batch_size=w.eval_batch_size,
            eval_strategy="epoch" if ctx.loop_evaluates else "no",
            save_strategy="no",
            logging_strategy="epoch",
            report_to="none",
            lr_scheduler_type="constant",
            max_grad_norm=w.grad_clip or 0.0,
            seed=w.seed,
            data_seed=w.seed,
            use_cpu=ctx.device.type != "cuda",
            dataloader_num_workers=0,
            dataloader_pin_memory=ctx.device.type == "cuda",
            disable_tqdm=True,
            prediction_loss_only=not has_metrics,
            remove_unused_columns=False,
        )
        timers = _timers(transformers, rec, w)
        callbacks: list[Any] = [timers[0]]
        trainer_cls = transformers.Trainer
        kwargs: dict[str, Any] = {}
        if ctx.runtime is not None:
            from sakura_adapters.hf import HFAdapter, SakuraTrainer

            callbacks.append(HFAdapter(ctx.runtime))
            # A service that owns part of the step, or that replaces the optimizer
            # (offload_adamw's wrap_optimizer returns a new one, which a callback cannot
            # hand the stock Trainer), needs SakuraTrainer.
            if any(
                ctx.runtime.implements(call)
                for call in ("wrap_loss", "unscale_gradients", "optimizer_step", "wrap_optimizer")
            ):
                trainer_cls = SakuraTrainer
                kwargs["runtime"] = ctx.runtime
        callbacks.append(timers[1])
        if has_metrics:
            kwargs["compute_metrics"] = lambda p: w.hf_metrics(p.predictions, p.label_ids)
            kwargs["preprocess_logits_for_metrics"] = lambda logits, labels: logits.argmax(-1)
        trainer = trainer_cls(
            model=model,
            args=args,
            train_dataset=DictDataset(ctx.train_split),
            eval_dataset=DictDataset(ctx.eval_split) if ctx.loop_evaluates else None,
            optimizers=(optimizer, None),
            callbacks=callbacks,
            **kwargs,
        )
        # The Trainer prints every log dict when tqdm is off; the harness reports instead.
        trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
        for service in ctx.eval_services:
            attach = getattr(service, "attach", None)
            if callable(attach):
                attach(trainer)
        rec.train_begin()
        trainer.train()
        rec.train_end()


def _timers(transformers: Any, rec: Any, workload: Workload) -> tuple[Any, Any]:
    """Callbacks before and after the adapter.  The Trainer calls ``on_epoch_end``, then
    logs (``on_log``) and evaluates (``on_evaluate``) when its strategies say so."""

    class Start(transformers.TrainerCallback):  # type: ignore[misc]
        epoch = 0
        evaluating = False

        def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            rec.epoch_begin(self.epoch)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            rec.step()

        def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            rec.train_phase_end(None)
            rec.eval_begin()
            self.evaluating = True

        def on_log(
            self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any
        ) -> None:
            if logs and "loss" in logs and rec.epochs:
                rec.epochs[-1].train_loss = float(logs["loss"])

        def on_evaluate(
            self, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any
        ) -> None:
            if self.evaluating:
                rec.eval_end(rename_hf_metrics(dict(metrics or {}), workload))
                self.evaluating = False
                rec.epoch_end(self.epoch)
                self.epoch += 1

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            rec.finish_begin()

    class End(transformers.TrainerCallback):  # type: ignore[misc]
        def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if args.eval_strategy == "no" or str(args.eval_strategy).endswith("NO"):
                rec.eval_end(None)
                start.evaluating = False
                rec.epoch_end(start.epoch)
                start.epoch += 1

    start = Start()
    return start, End()
