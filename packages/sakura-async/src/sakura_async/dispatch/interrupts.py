"""What one Ctrl+C means for tasks in flight: a bounded wait, then they are abandoned.

A ``KeyboardInterrupt`` that reaches a wait on a :class:`~sakura_async.dispatch.TaskFuture`
(``result()``, ``exception()``, ``Dispatcher.drain``/``close``), or that is being handled
while such a wait starts (the runtime draining its services on the way out of a ``with``
block), opens an *interrupt*:

* every task submitted before it may still finish within its dispatcher's
  ``interrupt_grace`` (a checkpoint write in flight completes; the previous checkpoint stays
  loadable either way, because checkpoints are written atomically);
* after that, waits on those tasks stop and the tasks fail with
  :class:`~sakura_async.errors.TaskInterruptedError`;
* a second Ctrl+C within the grace ends the grace at once;
* tasks submitted after the interrupt (a program that caught the ``KeyboardInterrupt`` and
  went on) are not affected.
"""

from __future__ import annotations

import sys
import threading
import time

__all__ = ["deadline_for", "note", "note_pending", "reset"]

_lock = threading.Lock()
_seen: list[BaseException] = []
_start: float | None = None
_final: float | None = None
_window = 10.0
"""A new KeyboardInterrupt within this many seconds of the first is a second press."""


def note(exc: BaseException | None) -> None:
    """Record ``exc`` if it is a KeyboardInterrupt not seen before."""
    global _start, _final
    if not isinstance(exc, KeyboardInterrupt):
        return
    with _lock:
        if any(seen is exc for seen in _seen):
            return
        _seen.append(exc)
        del _seen[:-8]
        now = time.monotonic()
        if _start is not None and _final is None and now < _start + _window:
            _final = now  # the second press: stop waiting now
        else:
            _start, _final = now, None


def note_pending() -> None:
    """Record the KeyboardInterrupt being handled by this thread, if any (a wait that
    starts inside ``__exit__`` or an ``except`` block of an interrupt), and the one that
    ended the program (in ``atexit`` handlers)."""
    note(sys.exc_info()[1])
    note(getattr(sys, "last_value", None))


def widen(grace: float) -> None:
    """Make the second-press window at least ``grace`` seconds (the longest grace of any
    dispatcher)."""
    global _window
    with _lock:
        _window = max(_window, grace)


def deadline_for(created: float, grace: float) -> float | None:
    """When a wait on a task created at ``created`` (``time.monotonic()``) must stop, or
    None while no interrupt concerns it."""
    with _lock:
        if _start is None or created >= _start:
            return None
        if _final is not None:
            return _final
        return _start + grace


def reset() -> None:
    """Forget every interrupt (for tests)."""
    global _start, _final
    with _lock:
        _seen.clear()
        _start = _final = None
