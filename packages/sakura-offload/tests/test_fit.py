"""``sakura_offload.wrap``: every branch of the plan forced by budgets on a tiny PEFT LoRA
Llama (frozen base, trainable adapters), trained a few steps, and the trained parameters
compared with the same choices applied by hand with the existing classes (WeightPaging,
OffloadAdamW, sakura-quant's quantize_model): equal to the bit, since the arithmetic is the
same.  Also: a model that fits is left alone; a budget below the smallest plan names it."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import sakura_offload
from sakura_offload.fit.decide import Budgets, FitError, candidates
from sakura_offload.fit.report import plan_table
from sakura_offload.fit.wrap import measure

pytest.importorskip("peft")
pytest.importorskip("transformers")

LAYERS = 3
STEPS = 3
HUGE = 2**40
CHOICES = "quantize_base"
"""The fit choices these tests allow (another installed distribution may offer more)."""


def lora_llama() -> Any:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=61,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="eager",
        use_cache=False,
    )
    model = LlamaForCausalLM(config).requires_grad_(False)
    model = get_peft_model(
        model,
        LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]),
    )
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    model.train()
    return model


def adamw(model: Any) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def train(model: Any, optimizer: Any, steps: int = STEPS) -> list[float]:
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 61, (2, 12), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def trained(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        assert torch.equal(a[name], b[name]), name


def quant_options(model: Any) -> list[Any]:
    from sakura_quant.fit_choice import QuantizeBase

    return QuantizeBase().estimate(model)


def ladder(model: Any, **budgets: Any) -> list[Any]:
    """Every candidate plan (unquantized, then int8, then nf4) for ``model``."""
    sizes = measure(model, adamw(model))
    b = Budgets(device=None, host=HUGE, **budgets)
    plans = candidates(sizes, b)
    for option in quant_options(model):
        plans += candidates(sizes.shrunk(option), b, option)
    return plans


def rung(plans: list[Any], optimizer: str, weights: str) -> Any:
    """The unquantized plan of ``plans`` with the optimizer and the frozen weights there."""
    return next(
        p for p in plans if (p.optimizer, p.weights, p.option) == (optimizer, weights, None)
    )


def by_hand(plan: Any, tmp: Path | None = None) -> dict[str, torch.Tensor]:
    """The plan's choices applied with the existing classes, then the same training."""
    import sakura_quant

    model = lora_llama()
    if plan.option is not None:
        sakura_quant.quantize_model(model, plan.option.name, targets=plan.option.detail["targets"])
    paging = None
    if plan.weights != "resident":
        paging = sakura_offload.WeightPaging(
            model,
            disk_offload=tmp if plan.weights == "disk" else None,
            host_budget=plan.host_weight_bytes if plan.weights == "disk" else None,
        )
    optimizer: Any = adamw(model)
    if plan.optimizer == "host":
        optimizer = sakura_offload.OffloadAdamW.from_optimizer(
            optimizer, moment_dtype=plan.moment_dtype
        )
    train(model, optimizer)
    result = trained(model)
    if paging is not None:
        paging.remove()
    return result


def fitted(tmp: Path | None = None, **options: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    model = lora_llama()
    model, optimizer = sakura_offload.wrap(
        model, adamw(model), activations="keep", disk_offload=tmp, choices=CHOICES, **options
    )
    train(model, optimizer)
    state = model.sakura_fit
    result = trained(model)
    return state, result


def test_a_model_that_fits_is_left_alone(caplog: pytest.LogCaptureFixture) -> None:
    plain = lora_llama()
    train(plain, adamw(plain))
    model = lora_llama()
    before = {n: p for n, p in model.named_parameters()}
    with caplog.at_level(logging.INFO, logger="sakura_offload.fit"):
        model, optimizer = sakura_offload.wrap(model, adamw(model))
    assert type(optimizer) is torch.optim.AdamW
    assert {n: p for n, p in model.named_parameters()}.keys() == before.keys()
    train(model, optimizer)
    assert_same(trained(model), trained(plain))
    state = model.sakura_fit
    assert (state.plan.optimizer, state.plan.weights, state.plan.option) == (
        "device", "resident", None
    )  # fmt: skip
    assert state.paging is None and state.planner is None  # no device limit on a CPU
    assert "optimizer on the device; frozen weights resident" in caplog.text
    assert sakura_offload.unwrap(model) is model and not hasattr(model, "sakura_fit")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_host_optimizer_moments_as_host_ram_requires(dtype: str) -> None:
    from sakura_offload.host_optimizer.placement import moment_bytes

    plans = ladder(lora_llama())
    device = plans[1].device_bytes  # host optimizer, weights resident
    sizes = plans[1].sizes
    host = moment_bytes(dtype, sizes.trainable_numel) + sizes.master_bytes
    state, result = fitted(device_budget=device, host_budget=host, host_reserve=0)
    plan = state.plan
    assert (plan.optimizer, plan.weights, plan.moment_dtype, plan.option) == (
        "host", "resident", dtype, None
    )  # fmt: skip
    assert isinstance(state.optimizer, sakura_offload.OffloadAdamW)
    assert state.optimizer.moment_dtype == dtype
    assert_same(result, by_hand(plan))


def test_weights_streamed_from_host() -> None:
    plans = ladder(lora_llama())
    state, result = fitted(device_budget=rung(plans, "host", "host").device_bytes)
    plan = state.plan
    assert (plan.optimizer, plan.weights, plan.option) == ("host", "host", None)
    assert plan.block_tiers == ("host",) * LAYERS
    assert state.paging.stats.paged_bytes == sum(plan.sizes.block_frozen)
    assert state.paging.stats.disk_bytes == 0
    report = sakura_offload.memory_report(state.paging.model)
    assert report["host"]["frozen"] == sum(plan.sizes.block_frozen)
    assert report["moved"]["weight_blocks_materialised"] == 2 * LAYERS * STEPS  # fwd + bwd
    assert report["host"]["optimizer"] == 2 * 4 * plan.sizes.trainable_numel  # fp32 moments
    assert_same(result, by_hand(plan))


def test_weights_streamed_with_the_optimizer_left_on_the_device() -> None:
    """Once the frozen weights stream, the device has room again: the loop's own AdamW
    stays there (no host step, no copies) when it fits, before a host optimizer."""
    plans = ladder(lora_llama())
    state, result = fitted(device_budget=rung(plans, "device", "host").device_bytes)
    plan = state.plan
    assert (plan.optimizer, plan.weights, plan.option) == ("device", "host", None)
    assert type(state.optimizer) is torch.optim.AdamW
    assert state.paging.stats.paged_bytes == sum(plan.sizes.block_frozen)
    assert sakura_offload.memory_report(state.paging.model)["host"]["optimizer"] == 0
    assert_same(result, by_hand(plan))


def test_weights_streamed_from_disk(tmp_path: Path) -> None:
    plans = ladder(lora_llama(), disk=HUGE)
    disk_plan = rung(plans, "host", "disk")
    host = (
        disk_plan.host_bytes - sum(disk_plan.sizes.block_frozen) + disk_plan.sizes.block_frozen[0]
    )
    state, result = fitted(
        tmp_path / "fit", device_budget=disk_plan.device_bytes, host_budget=host, host_reserve=0
    )
    plan = state.plan
    assert (plan.optimizer, plan.weights, plan.option) == ("host", "disk", None)
    assert plan.block_tiers == ("host",) + ("disk",) * (LAYERS - 1)
    stats = state.paging.stats
    assert stats.disk_bytes == sum(plan.sizes.block_frozen[1:]) == plan.disk_bytes
    table = plan_table(plan, state.budgets)
    lines = table.splitlines()
    assert "layers.0" in lines[1] and "streamed from host RAM" in lines[1]
    assert all("streamed from disk" in line for line in lines[2 : 1 + LAYERS])
    assert "host RAM (float32 moments)" in table and "totals: device" in table
    report = sakura_offload.memory_report(state.paging.model)
    assert report["disk"]["frozen"] == plan.disk_bytes
    assert report["host"]["frozen"] == plan.sizes.block_frozen[0]
    sakura_offload.unwrap(state.paging.model)
    assert_same(result, by_hand(plan, tmp_path / "by-hand"))


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_quantized_base_only_when_nothing_else_fits(fmt: str) -> None:
    pytest.importorskip("sakura_quant")
    plans = ladder(lora_llama())
    mine = [p for p in plans if p.option is not None and p.option.name == fmt]
    cheaper = [p for p in plans if p.option is None or p.option.cost < mine[0].option.cost]
    budget = min(p.device_bytes for p in cheaper) - 1
    fitting = [p for p in mine if p.device_bytes <= budget]
    assert fitting, "the tiny model's sizes do not separate the formats"
    state, result = fitted(device_budget=budget)
    plan = state.plan
    assert plan.option is not None and plan.option.label == f"quantize_base:{fmt}"
    assert (plan.optimizer, plan.weights) == (fitting[0].optimizer, fitting[0].weights)
    if state.paging is not None:  # the estimate is exact: the blocks weigh what it said
        assert state.paging.stats.paged_bytes == sum(plan.sizes.block_frozen)
    assert_same(result, by_hand(plan))


def test_budget_below_the_smallest_plan_names_it() -> None:
    plans = ladder(lora_llama())
    smallest = min(p.device_bytes for p in plans)
    model = lora_llama()
    with pytest.raises(FitError, match=f"device_budget >= .*{smallest} bytes") as info:
        sakura_offload.wrap(
            model, adamw(model), device_budget=smallest - 1, activations="keep", choices=CHOICES
        )
    assert info.value.minimum == smallest
    assert not hasattr(model, "sakura_fit")
    model, _ = sakura_offload.wrap(
        model, adamw(model), device_budget=smallest, activations="keep", choices=CHOICES
    )
    assert model.sakura_fit.plan.option.name == "nf4"


@pytest.mark.parametrize(
    ("option", "value", "accepted"),
    [
        ("device_budget", "lots", "a number of bytes"),
        ("host_budget", -1, "a number of bytes"),
        ("disk_offload", 3, "a directory path"),
        ("choices", 3, "'auto'"),
        ("moment_dtype", "fp7", "float32"),
        ("activations", "maybe", "auto"),
        ("prefetch", -1, ">= 0"),
        ("report", "yes", "True or False"),
        ("host_reserve", "some", "a number of bytes"),
    ],
)
def test_bad_options_name_option_value_and_accepted(option: str, value: Any, accepted: str) -> None:
    model = lora_llama()
    with pytest.raises(ValueError) as info:
        sakura_offload.wrap(model, adamw(model), **{option: value})
    text = str(info.value)
    assert option in text and repr(value) in text and accepted in text, text


def test_host_reserve_must_leave_part_of_the_host_budget() -> None:
    model = lora_llama()
    with pytest.raises(ValueError, match=r"host_reserve=4096 .*below host_budget \(4096 bytes\)"):
        sakura_offload.wrap(model, adamw(model), host_budget=4096, host_reserve=4096)


def test_unknown_choice_is_named() -> None:
    model = lora_llama()
    with pytest.raises(LookupError, match=r"unknown fit choice 'shrink_ray'; known: .*quantize"):
        sakura_offload.wrap(model, adamw(model), choices="shrink_ray", device_budget=1)
