"""Where asynchronous evaluation results go besides the ``OnValidationEnd`` event: the
framework's own metrics, so that loggers, progress bars and ``trainer.state`` see them.

* Lightning: ``trainer.callback_metrics`` and ``trainer.logged_metrics`` are updated and
  every logger in ``trainer.loggers`` gets ``log_metrics(metrics, step)``, with the step at
  which the evaluated weights were taken.  The trainer is found from the LightningModule on
  the events (``model.trainer``), so nothing needs configuring.
* Hugging Face: an entry ``{**metrics, "epoch": <epochs completed>, "step": <step>}`` is
  appended to ``trainer.state.log_history`` and the Trainer's callbacks get ``on_log`` (so
  ``report_to`` integrations see it).  A ``TrainerCallback`` event does not carry the
  Trainer, so pass it: ``AsyncEval(..., report_to=trainer)`` or ``async_eval.attach(trainer)``.
* Anything else: a callable ``report(metrics, epoch, step)``.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping
from typing import Any

from sakura.options import option_error

__all__ = [
    "Reporter",
    "lightning_trainer_of",
    "make_reporter",
    "numeric_metrics",
    "output_dir_of",
]

logger = logging.getLogger("sakura.async")

Reporter = Callable[[Mapping[str, Any], int, int], None]


def numeric_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The metrics that loggers accept: numbers and one-element tensors, as floats."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if isinstance(value, (bool, int, float)):
            out[key] = float(value)
        elif hasattr(value, "numel") and value.numel() == 1:
            out[key] = float(value.item())
    return out


def lightning_trainer_of(model: Any) -> Any:
    """The Lightning Trainer a LightningModule is attached to, else None."""
    pl = sys.modules.get("lightning.pytorch") or sys.modules.get("pytorch_lightning")
    if pl is None or not isinstance(model, pl.LightningModule):
        return None
    try:
        return model.trainer
    except RuntimeError:  # not attached
        return None


def _is_lightning_trainer(obj: Any) -> bool:
    pl = sys.modules.get("lightning.pytorch") or sys.modules.get("pytorch_lightning")
    return pl is not None and isinstance(obj, pl.Trainer)


def _is_hf_trainer(obj: Any) -> bool:
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(obj, transformers.Trainer)


def _is_hf_state(obj: Any) -> bool:
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(obj, transformers.TrainerState)


def is_hf_target(obj: Any) -> bool:
    """A transformers Trainer or TrainerState."""
    return _is_hf_trainer(obj) or _is_hf_state(obj)


def output_dir_of(trainer: Any) -> str | None:
    """A framework trainer's output directory: a Lightning Trainer's ``default_root_dir``,
    a Hugging Face Trainer's ``args.output_dir``; None for anything else (a TrainerState
    does not know it)."""
    if trainer is None:
        return None
    if _is_lightning_trainer(trainer):
        root = getattr(trainer, "default_root_dir", None)
    elif _is_hf_trainer(trainer):
        root = getattr(getattr(trainer, "args", None), "output_dir", None)
    else:
        return None
    return str(root) if root else None


def report_lightning(trainer: Any, metrics: Mapping[str, Any], epoch: int, step: int) -> None:
    import torch

    scalars = numeric_metrics(metrics)
    if not scalars:
        return
    tensors = {k: torch.tensor(v) for k, v in scalars.items()}
    trainer.callback_metrics.update(tensors)
    trainer.logged_metrics.update(tensors)
    for lg in trainer.loggers:
        lg.log_metrics(dict(scalars), step=step)


def report_hf(trainer_or_state: Any, metrics: Mapping[str, Any], epoch: int, step: int) -> None:
    entry: dict[str, Any] = dict(numeric_metrics(metrics))
    entry["epoch"] = float(epoch + 1)  # HF counts epochs completed
    entry["step"] = step
    if _is_hf_trainer(trainer_or_state):
        trainer = trainer_or_state
        trainer.state.log_history.append(entry)
        trainer.callback_handler.on_log(
            trainer.args, trainer.state, trainer.control, dict(numeric_metrics(metrics))
        )
    else:
        trainer_or_state.log_history.append(entry)


def check_report_to(value: Any) -> Any:
    if value is None or (isinstance(value, str) and value in ("auto", "none")):
        return value
    if _is_lightning_trainer(value) or _is_hf_trainer(value) or _is_hf_state(value):
        return value
    if callable(value):
        return value
    raise option_error(
        "report_to",
        value,
        "'auto', 'none' or None, a lightning.Trainer, a transformers.Trainer or TrainerState, "
        "or a callable report(metrics, epoch, step)",
        owner="AsyncEval",
    )


def make_reporter(target: Any) -> Reporter | None:
    """A reporter for an explicit target (not 'auto'), or None for no reporting."""
    if target is None or (isinstance(target, str) and target in ("none", "auto")):
        return None
    if _is_lightning_trainer(target):
        return lambda m, e, s: report_lightning(target, m, e, s)
    if _is_hf_trainer(target) or _is_hf_state(target):
        return lambda m, e, s: report_hf(target, m, e, s)
    return target  # type: ignore[no-any-return]
