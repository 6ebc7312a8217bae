"""The host-RAM floor held at run time: when the RAM reading (injected) falls under the
floor mid-run, blocks paged to host RAM switch to recomputation (half of those left per
forward, as the reference says), the plan records it, a warning names it once per switch,
and the parameters stay bit-identical to a run that kept everything."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from _offload_models import tiny_llama as llama

from sakura.options import OptionError
from sakura_offload.planner import MemoryPlan, MemoryPlanner
from sakura_offload.planner import apply as planner_apply
from sakura_offload.planner.service import MemoryPlannerService
from sakura_torch.host_memory import HostRam

transformers = pytest.importorskip("transformers")

LAYERS = [f"model.layers.{i}" for i in range(4)]
PAGED = {LAYERS[0]: "page_host", LAYERS[1]: "page_host", LAYERS[2]: "page_host"}
STEPS = 6
LOW_FROM = 3  # the step (from 1) whose forward first reads RAM under the floor
GIB = 2**30


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, 96, (2, 48), generator=torch.Generator().manual_seed(100 + step))


class Machine:
    """The injected RAM reading: plenty until ``low_from``, then ``low`` available."""

    def __init__(self, low_from: int, low: int, total: int = 64 * GIB) -> None:
        self.step = 0
        self.low_from = low_from
        self.low = low
        self.total = total
        self.readings = 0

    def __call__(self) -> HostRam:
        self.readings += 1
        available = self.low if self.step >= self.low_from else self.total // 2
        return HostRam(available, self.total)


class Counts:
    """Pages to host and recomputations (checkpoint calls) per step."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.pages: dict[int, int] = {}
        self.recomputed: dict[int, int] = {}
        self.step = 0
        pack, checkpoint = planner_apply._Pager.pack, planner_apply.checkpoint

        def counted_pack(pager: Any, t: torch.Tensor) -> Any:
            self.pages[self.step] = self.pages.get(self.step, 0) + 1
            return pack(pager, t)

        def counted_checkpoint(*args: Any, **kwargs: Any) -> Any:
            self.recomputed[self.step] = self.recomputed.get(self.step, 0) + 1
            return checkpoint(*args, **kwargs)

        monkeypatch.setattr(planner_apply._Pager, "pack", counted_pack)
        monkeypatch.setattr(planner_apply, "checkpoint", counted_checkpoint)


def train(model: torch.nn.Module, steps: int = STEPS, on_step: Any = None) -> list[torch.Tensor]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(1, steps + 1):
        if on_step is not None:
            on_step(step)
        ids = batch(step)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def planned(choices: Any, **options: Any) -> tuple[torch.nn.Module, MemoryPlanner, MemoryPlan]:
    model = llama()
    ids = batch(0)
    options.setdefault("min_bytes", 1024)
    plan_maker = MemoryPlanner(
        10**12, cost_trials=0, host_bandwidth=2e9, disk_bandwidth=1e9, **options
    )
    plan_maker.plan(model, lambda: model(input_ids=ids, labels=ids).loss)
    return model, plan_maker, plan_maker.decide(choices)


@pytest.fixture(scope="module")
def kept() -> list[torch.Tensor]:
    return train(llama())


@pytest.mark.parametrize("track", [False, True], ids=["plain", "tracked"])
def test_paged_blocks_switch_to_recompute_under_the_floor(
    track: bool, kept: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    machine = Machine(LOW_FROM, low=512 * 2**20)
    monkeypatch.setattr(planner_apply, "host_ram", machine)
    model, plan_maker, plan = planned(PAGED, ram_floor="1GiB", track=track)
    assert plan.ram_switches == ()
    counts = Counts(monkeypatch)

    def on_step(step: int) -> None:
        machine.step = counts.step = step

    with caplog.at_level(logging.WARNING, logger="sakura_offload.planner"):
        params = train(model, on_step=on_step)

    # Bit-identical to keeping everything (paging copies exactly; non-reentrant
    # recomputation runs the same ops on the same inputs, RNG state restored).
    assert all(torch.equal(a, b) for a, b in zip(params, kept, strict=True))
    # Before the floor is crossed three blocks page and none recomputes; at LOW_FROM half of
    # the three (rounded up: two) switch, at the next forward the last one; then no paging.
    per_block = counts.pages[1] // 3
    assert per_block > 0
    for step in range(1, LOW_FROM):
        assert counts.pages[step] == 3 * per_block and step not in counts.recomputed
    assert counts.pages[LOW_FROM] == per_block and counts.recomputed[LOW_FROM] == 2
    assert LOW_FROM + 1 not in counts.pages and counts.recomputed[LOW_FROM + 1] == 3
    for step in range(LOW_FROM + 2, STEPS + 1):
        assert step not in counts.pages and counts.recomputed[step] == 3
    # One RAM reading per forward while a block still pages to host, none after.
    assert machine.readings == LOW_FROM + 1
    applied = plan_maker.applied
    assert applied is not None
    assert applied.choices == {
        LAYERS[0]: "recompute", LAYERS[1]: "recompute", LAYERS[2]: "recompute",
        LAYERS[3]: "keep",
    }  # fmt: skip
    first, second = applied.ram_switches
    assert (first.forward, first.blocks) == (LOW_FROM, (LAYERS[0], LAYERS[1]))
    assert (second.forward, second.blocks) == (LOW_FROM + 1, (LAYERS[2],))
    assert first.available == 512 * 2**20 and first.floor == GIB
    table = applied.table()
    assert first.describe() in table and second.describe() in table
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [first.describe(), second.describe()]
    assert "536.9 MB" in warnings[0] and "1073.7 MB" in warnings[0]
    assert "model.layers.0, model.layers.1" in warnings[0]


def test_the_default_floor_is_the_host_optimizers(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``ram_floor``: 10 % of physical RAM, at least 4 GiB (one definition, shared with
    OffloadAdamW's placement)."""
    from sakura_offload.host_optimizer.placement import ram_floor

    total = 100 * GIB
    machine = Machine(2, low=9 * GIB, total=total)  # 10 GiB floor: 9 GiB is under it
    monkeypatch.setattr(planner_apply, "host_ram", machine)
    model, plan_maker, _ = planned({LAYERS[1]: "page_host"})
    assert plan_maker.floor(total) == ram_floor(total) == 10 * GIB
    assert plan_maker.floor(8 * GIB) == 4 * GIB
    train(model, steps=3, on_step=lambda step: setattr(machine, "step", step))
    applied = plan_maker.applied
    assert applied is not None and applied.choices[LAYERS[1]] == "recompute"
    (switch,) = applied.ram_switches
    assert (switch.forward, switch.floor, switch.available) == (2, 10 * GIB, 9 * GIB)


def test_above_the_floor_nothing_switches(
    kept: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    machine = Machine(STEPS + 1, low=0)
    monkeypatch.setattr(planner_apply, "host_ram", machine)
    model, plan_maker, _ = planned(PAGED, ram_floor=GIB)
    params = train(model)
    assert all(torch.equal(a, b) for a, b in zip(params, kept, strict=True))
    applied = plan_maker.applied
    assert applied is not None and applied.ram_switches == ()
    assert machine.readings == STEPS


def test_a_plan_without_host_paging_never_reads_ram(monkeypatch: pytest.MonkeyPatch) -> None:
    machine = Machine(1, low=0)
    monkeypatch.setattr(planner_apply, "host_ram", machine)
    model, _, _ = planned({LAYERS[0]: "recompute"}, ram_floor=GIB)
    train(model, steps=2)
    assert machine.readings == 0


def test_the_service_passes_the_floor_and_shows_the_switched_plan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    machine = Machine(1, low=0)
    monkeypatch.setattr(planner_apply, "host_ram", machine)
    service = MemoryPlannerService(10**12, ram_floor="2GB", report=False, cost_trials=0)
    assert service.planner.ram_floor == 2 * 10**9
    model = llama()
    service.wrap_model(model)
    train(model, steps=2)  # measures, plans (everything kept: nothing pages, nothing read)
    assert service.plan is not None and machine.readings == 0
    plan = service.planner.decide(PAGED)
    machine.step = 1
    train(model, steps=2)
    assert service.plan is not plan and service.plan is service.planner.applied
    assert [s.blocks for s in service.plan.ram_switches] == [
        (LAYERS[0], LAYERS[1]), (LAYERS[2],)
    ]  # fmt: skip


@pytest.mark.parametrize("bad", [-1, "lots", True, 1.5, "2GX"])
def test_ram_floor_is_validated(bad: Any) -> None:
    with pytest.raises(OptionError, match=r"MemoryPlanner: ram_floor=") as error:
        MemoryPlanner(1, ram_floor=bad)
    assert repr(bad) in str(error.value) and "a number of bytes" in str(error.value)
    with pytest.raises(OptionError, match=r"ram_floor="):
        MemoryPlannerService(1, ram_floor=bad)


def test_fit_holds_the_floor_too(kept: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch) -> None:
    """``sakura_offload.wrap``'s planner is a MemoryPlanner with the default floor."""
    import sakura_offload

    total = 100 * GIB
    machine = Machine(LOW_FROM, low=GIB, total=total)
    monkeypatch.setattr(planner_apply, "host_ram", machine)
    model = llama()
    holder: dict[str, Any] = {}

    def on_step(step: int) -> None:
        machine.step = step
        if step == 2:  # planned on step 1's forward (everything kept): page three blocks
            holder["planner"] = model.sakura_fit.planner
            holder["planner"].decide(PAGED)

    model, _ = sakura_offload.wrap(model, device_budget="1TB", activations="plan", report=False)
    params = train(model, on_step=on_step)
    assert all(torch.equal(a, b) for a, b in zip(params, kept, strict=True))
    applied = holder["planner"].applied
    assert [(s.forward, s.blocks, s.floor) for s in applied.ram_switches] == [
        (LOW_FROM - 1, (LAYERS[0], LAYERS[1]), 10 * GIB), (LOW_FROM, (LAYERS[2],), 10 * GIB)
    ]  # fmt: skip
    sakura_offload.unwrap(model)
