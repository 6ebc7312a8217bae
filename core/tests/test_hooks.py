"""One test per hookspec (datasette's rule), and the meta-tests that enforce it.

Event hooks are covered by ``test_event_hook`` with hand-written sample fields per event,
so a new event without an entry here fails ``test_every_hookspec_has_a_test``.
"""

from __future__ import annotations

import re
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from sakura import SakuraRuntime, Service, hookspecs
from sakura.cli import hook_signatures
from sakura.events import EVENT_TYPES, OnEpochEnd, OnError
from sakura.plugins import get_plugin_manager

REPO = Path(__file__).resolve().parents[2]

M, OPT, B = object(), object(), object()
EVENT_SAMPLES: dict[str, dict[str, Any]] = {
    "on_setup": {"stage": "validate", "model": M},
    "on_teardown": {"stage": "test", "model": M},
    "on_fit_begin": {"model": M},
    "on_fit_end": {"model": M},
    "on_sanity_check_begin": {"model": M},
    "on_sanity_check_end": {"model": M},
    "on_train_begin": {"model": M, "optimizer": OPT, "train_loader": [B]},
    "on_train_end": {"model": M, "metrics": {"val_loss": 0.1}},
    "on_epoch_begin": {"model": M, "epoch": 3},
    "on_epoch_end": {"model": M, "optimizer": OPT, "metrics": {"train_loss": 0.5}, "epoch": 3},
    "on_train_step_begin": {"model": M, "batch": B, "batch_idx": 4, "step": 9},
    "on_train_step_end": {"model": M, "batch": B, "batch_idx": 4, "loss": 0.3, "outputs": {"x": 1}},
    "on_substep_end": {"model": M, "batch_idx": 1},
    "on_before_backward": {"model": M, "loss": 1.25},
    "on_after_backward": {"model": M, "loss": 1.25},
    "on_before_optimizer_step": {"model": M, "optimizer": OPT},
    "on_optimizer_step": {"model": M, "optimizer": OPT, "step": 10},
    "on_before_zero_grad": {"model": M, "optimizer": OPT},
    "on_log": {"logs": {"loss": 0.2, "learning_rate": 1e-3}},
    "on_validation_begin": {"model": M},
    "on_validation_end": {"model": M, "metrics": {"val_acc": 0.9}},
    "on_validation_epoch_begin": {"model": M},
    "on_validation_epoch_end": {"model": M, "metrics": {"val_acc": 0.9}},
    "on_validation_batch_begin": {"model": M, "batch": B, "batch_idx": 2, "dataloader_idx": 1},
    "on_validation_batch_end": {
        "model": M,
        "batch": B,
        "batch_idx": 2,
        "dataloader_idx": 1,
        "outputs": 0.4,
    },
    "on_test_begin": {"model": M},
    "on_test_end": {"model": M, "metrics": {"test_acc": 0.8}},
    "on_test_epoch_begin": {"model": M},
    "on_test_epoch_end": {"model": M, "metrics": {"test_acc": 0.8}},
    "on_test_batch_begin": {"model": M, "batch": B, "batch_idx": 5, "dataloader_idx": 0},
    "on_test_batch_end": {
        "model": M,
        "batch": B,
        "batch_idx": 5,
        "dataloader_idx": 0,
        "outputs": [1],
    },
    "on_predict_begin": {"model": M},
    "on_predict_end": {"model": M, "metrics": {"n": 3}},
    "on_predict_epoch_begin": {"model": M},
    "on_predict_epoch_end": {"model": M},
    "on_predict_batch_begin": {"model": M, "batch": B, "batch_idx": 6, "dataloader_idx": 0},
    "on_predict_batch_end": {
        "model": M,
        "batch": B,
        "batch_idx": 6,
        "dataloader_idx": 0,
        "outputs": [2],
    },
    "on_save_checkpoint": {
        "model": M,
        "checkpoint": {"state_dict": {}},
        "path": "/ckpt/epoch=1.ckpt",
    },
    "on_load_checkpoint": {
        "model": M,
        "checkpoint": {"state_dict": {}},
        "path": "/ckpt/epoch=1.ckpt",
    },
    "on_push_begin": {"model": M, "path": "org/model"},
    "on_error": {"exception": ValueError("x"), "source": "lightning"},
}


def _single_hook_service(hook: str, sink: list[Any]) -> Service:
    service = Service()
    service.name = f"only_{hook}"
    setattr(service, hook, sink.append)
    return service


@pytest.mark.parametrize("hook", sorted(EVENT_SAMPLES))
def test_event_hook(hook: str) -> None:
    """Each event hook receives exactly its event, with the fields the emitter set."""
    received: list[Any] = []
    rt = SakuraRuntime([_single_hook_service(hook, received)], rank=1, world_size=2)
    for cls in EVENT_TYPES:  # every other event passes it by
        if cls.hook != hook:
            rt.emit(cls)
    assert received == []
    [cls] = [c for c in EVENT_TYPES if c.hook == hook]
    rt.emit(cls, **EVENT_SAMPLES[hook])
    [event] = received
    assert type(event) is cls and (event.rank, event.world_size) == (1, 2)
    for name, value in EVENT_SAMPLES[hook].items():
        assert getattr(event, name) is value or getattr(event, name) == value


# --- lifecycle ----------------------------------------------------------------------------


class Journal(Service):
    def __init__(self) -> None:
        self.calls: list[Any] = []

    def setup(self, runtime: SakuraRuntime) -> None:
        self.calls.append(("setup", runtime))

    def drain(self) -> None:
        self.calls.append("drain")

    def teardown(self) -> None:
        self.calls.append("teardown")


def test_hook_setup() -> None:
    journal = Journal()
    with SakuraRuntime([journal]) as rt:
        assert journal.calls == [("setup", rt)]


def test_hook_drain() -> None:
    journal = Journal()
    with SakuraRuntime([journal]):
        pass
    assert journal.calls[1:] == ["drain", "teardown"]


def test_hook_teardown() -> None:
    journal = Journal()
    with pytest.raises(KeyboardInterrupt), SakuraRuntime([journal]):
        raise KeyboardInterrupt
    assert journal.calls[-1] == "teardown"


# --- coordinated calls ----------------------------------------------------------------------


class Coordinated(Service):
    def __init__(self) -> None:
        self.state = {"count": 0}
        self.unscaled: list[Any] = []

    def wrap_model(self, model: Any) -> Any:
        return ("model", model)

    def wrap_optimizer(self, optimizer: Any) -> Any:
        return ("optimizer", optimizer)

    @contextmanager
    def autocast(self) -> Any:
        self.state["count"] += 1
        yield

    def wrap_loss(self, loss: Any) -> Any:
        return loss * 10

    def unscale_gradients(self, optimizer: Any) -> None:
        self.unscaled.append(optimizer)

    def loss_scale(self) -> float | None:
        return 10.0

    def optimizer_step(self, optimizer: Any) -> bool:
        return optimizer == "mine"

    def state_dict(self) -> dict[str, Any]:
        return dict(self.state)

    def load_state_dict(self, state: Any) -> None:
        self.state = dict(state)


def test_hook_wrap_model() -> None:
    assert SakuraRuntime([Coordinated()]).prepare("m")[0] == ("model", "m")


def test_hook_wrap_optimizer() -> None:
    assert SakuraRuntime([Coordinated()]).prepare("m", "o")[1] == ("optimizer", "o")


def test_hook_autocast() -> None:
    service = Coordinated()
    rt = SakuraRuntime([service])
    with rt.autocast():
        pass
    assert service.state["count"] == 1


def test_hook_wrap_loss() -> None:
    assert SakuraRuntime([Coordinated()]).scale_loss(2) == 20


def test_hook_unscale_gradients() -> None:
    service = Coordinated()
    SakuraRuntime([service]).unscale_gradients("opt")
    assert service.unscaled == ["opt"]


def test_hook_loss_scale() -> None:
    class NotScalingNow(Service):
        def loss_scale(self) -> float | None:
            return None

    class Halves(Service):
        def loss_scale(self) -> float | None:
            return 0.5

    assert SakuraRuntime().loss_scale() is None
    assert SakuraRuntime([NotScalingNow()]).loss_scale() is None
    assert SakuraRuntime([Coordinated(), NotScalingNow()]).loss_scale() == 10.0
    assert SakuraRuntime([Coordinated(), Halves()]).loss_scale() == 5.0  # the product


def test_hook_optimizer_step() -> None:
    rt = SakuraRuntime([Coordinated()])
    assert rt.optimizer_step("mine") is True and rt.optimizer_step("theirs") is False


def test_hook_state_dict() -> None:
    assert SakuraRuntime([Coordinated()]).state_dict() == {"coordinated": {"count": 0}}


def test_hook_load_state_dict() -> None:
    service = Coordinated()
    SakuraRuntime([service]).load_state_dict({"coordinated": {"count": 7}})
    assert service.state == {"count": 7}


def test_hook_on_event() -> None:
    seen: list[Any] = []
    service = _single_hook_service("on_event", seen)
    rt = SakuraRuntime([service])
    for cls in EVENT_TYPES:
        rt.emit(cls)
    assert [type(e) for e in seen] == list(EVENT_TYPES)


def test_hook_on_event_runs_after_the_specific_handler() -> None:
    order: list[str] = []

    class Both(Service):
        def on_epoch_end(self, event: OnEpochEnd) -> None:
            order.append("specific")

        def on_event(self, event: Any) -> None:
            order.append("catch-all")

    SakuraRuntime([Both()]).emit(OnEpochEnd)
    assert order == ["specific", "catch-all"]


# --- plugin hooks ------------------------------------------------------------------------

PLUGIN = """
from sakura import hookimpl, hookspec

class Thing:
    '''A {kind}.'''
    def __init__(self, value=0):
        self.value = value

class Specs:
    @hookspec
    def sakura_register_widgets(self, register):
        '''Offer widgets.'''

@hookimpl
def sakura_add_hookspecs(pluginmanager):
    pluginmanager.add_hookspecs(Specs)

@hookimpl
def sakura_register_widgets(register):
    register("widget")

@hookimpl
def sakura_register_{kind}s(register):
    register("thing", Thing)
"""


@pytest.fixture
def thing_plugin(make_distribution: Any, request: pytest.FixtureRequest) -> str:
    kind = request.param
    make_distribution(f"sakura-{kind}-thing", f"sakura_{kind}_thing", PLUGIN.format(kind=kind))
    return str(kind)


@pytest.mark.parametrize("thing_plugin", ["service"], indirect=True)
def test_hook_sakura_register_services(thing_plugin: str) -> None:
    assert get_plugin_manager().create("service", "thing:5").value == 5


@pytest.mark.parametrize("thing_plugin", ["dispatcher"], indirect=True)
def test_hook_sakura_register_dispatchers(thing_plugin: str) -> None:
    assert get_plugin_manager().create("dispatcher", "thing:value=6").value == 6
    from sakura.dispatch import Thing  # type: ignore[attr-defined]

    assert Thing(1).value == 1


@pytest.mark.parametrize("thing_plugin", ["adapter"], indirect=True)
def test_hook_sakura_register_adapters(thing_plugin: str) -> None:
    assert get_plugin_manager().create("adapter", "thing").value == 0
    from sakura.adapters import Thing  # type: ignore[attr-defined]

    assert Thing.__doc__ == "A adapter."


@pytest.mark.parametrize("thing_plugin", ["service"], indirect=True)
def test_hook_sakura_add_hookspecs(thing_plugin: str) -> None:
    manager = get_plugin_manager()
    manager.load()
    widgets: list[str] = []
    manager.pm.hook.sakura_register_widgets(register=widgets.append)
    assert widgets == ["widget"]


# --- meta-tests --------------------------------------------------------------------------


def _all_hooks() -> list[str]:
    return [h["name"] for h in hook_signatures()]


def test_every_hookspec_has_a_test() -> None:
    module = sys.modules[__name__]
    missing = [
        hook
        for hook in _all_hooks()
        if hook not in EVENT_SAMPLES and not callable(getattr(module, f"test_hook_{hook}", None))
    ]
    assert not missing, f"hookspecs without a test: {missing}"
    assert set(EVENT_SAMPLES) == {cls.hook for cls in EVENT_TYPES}


def test_every_hookspec_is_documented_with_its_exact_signature() -> None:
    text = (REPO / "docs" / "hooks.md").read_text()
    documented = set(re.findall(r"^### `([^`]+)`\s*$", text, flags=re.MULTILINE))
    expected = {h["signature"] for h in hook_signatures()}
    assert not expected - documented, (
        f"undocumented or outdated signatures: {sorted(expected - documented)}"
    )
    stale = {sig for sig in documented if sig.split("(")[0] not in set(_all_hooks())}
    assert not stale, f"docs/hooks.md documents hooks that do not exist: {sorted(stale)}"


def test_every_hookspec_has_a_docstring() -> None:
    assert all(h["doc"] for h in hook_signatures())
    assert len(_all_hooks()) == len(set(_all_hooks())) == 41 + 13 + 4


def test_on_error_hook_receives_handler_failures() -> None:
    received: list[OnError] = []
    failing = _single_hook_service("on_epoch_end", [])
    failing.on_epoch_end = lambda event: 1 / 0  # type: ignore[attr-defined]
    rt = SakuraRuntime([failing, _single_hook_service("on_error", received)])
    rt.errors.clear()
    import logging

    logging.getLogger("sakura").disabled = True
    try:
        rt.emit(OnEpochEnd)
    finally:
        logging.getLogger("sakura").disabled = False
    assert isinstance(received[0].exception, ZeroDivisionError)
    assert hookspecs.ServiceHooks.on_error.__doc__
