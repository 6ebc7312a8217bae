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
    ``submit`` after ``close`` raises :class:`~sakura_async.errors.DispatcherClosedError`;
    ``close(wait=False)`` fails the unfinished tasks with it.
``start()``
    Start the execution resource now instead of at the first ``submit`` (a worker process
    takes a few seconds to import torch: starting it early overlaps that with training).
``empty(shape, dtype)``
    A host tensor for snapshots that this dispatcher passes to its tasks most cheaply
    (shared memory for :class:`~sakura_async.dispatch.LocalDispatcher`).
``stage(tree)``
    The same tree with its tensors moved there once (for a payload sent with every task).

No caller waits forever: a task that has not finished ``task_timeout`` seconds after
``submit`` fails with :class:`~sakura_async.errors.TaskTimeoutError`, and after a Ctrl+C the
tasks in flight get ``interrupt_grace`` seconds before they are abandoned (see
:mod:`sakura_async.dispatch.interrupts`).

A :class:`TaskFuture` is a :class:`concurrent.futures.Future` (``result()``,
``exception()``, ``done()``, ``add_done_callback()``) with ``timings``.

Writing a dispatcher (the public contract, see ``docs/dispatchers.md``): subclass
:class:`Dispatcher`, implement :meth:`Dispatcher.start_task` (start the task, call
``future.mark_submitted()`` once the payload has left the caller, and later
``future.settle(result=...)`` or ``future.settle(error=...)`` from wherever the outcome
arrives), optionally :meth:`Dispatcher.close_resources` and
:meth:`Dispatcher.handle_timeout`.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from sakura_async.dispatch import deadlines, interrupts
from sakura_async.dispatch.options import (
    DEFAULT_INTERRUPT_GRACE,
    DEFAULT_TASK_TIMEOUT,
    DispatchOptions,
)
from sakura_async.errors import DispatcherClosedError, TaskInterruptedError, TaskTimeoutError

__all__ = [
    "DEFAULT_INTERRUPT_GRACE",
    "DEFAULT_TASK_TIMEOUT",
    "DispatchOptions",
    "Dispatcher",
    "TaskFuture",
    "Timings",
    "run_timed",
]


_POLL_S = 1.0
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
    :attr:`timings`, :attr:`task_id`, :attr:`name` and :attr:`dispatcher` (its kind).

    For dispatcher authors: call :meth:`mark_submitted` once the task has left the caller,
    then complete it with :meth:`settle` (safe when a timeout, a lost connection and a late
    result race: the first one wins) or with :meth:`set_result` / :meth:`set_exception`
    (the :class:`concurrent.futures.Future` calls, which also record the timings).
    """

    def __init__(self, dispatcher: str, name: str = "", *, interrupt_grace: float = 0.0) -> None:
        super().__init__()
        self.task_id: int = next(_ids)
        self.dispatcher = dispatcher
        self.name = name
        self.timings = Timings(submitted_at=time.time())
        self.interrupt_grace = interrupt_grace
        self._t0 = time.perf_counter()
        self._created = time.monotonic()
        self._t_submitted: float | None = None
        self._settle_lock = threading.Lock()
        self._on_abandon: Callable[[TaskFuture], None] | None = None

    # --- for dispatchers ------------------------------------------------------------------

    def mark_submitted(self) -> None:
        """Record that the payload has left the caller (the end of ``blocked_s``)."""
        self._t_submitted = time.perf_counter()
        self.timings.blocked_s = self._t_submitted - self._t0

    def settle(
        self,
        *,
        result: Any = None,
        error: BaseException | None = None,
        run_s: float | None = None,
        started: float | None = None,
    ) -> bool:
        """Complete the future with ``result``, or with ``error`` when one is given, unless
        it is already done.  Returns True if this call completed it.

        ``run_s``: how long the call itself took where it ran; ``started``: the
        ``time.perf_counter()`` at which it started, when it ran in this process.
        """
        with self._settle_lock:
            if self.done():
                return False
            self._record(run_s, started)
            try:
                if error is not None:
                    super().set_exception(error)
                else:
                    super().set_result(result)
            except concurrent.futures.InvalidStateError:  # cancelled meanwhile
                return False
            return True

    def set_result(
        self, result: Any, *, run_s: float | None = None, started: float | None = None
    ) -> None:
        """:meth:`concurrent.futures.Future.set_result`, recording the timings too."""
        with self._settle_lock:
            self._record(run_s, started)
            super().set_result(result)

    def set_exception(
        self,
        exception: BaseException | None,
        *,
        run_s: float | None = None,
        started: float | None = None,
    ) -> None:
        """:meth:`concurrent.futures.Future.set_exception`, recording the timings too."""
        with self._settle_lock:
            self._record(run_s, started)
            super().set_exception(exception)

    def _record(self, run_s: float | None, started: float | None) -> None:
        now = time.perf_counter()
        t = self.timings
        t.run_s = run_s
        if started is not None and self._t_submitted is not None:
            t.queued_s = max(0.0, started - self._t_submitted)
        elif run_s is not None and self._t_submitted is not None:
            t.queued_s = max(0.0, now - self._t_submitted - run_s)
        t.total_s = now - self._t0

    def _finish_outcome(self, body: Any, where: str) -> None:
        """Complete the future from a sakura worker's encoded RESULT body (see
        :func:`sakura_async.wire.tasks.decode_outcome`)."""
        from sakura_async.wire.tasks import decode_outcome

        ok, value, run_s = decode_outcome(body, where)
        if ok:
            self.settle(result=value, run_s=run_s)
        else:
            self.settle(error=value, run_s=run_s)

    # --- waiting: bounded after a Ctrl+C ----------------------------------------------------

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the task is done or ``timeout`` seconds passed; True if done.

        After a Ctrl+C (see :mod:`sakura_async.dispatch.interrupts`) the wait ends within
        ``interrupt_grace`` and an unfinished task fails with TaskInterruptedError.
        """
        interrupts.note_pending()
        until = None if timeout is None else time.monotonic() + timeout
        while not self.done():
            now = time.monotonic()
            limit = interrupts.deadline_for(self._created, self.interrupt_grace)
            if limit is not None and now >= limit:
                self._abandon()
                break
            if until is not None and now >= until:
                return False
            step = _POLL_S
            for bound in (limit, until):
                if bound is not None:
                    step = min(step, bound - now)
            try:
                concurrent.futures.wait([self], timeout=max(0.0, step))
            except KeyboardInterrupt as exc:
                interrupts.note(exc)
                raise
        return True

    def _abandon(self) -> None:
        error = TaskInterruptedError(
            f"task #{self.task_id} ({self.name}) on the {self.dispatcher} dispatcher was "
            f"abandoned after Ctrl+C (it had not finished within interrupt_grace="
            f"{self.interrupt_grace:g} s)"
        )
        if self.settle(error=error) and self._on_abandon is not None:
            self._on_abandon(self)

    def result(self, timeout: float | None = None) -> Any:
        self.wait(timeout)
        return super().result(timeout=0)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self.wait(timeout)
        return super().exception(timeout=0)

    def __repr__(self) -> str:
        state = "pending"
        if self.done():
            state = "failed" if self.cancelled() or super().exception(0) else "finished"
        label = f" {self.name!r}" if self.name else ""
        return f"<TaskFuture #{self.task_id}{label} on {self.dispatcher}: {state}>"


class Dispatcher:
    """Base class: bounded pending work, timeouts, drain and close; subclasses run tasks.

    Args:
        max_pending: how many submitted tasks may be unfinished at once; ``submit`` blocks
            beyond that until one finishes.
        task_timeout: seconds from ``submit`` until an unfinished task fails with
            :class:`~sakura_async.errors.TaskTimeoutError` (default one hour; None: no
            limit).
        interrupt_grace: seconds the tasks in flight get to finish after a Ctrl+C before
            they are abandoned (a second Ctrl+C abandons them at once).
        options: a :class:`~sakura_async.dispatch.options.DispatchOptions` already checked
            (a subclass builds one from all its keywords and passes it here); when given,
            the three keywords above are not read.

    Attributes:
        owned_by_service: True when the service this dispatcher is given to (AsyncEval,
            AsyncCheckpoint, a third-party service) must close it at teardown: a dispatcher
            built for that service alone, e.g. from a spec string.  False (the default)
            leaves closing it to whoever built it.
    """

    kind: str = "dispatcher"

    def __init__(
        self,
        *,
        max_pending: int = 2,
        task_timeout: float | None = DEFAULT_TASK_TIMEOUT,
        interrupt_grace: float = DEFAULT_INTERRUPT_GRACE,
        options: DispatchOptions | None = None,
    ) -> None:
        if options is None:
            options = DispatchOptions.from_kwargs(
                owner=type(self).__name__,
                max_pending=max_pending,
                task_timeout=task_timeout,
                interrupt_grace=interrupt_grace,
            )
        self.options = options
        """The checked options (:class:`~sakura_async.dispatch.options.DispatchOptions`)."""
        self.max_pending: int = options.max_pending
        self.task_timeout: float | None = options.task_timeout
        self.interrupt_grace: float = options.interrupt_grace
        interrupts.widen(self.interrupt_grace)
        self.owned_by_service = False
        self._slots = threading.Semaphore(self.max_pending)
        self._lock = threading.Lock()
        self._pending: set[TaskFuture] = set()
        self._idle = threading.Condition(self._lock)
        self._closed = False
        self._abandoned = False

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
        self.check_open()
        return self

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> TaskFuture:
        """Run ``fn(*args, **kwargs)`` on this dispatcher; block while ``max_pending`` tasks
        are unfinished.  Returns the task's future at once."""
        if not callable(fn):
            raise TypeError(f"submit() needs a callable as fn, got {type(fn).__name__}")
        self.check_open()
        future = TaskFuture(
            self.kind,
            getattr(fn, "__qualname__", type(fn).__name__),
            interrupt_grace=self.interrupt_grace,
        )
        ref = weakref.ref(self)

        def abandoned(f: TaskFuture) -> None:
            dispatcher = ref()
            if dispatcher is not None:
                dispatcher._abandoned = True

        future._on_abandon = abandoned
        self._slots.acquire()
        with self._lock:
            if self._closed:
                self._slots.release()
                raise DispatcherClosedError(f"{self!r} was closed while submit() waited for a slot")
            self._pending.add(future)
        future.add_done_callback(self._task_done)
        try:
            self.start_task(future, fn, args, kwargs)
        except BaseException as exc:
            # Nothing was started (e.g. the payload could not be serialized): fail the
            # future, which frees the slot, and raise to the caller.
            future.settle(error=exc)
            raise
        if self.task_timeout is not None and not future.done():
            deadlines.watch(future, self.task_timeout, self._expire)
        return future

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted task finished.  Returns False on timeout."""
        until = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                first = next(iter(self._pending), None)
            if first is None:
                return True
            remaining = None if until is None else until - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            first.wait(remaining)

    def close(self, wait: bool = True) -> None:
        """Drain (when ``wait``) and release the dispatcher's resources; unfinished tasks
        fail with DispatcherClosedError.  Idempotent.  A KeyboardInterrupt while draining
        closes without waiting, then propagates."""
        if wait:
            try:
                self.drain()
            except KeyboardInterrupt:
                self.close(wait=False)
                raise
        with self._lock:
            if self._closed:
                return
            self._closed = True
            abandoned = list(self._pending)
        for future in abandoned:  # never leave a caller waiting on a dead dispatcher
            future.settle(
                error=DispatcherClosedError(
                    f"{type(self).__name__} was closed before task #{future.task_id} "
                    f"({future.name}) finished"
                )
            )
        # Tasks given up after a Ctrl+C may still run: do not wait for them either.
        self.close_resources(wait and not self._abandoned)

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

    # --- the extension contract: what a dispatcher implements -------------------------------

    def start_task(
        self,
        future: TaskFuture,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        """Start running ``fn(*args, **kwargs)`` and return without waiting for it.

        Call ``future.mark_submitted()`` once the payload has left the caller, and complete
        the future with ``future.settle(result=..., run_s=...)`` or
        ``future.settle(error=...)`` when the outcome is known (from any thread).  An
        exception raised here fails the future and propagates to ``submit``'s caller.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement start_task()")

    def close_resources(self, wait: bool) -> None:
        """Release threads, processes, connections (called once by :meth:`close`, after
        draining when ``wait``).  With ``wait=False`` return promptly: kill rather than
        join.  Default: nothing to release."""

    def handle_timeout(self, future: TaskFuture) -> None:
        """Called after ``future`` failed with TaskTimeoutError, to free what still runs it
        (a stuck thread is replaced, a stuck worker process is stopped).  Default: nothing."""

    def check_open(self) -> None:
        """Raise DispatcherClosedError if this dispatcher is closed."""
        if self._closed:
            raise DispatcherClosedError(f"{self!r} is closed; create a new dispatcher")

    # --- internals --------------------------------------------------------------------------

    def _expire(self, future: TaskFuture) -> None:
        error = TaskTimeoutError(
            f"task #{future.task_id} ({future.name}) did not finish within "
            f"task_timeout={self.task_timeout:g} s on {self!r}"
        )
        if future.settle(error=error):
            self.handle_timeout(future)

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
