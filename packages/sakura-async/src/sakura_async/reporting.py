"""Where asynchronous evaluation results go besides the ``OnValidationEnd`` event: the
framework's own metrics, so that loggers, progress bars and the trainer's state see them.

The loop says where: an adapter publishes ``report_metrics`` on ``OnTrainBegin.loop`` (a
:class:`sakura.loop.LoopContext`), and ``AsyncEval(report_to="auto")`` hands each result to
it as ``report(metrics, epoch, step)``, with the epoch and the step at which the evaluated
weights were taken.  What that does is the adapter's business (Lightning's adapter updates
``trainer.callback_metrics`` and calls every logger; the Hugging Face adapter appends to
``state.log_history`` and, under ``SakuraTrainer``, calls the callbacks' ``on_log``; a raw
loop passes its own callable to ``DDPAdapter(report_metrics=...)``).  Nothing here knows a
framework.  ``report_to`` may also be a callable of that signature, or None/``"none"``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from sakura.options import option_error

__all__ = ["Reporter", "check_report_to", "make_reporter"]

Reporter = Callable[[Mapping[str, Any], int, int], None]


def check_report_to(value: Any) -> Any:
    if value is None or (isinstance(value, str) and value in ("auto", "none")):
        return value
    if callable(value) and not isinstance(value, type):
        return value
    raise option_error(
        "report_to",
        value,
        "'auto' (the loop's own metric reporting, which its adapter publishes), 'none' or "
        "None, or a callable report(metrics, epoch, step)",
        owner="AsyncEval",
    )


def make_reporter(target: Any, loop_reporter: Reporter | None) -> Reporter | None:
    """The reporter for ``report_to=target``: the loop's (``"auto"``), the callable itself,
    or None (no reporting)."""
    if target == "auto":
        return loop_reporter
    if target is None or target == "none":
        return None
    return target  # type: ignore[no-any-return]
