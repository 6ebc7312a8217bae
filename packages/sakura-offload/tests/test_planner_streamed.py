"""The memory planner over a block whose frozen weights ``WeightPaging`` streams: the device
copies it installs for each call are weights (tokens in WeightPaging's hooks, counted by
fit in its device bytes), never activations.  The planner measures and tracks exactly
what it does on the same model with its weights resident, for a float and a quantized
base (whose codes and scales are buffers), and fit plans on that figure.

Equal to the byte, not within a tolerance: the planner's own bookkeeping is the same in
both runs (the same saved tensors, inputs and temporaries; only the weights' storages
differ, and those are now left out of every count)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_fit import LAYERS, adamw, assert_same, by_hand, lora_llama, train, trained

import sakura_offload
from sakura_offload.fit.decide import Budgets, candidates
from sakura_offload.fit.wrap import measure
from sakura_offload.planner import MemoryPlan, MemoryPlanner

pytest.importorskip("peft")
pytest.importorskip("transformers")

LEAST = 117_120
"""The tiny LoRA Llama's least activation peak (every block recomputed) with its weights
resident, for the batch below (test_fit_service and test_fit_replan use it too)."""


def batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(3))
    return {"input_ids": ids, "labels": ids}


def base(quantize: str | None) -> Any:
    model = lora_llama()
    if quantize is not None:
        import sakura_quant

        sakura_quant.quantize_model(model, quantize)
    return model


def planned(model: Any, **options: Any) -> tuple[MemoryPlanner, MemoryPlan]:
    options = {"cost_trials": 0, "host_bandwidth": 1e9, "disk": False, **options}
    planner = MemoryPlanner(10**9, **options)
    return planner, planner.plan(model, batch())


def measured(plan: MemoryPlan) -> list[Any]:
    """Everything the planner measured: the peaks and each block's figures."""
    blocks = [
        (d.name, d.activation_bytes, d.pageable_bytes, d.copy_bytes, d.input_bytes,
         d.recompute_bytes, d.parameter_bytes)
        for d in plan.decisions
    ]  # fmt: skip
    return [plan.least_peak, plan.keep_peak, plan.outside_bytes, blocks]


@pytest.mark.parametrize(
    ("quantize", "prefetch"), [(None, 1), (None, 0), ("int8", 1)], ids=["fp32", "fp32-p0", "int8"]
)
def test_streamed_weights_measure_like_resident_ones(quantize: str | None, prefetch: int) -> None:
    resident_planner, resident = planned(base(quantize))
    resident_planner.remove()
    model = base(quantize)
    paging = sakura_offload.WeightPaging(model, prefetch=prefetch)
    planner, streamed = planned(model)
    assert paging.stats.materialised == 2 * LAYERS  # two measuring forwards streamed
    assert paging.stats.saved_tokens > 0  # the saved weights went to WeightPaging
    assert measured(streamed) == measured(resident)
    if quantize is None:
        assert streamed.least_peak == LEAST  # (was 239332 = keep_peak: weights counted)
        assert streamed.least_peak < streamed.keep_peak
    planner.remove()
    paging.remove()


def _tracked_step(quantize: str | None, choice: str, stream: bool) -> tuple[int, Any]:
    model = base(quantize)
    paging = sakura_offload.WeightPaging(model) if stream else None
    planner, _ = planned(model, track=True, min_bytes=1024)  # (so that paging pages)
    planner.decide(choice)
    planner.reset_peak()
    loss = model(**batch()).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    planner.remove()
    if paging is not None:
        assert paging.stats.materialised > 2 * LAYERS  # forward and backward streamed
        paging.remove()
    return planner.measured_peak, (loss.detach(), grads)


@pytest.mark.parametrize(
    ("quantize", "choice"),
    [(None, "recompute"), (None, "page_host"), (None, "keep"), ("int8", "recompute")],
)
def test_tracked_peak_under_a_plan_counts_no_streamed_weight(
    quantize: str | None, choice: str
) -> None:
    """With ``track=True`` the live saved-activation bytes of a training step (a
    recomputed block's materialised tensors counted again in backward) are the same with
    the weights streamed, and so are the loss and the gradients."""
    resident_peak, (loss, grads) = _tracked_step(quantize, choice, stream=False)
    streamed_peak, (streamed_loss, streamed_grads) = _tracked_step(quantize, choice, stream=True)
    assert resident_peak > 0
    assert streamed_peak == resident_peak
    assert torch.equal(streamed_loss, loss)
    assert_same(streamed_grads, grads)


def test_fit_streaming_from_the_start_plans_the_activations_in_what_is_left() -> None:
    """fit streams the weights from the start (the resident plan does not fit the device
    budget) and its activation planner measures the resident least peak: training runs
    in ``LEAST + 1000`` bytes for activations without re-planning (before, the planner
    measured 239332 bytes, counting the streamed copies fit already counts, and failed)."""
    sizes = measure(lora_llama(), adamw(lora_llama()))
    ladder = [(o, w) for o in ("device", "host") for w in ("resident", "host")]
    plans = candidates(sizes, Budgets(device=None, host=2**40), None, ladder)
    streamed = next(p for p in plans if (p.optimizer, p.weights) == ("device", "host"))
    room = LEAST + 1000
    model = lora_llama()
    model, optimizer = sakura_offload.wrap(
        model, adamw(model), device_budget=streamed.device_bytes + room, host_budget=2**40,
        activation_reserve=0, cost_trials=0, choices=None, replan=False,
    )  # fmt: skip
    state = model.sakura_fit
    assert (state.plan.optimizer, state.plan.weights) == ("device", "host")
    assert state.plan.activation_budget == room
    train(model, optimizer)
    applied = state.planner.applied
    assert applied.least_peak == LEAST
    assert applied.estimated_peak <= room
    assert set(applied.choices.values()) != {"keep"}  # it had to recompute or page
    result = trained(model)
    sakura_offload.unwrap(model)
    assert_same(result, by_hand(state.plan))  # the same arithmetic on a CPU
