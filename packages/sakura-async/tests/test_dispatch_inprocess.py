"""InThreadDispatcher and ThreadDispatcher: results, errors, timings, backpressure, close."""

from __future__ import annotations

import threading
import time

import pytest
from sakura_async.dispatch import InThreadDispatcher, ThreadDispatcher
from sakura_async.errors import DispatcherClosed


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
    with pytest.raises(DispatcherClosed, match="closed"):
        d.submit(add, 1)


def test_close_without_wait_fails_unfinished_futures() -> None:
    release = threading.Event()
    d = ThreadDispatcher(max_pending=2)
    running = d.submit(release.wait, 30)
    queued = d.submit(add, 1)
    time.sleep(0.05)
    d.close(wait=False)
    with pytest.raises(DispatcherClosed):
        queued.result(timeout=10)
    release.set()
    assert running.done()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_pending": 0}, "max_pending must be an int >= 1, got 0"),
        ({"max_pending": "2"}, "max_pending must be an int >= 1, got '2'"),
        ({"threads": 0}, "threads must be an int >= 1, got 0"),
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
