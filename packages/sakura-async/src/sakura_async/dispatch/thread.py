"""ThreadDispatcher: tasks run on background threads of this process.

torch's kernels release the GIL, so a background evaluation or checkpoint copy runs in
parallel with training; pure-Python work in the task still contends for the GIL (use
:class:`~sakura_async.dispatch.LocalDispatcher` for that).
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from sakura.options import check_int
from sakura_async.dispatch.base import (
    DEFAULT_INTERRUPT_GRACE,
    DEFAULT_TASK_TIMEOUT,
    Dispatcher,
    TaskFuture,
    run_timed,
)

__all__ = ["ThreadDispatcher"]

_Item = tuple[TaskFuture, Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class _Runner:
    """One background thread taking tasks from the dispatcher's queue until it is told to
    stop or is retired (its task timed out: a fresh runner replaces it)."""

    def __init__(self, tasks: queue.SimpleQueue[_Item | None], name: str) -> None:
        self.tasks = tasks
        self.retired = False
        self.current: TaskFuture | None = None
        # A daemon thread: a stuck task never keeps the interpreter from exiting; the
        # dispatcher's atexit hook waits (boundedly) for the tasks in flight instead.
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.retired:
            item = self.tasks.get()
            if item is None:
                return
            future, fn, args, kwargs = item
            if future.done():  # failed meanwhile (closed without waiting, timed out)
                continue
            self.current = future
            started = time.perf_counter()
            ok, value, seconds = run_timed(fn, args, kwargs, catch=BaseException)
            self.current = None
            if ok:
                future.settle(result=value, run_s=seconds, started=started)
            else:
                future.settle(error=value, run_s=seconds, started=started)


class ThreadDispatcher(Dispatcher):
    """Run tasks on ``threads`` background threads (one by default, so tasks run in
    submission order).

    A task still running when the program ends (normally or after Ctrl+C) is waited for
    at interpreter exit, within ``task_timeout`` (and ``interrupt_grace`` after a Ctrl+C).
    A task that times out keeps its thread (Python cannot stop a thread), but the thread is
    retired and a fresh one takes the next tasks.

    Args:
        threads: number of worker threads (>= 1).
        max_pending: unfinished tasks allowed before ``submit`` blocks.
        task_timeout, interrupt_grace: see :class:`~sakura_async.dispatch.Dispatcher`.
    """

    kind = "thread"

    def __init__(
        self,
        *,
        threads: int = 1,
        max_pending: int = 2,
        task_timeout: float | None = DEFAULT_TASK_TIMEOUT,
        interrupt_grace: float = DEFAULT_INTERRUPT_GRACE,
    ) -> None:
        super().__init__(
            max_pending=max_pending, task_timeout=task_timeout, interrupt_grace=interrupt_grace
        )
        self.threads: int = check_int("threads", threads, minimum=1, owner="ThreadDispatcher")
        self._tasks: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._runners: list[_Runner] = []
        self._start_lock = threading.Lock()
        self._made = 0
        ref = weakref.ref(self)

        def at_exit() -> None:  # finish in-flight work (a checkpoint write) at exit
            dispatcher = ref()
            if dispatcher is not None and not dispatcher.closed:
                dispatcher.close(wait=True)

        self._atexit = at_exit
        atexit.register(at_exit)

    def start(self) -> ThreadDispatcher:
        self.check_open()
        self._ensure_runners()
        return self

    def _ensure_runners(self) -> None:
        with self._start_lock:
            self._runners = [r for r in self._runners if not r.retired]
            while len(self._runners) < self.threads:
                self._made += 1
                self._runners.append(_Runner(self._tasks, f"sakura-dispatch-{self._made}"))

    def start_task(
        self,
        future: TaskFuture,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        self._ensure_runners()
        future.mark_submitted()
        self._tasks.put((future, fn, args, kwargs))

    def handle_timeout(self, future: TaskFuture) -> None:
        with self._start_lock:
            for runner in self._runners:
                if runner.current is future:
                    runner.retired = True  # it exits once (if ever) the stuck call returns
        if not self.closed:
            self._ensure_runners()

    def close_resources(self, wait: bool) -> None:
        atexit.unregister(self._atexit)
        with self._start_lock:
            runners, self._runners = self._runners, []
        for _ in runners:
            self._tasks.put(None)
        if wait:  # drained already: the threads are idle and exit at once
            for runner in runners:
                runner.thread.join(timeout=5)
