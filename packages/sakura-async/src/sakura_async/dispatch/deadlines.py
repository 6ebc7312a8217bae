"""One background thread that fails tasks whose ``task_timeout`` has passed.

Every dispatcher of the process shares it: a heap of ``(deadline, future)``; the thread
sleeps until the earliest deadline (or until a new, earlier one arrives).  A future that
finishes in time is simply skipped when its deadline comes up; the heap holds futures
weakly, so a finished task's result is not kept alive until its deadline.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["watch"]

_order = itertools.count()
_heap: list[tuple[float, int, Any, Callable[[Any], None]]] = []
_wake = threading.Condition()
_thread: threading.Thread | None = None


def watch(future: Any, seconds: float, expire: Callable[[Any], None]) -> None:
    """Call ``expire(future)`` once ``seconds`` have passed, unless ``future`` is done."""
    global _thread
    deadline = time.monotonic() + seconds
    with _wake:
        heapq.heappush(_heap, (deadline, next(_order), weakref.ref(future), expire))
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_run, name="sakura-task-deadlines", daemon=True)
            _thread.start()
        _wake.notify()


def _run() -> None:
    while True:
        with _wake:
            while not _heap or _heap[0][0] > time.monotonic():
                _wake.wait(None if not _heap else _heap[0][0] - time.monotonic())
            _, _, ref, expire = heapq.heappop(_heap)
        future = ref()
        if future is not None and not future.done():
            try:
                expire(future)
            except Exception:
                import logging

                logging.getLogger("sakura.async").exception("sakura: a task timeout failed")
