"""A plan that fails midway is rolled back: every part ``apply_fit`` applied and can undo is
removed (weight streaming, the activation planner, the re-planner's hooks, a reversible fit
choice), the model's state and hooks are as before, a fit choice that cannot be undone stays
(a note on the error says so) and the error propagates.  Failures are injected into the part
that follows the ones applied."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_fit import HUGE, adamw, lora_llama

from sakura_offload.fit.choices import FitChoice, FitOption
from sakura_offload.fit.decide import Budgets, FitPlan, candidates
from sakura_offload.fit.wrap import apply_fit, fit_options, measure
from sakura_offload.paging.weights import WeightPaging
from sakura_offload.planner import MemoryPlanner

pytest.importorskip("peft")
pytest.importorskip("transformers")


class Scale(FitChoice):
    """A fit choice for the test: halves the frozen weights of the first block in place
    (``reversible`` says whether :meth:`undo` is offered)."""

    description = "halve layer 0's frozen weights"

    def __init__(self, reversible: bool) -> None:
        self.reversible = reversible
        self.kept: dict[str, torch.Tensor] = {}

    def applies(self, model: Any) -> bool:
        return True

    def estimate(self, model: Any, **context: Any) -> list[FitOption]:
        return []

    def apply(self, model: Any, option: FitOption) -> None:
        for name, p in model.named_parameters():
            if ".layers.0." in name and not p.requires_grad:
                self.kept[name] = p.detach().clone()
                p.data.mul_(0.5)

    def undo(self, model: Any) -> None:
        if not self.reversible:
            super().undo(model)
        params = dict(model.named_parameters())
        for name, value in self.kept.items():
            params[name].data.copy_(value)


def option() -> FitOption:
    return FitOption("scale", "half", 1.0, {}, 0, "test")


def hooks(model: torch.nn.Module) -> list[tuple[str, int, int, int, bool, list[str]]]:
    """Per module: its forward pre-hooks, forward hooks, backward hooks, an instance
    ``forward`` and its sakura marks."""
    return [
        (
            name,
            len(m._forward_pre_hooks),
            len(m._forward_hooks),
            len(m._backward_hooks),
            "forward" in m.__dict__,
            sorted(k for k in m.__dict__ if k.startswith("_sakura")),
        )
        for name, m in model.named_modules()
    ]


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def assert_state(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    now = model.state_dict()
    assert now.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(now[name], value), name


def streamed_plan(model: Any, with_option: bool) -> tuple[FitPlan, Budgets]:
    budgets = Budgets(device=None, host=HUGE)
    plan = next(p for p in candidates(measure(model, adamw(model)), budgets) if p.weights == "host")
    budgets = dataclasses.replace(budgets, device=plan.device_bytes + 10**6)
    plan = dataclasses.replace(plan, activation_budget=10**6)
    return (dataclasses.replace(plan, option=option()) if with_option else plan), budgets


@pytest.fixture
def model() -> Iterator[Any]:
    yield lora_llama()


@pytest.mark.parametrize("reversible", [True, False])
def test_a_full_disk_after_a_fit_choice_rolls_back(
    model: Any, reversible: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    before, before_hooks = snapshot(model), hooks(model)
    plan, budgets = streamed_plan(model, with_option=True)
    choice = Scale(reversible)

    def full(self: Any, block: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(WeightPaging, "_page_out", full)
    options = fit_options(device_budget=budgets.device, host_budget=HUGE)
    with pytest.raises(OSError, match="No space left") as info:
        apply_fit(model, adamw(model), plan, {"scale": choice}, budgets, options)
    assert not hasattr(model, "sakura_fit")
    assert hooks(model) == before_hooks
    notes = "\n".join(getattr(info.value, "__notes__", []))
    if reversible:
        assert_state(model, before)
        assert "rolled back (fit choice scale:half)" in notes
    else:  # the choice stays applied, everything else is back
        halved = {n: v * 0.5 if n in choice.kept else v for n, v in before.items()}
        assert choice.kept
        assert_state(model, halved)
        assert "fit choice scale:half was applied and cannot be undone" in notes


@pytest.mark.parametrize("failing", ["planner", "replanner"])
def test_a_failure_after_streaming_and_the_planner_removes_them(
    model: Any, failing: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    before, before_hooks = snapshot(model), hooks(model)
    plan, budgets = streamed_plan(model, with_option=False)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"injected: {failing}")

    if failing == "planner":
        monkeypatch.setattr(MemoryPlanner, "attach", broken)
    else:  # the last part: the planner is attached by then
        monkeypatch.setattr("sakura_offload.fit.replan.Replanner.attach", broken)
    options = fit_options(device_budget=budgets.device, host_budget=HUGE, cost_trials=0)
    with pytest.raises(RuntimeError, match=f"injected: {failing}") as info:
        apply_fit(model, adamw(model), plan, {}, budgets, options)
    assert not hasattr(model, "sakura_fit")
    assert hooks(model) == before_hooks
    assert_state(model, before)
    # every weight is the module's own tensor again, on its device (not a stored copy)
    assert all(p.device.type == "cpu" for p in model.parameters())
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert ("planner, paging" if failing == "replanner" else "paging") in notes
    # and the model trains plainly afterwards
    ids = torch.arange(12).reshape(1, 12)
    model(input_ids=ids, labels=ids).loss.backward()
