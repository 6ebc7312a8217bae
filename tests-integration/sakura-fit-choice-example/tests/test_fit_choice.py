"""A third-party fit choice, installed as a distribution, is discovered through
sakura-offload's hook and chosen by ``wrap`` when it is the cheapest option that fits; the
training it gives equals the choice applied by hand."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from sakura_fit_choice_example.choice import BF16Base
from torch import nn

import sakura_offload
from sakura_offload.fit import Budgets, fit_choices
from sakura_offload.fit.decide import candidates
from sakura_offload.fit.wrap import measure


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.proj(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(4))
        self.head = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def net() -> Net:
    torch.manual_seed(0)
    model = Net()
    model.layers.requires_grad_(False)
    return model


def train(model: nn.Module, optimizer: Any) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = torch.randn(8, 64, generator=g), torch.randn(8, 8, generator=g)
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def adamw(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def smallest_unshrunk(model: nn.Module) -> int:
    sizes = measure(model, adamw(model), blocks=Block)
    return min(p.device_bytes for p in candidates(sizes, Budgets(device=None, host=2**40)))


def test_the_choice_is_discovered_through_the_hook() -> None:
    found = fit_choices()
    assert isinstance(found["bf16_base"], BF16Base)
    assert isinstance(fit_choices(["bf16_base"])["bf16_base"], BF16Base)


def test_chosen_when_it_is_the_cheapest_that_fits() -> None:
    model = net()
    budget = smallest_unshrunk(model) - 1  # nothing fits without a choice
    model, optimizer = sakura_offload.wrap(
        model, adamw(model), device_budget=budget, blocks=Block, activations="keep"
    )
    plan = model.sakura_fit.plan
    assert plan.option is not None and plan.option.label == "bf16_base:bf16"
    assert model.layers[0].proj.weight.dtype == torch.bfloat16
    result = train(model, optimizer)

    # the same plan by hand: the choice, then the parts the plan names
    by_hand = net()
    choice = BF16Base()
    choice.apply(by_hand, choice.estimate(by_hand)[0])
    if plan.weights != "resident":
        sakura_offload.WeightPaging(by_hand, blocks=Block)
    optimizer = adamw(by_hand)
    if plan.optimizer == "host":
        optimizer = sakura_offload.OffloadAdamW.from_optimizer(
            optimizer, moment_dtype=plan.moment_dtype
        )
    expected = train(by_hand, optimizer)
    assert result.keys() == expected.keys()
    for name in result:
        assert torch.equal(result[name], expected[name]), name


def test_a_cheaper_choice_that_does_not_fit_is_passed_over() -> None:
    pytest.importorskip("sakura_quant")
    model = net()
    sizes = measure(model, adamw(model), blocks=Block)
    halved = sizes.shrunk(BF16Base().estimate(model)[0])
    budget = min(p.device_bytes for p in candidates(halved, Budgets(device=None, host=2**40))) - 1
    model, _ = sakura_offload.wrap(
        model, adamw(model), device_budget=budget, blocks=Block, activations="keep"
    )
    plan = model.sakura_fit.plan
    assert plan.option is not None and plan.option.choice == "quantize_base"
