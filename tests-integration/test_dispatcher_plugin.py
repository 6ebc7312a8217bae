"""A third-party dispatcher (sakura-example-dispatcher, installed from its wheel) written
against sakura-async's public contract only: it is discovered, AsyncEval and
AsyncCheckpoint run through it by name in a real training loop, and timeouts, closing
without waiting and failing tasks behave as the contract says.

Every test here turns DeprecationWarning into an error: the example uses the public
contract only.
"""

from __future__ import annotations

import copy
import importlib.metadata as md
import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from sakura_example_dispatcher import JournalDispatcher
from torch import nn

from sakura import OnEpochEnd, OnError, SakuraRuntime
from sakura.errors import SpecError
from sakura.options import OptionError
from sakura.testing import RecordingService, run_tiny_loop
from sakura_async import AsyncCheckpoint, AsyncEval, EvalTask, find_checkpoints, load_latest
from sakura_async.errors import DispatcherClosedError, TaskTimeoutError

pytestmark = pytest.mark.filterwarnings("error::DeprecationWarning")

Run = Callable[..., subprocess.CompletedProcess[str]]  # the fixtures of conftest.py

DISTRIBUTION = "sakura-example-dispatcher"
WAIT_S = 60.0  # bound on every wait for another thread; never reached when things work


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


# --- helpers -------------------------------------------------------------------------------


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def val_payload() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return {
        "x": torch.randn(32, 8, generator=generator),
        "y": torch.randint(0, 4, (32,), generator=generator),
    }


def evaluate(state_dict: Any, payload: dict[str, torch.Tensor]) -> dict[str, float]:
    model = make_model()
    model.load_state_dict(state_dict)
    model.eval()
    with torch.no_grad():
        logits = model(payload["x"])
    loss = nn.functional.cross_entropy(logits, payload["y"])
    accuracy = (logits.argmax(1) == payload["y"]).float().mean()
    return {"val_loss": loss.item(), "val_acc": accuracy.item()}


def eval_fn(epoch: int, task: EvalTask) -> dict[str, float]:
    return evaluate(task.state_dict, task.payload)


class EpochWeights:
    """Keeps a copy of the live weights at each epoch end: the synchronous reference."""

    name = "epoch_weights"
    priority = 50

    def __init__(self) -> None:
        self.states: list[dict[str, torch.Tensor]] = []

    def on_epoch_end(self, event: OnEpochEnd) -> None:
        self.states.append(copy.deepcopy(event.model.state_dict()))


def journal_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def wait_for_journal(path: Path, count: int) -> list[dict[str, Any]]:
    """The journal once it has ``count`` lines (a retired thread writes its line when its
    call returns); fails after WAIT_S."""
    until = time.monotonic() + WAIT_S
    while len(lines := journal_lines(path)) < count:
        if time.monotonic() > until:
            pytest.fail(f"{path} has {len(lines)} lines after {WAIT_S} s, expected {count}")
        time.sleep(0.05)
    return lines


# --- discovery -----------------------------------------------------------------------------


def test_sakura_plugins_json_lists_the_dispatcher(sakura_cli: Run) -> None:
    report = json.loads(sakura_cli(["plugins", "--json"]).stdout)
    assert report["failures"] == []
    found = [p for p in report["plugins"] if p["distribution"] == DISTRIBUTION]
    assert found == [
        {
            "name": "example-dispatcher",
            "distribution": DISTRIBUTION,
            "version": md.version(DISTRIBUTION),
            "module": "sakura_example_dispatcher.plugin",
            "provides": {"dispatcher": ["journal"]},
        }
    ]
    async_plugin = [p for p in report["plugins"] if p["distribution"] == "sakura-async"]
    assert "journal" not in async_plugin[0]["provides"]["dispatcher"]


def test_the_facade_and_the_name_build_the_dispatcher(tmp_path: Path) -> None:
    from sakura.dispatch import JournalDispatcher as from_facade
    from sakura.plugins import get_plugin_manager

    assert from_facade is JournalDispatcher
    journal = tmp_path / "journal.jsonl"
    built = get_plugin_manager().create("dispatcher", f"journal:journal={journal},max_pending=3")
    assert isinstance(built, JournalDispatcher)
    assert (built.journal, built.max_pending, built.kind) == (str(journal), 3, "journal")
    built.close()


def test_listing_plugins_does_not_import_the_dispatcher(run: Run) -> None:
    code = (
        "import sys\n"
        "from sakura.plugins import get_plugin_manager\n"
        "get_plugin_manager()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'sakura_async'}))\n"
    )
    assert run([sys.executable, "-c", code]).stdout.strip() == "[]"


def test_importing_the_example_raises_no_deprecation_warning(run: Run) -> None:
    code = "import sakura_example_dispatcher.dispatcher, sakura_example_dispatcher.plugin\n"
    run([sys.executable, "-W", "error::DeprecationWarning", "-c", code])


# --- AsyncEval and AsyncCheckpoint by name, in a training loop -------------------------------


def test_async_eval_by_name_gives_the_synchronous_results(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="sakura_example_dispatcher")
    weights = EpochWeights()
    payload = val_payload()
    with SakuraRuntime([weights], strict=True) as rt:
        ae = rt.install(AsyncEval(eval_fn, payload, dispatcher="journal", pass_task=True))
        dispatcher = ae.dispatcher
        assert isinstance(dispatcher, JournalDispatcher)
        assert dispatcher.owned_by_service
        run_tiny_loop(rt, epochs=3, steps_per_epoch=4, model=make_model())
    reference = [evaluate(state, payload) for state in weights.states]
    assert len(reference) == 3
    # The same computation on the same weights in the same process: bit-identical.
    assert [r.metrics for r in ae.history] == reference
    assert [r.epoch for r in ae.history] == [0, 1, 2]
    assert reference[0] != reference[2]  # the weights did move between epochs
    assert dispatcher.closed  # built from the name, so the service closed it
    records = [r for r in caplog.records if r.name == "sakura_example_dispatcher"]
    outcomes = [r.getMessage().rsplit(": ", 1)[1] for r in records]
    assert outcomes == ["ok", "ok", "ok"]


def test_a_failing_evaluation_is_an_on_error_and_the_next_one_runs() -> None:
    def flaky(epoch: int, task: EvalTask) -> dict[str, float]:
        if epoch == 1:
            raise RuntimeError("evaluation exploded")
        return eval_fn(epoch, task)

    weights = EpochWeights()
    errors = RecordingService(event_types={OnError})
    payload = val_payload()
    with SakuraRuntime([weights, errors]) as rt:
        ae = rt.install(AsyncEval(flaky, payload, dispatcher="journal", pass_task=True))
        run_tiny_loop(rt, epochs=3, steps_per_epoch=2, model=make_model())
    assert [r.epoch for r in ae.history] == [0, 1, 2]
    assert ae.history[0].metrics == evaluate(weights.states[0], payload)
    assert ae.history[2].metrics == evaluate(weights.states[2], payload)
    assert isinstance(ae.history[1].error, RuntimeError)
    assert "evaluation exploded" in str(ae.history[1].error)
    assert [type(e.exception) for e in errors.of(OnError)] == [RuntimeError]


def test_async_checkpoint_by_name_writes_loadable_checkpoints(tmp_path: Path) -> None:
    journal = tmp_path / "journal.jsonl"
    root = tmp_path / "ckpt"
    with SakuraRuntime() as rt:
        ckpt = rt.install(
            AsyncCheckpoint(root, every=1, keep=None, dispatcher=f"journal:journal={journal}")
        )
        dispatcher = ckpt.dispatcher
        assert isinstance(dispatcher, JournalDispatcher)
        assert dispatcher.journal == str(journal)
        result = run_tiny_loop(rt, epochs=2, steps_per_epoch=3, model=make_model())
    assert dispatcher.closed
    found = find_checkpoints(root)
    assert [c.epoch for c in found] == [0, 1]
    latest = load_latest(root)  # weights_only=True
    assert latest is not None and (latest.epoch, latest.step) == (1, 6)
    final = result.model.state_dict()
    assert sorted(latest.state["model"]) == sorted(final)
    for name, tensor in final.items():
        assert torch.equal(latest.state["model"][name], tensor), name
    lines = journal_lines(journal)
    assert [line["outcome"] for line in lines] == ["ok"] * len(lines)
    assert len(lines) >= len(found)  # at least one task per checkpoint written
    assert all(line["error"] is None and line["run_s"] >= 0 for line in lines)


# --- the contract: timeouts, close(wait=False), exceptions, options --------------------------


def test_a_task_that_times_out_fails_and_the_next_runs_on_a_fresh_thread(
    tmp_path: Path,
) -> None:
    journal = tmp_path / "journal.jsonl"
    release = threading.Event()

    def stuck_call() -> str:
        release.wait(WAIT_S)
        return threading.current_thread().name

    def thread_name() -> str:
        return threading.current_thread().name

    with JournalDispatcher(journal, task_timeout=0.5) as dispatcher:
        first = dispatcher.submit(thread_name).result(timeout=WAIT_S)
        stuck = dispatcher.submit(stuck_call)
        with pytest.raises(TaskTimeoutError, match=r"task_timeout=0\.5"):
            stuck.result(timeout=WAIT_S)
        # The thread stuck in the call was retired: a fresh one runs the next task.
        assert dispatcher.submit(thread_name).result(timeout=WAIT_S) != first
        assert dispatcher.submit(sum, [1, 2, 3]).result(timeout=WAIT_S) == 6
        release.set()
        lines = wait_for_journal(journal, 4)
    outcomes = sorted((line["name"].rsplit(".", 1)[-1], line["outcome"]) for line in lines)
    # The stuck call returned after its future had failed: its result was dropped.
    assert outcomes == [
        ("stuck_call", "late"),
        ("sum", "ok"),
        ("thread_name", "ok"),
        ("thread_name", "ok"),
    ]


def test_close_without_waiting_fails_the_unfinished_tasks(tmp_path: Path) -> None:
    journal = tmp_path / "journal.jsonl"
    release = threading.Event()
    started = threading.Event()

    def blocking() -> str:
        started.set()
        assert release.wait(WAIT_S)
        return "finished"

    dispatcher = JournalDispatcher(journal, max_pending=2)
    running = dispatcher.submit(blocking)
    queued = dispatcher.submit(sum, [1, 2])
    assert started.wait(WAIT_S)
    worker = next(t for t in threading.enumerate() if t.name.startswith("journal-"))
    dispatcher.close(wait=False)  # returns at once although a task is running
    for future in (running, queued):
        with pytest.raises(DispatcherClosedError):
            future.result(timeout=WAIT_S)
    with pytest.raises(DispatcherClosedError):
        dispatcher.submit(sum, [1])
    release.set()
    worker.join(WAIT_S)
    assert not worker.is_alive()  # it read the stop marker after the queued task
    outcomes = {line["name"]: line["outcome"] for line in wait_for_journal(journal, 2)}
    assert outcomes == {
        "test_close_without_waiting_fails_the_unfinished_tasks.<locals>.blocking": "late",
        "sum": "skipped",
    }


def test_close_waits_for_the_tasks_by_default(tmp_path: Path) -> None:
    journal = tmp_path / "journal.jsonl"
    dispatcher = JournalDispatcher(journal, max_pending=3)
    futures = [dispatcher.submit(pow, 2, n) for n in range(5)]  # blocks beyond 3 pending
    dispatcher.close()
    assert [f.result(timeout=0) for f in futures] == [1, 2, 4, 8, 16]
    lines = journal_lines(journal)
    assert [line["task"] for line in lines] == [f.task_id for f in futures]  # in order
    assert {line["outcome"] for line in lines} == {"ok"}
    assert all(f.timings.run_s is not None and f.timings.total_s >= 0 for f in futures)


def test_an_exception_in_a_task_reaches_the_caller_and_the_next_task_runs(
    tmp_path: Path,
) -> None:
    journal = tmp_path / "journal.jsonl"
    error = ValueError("bad input")

    def fails() -> None:
        raise error

    with JournalDispatcher(journal) as dispatcher:
        failed = dispatcher.submit(fails)
        assert failed.exception(timeout=WAIT_S) is error
        with pytest.raises(ValueError, match="bad input"):
            failed.result(timeout=0)
        assert dispatcher.submit(max, 3, 7).result(timeout=WAIT_S) == 7
    assert [(line["outcome"], line["error"]) for line in journal_lines(journal)] == [
        ("error", "ValueError"),
        ("ok", None),
    ]


def test_a_task_that_cannot_start_fails_in_submit() -> None:
    with JournalDispatcher() as dispatcher, pytest.raises(TypeError, match="needs a callable"):
        dispatcher.submit("not callable")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"journal": 3}, r"JournalDispatcher: journal=3 is not accepted; accepted: a file path"),
        ({"journal": ""}, r"JournalDispatcher: journal='' is not accepted"),
        ({"max_pending": 0}, r"JournalDispatcher: max_pending=0 is not accepted"),
        ({"task_timeout": -1}, r"JournalDispatcher: task_timeout=-1 is not accepted"),
    ],
)
def test_wrong_options_are_named(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(OptionError, match=message):
        JournalDispatcher(**kwargs)


def test_a_service_spec_string_names_the_dispatcher() -> None:
    from sakura.plugins import get_plugin_manager

    service = get_plugin_manager().create(
        "service", "async_checkpoint:journal,dir=ckpt,journal=run.jsonl"
    )
    try:
        assert isinstance(service.dispatcher, JournalDispatcher)
        # An option the service does not take goes to the dispatcher.
        assert service.dispatcher.journal == str(Path("run.jsonl").resolve())
        assert service.dispatcher.owned_by_service  # built for the service: it closes it
    finally:
        service.dispatcher.close()
    with pytest.raises(SpecError, match=r"unknown dispatcher 'jornal'; accepted: .*journal"):
        get_plugin_manager().create("service", "async_eval:jornal")
