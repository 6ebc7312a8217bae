"""A tiny but complete training loop driven through a :class:`~sakura.SakuraRuntime`.

It is the reference raw loop: it calls every coordinated call (``prepare``, ``autocast``,
``backward``, ``clip_grad_norm_``, ``optimizer_step``, ``state_dict``) and emits the
per-step, epoch, validation, checkpoint and lifecycle events in the documented order
(``docs/events.md``).  Plugin authors run their service through it; the demo uses it.
Needs torch (imported when called): ``pip install 'sakura-core[testing]'``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sakura.events import (
    OnAfterBackward,
    OnBeforeBackward,
    OnBeforeOptimizerStep,
    OnBeforeZeroGrad,
    OnEpochBegin,
    OnEpochEnd,
    OnFitBegin,
    OnFitEnd,
    OnOptimizerStep,
    OnSaveCheckpoint,
    OnSetup,
    OnTeardown,
    OnTrainBegin,
    OnTrainEnd,
    OnTrainStepBegin,
    OnTrainStepEnd,
    OnValidationBatchBegin,
    OnValidationBatchEnd,
    OnValidationBegin,
    OnValidationEnd,
    OnValidationEpochBegin,
    OnValidationEpochEnd,
)
from sakura.runtime import SakuraRuntime

__all__ = ["TESTING_EXTRA", "TinyLoopResult", "expected_event_names", "run_tiny_loop"]

TESTING_EXTRA = "sakura-core[testing]"
"""The extra that installs what the tiny loop needs (torch)."""


def _needs_torch() -> ModuleNotFoundError:
    return ModuleNotFoundError(
        "sakura.testing's tiny training loop (run_tiny_loop, the tiny_loop fixture) needs "
        f"torch, which is not installed: pip install '{TESTING_EXTRA}'",
        name="torch",
    )


@dataclass
class TinyLoopResult:
    model: Any
    optimizer: Any
    losses: list[float] = field(default_factory=list)
    val_losses: list[float] = field(default_factory=list)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    steps: int = 0


def run_tiny_loop(
    rt: SakuraRuntime,
    *,
    epochs: int = 2,
    steps_per_epoch: int = 3,
    val_batches: int = 2,
    batch_size: int = 8,
    features: int = 8,
    hidden: int = 16,
    classes: int = 4,
    lr: float = 0.1,
    clip: float | None = None,
    seed: int = 0,
    model: Any = None,
    optimizer: Any = None,
) -> TinyLoopResult:
    """Train a small MLP on fixed random data for ``epochs`` x ``steps_per_epoch`` steps.

    Deterministic for a given ``seed``.  A checkpoint dict (model, optimizer and the
    runtime's service state under ``"sakura"``) is built at every epoch end and passed
    to OnSaveCheckpoint; the list is returned.
    """
    try:
        import torch
        from torch import nn
    except ImportError as error:
        raise _needs_torch() from error

    for option, value in (
        ("epochs", epochs),
        ("steps_per_epoch", steps_per_epoch),
        ("batch_size", batch_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{option} must be a positive int, got {value!r}")
    generator = torch.Generator().manual_seed(seed)
    if model is None:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(features, hidden), nn.ReLU(), nn.Linear(hidden, classes))
    if optimizer is None:
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    data = [
        (
            torch.randn(batch_size, features, generator=generator),
            torch.randint(0, classes, (batch_size,), generator=generator),
        )
        for _ in range(steps_per_epoch)
    ]
    val_data = [
        (
            torch.randn(batch_size, features, generator=generator),
            torch.randint(0, classes, (batch_size,), generator=generator),
        )
        for _ in range(val_batches)
    ]
    loss_fn = nn.CrossEntropyLoss()
    model, optimizer = rt.prepare(model, optimizer)
    result = TinyLoopResult(model=model, optimizer=optimizer)
    emit = rt.emit
    step = 0
    emit(OnSetup, stage="fit", model=model)
    emit(OnFitBegin, model=model)
    emit(OnTrainBegin, model=model, optimizer=optimizer, train_loader=data)
    for epoch in range(epochs):
        model.train()
        emit(OnEpochBegin, step=step, epoch=epoch, model=model)
        epoch_losses = []
        for batch_idx, batch in enumerate(data):
            emit(
                OnTrainStepBegin,
                step=step,
                epoch=epoch,
                model=model,
                batch=batch,
                batch_idx=batch_idx,
            )
            inputs, targets = batch
            with rt.autocast():
                loss = loss_fn(model(inputs), targets)
            emit(OnBeforeBackward, step=step, epoch=epoch, model=model, loss=loss)
            rt.backward(loss)
            emit(OnAfterBackward, step=step, epoch=epoch, model=model, loss=loss)
            if clip is not None:
                rt.clip_grad_norm_(optimizer, clip)
            emit(OnBeforeOptimizerStep, step=step, epoch=epoch, model=model, optimizer=optimizer)
            if not rt.optimizer_step(optimizer):
                optimizer.step()
            step += 1
            emit(
                OnOptimizerStep,
                step=step,
                epoch=epoch,
                model=model,
                optimizer=optimizer,
                skipped=rt.last_step_skipped,
            )
            emit(OnBeforeZeroGrad, step=step, epoch=epoch, model=model, optimizer=optimizer)
            optimizer.zero_grad(set_to_none=True)
            detached = loss.detach()
            epoch_losses.append(detached)
            emit(
                OnTrainStepEnd,
                step=step,
                epoch=epoch,
                model=model,
                batch=batch,
                batch_idx=batch_idx,
                loss=detached,
            )
        train_loss = float(torch.stack(epoch_losses).float().mean())
        result.losses.extend(float(x) for x in epoch_losses)
        model.eval()
        emit(OnValidationBegin, step=step, epoch=epoch, model=model)
        emit(OnValidationEpochBegin, step=step, epoch=epoch, model=model)
        val_total = 0.0
        with torch.inference_mode():
            for batch_idx, (inputs, targets) in enumerate(val_data):
                emit(
                    OnValidationBatchBegin,
                    step=step,
                    epoch=epoch,
                    model=model,
                    batch=(inputs, targets),
                    batch_idx=batch_idx,
                )
                with rt.autocast():
                    val_loss = loss_fn(model(inputs), targets)
                val_total += float(val_loss)
                emit(
                    OnValidationBatchEnd,
                    step=step,
                    epoch=epoch,
                    model=model,
                    batch=(inputs, targets),
                    batch_idx=batch_idx,
                    outputs=val_loss,
                )
        metrics = {"val_loss": val_total / max(1, len(val_data))}
        result.val_losses.append(metrics["val_loss"])
        emit(OnValidationEpochEnd, step=step, epoch=epoch, model=model, metrics=metrics)
        emit(OnValidationEnd, step=step, epoch=epoch, model=model, metrics=metrics)
        emit(
            OnEpochEnd,
            step=step,
            epoch=epoch,
            model=model,
            optimizer=optimizer,
            metrics={"train_loss": train_loss, **metrics},
        )
        checkpoint = {
            "epoch": epoch,
            "global_step": step,
            "state_dict": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optimizer": optimizer.state_dict(),
            "sakura": rt.state_dict(),
        }
        emit(OnSaveCheckpoint, step=step, epoch=epoch, model=model, checkpoint=checkpoint)
        result.checkpoints.append(checkpoint)
    emit(
        OnTrainEnd,
        step=step,
        epoch=epochs - 1,
        model=model,
        metrics={"val_loss": result.val_losses[-1]},
    )
    emit(OnFitEnd, step=step, epoch=epochs - 1, model=model)
    emit(OnTeardown, stage="fit", step=step, epoch=epochs - 1, model=model)
    result.steps = step
    return result


def expected_event_names(epochs: int, steps_per_epoch: int, val_batches: int) -> list[str]:
    """The exact sequence of event names :func:`run_tiny_loop` emits."""
    names = ["OnSetup", "OnFitBegin", "OnTrainBegin"]
    for _ in range(epochs):
        names.append("OnEpochBegin")
        names += [
            "OnTrainStepBegin",
            "OnBeforeBackward",
            "OnAfterBackward",
            "OnBeforeOptimizerStep",
            "OnOptimizerStep",
            "OnBeforeZeroGrad",
            "OnTrainStepEnd",
        ] * steps_per_epoch
        names += ["OnValidationBegin", "OnValidationEpochBegin"]
        names += ["OnValidationBatchBegin", "OnValidationBatchEnd"] * val_batches
        names += ["OnValidationEpochEnd", "OnValidationEnd", "OnEpochEnd", "OnSaveCheckpoint"]
    names += ["OnTrainEnd", "OnFitEnd", "OnTeardown"]
    return names
