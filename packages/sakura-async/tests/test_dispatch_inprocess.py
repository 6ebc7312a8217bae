"""InThreadDispatcher and ThreadDispatcher: results, errors, timings, backpressure, close."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from sakura_async.dispatch import Dispatcher, InThreadDispatcher, TaskFuture, ThreadDispatcher
from sakura_async.dispatch.resolve import resolve_dispatcher
from sakura_async.errors import DispatcherClosedError, TaskTimeoutError


def add(a: int, b: int = 0) -> int:
    return a + b


def fail(message: str) -> None:
    raise ValueError(message)


@pytest.mark.parametrize("make", [InThreadDispatcher, ThreadDispatcher])
def test_result_error_and_timings(make: type) -> None:
    with make() as d:
        ok = d.submit(add, 2, b=3)
        bad = d.submit(fail, "boom")
        assert ok.result(timeout=10) == 5
        with pytest.raises(ValueError, match="boom"):
            bad.result(timeout=10)
        t = ok.timings
        assert t.run_s is not None and t.run_s >= 0
        assert t.total_s is not None and t.total_s >= t.run_s
        assert t.blocked_s is not None and t.queued_s is not None
        assert ok.dispatcher == d.kind


def test_inthread_runs_before_submit_returns() -> None:
    seen = []
    d = InThreadDispatcher()
    future = d.submit(seen.append, 1)
    assert future.done() and seen == [1]
    d.close()


def test_thread_runs_in_submission_order_off_the_caller_thread() -> None:
    order: list[int] = []
    threads: set[str] = set()

    def record(i: int) -> None:
        order.append(i)
        threads.add(threading.current_thread().name)

    with ThreadDispatcher(max_pending=8) as d:
        futures = [d.submit(record, i) for i in range(8)]
        assert d.drain(timeout=30)
    assert all(f.done() for f in futures)
    assert order == list(range(8))
    assert threading.current_thread().name not in threads


def test_backpressure_blocks_submit_until_a_slot_frees() -> None:
    release = threading.Event()
    d = ThreadDispatcher(max_pending=1)
    first = d.submit(release.wait, 30)
    returned = threading.Event()

    def second() -> None:
        d.submit(add, 1)
        returned.set()

    t = threading.Thread(target=second)
    t.start()
    assert not returned.wait(0.3)  # blocked: one task unfinished and max_pending=1
    assert d.pending == 1
    release.set()
    assert returned.wait(30)
    t.join()
    assert first.result() is True
    d.close()
    assert d.pending == 0


def test_close_rejects_new_work_and_is_idempotent() -> None:
    d = ThreadDispatcher()
    assert d.submit(add, 1).result(timeout=10) == 1
    d.close()
    d.close()
    with pytest.raises(DispatcherClosedError, match="closed"):
        d.submit(add, 1)


def test_close_without_wait_fails_unfinished_futures() -> None:
    release = threading.Event()
    d = ThreadDispatcher(max_pending=2)
    running = d.submit(release.wait, 30)
    queued = d.submit(add, 1)
    time.sleep(0.05)
    d.close(wait=False)
    with pytest.raises(DispatcherClosedError):
        queued.result(timeout=10)
    release.set()
    assert running.done()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"max_pending": 0},
            "ThreadDispatcher: max_pending=0 is not accepted; accepted: an int >= 1",
        ),
        ({"max_pending": "2"}, "max_pending='2' is not accepted; accepted: an int >= 1"),
        ({"threads": 0}, "threads=0 is not accepted; accepted: an int >= 1"),
        (
            {"task_timeout": 0},
            "task_timeout=0 is not accepted; accepted: a finite number > 0 or None",
        ),
        ({"task_timeout": "1h"}, "task_timeout='1h' is not accepted"),
        (
            {"interrupt_grace": -1},
            "interrupt_grace=-1 is not accepted; accepted: a finite number >= 0",
        ),
    ],
)
def test_options_are_validated(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ThreadDispatcher(**kwargs)


def test_submit_needs_a_callable() -> None:
    with pytest.raises(TypeError, match="callable"):
        InThreadDispatcher().submit(42)  # type: ignore[arg-type]


def test_facade_names_resolve() -> None:
    import sakura.dispatch

    assert sakura.dispatch.InThreadDispatcher is InThreadDispatcher
    assert sakura.dispatch.ThreadDispatcher is ThreadDispatcher


# --- no caller waits forever ---------------------------------------------------------------


def test_a_task_that_never_returns_fails_with_a_timeout_naming_it() -> None:
    stuck = threading.Event()
    d = ThreadDispatcher(task_timeout=0.5)
    hung = d.submit(stuck.wait)  # never set: the call never returns
    with pytest.raises(
        TaskTimeoutError,
        match=r"task #\d+ \(Event.wait\) did not finish within "
        r"task_timeout=0.5 s",
    ) as info:
        hung.result(timeout=60)  # a hang detector, not a timing assertion
    assert isinstance(info.value, TimeoutError)
    # The stuck thread is retired: the next task runs on a fresh one.
    assert d.submit(add, 2, b=2).result(timeout=60) == 4
    d.close(wait=False)
    stuck.set()


def test_close_without_wait_returns_promptly_with_a_stuck_task() -> None:
    stuck = threading.Event()
    d = ThreadDispatcher(task_timeout=None)
    hung = d.submit(stuck.wait)
    closer = threading.Thread(target=d.close, kwargs={"wait": False})
    closer.start()
    closer.join(timeout=30)  # a hang detector
    assert not closer.is_alive()
    with pytest.raises(DispatcherClosedError, match="closed before task"):
        hung.result(timeout=0)
    stuck.set()


STUCK_AT_EXIT = """
import threading, sys
from sakura_async.dispatch import ThreadDispatcher
d = ThreadDispatcher(task_timeout=1)
d.submit(threading.Event().wait)   # never returns
print("submitted", flush=True)
"""


def test_a_stuck_thread_task_does_not_keep_the_interpreter_from_exiting() -> None:
    done = subprocess.run(
        [sys.executable, "-c", STUCK_AT_EXIT], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "submitted" in done.stdout


def test_the_public_extension_contract() -> None:
    f = TaskFuture("custom", "job")
    f.mark_submitted()
    assert f.timings.blocked_s is not None
    assert f.settle(result=7, run_s=0.25) is True
    assert f.settle(error=ValueError("late")) is False  # the first outcome wins
    assert f.result(timeout=0) == 7 and f.timings.run_s == 0.25
    g = TaskFuture("custom", "job")
    g.set_exception(KeyError("x"), run_s=0.5)
    assert isinstance(g.exception(timeout=0), KeyError) and g.timings.run_s == 0.5


def test_the_never_released_private_names_are_gone() -> None:
    """0.1.0 is the first release: no stand-ins for the private names of development."""
    f = TaskFuture("custom")
    assert not hasattr(f, "_mark_submitted") and not hasattr(f, "_finish")
    with pytest.raises(ImportError):
        from sakura_async.errors import DispatcherClosed  # noqa: F401
    with pytest.raises(ImportError):
        from sakura_async.errors import WorkerCrashed  # noqa: F401

    class Old(Dispatcher):
        def _submit(self, future: Any, fn: Any, args: Any, kwargs: Any) -> None:
            future.settle(result=fn(*args, **kwargs))

    with pytest.raises(NotImplementedError, match="Old must implement start_task"):
        Old().submit(add, 1, b=1)


def test_resolve_marks_built_dispatchers_owned_by_the_service() -> None:
    built, owned = resolve_dispatcher(None)
    assert owned and built.owned_by_service
    mine = ThreadDispatcher()
    assert resolve_dispatcher(mine) == (mine, False)
    mine.owned_by_service = True
    assert resolve_dispatcher(mine) == (mine, True)
    for d in (built, mine):
        d.close()
