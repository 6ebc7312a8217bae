"""``wrap_model``, ``wrap_optimizer`` and ``autocast`` where the Trainer offers no hook.

Under the stock Trainer a callback cannot hand the Trainer a new model or optimizer, so the
services' wraps must work in place; :class:`WrapRecord` applies them and remembers what was
wrapped by which services, so that train start can tell whether the model the Trainer
trains went through every ``wrap_model`` (SakuraTrainer records its own wraps in it too).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

# accelerate ships no type information (no py.typed).
from accelerate.utils import extract_model_from_parallel  # type: ignore[import-untyped]

from sakura.runtime import SakuraRuntime
from sakura_adapters.hf.checks import USE_SAKURA_TRAINER, SakuraTrainerRequiredError
from sakura_adapters.hf.optimizer import service_optimizer

__all__ = ["WrapRecord", "patch_autocast"]

_AUTOCAST_MARK = "_sakura_autocast_runtime"


class WrapRecord:
    """Which model and optimizer went through which services' ``wrap_*`` (weakly held)."""

    def __init__(self, rt: SakuraRuntime) -> None:
        self.rt = rt
        self._model_ref: Callable[[], Any] | None = None
        self._model_wrappers: tuple[str, ...] = ()
        self._optimizer_ref: Callable[[], Any] | None = None
        self._optimizer_wrappers: tuple[str, ...] = ()

    def record_model(self, model: Any, names: tuple[str, ...]) -> None:
        """``model`` is what the ``wrap_model`` of the services ``names`` produced."""
        self._model_ref = weakref.ref(model)
        self._model_wrappers = names

    def wrap_model_in_place(self, model: Any) -> None:
        """Stock Trainer: apply ``wrap_model``; only in-place changes can reach the Trainer."""
        names = self.rt.implements("wrap_model")
        if not names or model is None:
            return
        wrapped = self.rt.wrap_model(model)
        if wrapped is not model:
            raise SakuraTrainerRequiredError(
                f"the sakura service(s) {list(names)} implement wrap_model and returned a new "
                f"{type(wrapped).__name__} instead of modifying the {type(model).__name__} in "
                f"place; the stock transformers.Trainer would keep training the unwrapped model "
                f"and a callback cannot hand it the new one; {USE_SAKURA_TRAINER}"
            )
        self.record_model(model, names)

    def check_model_wrapped(self, model: Any, *, sakura_trainer: bool) -> None:
        """At train start: the model the Trainer trains went through every ``wrap_model``."""
        names = self.rt.implements("wrap_model")
        if not names:
            return
        current = self._model_ref() if self._model_ref is not None else None
        same_model = current is not None and (
            current is model
            or extract_model_from_parallel(model, keep_torch_compile=False) is current
        )
        if names == self._model_wrappers and (same_model or sakura_trainer):
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
            if sakura_trainer
            else f"install every service before building the Trainer, or {USE_SAKURA_TRAINER}"
        )
        raise SakuraTrainerRequiredError(
            f"{why}; wrap_model of {list(names)} can only be applied when the Trainer is "
            f"built; {fix}"
        )

    def wrap_optimizer_in_place(self, optimizer: Any) -> None:
        """Stock Trainer, at train start: apply ``wrap_optimizer`` in place (once per
        optimizer and set of services)."""
        names = self.rt.implements("wrap_optimizer")
        if not names or optimizer is None:
            return
        inner = service_optimizer(optimizer)
        done = self._optimizer_ref() if self._optimizer_ref is not None else None
        if done is inner and names == self._optimizer_wrappers:
            return
        wrapped = self.rt.wrap_optimizer(inner)
        if wrapped is not inner:
            raise SakuraTrainerRequiredError(
                f"the sakura service(s) {list(names)} implement wrap_optimizer and returned a new "
                f"{type(wrapped).__name__} instead of modifying the {type(inner).__name__} in "
                f"place; a callback cannot hand the stock transformers.Trainer a new optimizer; "
                f"{USE_SAKURA_TRAINER}"
            )
        self._optimizer_ref = weakref.ref(inner)
        self._optimizer_wrappers = names


def patch_autocast(rt: SakuraRuntime, model: Any) -> None:
    """Stock Trainer: enter ``rt.autocast()`` around every forward of ``model``.

    The Trainer offers a callback no autocast extension point, so the model's ``forward``
    is wrapped in place, the way accelerate applies its own mixed precision.  The wrapper
    asks the runtime for its context on every call (a service installed or removed later
    is honoured); ``functools.wraps`` keeps the signature the Trainer inspects.  Done once
    per model and runtime.
    """
    if model is None or not rt.implements("autocast"):
        return
    if model.__dict__.get(_AUTOCAST_MARK) is rt:
        return
    original = model.forward

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with rt.autocast():
            return original(*args, **kwargs)

    model.forward = forward
    model.__dict__[_AUTOCAST_MARK] = rt
