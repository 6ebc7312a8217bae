"""InThreadDispatcher: runs each task synchronously inside ``submit`` (tests, debugging)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sakura_async.dispatch.base import Dispatcher, TaskFuture, run_timed

__all__ = ["InThreadDispatcher"]


class InThreadDispatcher(Dispatcher):
    """Run every task in the calling thread, before ``submit`` returns.

    The future is already done when ``submit`` returns; a task's exception is stored in it
    (``KeyboardInterrupt`` propagates).  Use it in tests and to debug a service without
    concurrency.  There is no ``task_timeout``: the caller's own thread runs the task.
    """

    kind = "inthread"

    def __init__(self, *, max_pending: int = 1) -> None:
        super().__init__(max_pending=max_pending, task_timeout=None)

    def start_task(
        self,
        future: TaskFuture,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        future.mark_submitted()
        ok, value, seconds = run_timed(fn, args, kwargs)
        if ok:
            future.settle(result=value, run_s=seconds)
        else:
            future.settle(error=value, run_s=seconds)
