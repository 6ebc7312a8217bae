"""Suggestions for hook names that are not sakura hooks.

Most wrong hook names are not typos: they are the names another framework uses for the
same moment (Lightning's ``on_train_start``, the Hugging Face Trainer's ``on_step_begin``).
Plain edit distance gets those wrong, often backwards (``on_train_start`` is closest to
``on_train_step_end``; ``on_fit_start`` to ``on_fit_end``), so the framework names are
looked up first, in the tables below, and edit distance is only the fallback.

The tables are the mapping the adapters implement and that ``docs/events.md`` documents;
a test checks the three against each other and against the hook lists of the installed
``lightning.pytorch.Callback`` and ``transformers.TrainerCallback``.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping

from sakura.hookspecs import SERVICE_HOOKS

__all__ = [
    "HF_TRAINER_EVENTS",
    "LIGHTNING_HOOKS",
    "framework_alias",
    "hook_hint",
    "suggest_hook",
]

LIGHTNING_HOOKS: Mapping[str, str | None] = {
    # lightning.pytorch.Callback hook -> the sakura event hook for the same moment
    "setup": "on_setup",
    "on_fit_start": "on_fit_begin",
    "on_sanity_check_start": "on_sanity_check_begin",
    "on_sanity_check_end": "on_sanity_check_end",
    "on_train_start": "on_train_begin",
    "on_train_epoch_start": "on_epoch_begin",
    "on_train_batch_start": "on_train_step_begin",
    "on_before_backward": "on_before_backward",
    "on_after_backward": "on_after_backward",
    "on_before_optimizer_step": "on_before_optimizer_step",
    "on_before_zero_grad": "on_before_zero_grad",
    "on_train_batch_end": "on_train_step_end",
    "on_train_epoch_end": "on_epoch_end",
    "on_train_end": "on_train_end",
    "on_fit_end": "on_fit_end",
    "teardown": "on_teardown",
    "on_validation_start": "on_validation_begin",
    "on_validation_epoch_start": "on_validation_epoch_begin",
    "on_validation_batch_start": "on_validation_batch_begin",
    "on_validation_batch_end": "on_validation_batch_end",
    "on_validation_epoch_end": "on_validation_epoch_end",
    "on_validation_end": "on_validation_end",
    "on_test_start": "on_test_begin",
    "on_test_epoch_start": "on_test_epoch_begin",
    "on_test_batch_start": "on_test_batch_begin",
    "on_test_batch_end": "on_test_batch_end",
    "on_test_epoch_end": "on_test_epoch_end",
    "on_test_end": "on_test_end",
    "on_predict_start": "on_predict_begin",
    "on_predict_epoch_start": "on_predict_epoch_begin",
    "on_predict_batch_start": "on_predict_batch_begin",
    "on_predict_batch_end": "on_predict_batch_end",
    "on_predict_epoch_end": "on_predict_epoch_end",
    "on_predict_end": "on_predict_end",
    "on_save_checkpoint": "on_save_checkpoint",
    "on_load_checkpoint": "on_load_checkpoint",
    "on_exception": "on_error",
    "state_dict": None,  # not an event: the services' state travels in the checkpoint
    "load_state_dict": None,
}
"""Every ``lightning.pytorch.Callback`` hook and the sakura event hook it becomes
(``None``: no event)."""

HF_TRAINER_EVENTS: Mapping[str, str] = {
    # transformers.TrainerCallback event -> the sakura event hook for the same moment
    # (where the adapter emits several events, the one that answers the moment itself)
    "on_init_end": "on_setup",
    "on_train_begin": "on_train_begin",
    "on_epoch_begin": "on_epoch_begin",
    "on_step_begin": "on_train_step_begin",
    "on_substep_end": "on_substep_end",
    "on_pre_optimizer_step": "on_before_optimizer_step",
    "on_optimizer_step": "on_optimizer_step",
    "on_step_end": "on_train_step_end",
    "on_log": "on_log",
    "on_evaluate": "on_validation_end",
    "on_prediction_step": "on_validation_batch_end",
    "on_predict": "on_predict_end",
    "on_save": "on_save_checkpoint",
    "on_epoch_end": "on_epoch_end",
    "on_train_end": "on_train_end",
    "on_push_begin": "on_push_begin",
}
"""Every ``transformers.TrainerCallback`` event and the sakura event hook it becomes."""


def framework_alias(name: str) -> tuple[str, str] | None:
    """``(sakura hook, "Lightning's Callback.x" / "the HF TrainerCallback's x")`` when
    ``name`` is another framework's name for a sakura hook, else None."""
    target = LIGHTNING_HOOKS.get(name)
    if target is not None:
        return target, f"Lightning's Callback.{name}"
    target = HF_TRAINER_EVENTS.get(name)
    if target is not None:
        return target, f"transformers.TrainerCallback.{name}"
    return None


def suggest_hook(name: str, valid: Iterable[str] | None = None) -> str | None:
    """The sakura hook ``name`` most likely means: the hook a Lightning or Hugging Face
    name maps to, else the closest valid name by spelling, else None.

    ``valid`` defaults to every service hook (:data:`sakura.hookspecs.SERVICE_HOOKS`).
    """
    candidates = list(SERVICE_HOOKS if valid is None else valid)
    alias = framework_alias(name)
    if alias is not None and alias[0] in candidates:
        return alias[0]
    matches = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return matches[0] if matches else None


def hook_hint(name: str, valid: Iterable[str] | None = None) -> str:
    """The message suffix for an unknown hook name: ``"; did you mean 'x'?"`` and, for
    another framework's name, which one it is (``"(Lightning's Callback.on_train_start
    is sakura's on_train_begin)"``); empty when nothing is close."""
    hint = suggest_hook(name, valid)
    if hint is None:
        return ""
    alias = framework_alias(name)
    if alias is not None and alias[0] == hint:
        return f"; did you mean {hint!r}? ({alias[1]} is sakura's {hint})"
    return f"; did you mean {hint!r}?"
