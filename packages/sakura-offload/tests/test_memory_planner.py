"""The memory planner on a tiny Llama: bit-identical gradients for every choice, measured
peaks within the budget, generous -> keep, tight -> a mix, impossible -> the minimum."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _offload_models import tiny_llama as llama

from sakura import SakuraRuntime, marks
from sakura.options import OptionError
from sakura_offload.planner import (
    CHOICES,
    MemoryBudgetError,
    MemoryPlan,
    MemoryPlanner,
    parse_bytes,
    plan_memory,
)
from sakura_offload.planner.service import MemoryPlannerService

transformers = pytest.importorskip("transformers")

LAYERS = [f"model.layers.{i}" for i in range(4)]


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 96, (2, 48), generator=torch.Generator().manual_seed(seed))


def step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    for p in model.parameters():
        p.grad = None
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def same(a: tuple[torch.Tensor, list[torch.Tensor]], b: tuple[Any, list[torch.Tensor]]) -> bool:
    return torch.equal(a[0], b[0]) and all(
        torch.equal(x, y) for x, y in zip(a[1], b[1], strict=True)
    )


@pytest.fixture(scope="module")
def reference() -> tuple[torch.Tensor, list[torch.Tensor]]:
    return step(llama(), tokens())


def planner(
    budget: Any = 10**12, **options: Any
) -> tuple[torch.nn.Module, MemoryPlanner, MemoryPlan]:
    model = llama()
    ids = tokens()
    options.setdefault("min_bytes", 1024)
    options.setdefault("track", True)
    options.setdefault("host_bandwidth", 2e9)  # measured in `measured` only
    options.setdefault("disk_bandwidth", 1e9)
    plan_maker = MemoryPlanner(budget, **options)
    plan = plan_maker.plan(model, lambda: model(input_ids=ids, labels=ids).loss)
    return model, plan_maker, plan


@pytest.fixture(scope="module")
def measured() -> MemoryPlan:
    return planner(host_bandwidth=None, disk_bandwidth=None)[2]


@pytest.mark.parametrize(
    "choices",
    [*CHOICES, {LAYERS[0]: "recompute", LAYERS[1]: "page_disk", LAYERS[2]: "page_host"}],
    ids=[*CHOICES, "mixed"],
)
@pytest.mark.parametrize("track", [True, False], ids=["tracked", "plain"])
def test_every_choice_gives_bit_identical_gradients(
    choices: Any, track: bool, reference: Any, tmp_path: Path
) -> None:
    model, plan_maker, _ = planner(track=track, directory=tmp_path)
    plan = plan_maker.decide(choices)
    expected = (
        [choices] * 4 if isinstance(choices, str) else [choices.get(n, "keep") for n in LAYERS]
    )
    assert [d.choice for d in plan.decisions] == expected
    plan_maker.reset_peak()
    for _ in range(2):  # the second step runs on the same plan
        assert same(step(model, tokens()), reference)
    if track:
        assert 0 < plan_maker.measured_peak <= plan.estimated_peak
        assert plan_maker.live_bytes == 0  # everything saved was released after backward
    disk = plan_maker._paging.get("disk")
    if disk is not None:
        assert disk.root is not None and list(disk.root.iterdir()) == []


def test_measurements_are_plausible(measured: MemoryPlan) -> None:
    assert [d.name for d in measured.decisions] == LAYERS
    for d in measured.decisions:
        assert d.activation_bytes > d.pageable_bytes > 0
        assert d.copy_bytes >= d.pageable_bytes
        assert d.recompute_bytes >= d.activation_bytes
        assert 0 < d.input_bytes < d.activation_bytes
        assert d.parameter_bytes == sum(p.numel() * 4 for p in llama().model.layers[0].parameters())
        assert d.forward_seconds > 0
    assert measured.outside_bytes > 0
    assert measured.least_peak < measured.keep_peak
    assert measured.host_bandwidth > 0 and measured.disk_bandwidth > 0


def test_a_generous_budget_keeps_everything(measured: MemoryPlan, reference: Any) -> None:
    model, plan_maker, plan = planner(budget=measured.keep_peak)
    assert set(plan.choices.values()) == {"keep"}
    assert plan.estimated_peak == plan.keep_peak == measured.keep_peak
    assert plan.estimated_cost_seconds == 0.0
    plan_maker.reset_peak()
    assert same(step(model, tokens()), reference)
    assert plan_maker.measured_peak <= measured.keep_peak
    text = plan.table()
    assert all(name in text for name in LAYERS) and "keep" in text and "+ms recompute" in text


def test_a_tight_budget_mixes_and_fits(measured: MemoryPlan, reference: Any) -> None:
    budget = (measured.keep_peak + measured.least_peak) // 2
    one_block = max(d.copy_bytes for d in measured.decisions)
    model, plan_maker, plan = planner(
        budget=budget,
        host_budget=one_block,  # room in host RAM for one block's pages
        disk=False,
        host_bandwidth=1e12,  # paging nearly free: it goes first, then recomputation
    )
    choices = [d.choice for d in plan.decisions]
    assert choices.count("page_host") == 1
    assert "recompute" in choices and "keep" in choices
    assert plan.estimated_peak <= budget
    plan_maker.reset_peak()
    assert same(step(model, tokens()), reference)
    assert plan_maker.measured_peak <= budget
    table = plan.table()
    assert "page (host)" in table and "recompute" in table


def test_host_ram_margin_sends_pages_to_disk(measured: MemoryPlan, tmp_path: Path) -> None:
    _, _, plan = planner(
        budget=measured.least_peak + (measured.keep_peak - measured.least_peak) // 4,
        host_budget=0,
        directory=tmp_path,
        disk_bandwidth=1e12,
    )
    choices = set(plan.choices.values())
    assert "page_disk" in choices and "page_host" not in choices


def test_an_impossible_budget_says_the_minimum(measured: MemoryPlan) -> None:
    with pytest.raises(MemoryBudgetError) as caught:
        planner(budget=1000)
    error = caught.value
    assert error.budget == 1000 and error.minimum == measured.least_peak
    assert f"least reachable peak is {measured.least_peak} bytes" in str(error)
    _, _, plan = planner(budget=error.minimum)  # the minimum itself is reachable
    assert plan.estimated_peak <= error.minimum


def test_a_batch_works_as_the_sample() -> None:
    model = llama()
    ids = tokens()
    plan = plan_memory(model, {"input_ids": ids, "labels": ids}, "1GB", min_bytes=1024, trials=1)
    assert plan.budget == 10**9 and len(plan.decisions) == 4


def test_options_are_validated() -> None:
    assert parse_bytes("budget", "2GB") == 2 * 10**9
    assert parse_bytes("budget", "512MiB") == 512 * 2**20
    assert parse_bytes("budget", 1.5e9) == 1_500_000_000
    for bad in ("2GX", -1, True, "lots", 1.5, None):
        with pytest.raises(OptionError, match="budget="):
            parse_bytes("budget", bad)
    with pytest.raises(OptionError, match="MemoryPlanner: budget=0"):
        MemoryPlanner(0)
    with pytest.raises(OptionError, match="min_bytes"):
        MemoryPlanner(1, min_bytes=-1)
    with pytest.raises(OptionError, match="disk=1"):
        MemoryPlanner(1, disk=1)  # type: ignore[arg-type]
    with pytest.raises(OptionError, match="host_bandwidth=0"):
        MemoryPlanner(1, host_bandwidth=0)
    with pytest.raises(OptionError, match="an existing directory"):
        MemoryPlanner(1, directory="/nonexistent/sakura")
    with pytest.raises(OptionError, match="host_budget"):
        MemoryPlanner(1, host_budget="a lot")
    with pytest.raises(OptionError, match="budget=None"):  # a CPU has no memory to measure
        MemoryPlanner().attach(llama())
    with pytest.raises(OptionError, match="blocks"):
        MemoryPlanner(1, blocks="NoSuchLayer").attach(llama())
    with pytest.raises(OptionError, match="measure_steps=0"):
        MemoryPlannerService(1, measure_steps=0)
    _, plan_maker, _ = planner()
    with pytest.raises(OptionError, match="choices='swap'"):
        plan_maker.decide("swap")
    with pytest.raises(OptionError, match="block names"):
        plan_maker.decide({"model.layers.9": "keep"})
    with pytest.raises(OptionError, match="trials=0"):
        MemoryPlanner(1).plan(llama(), tokens(), trials=0)


def test_blocks_recomputed_by_another_service_are_refused() -> None:
    # The public mark, as any service that recomputes a block sets it ...
    model = llama()
    marks.set_mark(model.model.layers[1], marks.RECOMPUTED, "some_service")
    with pytest.raises(
        ValueError, match=r"block model\.layers\.1 is already checkpointed by 'some_service'"
    ):
        MemoryPlanner(1).attach(model)
    assert all("forward" not in block.__dict__ for block in model.model.layers)
    marks.clear_mark(model.model.layers[1], marks.RECOMPUTED)
    MemoryPlanner(1).attach(model)  # ... and without it the block is planned


def test_blocks_of_activation_checkpoint_are_refused() -> None:
    precision = pytest.importorskip("sakura_precision")
    model = llama()
    precision.ActivationCheckpoint().wrap_model(model)
    with pytest.raises(ValueError, match="already checkpointed by 'activation_checkpoint'"):
        MemoryPlanner(1).attach(model)


def test_remove_restores_the_blocks(reference: Any) -> None:
    model, plan_maker, _ = planner()
    plan_maker.decide("recompute")
    plan_maker.remove()
    assert all("forward" not in block.__dict__ for block in model.model.layers)
    assert same(step(model, tokens()), reference)


def test_the_service_measures_then_plans_through_wrap_model(
    measured: MemoryPlan, capsys: pytest.CaptureFixture[str]
) -> None:
    budget = (measured.keep_peak + measured.least_peak) // 2
    plain, planned = llama(), llama()
    with SakuraRuntime() as rt:
        service = rt.install(f"memory_plan:budget={budget},min_bytes=1024,track=true")
        assert isinstance(service, MemoryPlannerService)
        planned, _ = rt.prepare(planned, None)
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, planned)]
        for i in range(4):
            ids = tokens(i)
            for model, optimizer in zip((plain, planned), optimizers, strict=True):
                optimizer.zero_grad()
                rt.backward(model(input_ids=ids, labels=ids).loss)
                optimizer.step()
            if i == 0:
                assert service.plan is None  # measuring (measure_steps=2)
        plan = service.plan
        assert plan is not None and plan.budget == budget
        assert set(plan.choices.values()) != {"keep"}
        assert service.planner.measured_peak <= budget
    for a, b in zip(plain.parameters(), planned.parameters(), strict=True):
        assert torch.equal(a, b)
    assert "memory plan (cpu)" in capsys.readouterr().out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_budget_defaults_to_free_memory() -> None:  # pragma: no cover - GPU only
    model = llama().cuda()
    ids = tokens().cuda()
    reference = step(llama().cuda(), ids)
    plan_maker = MemoryPlanner(min_bytes=1024, track=True)
    plan = plan_maker.plan(model, lambda: model(input_ids=ids, labels=ids).loss)
    assert plan.budget is not None and plan.budget > plan.keep_peak
    assert set(plan.choices.values()) == {"keep"}
    for choice in ("page_host", "recompute"):
        plan_maker.decide(choice)
        assert same(step(model, ids), reference)


def test_tracking_can_be_turned_on_after_planning(reference: Any) -> None:
    model, plan_maker, _ = planner(track=False)
    plan = plan_maker.decide("page_host")
    plan_maker.track = True
    plan_maker.decide(plan.choices)
    plan_maker.reset_peak()
    assert same(step(model, tokens()), reference)
    assert 0 < plan_maker.measured_peak <= plan.estimated_peak
