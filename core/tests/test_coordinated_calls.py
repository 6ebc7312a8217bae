"""prepare / autocast / scale_loss / backward / unscale / clip / optimizer_step / state."""

from __future__ import annotations

import pickle
from contextlib import contextmanager
from typing import Any

import pytest

from sakura import STEP_SKIPPED, SakuraRuntime, Service, StepSkipped
from sakura.resume import ServiceStateWarning

torch = pytest.importorskip("torch")


class Tag(Service):
    def __init__(self, name: str, priority: float, journal: list[str]) -> None:
        self.name = name
        self.priority = priority
        self.journal = journal

    def wrap_model(self, model: Any) -> Any:
        self.journal.append(f"model:{self.name}")
        return ("wrapped", self.name, model)

    def wrap_optimizer(self, optimizer: Any) -> Any:
        self.journal.append(f"optimizer:{self.name}")
        return ("wrapped", self.name, optimizer)

    @contextmanager
    def _ctx(self) -> Any:
        self.journal.append(f"enter:{self.name}")
        yield
        self.journal.append(f"exit:{self.name}")

    def autocast(self) -> Any:
        return self._ctx()

    def wrap_loss(self, loss: Any) -> Any:
        self.journal.append(f"loss:{self.name}")
        return loss * 2


def test_prepare_threads_model_then_optimizer_in_priority_order() -> None:
    journal: list[str] = []
    rt = SakuraRuntime([Tag("b", 2, journal), Tag("a", 1, journal)])
    model, optimizer = rt.prepare("m", "o")
    assert model == ("wrapped", "b", ("wrapped", "a", "m"))
    assert optimizer == ("wrapped", "b", ("wrapped", "a", "o"))
    assert journal == ["model:a", "model:b", "optimizer:a", "optimizer:b"]
    assert rt.prepare("m") == (("wrapped", "b", ("wrapped", "a", "m")), None)


def test_autocast_stacks_contexts_and_is_a_shared_noop_without_services() -> None:
    journal: list[str] = []
    rt = SakuraRuntime([Tag("a", 1, journal), Tag("b", 2, journal)])
    with rt.autocast():
        journal.append("forward")
    assert journal == ["enter:a", "enter:b", "forward", "exit:b", "exit:a"]
    empty = SakuraRuntime()
    assert empty.autocast() is empty.autocast()
    journal.clear()
    single = SakuraRuntime([Tag("only", 1, journal)])
    with single.autocast():
        pass
    assert journal == ["enter:only", "exit:only"]


def test_scale_loss_and_backward_thread_through_wrap_loss() -> None:
    journal: list[str] = []
    rt = SakuraRuntime([Tag("a", 1, journal), Tag("b", 2, journal)])
    weight = torch.tensor(3.0, requires_grad=True)
    assert float(rt.scale_loss(weight * 1.0).detach()) == 12.0
    rt.backward(weight * 1.0)
    assert weight.grad is not None and float(weight.grad) == 4.0  # d(4w)/dw
    assert journal == ["loss:a", "loss:b", "loss:a", "loss:b"]


class Scaler(Service):
    """A minimal static loss scaler: exercises wrap_loss/unscale/optimizer_step/state."""

    name = "scaler"

    def __init__(self, scale: float = 8.0) -> None:
        self.scale = scale
        self.unscaled = False
        self.unscale_calls = 0
        self.steps = 0

    def wrap_loss(self, loss: Any) -> Any:
        self.unscaled = False
        return loss * self.scale

    def unscale_gradients(self, optimizer: Any) -> None:
        self.unscale_calls += 1
        if self.unscaled:
            return
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.div_(self.scale)
        self.unscaled = True

    def optimizer_step(self, optimizer: Any) -> bool:
        self.unscale_gradients(optimizer)
        optimizer.step()
        self.steps += 1
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "steps": self.steps}

    def load_state_dict(self, state: Any) -> None:
        self.scale = state["scale"]
        self.steps = state["steps"]


def _train(rt: SakuraRuntime | None, clip: float | None) -> Any:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = torch.randn(16, 4), torch.randn(16, 2)
    for _ in range(3):
        loss = torch.nn.functional.mse_loss(model(x), y)
        if rt is None:
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
        else:
            rt.backward(loss)
            if clip is not None:
                rt.clip_grad_norm_(opt, clip)
            if not rt.optimizer_step(opt):
                opt.step()
        opt.zero_grad(set_to_none=True)
    return model


@pytest.mark.parametrize("clip", [None, 0.05])
def test_owned_step_with_clipping_unscales_exactly_once(clip: float | None) -> None:
    reference = _train(None, clip)
    scaler = Scaler()
    through = _train(SakuraRuntime([scaler]), clip)
    for a, b in zip(reference.parameters(), through.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert scaler.steps == 3
    # clipping unscaled, then the step asked again and found the work already done
    assert scaler.unscale_calls == (6 if clip else 3)


def test_optimizer_step_stops_at_the_first_owner() -> None:
    journal: list[str] = []

    class Declines(Service):
        def optimizer_step(self, optimizer: Any) -> bool:
            journal.append("declines")
            return False

    class Owns(Service):
        def optimizer_step(self, optimizer: Any) -> bool:
            journal.append("owns")
            return True

    class Never(Service):
        def optimizer_step(self, optimizer: Any) -> bool:
            journal.append("never")
            return True

    rt = SakuraRuntime()
    rt.install(Declines())
    rt.install(Owns())
    rt.install(Never())
    assert rt.optimizer_step(object()) is True
    assert journal == ["declines", "owns"]
    assert SakuraRuntime([Declines()]).optimizer_step(object()) is False
    assert SakuraRuntime().optimizer_step(object()) is False


def test_a_skipped_step_is_owned_and_recorded() -> None:
    outcomes: list[Any] = [True, STEP_SKIPPED, False, STEP_SKIPPED]

    class Scaler(Service):
        def optimizer_step(self, optimizer: Any) -> Any:
            return outcomes.pop(0)

    rt = SakuraRuntime([Scaler()])
    assert rt.last_step_skipped is False
    results = [(rt.optimizer_step(object()), rt.last_step_skipped) for _ in range(3)]
    assert results == [(True, False), (True, True), (False, False)]
    rt.optimizer_step(object())
    assert rt.last_step_skipped is True

    class Raises(Service):
        priority = -1

        def optimizer_step(self, optimizer: Any) -> bool:
            raise RuntimeError("boom")

    rt.install(Raises())
    with pytest.raises(RuntimeError, match="boom"):
        rt.optimizer_step(object())
    assert rt.last_step_skipped is False  # an error leaves no stale "skipped"


def test_step_skipped_is_a_truthy_singleton_that_pickles_to_itself() -> None:
    assert bool(STEP_SKIPPED) is True and StepSkipped() is STEP_SKIPPED
    assert repr(STEP_SKIPPED) == "sakura.STEP_SKIPPED"
    assert pickle.loads(pickle.dumps(STEP_SKIPPED)) is STEP_SKIPPED


def test_clip_grad_norm_validates_max_norm() -> None:
    with pytest.raises(ValueError, match="max_norm must be a positive number"):
        SakuraRuntime().clip_grad_norm_(
            torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1), 0
        )


@pytest.mark.parametrize(
    "call",
    [
        "wrap_model",
        "wrap_optimizer",
        "autocast",
        "wrap_loss",
        "optimizer_step",
        "unscale_gradients",
        "state_dict",
        "load_state_dict",
    ],
)
def test_coordinated_call_errors_propagate_naming_the_service(call: str) -> None:
    class Broken(Service):
        name = "broken"

    def fail(*args: Any) -> Any:
        raise OSError(f"{call} broke")

    broken = Broken()
    setattr(broken, call, fail)
    rt = SakuraRuntime([broken])
    actions = {
        "wrap_model": lambda: rt.prepare("m"),
        "wrap_optimizer": lambda: rt.prepare("m", "o"),
        "autocast": lambda: rt.autocast(),
        "wrap_loss": lambda: rt.scale_loss(1.0),
        "optimizer_step": lambda: rt.optimizer_step("o"),
        "unscale_gradients": lambda: rt.unscale_gradients("o"),
        "state_dict": lambda: rt.state_dict(),
        "load_state_dict": lambda: rt.load_state_dict({"broken": {}}, strict=False),
    }
    with pytest.raises(OSError, match=f"{call} broke") as info:  # the original type, not a wrapper
        actions[call]()
    assert f"raised by sakura service 'broken' in {call}()" in info.value.__notes__


def test_state_dict_round_trip_through_torch_save(tmp_path: Any) -> None:
    scaler = Scaler(scale=4.0)
    rt = SakuraRuntime([scaler, Tag("stateless", 1, [])])
    _train(rt, None)
    state = rt.state_dict()
    assert state == {"scaler": {"scale": 4.0, "steps": 3}}
    path = tmp_path / "ckpt.pt"
    torch.save({"sakura": state}, path)
    loaded = torch.load(path, weights_only=True)["sakura"]
    fresh = Scaler(scale=1.0)
    SakuraRuntime([fresh]).load_state_dict(loaded)
    assert (fresh.scale, fresh.steps) == (4.0, 3)


def test_load_state_dict_strictness() -> None:
    """strict=True raises one KeyError listing both kinds; the default warns (the full
    semantics are in test_resume.py)."""
    rt = SakuraRuntime([Scaler()])
    with pytest.raises(
        KeyError, match=r"state for service\(s\) \['ghost'\] that are not installed"
    ):
        rt.load_state_dict({"ghost": {}, "scaler": {"scale": 1.0, "steps": 0}}, strict=True)
    with pytest.raises(KeyError, match=r"no state for installed service\(s\) \['scaler'\]"):
        rt.load_state_dict({}, strict=True)
    with pytest.warns(ServiceStateWarning, match="ghost"):
        rt.load_state_dict({"ghost": {}, "scaler": {"scale": 1.0, "steps": 0}})
    with pytest.raises(TypeError, match="state must be a mapping"):
        rt.load_state_dict([("scaler", {})])  # type: ignore[arg-type]


def test_wrap_model_wrap_optimizer_and_implements() -> None:
    journal: list[str] = []
    rt = SakuraRuntime([Tag("a", 1, journal), Scaler()])
    assert rt.wrap_model("m") == ("wrapped", "a", "m")
    assert rt.wrap_optimizer("o") == ("wrapped", "a", "o")
    assert journal == ["model:a", "optimizer:a"]
    assert rt.implements("optimizer_step") == ("scaler",)
    assert rt.implements("wrap_loss") == ("a", "scaler")
    assert rt.implements("setup") == ()
