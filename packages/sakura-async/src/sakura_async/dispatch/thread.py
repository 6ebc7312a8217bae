"""ThreadDispatcher: tasks run on background threads of this process.

torch's kernels release the GIL, so a background evaluation or checkpoint copy runs in
parallel with training; pure-Python work in the task still contends for the GIL (use
:class:`~sakura_async.dispatch.LocalDispatcher` for that).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sakura_async._options import check_int
from sakura_async.dispatch.base import Dispatcher, TaskFuture, run_timed

__all__ = ["ThreadDispatcher"]


class ThreadDispatcher(Dispatcher):
    """Run tasks on ``threads`` background threads (one by default, so tasks run in
    submission order).

    The threads are those of a :class:`concurrent.futures.ThreadPoolExecutor`, which the
    interpreter joins at exit: a task still running when the program ends (normally or
    after Ctrl+C) is completed, not abandoned.

    Args:
        threads: number of worker threads (>= 1).
        max_pending: unfinished tasks allowed before ``submit`` blocks.
    """

    kind = "thread"

    def __init__(self, *, threads: int = 1, max_pending: int = 2) -> None:
        super().__init__(max_pending=max_pending)
        self.threads: int = check_int("threads", threads, minimum=1)
        self._executor: ThreadPoolExecutor | None = None
        self._start_lock = threading.Lock()

    def start(self) -> ThreadDispatcher:
        self._check_open()
        self._pool()
        return self

    def _pool(self) -> ThreadPoolExecutor:
        with self._start_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    max_workers=self.threads, thread_name_prefix="sakura-dispatch"
                )
            return self._executor

    def _submit(
        self,
        future: TaskFuture,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        def run() -> None:
            started = time.perf_counter()
            ok, value, seconds = run_timed(fn, args, kwargs, catch=BaseException)
            if ok:
                future._finish(result=value, run_s=seconds, started=started)
            else:
                future._finish(error=value, run_s=seconds, started=started)

        pool = self._pool()
        future._mark_submitted()
        pool.submit(run)

    def _close(self, wait: bool) -> None:
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=wait, cancel_futures=not wait)
