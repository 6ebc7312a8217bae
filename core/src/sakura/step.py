"""What a service's ``optimizer_step`` hook can answer besides True and False.

A service that owns the optimizer step returns True when it performed it, and
:data:`STEP_SKIPPED` when it deliberately did not (a loss scaler that found inf/NaN
gradients, for instance).  Both are truthy, so a loop written as
``if not rt.optimizer_step(optimizer): optimizer.step()`` is right either way; the runtime
records the difference in ``rt.last_step_skipped`` so that loops and adapters can do what
the frameworks do after an overflow: leave the learning-rate scheduler where it is
(the Hugging Face Trainer checks ``accelerator.optimizer_step_was_skipped``).
"""

from __future__ import annotations

from typing import Final

__all__ = ["STEP_SKIPPED", "StepSkipped"]


class StepSkipped:
    """The type of :data:`STEP_SKIPPED` (a singleton; truthy: the step was owned)."""

    __slots__ = ()
    _instance: StepSkipped | None = None

    def __new__(cls) -> StepSkipped:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __bool__(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "sakura.STEP_SKIPPED"

    def __reduce__(self) -> str:
        return "STEP_SKIPPED"  # pickles as a reference to this module's singleton


STEP_SKIPPED: Final = StepSkipped()
"""Returned by a service's ``optimizer_step`` that owned the step and skipped it."""
