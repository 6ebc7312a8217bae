"""The dispatcher interface: submit a callable and its payload, get a :class:`TaskFuture`.

Every dispatcher (in the calling thread, a background thread, a worker process, a remote
worker, a Dask cluster) offers the same calls:

``submit(fn, *args, **kwargs) -> TaskFuture``
    Run ``fn(*args, **kwargs)`` somewhere else.  At most ``max_pending`` tasks are
    unfinished at a time: a further ``submit`` blocks until one finishes (backpressure),
    so a slow consumer cannot make memory grow without bound.
``drain(timeout=None)``
    Wait until every submitted task has finished (successfully or not).
``close(wait=True)``
    Drain (unless ``wait=False``), then release threads, processes and connections.
    ``submit`` after ``close`` raises :class:`~sakura_async.errors.DispatcherClosed`.
``start()``
    Start the execution resource now instead of at the first ``submit`` (a worker process
    takes a few seconds to import torch: starting it early overlaps that with training).
``empty(shape, dtype)``
    A host tensor for snapshots that this dispatcher passes to its tasks most cheaply
    (shared memory for :class:`~sakura_async.dispatch.LocalDispatcher`).
``stage(tree)``
    The same tree with its tensors moved there once (for a payload sent with every task).

A :class:`TaskFuture` is a :class:`concurrent.futures.Future` (``result()``,
``exception()``, ``done()``, ``add_done_callback()``) with ``timings``.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from sakura_async._options import check_int
from sakura_async.errors import DispatcherClosed

__all__ = ["Dispatcher", "TaskFuture", "Timings"]

_ids = itertools.count(1)


@dataclass
class Timings:
    """Where a task's time went (seconds; ``None`` until known).

    ``blocked_s`` is how long ``submit`` waited for a free slot (backpressure) plus the time
    it spent preparing the payload on the caller's thread; ``queued_s`` from the end of
    ``submit`` to the start of the run; ``run_s`` the call itself, measured where it ran;
    ``total_s`` from the start of ``submit`` to the result being available.
    """

    submitted_at: float = 0.0
    """``time.time()`` when ``submit`` was called."""
    blocked_s: float | None = None
    queued_s: float | None = None
    run_s: float | None = None
    total_s: float | None = None


class TaskFuture(concurrent.futures.Future):  # type: ignore[type-arg]
    """The result of a submitted task: a :class:`concurrent.futures.Future` plus
    :attr:`timings`, :attr:`task_id` and :attr:`dispatcher` (its kind)."""

    def __init__(self, dispatcher: str, name: str = "") -> None:
        super().__init__()
        self.task_id: int = next(_ids)
        self.dispatcher = dispatcher
        self.name = name
        self.timings = Timings(submitted_at=time.time())
        self._t0 = time.perf_counter()
        self._t_submitted: float | None = None

    def _mark_submitted(self) -> None:
        self._t_submitted = time.perf_counter()
        self.timings.blocked_s = self._t_submitted - self._t0

    def _finish(
        self,
        *,
        result: Any = None,
        error: BaseException | None = None,
        run_s: float | None = None,
        started: float | None = None,
    ) -> None:
        """Complete the future (once; later calls are ignored)."""
        now = time.perf_counter()
        t = self.timings
        t.run_s = run_s
        if started is not None and self._t_submitted is not None:
            t.queued_s = max(0.0, started - self._t_submitted)
        elif run_s is not None and self._t_submitted is not None:
            t.queued_s = max(0.0, now - self._t_submitted - run_s)
        t.total_s = now - self._t0
        try:
            if error is not None:
                self.set_exception(error)
            else:
                self.set_result(result)
        except concurrent.futures.InvalidStateError:
            pass

    def _finish_outcome(self, body: Any, where: str) -> None:
        """Complete the future from a worker's encoded RESULT body (see
        :func:`sakura_async.wire.tasks.decode_outcome`)."""
        from sakura_async.wire.tasks import decode_outcome

        ok, value, run_s = decode_outcome(body, where)
        if ok:
            self._finish(result=value, run_s=run_s)
        else:
            self._finish(error=value, run_s=run_s)

    def __repr__(self) -> str:
        state = "pending"
        if self.done():
            state = "failed" if self.exception() is not None else "finished"
        label = f" {self.name!r}" if self.name else ""
        return f"<TaskFuture #{self.task_id}{label} on {self.dispatcher}: {state}>"


class Dispatcher(ABC):
    """Base class: bounded pending work, drain and close; subclasses run the tasks.

    Args:
        max_pending: how many submitted tasks may be unfinished at once; ``submit`` blocks
            beyond that until one finishes.
    """

    kind: str = "dispatcher"

    def __init__(self, *, max_pending: int = 2) -> None:
        self.max_pending: int = check_int("max_pending", max_pending, minimum=1)
        self._slots = threading.Semaphore(self.max_pending)
        self._lock = threading.Lock()
        self._pending: set[TaskFuture] = set()
        self._idle = threading.Condition(self._lock)
        self._closed = False

    # --- public API -----------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def pending(self) -> int:
        """Number of submitted tasks not finished yet."""
        with self._lock:
            return len(self._pending)

    def start(self) -> Dispatcher:
        """Start the execution resource now (no-op where there is none to start)."""
        self._check_open()
        return self

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> TaskFuture:
        """Run ``fn(*args, **kwargs)`` on this dispatcher; block while ``max_pending`` tasks
        are unfinished.  Returns the task's future at once."""
        if not callable(fn):
            raise TypeError(f"submit() needs a callable as fn, got {type(fn).__name__}")
        self._check_open()
        future = TaskFuture(self.kind, getattr(fn, "__qualname__", type(fn).__name__))
        self._slots.acquire()
        with self._lock:
            if self._closed:
                self._slots.release()
                raise DispatcherClosed(f"{self!r} was closed while submit() waited for a slot")
            self._pending.add(future)
        future.add_done_callback(self._task_done)
        try:
            self._submit(future, fn, args, kwargs)
        except BaseException as exc:
            # Nothing was started (e.g. the payload could not be serialized): fail the
            # future, which frees the slot, and raise to the caller.
            future._finish(error=exc)
            raise
        return future

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted task finished.  Returns False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._pending:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._idle.wait(remaining)
        return True

    def close(self, wait: bool = True) -> None:
        """Drain (when ``wait``) and release the dispatcher's resources.  Idempotent."""
        if wait:
            self.drain()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            abandoned = list(self._pending)
        self._close(wait)
        if not wait:
            for future in abandoned:  # never leave a caller waiting on a dead dispatcher
                future._finish(
                    error=DispatcherClosed(f"{self!r} was closed before the task finished")
                )

    def empty(self, shape: Iterable[int], dtype: Any, *, pin_memory: bool = False) -> Any:
        """A host tensor to snapshot into; tasks on this dispatcher receive it cheaply."""
        import torch

        return torch.empty(tuple(shape), dtype=dtype, pin_memory=pin_memory)

    def stage(self, tree: Any) -> Any:
        """Return ``tree`` (dicts, lists, tuples of tensors and values) placed where this
        dispatcher's tasks receive it most cheaply; pass the result to ``submit`` instead of
        ``tree`` when the same large payload (validation data) goes with every task.

        The identity here; :class:`~sakura_async.dispatch.LocalDispatcher` copies the
        tensors once into shared memory, so later tasks receive them without a copy.
        """
        return tree

    def __enter__(self) -> Dispatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(wait=exc[0] is None or exc[0] is KeyboardInterrupt)

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.pending}/{self.max_pending} pending"
        return f"<{type(self).__name__} {state}>"

    # --- for subclasses -------------------------------------------------------------------

    @abstractmethod
    def _submit(
        self,
        future: TaskFuture,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        """Start the task; complete ``future`` with ``future._finish(...)`` when it ends.
        Must call ``future._mark_submitted()`` once the payload has left the caller."""

    def _close(self, wait: bool) -> None:  # noqa: B027 - optional override
        """Release resources (called once, after draining when ``wait``)."""

    def _check_open(self) -> None:
        if self._closed:
            raise DispatcherClosed(f"{self!r} is closed; create a new dispatcher")

    def _task_done(self, future: concurrent.futures.Future) -> None:  # type: ignore[type-arg]
        with self._idle:
            if future in self._pending:
                self._pending.discard(future)
                self._slots.release()
            if not self._pending:
                self._idle.notify_all()


def run_timed(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    catch: type[BaseException] = Exception,
) -> tuple[bool, Any, float]:
    """Call ``fn``; return ``(ok, result_or_exception, seconds)``.

    ``catch=BaseException`` on threads that must never die with a future left pending; the
    default lets KeyboardInterrupt and SystemExit through on the caller's own thread.
    """
    t0 = time.perf_counter()
    try:
        result = fn(*args, **kwargs)
    except catch as exc:  # reported through the future, never lost
        return False, exc, time.perf_counter() - t0
    return True, result, time.perf_counter() - t0
