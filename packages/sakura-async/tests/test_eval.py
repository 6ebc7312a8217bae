"""AsyncEval on the in-process dispatchers, through a raw loop's events."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from sakura import OnError, OnValidationEnd, SakuraRuntime
from sakura.testing import RecordingService
from sakura_async import AsyncEval, EvalTask
from sakura_async.dispatch import InThreadDispatcher, ThreadDispatcher


def results_of(rec: RecordingService) -> list[tuple[int, int, dict[str, Any]]]:
    return [(e.epoch, e.step, dict(e.metrics)) for e in rec.of(OnValidationEnd)]


@pytest.mark.parametrize("make", [InThreadDispatcher, ThreadDispatcher])
def test_each_epoch_gets_exactly_the_synchronous_metrics(world: Any, make: type) -> None:
    rec = RecordingService(event_types={OnValidationEnd, OnError})
    with make() as dispatcher, SakuraRuntime([rec], strict=True) as rt:
        ae = rt.install(
            AsyncEval(world.eval_fn, world.val_payload(), dispatcher=dispatcher, pass_task=True)
        )
        _, reference = world.train(rt, epochs=3)
    steps = [world.STEPS_PER_EPOCH * (e + 1) for e in range(3)]
    assert results_of(rec) == [(e, steps[e], reference[e]) for e in range(3)]  # bit-identical
    assert [r.metrics for r in ae.history] == reference
    assert rec.of(OnError) == []


def test_snapshot_is_that_epochs_weights_even_while_training_moves_on(world: Any) -> None:
    """The evaluation of epoch 0 only starts after epoch 1 changed the live weights."""
    go = threading.Event()

    def slow_eval(epoch: int, task: EvalTask) -> dict[str, float]:
        if epoch == 0:
            assert go.wait(30)
        return world.eval_fn(epoch, task)

    def after_epoch(epoch: int, model: Any) -> None:
        if epoch == 1:
            go.set()

    rec = RecordingService(event_types={OnValidationEnd})
    with SakuraRuntime([rec], strict=True) as rt:
        rt.install(AsyncEval(slow_eval, world.val_payload(), dispatcher="thread", max_pending=2))
        _, reference = world.train(rt, epochs=3, after_epoch=after_epoch)
    assert [dict(e.metrics) for e in rec.of(OnValidationEnd)] == reference


def test_results_arrive_in_epoch_order_and_pending_is_bounded(world: Any) -> None:
    observed: list[int] = []

    class Probe:
        name = "probe"
        priority = 90  # after AsyncEval

        def on_epoch_end(self, event: Any) -> None:
            observed.append(len(ae._pending))

    rec = RecordingService(event_types={OnValidationEnd})
    with SakuraRuntime([rec, Probe()], strict=True) as rt:
        ae = rt.install(
            AsyncEval(
                world.eval_fn,
                world.val_payload(),
                dispatcher=ThreadDispatcher(threads=2),
                pass_task=True,
                max_pending=2,
            )
        )
        world.train(rt, epochs=5)
    assert [e.epoch for e in rec.of(OnValidationEnd)] == [0, 1, 2, 3, 4]
    assert max(observed) <= 2
    assert ae._pending == type(ae._pending)()


def test_every_n_epochs(world: Any) -> None:
    rec = RecordingService(event_types={OnValidationEnd})
    with SakuraRuntime([rec], strict=True) as rt:
        rt.install(
            AsyncEval(
                world.eval_fn, world.val_payload(), dispatcher="inthread", every=2, pass_task=True
            )
        )
        world.train(rt, epochs=5)
    assert [e.epoch for e in rec.of(OnValidationEnd)] == [1, 3]


def test_a_failing_evaluation_is_an_on_error_and_training_goes_on(world: Any) -> None:
    def flaky(epoch: int, task: EvalTask) -> dict[str, float]:
        if epoch == 1:
            raise RuntimeError("eval exploded")
        return world.eval_fn(epoch, task)

    rec = RecordingService(event_types={OnValidationEnd, OnError})
    with SakuraRuntime([rec]) as rt:
        ae = rt.install(AsyncEval(flaky, world.val_payload(), dispatcher="thread"))
        _, reference = world.train(rt, epochs=3)
    assert [e.epoch for e in rec.of(OnValidationEnd)] == [0, 2]
    (error,) = rec.of(OnError)
    assert error.source == "async_eval" and error.epoch == 1
    assert "eval exploded" in str(error.exception)
    assert [r.epoch for r in ae.errors] == [1]
    assert dict(rec.of(OnValidationEnd)[1].metrics) == reference[2]


def test_eval_fn_must_return_a_mapping(world: Any) -> None:
    rec = RecordingService(event_types={OnError})
    with SakuraRuntime([rec]) as rt:
        rt.install(AsyncEval(lambda epoch, task: 0.5, dispatcher="inthread"))
        world.train(rt, epochs=1)
    (error,) = rec.of(OnError)
    assert "eval_fn must return a mapping" in str(error.exception)


def test_the_last_evaluation_is_drained_when_the_runtime_exits(world: Any) -> None:
    """No OnTrainEnd (the loop was interrupted): the runtime's drain still delivers."""
    rec = RecordingService(event_types={OnValidationEnd})
    release = threading.Event()

    def slow(epoch: int, task: EvalTask) -> dict[str, float]:
        release.wait(30)
        return world.eval_fn(epoch, task)

    from sakura import OnEpochEnd

    with SakuraRuntime([rec], strict=True) as rt:
        rt.install(AsyncEval(slow, world.val_payload(), dispatcher="thread"))
        model = world.make_model()
        rt.emit(OnEpochEnd, epoch=0, step=4, model=model)
        release.set()
    assert [e.epoch for e in rec.of(OnValidationEnd)] == [0]


def test_without_eval_fn_setup_explains_what_to_do() -> None:
    ae = AsyncEval(dispatcher="inthread")
    with pytest.raises(ValueError, match=r"no eval_fn.*configure"):
        SakuraRuntime([ae]).start()


def test_configure_supplies_the_eval_fn_later(world: Any) -> None:
    rec = RecordingService(event_types={OnValidationEnd})
    ae = AsyncEval(dispatcher="inthread").configure(
        world.eval_fn, world.val_payload(), pass_task=True
    )
    with SakuraRuntime([rec, ae], strict=True) as rt:
        _, reference = world.train(rt, epochs=1)
    assert [dict(e.metrics) for e in rec.of(OnValidationEnd)] == reference


def test_only_rank_zero_evaluates_by_default(world: Any) -> None:
    rec = RecordingService(event_types={OnValidationEnd})
    with SakuraRuntime([rec], rank=1, world_size=2, strict=True) as rt:
        rt.install(
            AsyncEval(world.eval_fn, world.val_payload(), dispatcher="inthread", pass_task=True)
        )
        world.train(rt, epochs=2)
    assert rec.of(OnValidationEnd) == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"every": 0}, r"AsyncEval: every=0 is not accepted; accepted: an int >= 1"),
        ({"max_pending": 0}, r"AsyncEval: max_pending=0 is not accepted; accepted: an int >= 1"),
        ({"ranks": "one"}, r"AsyncEval: ranks='one' is not accepted; accepted: 'zero', 'all'"),
        ({"report_to": 3}, r"AsyncEval: report_to=3 is not accepted; accepted: 'auto'"),
        ({"eval_fn": 3}, r"AsyncEval: eval_fn=3 is not accepted; accepted: a callable"),
        ({"eval_fn": lambda epoch: {}}, r"eval_fn=.* cannot be called with two positional"),
        (
            {"pass_task": 1},
            r"AsyncEval: pass_task=1 is not accepted; accepted: True, False or None",
        ),
        ({"dispatcher": 3}, "dispatcher must be a sakura_async dispatcher"),
        ({"state_provider": 1}, r"AsyncEval: state_provider=1 is not accepted; accepted: a call"),
        (
            {"state_provider": lambda m: {}, "pass_task": False},
            r"state_provider=.* accepted: None with pass_task=False",
        ),
        ({"name": ""}, r"AsyncEval: name='' is not accepted; accepted: a non-empty string"),
    ],
)
def test_options_are_validated(kwargs: dict, match: str) -> None:
    options = {"eval_fn": lambda e, t: {}}
    options.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=match):
        AsyncEval(**options)


# --- the two forms of eval_fn's second argument -------------------------------------------


def test_by_default_eval_fn_receives_the_payload_as_the_reference_contract_says(
    world: Any,
) -> None:
    """``eval_fn(epoch, payload)`` with ``payload`` being ``eval_payload`` itself; the
    function evaluates the model it holds (here the live one, synchronously)."""
    seen: list[tuple[int, Any]] = []
    holder: dict[str, Any] = {}
    payload = world.val_payload()

    def eval_fn(epoch, payload):  # the reference's untyped spelling
        seen.append((epoch, payload))
        return world.evaluate(holder["model"], payload)  # indexes payload["x"], ["y"]

    def after_epoch(epoch: int, model: Any) -> None:
        holder["model"] = model

    rec = RecordingService(event_types={OnValidationEnd, OnError})
    with SakuraRuntime([rec], strict=True) as rt:
        # Remember the model before AsyncEval's epoch end runs: train() passes it.
        class Keep:
            name, priority = "keep", 10

            def on_train_begin(self, event: Any) -> None:
                holder["model"] = event.model

        rt.install(Keep())
        ae = rt.install(AsyncEval(eval_fn=eval_fn, eval_payload=payload, dispatcher="inthread"))
        _, reference = world.train(rt, epochs=3, after_epoch=after_epoch)
    assert ae.pass_task is False and ae._pool is None  # no snapshot is taken
    assert [epoch for epoch, _ in seen] == [0, 1, 2]
    assert all(p is payload for _, p in seen)
    assert results_of(rec) == [(e, world.STEPS_PER_EPOCH * (e + 1), reference[e]) for e in range(3)]
    assert rec.of(OnError) == []


def test_an_eval_task_annotation_selects_the_task_form(world: Any) -> None:
    def eval_fn(epoch: int, task: EvalTask) -> dict[str, float]:
        assert isinstance(task, EvalTask)
        return world.eval_fn(epoch, task)

    rec = RecordingService(event_types={OnValidationEnd})
    with SakuraRuntime([rec], strict=True) as rt:
        ae = rt.install(AsyncEval(eval_fn, world.val_payload(), dispatcher="inthread"))
        _, reference = world.train(rt, epochs=2)
    assert ae.pass_task is True
    assert [dict(e.metrics) for e in rec.of(OnValidationEnd)] == reference


def test_pass_task_false_contradicting_an_eval_task_annotation_is_an_error() -> None:
    def eval_fn(epoch: int, task: EvalTask) -> dict[str, float]:
        return {}

    with pytest.raises(ValueError, match=r"pass_task=False is not accepted.*annotated EvalTask"):
        AsyncEval(eval_fn, pass_task=False)


def test_a_payload_form_eval_fn_that_expects_a_task_gets_a_note_on_its_error(world: Any) -> None:
    rec = RecordingService(event_types={OnError})
    with SakuraRuntime([rec]) as rt:
        rt.install(AsyncEval(world.eval_fn, world.val_payload(), dispatcher="inthread"))
        world.train(rt, epochs=1)
    (error,) = rec.of(OnError)
    assert isinstance(error.exception, AttributeError)
    notes = "\n".join(getattr(error.exception, "__notes__", []))
    assert "eval_fn received eval_payload (a dict)" in notes and "pass_task=True" in notes


def test_a_task_form_eval_fn_that_indexes_its_argument_gets_a_note_on_its_error(
    world: Any,
) -> None:
    rec = RecordingService(event_types={OnError})
    with SakuraRuntime([rec]) as rt:
        fn = lambda epoch, payload: {"n": len(payload["x"])}  # noqa: E731
        rt.install(AsyncEval(fn, world.val_payload(), dispatcher="inthread", pass_task=True))
        world.train(rt, epochs=1)
    (error,) = rec.of(OnError)
    assert isinstance(error.exception, TypeError) and "EvalTask" in str(error.exception)
    notes = "\n".join(getattr(error.exception, "__notes__", []))
    assert "the eval_payload is task.payload" in notes


def test_configure_chooses_the_form_too(world: Any) -> None:
    payload = world.val_payload()
    seen: list[Any] = []

    def by_payload(epoch, payload):
        seen.append(payload)
        return {"n": float(len(payload["y"]))}

    ae = AsyncEval(dispatcher="inthread").configure(by_payload, payload)
    assert ae.pass_task is False
    with SakuraRuntime([ae], strict=True) as rt:
        world.train(rt, epochs=1)
    assert seen == [payload] and ae.history[0].metrics == {"n": 64.0}
    with pytest.raises(ValueError, match="state_provider"):
        AsyncEval(state_provider=lambda m: {}, pass_task=True).configure(
            by_payload, pass_task=False
        )


def test_a_state_provider_implies_the_task_form(world: Any) -> None:
    """A state_provider says what to snapshot: without pass_task, the task form is taken
    (an eval_fn(epoch, task) written for the snapshot form keeps working)."""
    seen: list[Any] = []

    def eval_fn(epoch, task):
        seen.append(task)
        return world.eval_fn(epoch, task)

    ae = AsyncEval(
        eval_fn, world.val_payload(), dispatcher="inthread", state_provider=lambda m: m.state_dict()
    )
    assert ae.pass_task is True
    with SakuraRuntime([ae], strict=True) as rt:
        _, reference = world.train(rt, epochs=2)
    assert all(isinstance(t, EvalTask) for t in seen)
    assert [r.metrics for r in ae.history] == reference
