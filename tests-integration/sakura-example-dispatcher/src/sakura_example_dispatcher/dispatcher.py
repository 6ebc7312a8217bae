"""JournalDispatcher: tasks run one at a time on a background thread, each one journaled.

A run that evaluates and checkpoints in the background leaves no trace of that work by
default. This dispatcher keeps one: every task is logged (logger
``sakura_example_dispatcher``) and, with ``journal=PATH``, appended to that file as one
JSON line saying which task it was, how it ended and how long it waited and ran.

It is written against the public dispatcher contract of sakura-async only: subclass
``Dispatcher``, implement ``start_task``, ``handle_timeout`` and ``close_resources``, and
complete each task's future with ``mark_submitted`` and ``settle``.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from sakura.options import option_error
from sakura_async.dispatch import Dispatcher, TaskFuture
from sakura_async.dispatch.base import DEFAULT_INTERRUPT_GRACE, DEFAULT_TASK_TIMEOUT, run_timed

__all__ = ["JournalDispatcher"]

logger = logging.getLogger("sakura_example_dispatcher")

_Task = tuple[TaskFuture, Callable[..., Any], tuple[Any, ...], dict[str, Any]]

_JOIN_S = 5.0
"""How long ``close()`` waits for the (idle) worker thread to exit."""


class _Worker:
    """The background thread: takes tasks from the queue in order until it reads the stop
    marker (None) or is retired because its task timed out (a fresh worker replaces it)."""

    def __init__(self, dispatcher: JournalDispatcher, number: int) -> None:
        self.dispatcher = dispatcher
        self.tasks = dispatcher._tasks
        self.retired = False
        self.current: TaskFuture | None = None
        # A daemon thread: a task stuck forever never keeps the interpreter from exiting.
        self.thread = threading.Thread(target=self._loop, name=f"journal-{number}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.retired:
            task = self.tasks.get()
            if task is None:
                return
            future, fn, args, kwargs = task
            if future.done():  # failed before it could start (closed without waiting)
                self.dispatcher._write(future, "skipped", None, None)
                continue
            self.current = future
            started = time.perf_counter()
            # catch=BaseException: this thread must never die with a future left pending.
            ok, value, run_s = run_timed(fn, args, kwargs, catch=BaseException)
            self.current = None
            if ok:
                won = future.settle(result=value, run_s=run_s, started=started)
            else:
                won = future.settle(error=value, run_s=run_s, started=started)
            # settle() returns False when the future had already failed (timed out, or
            # closed without waiting): the outcome came too late and is dropped.
            outcome = ("ok" if ok else "error") if won else "late"
            self.dispatcher._write(future, outcome, None if ok else value, run_s)


class JournalDispatcher(Dispatcher):
    """Run tasks one at a time, in submission order, on a background thread, and journal
    each one.

    Args:
        journal: a file to append one JSON line per task to (``task``, ``name``,
            ``outcome``: ``ok``, ``error``, ``late`` (finished after it had timed out or the
            dispatcher was closed) or ``skipped`` (never started), ``error``: the exception
            type or null, ``queued_s``, ``run_s``); None: log only.
        max_pending, task_timeout, interrupt_grace: see sakura_async's ``Dispatcher``.
    """

    kind = "journal"

    def __init__(
        self,
        journal: str | os.PathLike[str] | None = None,
        *,
        max_pending: int = 2,
        task_timeout: float | None = DEFAULT_TASK_TIMEOUT,
        interrupt_grace: float = DEFAULT_INTERRUPT_GRACE,
    ) -> None:
        super().__init__(
            max_pending=max_pending, task_timeout=task_timeout, interrupt_grace=interrupt_grace
        )
        if journal is not None and (not isinstance(journal, (str, os.PathLike)) or not journal):
            raise option_error(
                "journal",
                journal,
                "a file path (str or os.PathLike) or None",
                owner="JournalDispatcher",
            )
        self.journal: str | None = None if journal is None else os.path.abspath(journal)
        # Unbounded as a queue, bounded in fact: the base class lets at most max_pending
        # tasks be unfinished, and submit() blocks beyond that.
        self._tasks: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._worker: _Worker | None = None
        self._workers_made = 0
        self._worker_lock = threading.Lock()
        self._write_lock = threading.Lock()

    def start(self) -> JournalDispatcher:
        """Start the worker thread now rather than at the first task."""
        self.check_open()
        self._ensure_worker()
        return self

    # --- the dispatcher contract ---------------------------------------------------------

    def start_task(
        self,
        future: TaskFuture,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        self._ensure_worker()
        future.mark_submitted()  # before the worker can see it, so the timings are right
        self._tasks.put((future, fn, args, kwargs))

    def handle_timeout(self, future: TaskFuture) -> None:
        # Python cannot stop a thread: retire the one stuck in the call (it exits if the
        # call ever returns) and let a fresh one take the next tasks.
        with self._worker_lock:
            worker = self._worker
            if worker is not None and worker.current is future:
                worker.retired = True
                self._worker = None
        if not self.closed:
            self._ensure_worker()

    def close_resources(self, wait: bool) -> None:
        with self._worker_lock:
            worker, self._worker = self._worker, None
        if worker is None:
            return
        self._tasks.put(None)  # the worker exits once it reads it
        if wait:  # drained already: the worker is idle and exits at once
            worker.thread.join(timeout=_JOIN_S)

    # --- internals ------------------------------------------------------------------------

    def _ensure_worker(self) -> None:
        with self._worker_lock:
            # After close() nothing reads the queue again, and nothing needs to: close()
            # failed every unfinished task.
            if self._worker is None and not self.closed:
                self._workers_made += 1
                self._worker = _Worker(self, self._workers_made)

    def _write(
        self,
        future: TaskFuture,
        outcome: str,
        error: BaseException | None,
        run_s: float | None,
    ) -> None:
        """Log one task and append it to the journal file; never raises (it runs on the
        worker thread, which must go on with the next task)."""
        entry = {
            "task": future.task_id,
            "name": future.name,
            "outcome": outcome,
            "error": None if error is None else type(error).__name__,
            "queued_s": future.timings.queued_s,
            "run_s": run_s,
        }
        logger.info("task #%d %s: %s", future.task_id, future.name, outcome)
        if self.journal is None:
            return
        try:
            with self._write_lock, open(self.journal, "a", encoding="utf-8") as f:
                f.write(json.dumps(entry) + "\n")
        except OSError as exc:
            logger.warning("cannot write to the journal %s: %s", self.journal, exc)
