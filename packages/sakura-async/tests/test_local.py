"""LocalDispatcher: an auto-spawned sakura-worker process, tensors through shared memory."""

from __future__ import annotations

import operator
import os
import signal
import socket
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import psutil
import pytest
import torch

from sakura import OnError, OnValidationEnd, SakuraRuntime
from sakura.testing import RecordingService
from sakura_async import AsyncCheckpoint, AsyncEval, EvalTask, load_latest
from sakura_async.dispatch import LocalDispatcher
from sakura_async.errors import (
    DispatcherClosedError,
    RemoteTaskError,
    TaskTimeoutError,
    WorkerCrashedError,
    WorkerUnresponsiveError,
)

cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def local() -> Iterator[LocalDispatcher]:
    """One worker for the module's tests (each spawn imports torch: seconds)."""
    with LocalDispatcher(threads=1) as dispatcher:
        dispatcher.start()
        yield dispatcher


def worker_children() -> set[int]:
    found = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if (
                "sakura_async.worker" in " ".join(p.cmdline())
                and p.status() != psutil.STATUS_ZOMBIE
            ):
                found.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return found


def describe(x: torch.Tensor, extra: Any = None) -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "sum": float(x.double().sum()),
        "dtype": str(x.dtype),
        "extra": extra,
    }


def test_runs_in_another_interpreter_and_round_trips_values(local: LocalDispatcher) -> None:
    info = local.wait_ready()
    assert info["pid"] == local.worker_pid != os.getpid()
    shared = local.empty((3, 4), torch.bfloat16)
    shared.fill_(2.0)
    plain = torch.arange(10, dtype=torch.int64)[::2]  # not contiguous, not shared: copied
    result = local.submit(describe, shared, extra={"t": plain, "s": "x", "n": (1, 2.5)}).result(60)
    assert result["pid"] == local.worker_pid
    assert result["sum"] == 24.0 and result["dtype"] == "torch.bfloat16"
    assert torch.equal(result["extra"]["t"], plain) and result["extra"]["n"] == (1, 2.5)
    assert local.submit(describe, torch.zeros(0)).result(60)["sum"] == 0.0


def test_a_task_exception_comes_back_with_the_worker_traceback(local: LocalDispatcher) -> None:
    def explode() -> None:
        raise KeyError("missing key in the worker")

    future = local.submit(explode)
    with pytest.raises(KeyError, match="missing key in the worker") as info:
        future.result(60)
    if sys.version_info >= (3, 11):
        assert any("raised in sakura-worker" in note for note in info.value.__notes__)


def test_a_function_the_worker_cannot_import_fails_its_task(local: LocalDispatcher) -> None:
    module = types.ModuleType("sakura_only_in_the_test_process")
    exec("def answer():\n    return 42\n", module.__dict__)  # noqa: S102 - a test fixture
    sys.modules[module.__name__] = module
    try:
        with pytest.raises(ModuleNotFoundError, match="sakura_only_in_the_test_process"):
            local.submit(module.answer).result(60)
    finally:
        del sys.modules[module.__name__]
    assert local.submit(describe, torch.ones(2)).result(60)["sum"] == 2.0


def test_async_eval_gives_exactly_the_synchronous_metrics(
    world: Any, local: LocalDispatcher
) -> None:
    rec = RecordingService(event_types={OnValidationEnd, OnError})
    with SakuraRuntime([rec], strict=True) as rt:
        rt.install(AsyncEval(world.eval_fn, world.val_payload(), dispatcher=local, pass_task=True))
        _, reference = world.train(rt, epochs=3)
    assert [dict(e.metrics) for e in rec.of(OnValidationEnd)] == reference  # bit-identical
    assert rec.of(OnError) == []


def test_async_checkpoint_writes_from_the_worker(
    world: Any, local: LocalDispatcher, tmp_path: Path
) -> None:
    with SakuraRuntime(strict=True) as rt:
        ckpt = rt.install(AsyncCheckpoint(tmp_path, every=1, keep=1, dispatcher=local))
        model, _ = world.train(rt, epochs=2)
    latest = load_latest(tmp_path)
    assert latest is not None and latest.step == 2 * world.STEPS_PER_EPOCH
    assert all(torch.equal(latest.state["model"][k], v) for k, v in model.state_dict().items())
    assert ckpt._pool is not None and ckpt._pool.allocations == 1  # one fp32 shared buffer, reused


def test_killing_the_worker_mid_task_fails_the_task_and_the_next_one_gets_a_new_worker(
    world: Any, tmp_path: Path
) -> None:
    started = tmp_path / "started"
    evaluate = world.eval_fn  # capture the function, not the module

    def eval_fn(epoch: int, task: EvalTask) -> dict[str, float]:
        if epoch == 1:
            started.write_text(str(os.getpid()))
            time.sleep(120)  # killed long before this ends
        return evaluate(epoch, task)

    killed: list[int] = []

    def after_epoch(epoch: int, model: Any) -> None:
        if epoch == 1:
            deadline = time.monotonic() + 60
            while not started.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            pid = int(started.read_text())
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    before = worker_children()
    rec = RecordingService(event_types={OnValidationEnd, OnError})
    with LocalDispatcher(threads=1) as dispatcher, SakuraRuntime([rec]) as rt:
        ae = rt.install(
            AsyncEval(eval_fn, world.val_payload(), dispatcher=dispatcher, pass_task=True)
        )
        _, reference = world.train(rt, epochs=3, after_epoch=after_epoch)
        assert dispatcher.workers_started == 2
        new_pid = dispatcher.worker_pid
    (error,) = rec.of(OnError)
    assert isinstance(error.exception, WorkerCrashedError) and error.source == "async_eval"
    assert "killed by SIGKILL" in str(error.exception) and error.epoch == 1
    assert [(e.epoch, dict(e.metrics)) for e in rec.of(OnValidationEnd)] == [
        (0, reference[0]),
        (2, reference[2]),
    ]
    assert [r.epoch for r in ae.errors] == [1]
    assert new_pid not in killed
    for pid in (*killed, new_pid):
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert worker_children() == before  # no orphan left behind


PARENT = """
import sys, time
from sakura_async.dispatch import LocalDispatcher
d = LocalDispatcher()
info = d.wait_ready()
print(info["pid"], flush=True)
time.sleep(600)
"""


def test_the_worker_dies_with_its_parent() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    try:
        line = parent.stdout.readline()  # type: ignore[union-attr]
        worker = int(line)
        assert psutil.Process(worker).ppid() == parent.pid
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 30
    while psutil.pid_exists(worker) and time.monotonic() < deadline:
        if psutil.Process(worker).status() == psutil.STATUS_ZOMBIE:
            break
        time.sleep(0.05)
    assert not psutil.pid_exists(worker) or psutil.Process(worker).status() == psutil.STATUS_ZOMBIE


def test_options_are_validated() -> None:
    with pytest.raises(
        ValueError,
        match="LocalDispatcher: threads=0 is not accepted; accepted: an int >= 1 or None",
    ):
        LocalDispatcher(threads=0)
    with pytest.raises(ValueError, match="start_timeout=0 is not accepted"):
        LocalDispatcher(start_timeout=0)
    with pytest.raises(ValueError, match="liveness_timeout=0 is not accepted"):
        LocalDispatcher(liveness_timeout=0)
    with pytest.raises(ValueError, match="task_timeout=-1 is not accepted"):
        LocalDispatcher(task_timeout=-1)
    with pytest.raises(ValueError, match="max_frame_bytes=1 is not accepted"):
        LocalDispatcher(max_frame_bytes=1)
    with pytest.raises(TypeError, match="env must be a mapping"):
        LocalDispatcher(env={"A": 1})  # type: ignore[dict-item]


def test_the_python_option_is_checked_at_construction(tmp_path: Path) -> None:
    """A wrong interpreter fails here, naming the option and the value, not at the first
    submit with a raw FileNotFoundError."""
    not_executable = tmp_path / "python3"
    not_executable.write_text("#!/bin/sh\nexit 0\n")
    not_python = tmp_path / "not-python"
    not_python.write_text("#!/bin/sh\necho 'this is no python' >&2; exit 3\n")
    not_python.chmod(0o755)
    for bad, why in [
        ("/nonexistent/python", "no executable file is there"),
        (str(not_executable), "no executable file is there"),
        (str(not_python), "exited with status 3: this is no python"),
    ]:
        with pytest.raises(
            ValueError,
            match=f"LocalDispatcher: python='{bad}' is not accepted; accepted: the path of a Python 3 interpreter.*{why}",
        ):
            LocalDispatcher(python=bad)
    with LocalDispatcher(python=sys.executable) as d:
        assert d.submit(operator.add, 2, 3).result(timeout=120) == 5


def test_the_worker_connection_is_an_unnamed_socket_pair() -> None:
    """Its frames carry no MAC (docs of sakura_async.wire.channel): nothing but the two
    processes can reach it, as it has no address anyone could connect to."""
    with LocalDispatcher() as d:
        d.start()
        sock = d._worker.channel.sock  # type: ignore[union-attr]
        assert sock.family == socket.AF_UNIX
        assert sock.getsockname() == "" and sock.getpeername() == ""


# --- no caller waits forever ---------------------------------------------------------------


def sleep_then(seconds: float, value: Any) -> Any:
    time.sleep(seconds)
    return value


def report_pid_and_sleep(path: str, seconds: float) -> None:
    Path(path).write_text(str(os.getpid()))
    time.sleep(seconds)


def test_a_task_over_its_timeout_fails_and_its_worker_is_replaced(tmp_path: Path) -> None:
    with LocalDispatcher(threads=1, task_timeout=3) as d:
        d.wait_ready()
        first = d.worker_pid
        hung = d.submit(sleep_then, 600, "never")
        with pytest.raises(
            TaskTimeoutError, match=r"\(sleep_then\) did not finish within task_timeout=3 s"
        ):
            hung.result(timeout=120)  # a hang detector
        # The replacement must be up before the next task: task_timeout counts from submit,
        # and starting a worker (importing torch) can take longer than 3 s on a loaded machine.
        d.wait_ready()
        assert d.submit(sleep_then, 0, 5).result(timeout=120) == 5
        assert d.workers_started == 2 and d.worker_pid != first
    assert not psutil.pid_exists(first) or psutil.Process(first).status() == psutil.STATUS_ZOMBIE


def test_a_stopped_worker_is_detected_by_its_missing_heartbeat(tmp_path: Path) -> None:
    marker = tmp_path / "pid"
    with LocalDispatcher(threads=1, liveness_timeout=3, task_timeout=None) as d:
        future = d.submit(report_pid_and_sleep, str(marker), 600)
        deadline = time.monotonic() + 120
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        pid = int(marker.read_text())
        os.kill(pid, signal.SIGSTOP)
        with pytest.raises(WorkerUnresponsiveError, match="not even a heartbeat"):
            future.result(timeout=120)  # a hang detector
        assert d.submit(sleep_then, 0, "fresh").result(timeout=120) == "fresh"
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


class ExitsWhenUnpickled:
    def __reduce__(self) -> Any:
        return (sys.exit, ("unpickling this result calls sys.exit",))


def returns_a_result_that_exits_when_unpickled() -> Any:
    return ExitsWhenUnpickled()


def test_a_result_whose_unpickling_raises_system_exit_fails_its_task(
    local: LocalDispatcher,
) -> None:
    future = local.submit(returns_a_result_that_exits_when_unpickled)
    with pytest.raises(RemoteTaskError, match="could not be unpickled: SystemExit"):
        future.result(timeout=120)  # a hang detector
    assert local.submit(sleep_then, 0, 1).result(timeout=120) == 1  # the reader lives on


def test_close_without_wait_fails_pending_tasks_with_dispatcher_closed() -> None:
    d = LocalDispatcher(threads=1, max_pending=3)
    running = d.submit(sleep_then, 600, "never")
    queued = d.submit(sleep_then, 0, "queued")
    pid = d.worker_pid
    d.close(wait=False)
    for future in (running, queued):
        with pytest.raises(DispatcherClosedError, match="closed before task"):
            future.result(timeout=60)
    assert pid is not None
    proc = psutil.Process(pid) if psutil.pid_exists(pid) else None
    if proc is not None:
        proc.wait(timeout=60)  # killed, not left running the stuck task
