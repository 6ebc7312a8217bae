"""Running a task on a worker and turning its outcome into a message, and back."""

from __future__ import annotations

import time
import traceback
from typing import Any

from sakura_async.errors import RemoteTaskError
from sakura_async.wire.serialize import Decoder, Encoder

__all__ = ["decode_outcome", "run_task"]

_RESULT_ENCODER = Encoder(placer=None)


def run_task(body: Any, decoder: Decoder) -> list[Any]:
    """Decode ``(fn, args, kwargs)``, run it, encode the outcome
    ``(ok, value_or_exception, traceback_text, exception_type, run_seconds)``.  Never raises
    (except KeyboardInterrupt/SystemExit): every failure becomes an error outcome."""
    t0 = time.perf_counter()
    try:
        fn, args, kwargs = decoder.decode(body)
        t0 = time.perf_counter()
        value = fn(*args, **kwargs)
        outcome: tuple[Any, ...] = (True, value, "", "")
    except Exception as exc:
        outcome = (
            False,
            exc,
            traceback.format_exc(),
            f"{type(exc).__module__}.{type(exc).__qualname__}",
        )
    run_s = time.perf_counter() - t0
    try:
        return _RESULT_ENCODER.encode((*outcome, run_s))
    except Exception as exc:
        if outcome[0]:
            message = (
                f"the task's result ({type(outcome[1]).__name__}) could not be pickled: {exc!r}"
            )
            fallback: tuple[Any, ...] = (False, None, message, "pickle.PicklingError", run_s)
        else:
            fallback = (False, None, outcome[2], outcome[3], run_s)
        return _RESULT_ENCODER.encode(fallback)


def decode_outcome(body: Any, where: str) -> tuple[bool, Any, float]:
    """``(ok, value_or_exception, run_seconds)`` from a RESULT body; the worker's traceback
    is attached to the exception as a note (Python >= 3.11) or carried by a
    RemoteTaskError."""
    try:
        ok, value, tb_text, type_name, run_s = Decoder().decode(body)
    except BaseException as exc:
        # here, or unpickling it raises SystemExit: fail the task, never the reader thread
        return (
            False,
            RemoteTaskError(f"the result from {where} could not be unpickled: {exc!r}"),
            0.0,
        )
    if ok:
        return True, value, run_s
    if isinstance(value, BaseException):
        if hasattr(value, "add_note") and tb_text:
            value.add_note(f"raised in {where}:\n{tb_text.rstrip()}")
        return False, value, run_s
    return (
        False,
        RemoteTaskError(
            f"task failed in {where} with {type_name}:\n{tb_text.rstrip()}", remote_type=type_name
        ),
        run_s,
    )
