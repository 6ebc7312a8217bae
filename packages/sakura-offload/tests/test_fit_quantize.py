"""``wrap(..., quantize=)``: the user forces a fit option (sakura-quant's ``int8`` /
``nf4``) whatever the budgets, or forbids every fit choice; checked like every option.
The forced plan trains to the same parameters as the same choices by hand (bit-equal)."""

from __future__ import annotations

from typing import Any

import pytest
from test_fit import CHOICES, HUGE, adamw, assert_same, by_hand, fitted, ladder, lora_llama

import sakura_offload
from sakura_offload.fit.decide import Budgets, decide
from sakura_offload.fit.wrap import measure

pytest.importorskip("sakura_quant")


@pytest.mark.parametrize("spelling", ["nf4", "quantize_base:nf4", "int8"])
def test_forced_option_is_applied_although_the_model_fits(spelling: str) -> None:
    state, result = fitted(device_budget=HUGE, quantize=spelling)
    plan = state.plan
    assert plan.option is not None and plan.option.label.endswith(spelling.split(":")[-1])
    # The cheapest plan of the ladder with that option: everything resident.
    assert (plan.optimizer, plan.weights) == ("device", "resident")
    assert_same(result, by_hand(plan))


def test_forced_option_streams_when_its_resident_plan_does_not_fit() -> None:
    nf4 = [p for p in ladder(lora_llama()) if p.option is not None and p.option.name == "nf4"]
    resident = [p for p in nf4 if p.weights == "resident"]
    budget = min(p.device_bytes for p in resident) - 1
    state, result = fitted(device_budget=budget, quantize="nf4")
    plan = state.plan
    assert plan.option is not None and plan.option.name == "nf4"
    assert plan.weights == "host" and plan.device_bytes <= budget
    assert_same(result, by_hand(plan))


def test_quantize_none_keeps_the_base_even_when_nothing_fits() -> None:
    plans = ladder(lora_llama())
    unquantized = [p for p in plans if p.option is None]
    budget = min(p.device_bytes for p in unquantized) - 1  # only a quantized base fits
    model = lora_llama()
    with pytest.raises(sakura_offload.FitError, match="no plan fits"):
        sakura_offload.wrap(model, adamw(model), device_budget=budget, activations="keep",
                            quantize="none")  # fmt: skip
    state, _ = fitted(device_budget=budget)  # "auto" quantizes
    assert state.plan.option is not None


def test_decide_with_a_forced_option_tries_only_that_option() -> None:
    model = lora_llama()
    sizes = measure(model, adamw(model))
    from test_fit import quant_options

    options = quant_options(model)
    nf4 = next(o for o in options if o.name == "nf4")
    plan = decide(sizes, Budgets(device=None, host=HUGE), options, forced=nf4)
    assert plan.option is nf4
    assert decide(sizes, Budgets(device=None, host=HUGE), options).option is None


@pytest.mark.parametrize(
    ("value", "accepted"),
    [(3, "'auto'"), ("", "'auto'"), ("fp8", "quantize_base:nf4"), ("shrink", "quantize_base:int8")],
)
def test_bad_quantize_names_option_value_and_accepted(value: Any, accepted: str) -> None:
    model = lora_llama()
    with pytest.raises(ValueError) as info:
        sakura_offload.wrap(model, adamw(model), quantize=value, choices=CHOICES)
    text = str(info.value)
    assert "quantize" in text and repr(value) in text and accepted in text, text
    assert not hasattr(model, "sakura_fit")


def test_trim_heap_off_attaches_no_per_step_trim() -> None:
    state, _ = fitted(device_budget=HUGE, quantize="nf4", trim_heap=False)
    assert state.heap_trim is None
    state, _ = fitted(device_budget=HUGE, quantize="nf4")  # a shrunk base: fit trims
    assert state.heap_trim is not None and state.heap_trim.trims in (0, 3)


def test_bad_trim_heap_is_named() -> None:
    model = lora_llama()
    with pytest.raises(ValueError, match=r"trim_heap='yes'.*True or False"):
        sakura_offload.wrap(model, adamw(model), trim_heap="yes")
