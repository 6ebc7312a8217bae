"""Re-planning after the measured first step (``sakura_offload.fit.replan``) and the plan's
expected extra time per block.

The tiny LoRA Llama of test_fit: its activations need at least 117120 bytes (every block
recomputed), and streaming its three blocks with prefetch 1 takes one block (about 0.15 MB)
off the device.  A budget that leaves the activations 1000 bytes (``activation_reserve=0``,
the estimate too optimistic) fails at the first forward without re-planning; with it, fit
streams the weights and trains, equal to the bit to the final plan applied by hand from the
start (on a CPU the arithmetic of paging and recomputation is the same)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from test_fit import HUGE, LAYERS, STEPS, adamw, assert_same, by_hand, lora_llama, train, trained

import sakura_offload
from sakura import SakuraRuntime
from sakura_offload.fit.decide import Budgets, FitError, candidates
from sakura_offload.fit.report import plan_table, weight_seconds
from sakura_offload.fit.wrap import measure

pytest.importorskip("peft")
pytest.importorskip("transformers")

LEAST = 117_120
"""The tiny model's least activation peak (every block recomputed), as the planner measures it
(test_fit_service asserts it)."""


def plans(optimizer: Any = None, **budgets: Any) -> list[Any]:
    model = lora_llama()
    sizes = measure(model, optimizer(model) if optimizer else adamw(model))
    ladder = [(o, w) for o in ("device", "host") for w in ("resident", "host", "disk")]
    return candidates(sizes, Budgets(device=None, host=HUGE, **budgets), None, ladder)


def find(ladder: list[Any], optimizer: str, weights: str) -> Any:
    return next(p for p in ladder if (p.optimizer, p.weights) == (optimizer, weights))


def test_activations_over_the_estimate_replan_to_streamed_weights(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ladder = plans()
    resident = find(ladder, "host", "resident")
    budget = resident.device_bytes + 1000
    model = lora_llama()
    with caplog.at_level(logging.WARNING, logger="sakura_offload.fit"):
        model, optimizer = sakura_offload.wrap(
            model, adamw(model), device_budget=budget, host_budget=HUGE, activation_reserve=0,
            cost_trials=0, choices=None,
        )  # fmt: skip
        state = model.sakura_fit
        assert (state.plan.optimizer, state.plan.weights) == ("host", "resident")
        train(model, optimizer)
    plan = state.plan
    assert (plan.optimizer, plan.weights, plan.moment_dtype) == ("host", "host", "float32")
    streamed = find(ladder, "host", "host")
    assert plan.device_bytes == streamed.device_bytes
    assert plan.activation_budget == budget - streamed.device_bytes
    assert state.planner.budget == plan.activation_budget >= LEAST
    assert [(r.what, r.measured, r.estimated, r.step) for r in state.replans] == [
        ("activations", LEAST, 1000, 0)
    ]
    assert state.paging.stats.paged_bytes == sum(plan.sizes.block_frozen)
    # streamed from the second step on: forward + backward of each block
    assert state.paging.stats.materialised == 2 * LAYERS * (STEPS - 1)
    assert caplog.text.count("re-planned") == 1
    report = sakura_offload.memory_report(model)
    assert report["replans"] == [state.replans[0].describe()]
    assert "re-planned: the activations need at least 117120 bytes" in report["table"]
    assert "frozen weights streamed from host" in report["plan"]
    result = trained(model)
    sakura_offload.unwrap(model)
    assert_same(result, by_hand(plan))


def test_replan_to_disk_keeps_the_optimizer_on_the_device(tmp_path: Path) -> None:
    """The optimizer on the device stays there; host RAM holds one block: the others stream
    from disk, like the same WeightPaging by hand."""
    ladder = plans(disk=HUGE)
    resident = find(ladder, "device", "resident")
    one_block = resident.sizes.block_frozen[0]
    model = lora_llama()
    model, optimizer = sakura_offload.wrap(
        model, adamw(model), device_budget=resident.device_bytes + 1000, host_budget=one_block, host_reserve=0,
        activation_reserve=0, cost_trials=0, choices=None, disk_offload=tmp_path / "fit",
    )  # fmt: skip
    assert model.sakura_fit.plan.weights == "resident"
    train(model, optimizer)
    state = model.sakura_fit
    plan = state.plan
    assert (plan.optimizer, plan.weights) == ("device", "disk")
    assert plan.block_tiers == ("host",) + ("disk",) * (LAYERS - 1)
    assert state.paging.stats.disk_bytes == sum(plan.sizes.block_frozen[1:])
    assert type(optimizer) is torch.optim.AdamW and state.optimizer is optimizer
    assert set(state.bandwidths) == {"host", "disk"}
    result = trained(model)
    sakura_offload.unwrap(model)
    assert not (tmp_path / "fit").exists() or not any((tmp_path / "fit").rglob("*.bin"))
    expected = lora_llama()
    paging = sakura_offload.WeightPaging(
        expected, disk_offload=tmp_path / "by-hand", host_budget=plan.host_weight_bytes
    )
    train(expected, adamw(expected))
    assert_same(result, trained(expected))
    paging.remove()


def test_gradient_accumulation_moves_the_weights_before_the_next_forward() -> None:
    budget = find(plans(), "device", "resident").device_bytes + 1000  # AdamW on the device

    def accumulate(model: Any, optimizer: Any) -> None:
        g = torch.Generator().manual_seed(3)
        for _ in range(2):
            for _ in range(2):  # two micro-batches per optimizer step
                ids = torch.randint(0, 61, (2, 12), generator=g)
                (model(input_ids=ids, labels=ids).loss / 2).backward()
            optimizer.step()
            optimizer.zero_grad()

    model = lora_llama()
    model, optimizer = sakura_offload.wrap(
        model, adamw(model), device_budget=budget, host_budget=HUGE, activation_reserve=0,
        cost_trials=0, choices=None,
    )  # fmt: skip
    accumulate(model, optimizer)
    state = model.sakura_fit
    assert (state.plan.optimizer, state.plan.weights) == ("device", "host")
    assert len(state.replans) == 1
    # moved before the second micro-batch: 3 forwards (+ backwards) streamed
    assert state.paging.stats.materialised == 2 * LAYERS * 3
    result = trained(model)
    sakura_offload.unwrap(model)
    expected = lora_llama()
    paging = sakura_offload.WeightPaging(expected)
    accumulate(expected, adamw(expected))
    assert_same(result, trained(expected))
    paging.remove()


def test_replan_shrinks_the_base_by_a_fit_choice_when_streaming_cannot_help() -> None:
    """prefetch=2 keeps every block on the device: only a quantized base (int8, the
    cheapest option) holds the measured activations.  The first step ran on the fp32 base;
    by hand: one step, then quantize_model, then the rest."""
    pytest.importorskip("sakura_quant")
    import sakura_quant

    budget = find(plans(prefetch=2), "host", "resident").device_bytes + 1000
    model = lora_llama()
    model, optimizer = sakura_offload.wrap(
        model, adamw(model), device_budget=budget, host_budget=HUGE, activation_reserve=0,
        prefetch=2, cost_trials=0, choices="quantize_base",
    )  # fmt: skip
    assert model.sakura_fit.plan.option is None
    losses = train(model, optimizer)
    state = model.sakura_fit
    plan = state.plan
    assert plan.option is not None and plan.option.label == "quantize_base:int8"
    assert (plan.optimizer, plan.weights) == ("host", "resident")
    assert plan.device_bytes + LEAST <= budget
    assert [r.what for r in state.replans] == ["activations"]
    assert state.choice is not None
    assert any(type(m).__name__ == "QuantizedLinear" for m in model.modules())
    result = trained(model)
    sakura_offload.unwrap(model)

    expected = lora_llama()
    optimizer = sakura_offload.OffloadAdamW.from_optimizer(adamw(expected), moment_dtype="float32")
    g = torch.Generator().manual_seed(3)
    by_hand_losses = []
    for step in range(STEPS):
        if step == 1:
            sakura_quant.quantize_model(expected, "int8", targets=plan.option.detail["targets"])
        ids = torch.randint(0, 61, (2, 12), generator=g)
        loss = expected(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        by_hand_losses.append(loss.item())
    assert losses == by_hand_losses
    assert_same(result, trained(expected))


def test_no_plan_holds_the_measured_activations_names_the_smallest_budget() -> None:
    # prefetch=2: streaming keeps all three blocks on the device, nothing to gain
    ladder = plans(prefetch=2)
    host_plans = [p for p in ladder if p.optimizer == "host" and p.weights != "disk"]
    budget = find(ladder, "host", "resident").device_bytes + 1000
    smallest = min(p.device_bytes for p in host_plans) + LEAST
    model = lora_llama()
    start = trained(model)
    model, optimizer = sakura_offload.wrap(
        model, adamw(model), device_budget=budget, host_budget=HUGE, activation_reserve=0,
        prefetch=2, cost_trials=0, choices=None,
    )  # fmt: skip
    with pytest.raises(FitError, match=f"device_budget >= {smallest} bytes would fit") as info:
        train(model, optimizer)
    assert info.value.minimum == smallest and info.value.budget == budget
    assert model.sakura_fit.replans == []
    assert_same(trained(model), start)  # no optimizer step was taken


def sgd(model: Any) -> torch.optim.SGD:
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)


def test_step_peak_over_the_budget_replans_after_the_first_step(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An SGD's momentum does not exist before its first step: the estimate leaves it out;
    the measured step (an accounting on a CPU) shows it, and fit streams the weights."""
    ladder = plans(sgd)
    resident = find(ladder, "device", "resident")
    assert resident.sizes.optimizer_bytes == 0  # unknown before the step
    budget = resident.device_bytes
    model = lora_llama()
    with caplog.at_level(logging.WARNING, logger="sakura_offload.fit"):
        model, optimizer = sakura_offload.wrap(
            model, sgd(model), device_budget=budget, activations="keep", choices=None
        )
        assert model.sakura_fit.plan.weights == "resident"
        train(model, optimizer)
    state = model.sakura_fit
    momentum = resident.sizes.trainable_bytes
    assert [(r.what, r.measured, r.estimated, r.step) for r in state.replans] == [
        ("step peak", budget + momentum, budget, 1)
    ]
    assert (state.plan.optimizer, state.plan.weights) == ("device", "host")
    assert state.plan.sizes.optimizer_bytes == momentum
    assert state.plan.device_bytes == find(ladder, "device", "host").device_bytes + momentum
    assert caplog.text.count("re-planned") == 1
    assert state.optimizer is optimizer and type(optimizer) is torch.optim.SGD
    result = trained(model)
    sakura_offload.unwrap(model)

    expected_model = lora_llama()
    paging = sakura_offload.WeightPaging(expected_model)
    train(expected_model, sgd(expected_model))
    expected = trained(expected_model)
    paging.remove()
    assert_same(result, expected)


def test_a_step_over_the_estimate_within_the_budget_is_logged_and_kept(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sakura_offload.fit.replan.MARGIN", 0.01)  # the momentum is 2 % here
    resident = find(plans(sgd), "device", "resident")
    budget = resident.device_bytes + resident.sizes.trainable_bytes  # holds the momentum
    model = lora_llama()
    with caplog.at_level(logging.INFO, logger="sakura_offload.fit"):
        model, optimizer = sakura_offload.wrap(
            model, sgd(model), device_budget=budget, activations="keep", choices=None
        )
        train(model, optimizer)
    assert model.sakura_fit.replans == [] and model.sakura_fit.plan.weights == "resident"
    assert (
        f"device peak measured {budget} bytes, over the plan's estimate of "
        f"{resident.device_bytes}; it fits device_budget={budget}, the plan stays"
    ) in caplog.text


def test_replan_off_keeps_the_plan_and_is_checked() -> None:
    ladder = plans(sgd)
    model = lora_llama()
    model, optimizer = sakura_offload.wrap(
        model, sgd(model), device_budget=find(ladder, "device", "resident").device_bytes,
        activations="keep", choices=None, replan=False,
    )  # fmt: skip
    train(model, optimizer)
    assert model.sakura_fit.replans == [] and model.sakura_fit.plan.weights == "resident"
    with pytest.raises(ValueError, match="replan='yes'"):
        sakura_offload.wrap(lora_llama(), None, replan="yes")


def test_service_under_lightning_replans_like_the_final_plan_by_hand(tmp_path: Any) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from torch.utils.data import DataLoader

    from sakura_adapters.lightning import LightningAdapter

    g = torch.Generator().manual_seed(5)
    rows = [{"input_ids": r, "labels": r} for r in torch.randint(0, 61, (6, 12), generator=g)]

    class Module(pl.LightningModule):  # type: ignore[misc]
        def __init__(self, make_optimizer: Any) -> None:
            super().__init__()
            self.model = lora_llama()
            self.make_optimizer = make_optimizer

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.model(**batch).loss  # type: ignore[no-any-return]

        def configure_optimizers(self) -> Any:
            return self.make_optimizer(self)

    def fit(module: Any, rt: SakuraRuntime | None) -> dict[str, torch.Tensor]:
        trainer = pl.Trainer(
            max_steps=3, logger=False, enable_progress_bar=False, enable_model_summary=False,
            enable_checkpointing=False, default_root_dir=str(tmp_path), accelerator="cpu",
            devices=1, callbacks=[LightningAdapter(rt)] if rt is not None else [],
        )  # fmt: skip
        trainer.fit(module, DataLoader(rows, batch_size=2, shuffle=False))
        return trained(module.model)

    ladder = plans()
    budget = find(ladder, "host", "resident").device_bytes + 1000
    with SakuraRuntime(strict=True) as rt:
        service = rt.install(
            f"fit:device_budget={budget},host_budget={HUGE},activation_reserve=0,"
            "cost_trials=0,choices=none,report=false"
        )
        result = fit(Module(adamw), rt)
    state = service.state
    assert [(r.what, r.measured) for r in state.replans] == [("activations", LEAST)]
    assert (state.plan.optimizer, state.plan.weights) == ("host", "host")
    assert state.planner.budget == budget - find(ladder, "host", "host").device_bytes
    by_hand_module = Module(
        lambda m: sakura_offload.OffloadAdamW.from_optimizer(adamw(m), moment_dtype="float32")
    )
    paging = sakura_offload.WeightPaging(by_hand_module.model)
    expected = fit(by_hand_module, None)
    paging.remove()
    assert_same(result, expected)
    start = trained(lora_llama())
    assert all(not torch.equal(start[n], expected[n]) for n in start)  # it trained


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def test_plan_table_shows_the_cost_models_extra_time_per_block() -> None:
    from sakura_offload.planner.cost import Costs, copy_bandwidth

    # the re-planned case of the first test: streamed weights, activations paged or
    # recomputed in what is left
    budget = find(plans(), "host", "resident").device_bytes + 1000
    model = lora_llama()
    model, optimizer = sakura_offload.wrap(
        model, adamw(model), device_budget=budget, host_budget=HUGE, activation_reserve=0,
        cost_trials=0, choices=None,
    )  # fmt: skip
    train(model, optimizer, steps=2)
    state = model.sakura_fit
    assert state.plan.weights == "host" and len(state.replans) == 1
    applied = state.planner.applied
    assert set(applied.choices.values()) - {"keep"}
    bandwidths = {"host": 2.5e8}
    table = plan_table(state.plan, state.budgets, bandwidths=bandwidths, activations=applied)
    rows = table.splitlines()[1 : 1 + LAYERS]
    weights = weight_seconds(state.plan, bandwidths)
    costs = Costs(applied.decisions, {}, applied.host_bandwidth, applied.disk_bandwidth)
    for i, (row, size, decision) in enumerate(
        zip(rows, state.plan.sizes.block_frozen, applied.decisions, strict=True)
    ):
        assert weights[i] == 2 * size / bandwidths["host"]
        assert row.split()[3:5] == _ms(weights[i]).split(), row
        # the activations' extra time: the planner's own cost model for its choice
        assert decision.cost_seconds == costs(i, decision.choice)
        assert f"activations {decision.choice} +{_ms(decision.cost_seconds)}" in row
    total_w = sum(2 * b for b in state.plan.sizes.block_frozen) / bandwidths["host"]
    total_a = sum(d.cost_seconds for d in applied.decisions)
    assert f"weights {_ms(total_w)}" in table
    assert f"activations {_ms(total_a)}, total {_ms(total_w + total_a)}" in table
    # fit's own table uses the bandwidth it probed, through the same formula
    assert state.bandwidths["host"] > 0
    report = sakura_offload.memory_report(model)
    probed = weight_seconds(state.plan, state.bandwidths)
    assert all(_ms(s) in report["table"] for s in probed if s is not None)
    # the probe: one-way copies of the sizes given, for both tiers
    assert copy_bandwidth(torch.device("cpu"), [4096], tier="disk") > 0
    with pytest.raises(ValueError, match="tier='tape'"):
        copy_bandwidth(torch.device("cpu"), [4096], tier="tape")
    sakura_offload.unwrap(model)
