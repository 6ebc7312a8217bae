"""The memory planner's measured costs: each choice timed on the block through the code the
plan runs (a clock the test advances makes the figures exact), the plan made from them,
and trials that leave no trace (RNG, buffers, gradients, objects passed to the block)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from sakura.options import OptionError
from sakura_offload.planner import MemoryPlanner, apply, cost
from sakura_offload.planner.service import MemoryPlannerService

WIDTH = 256


class FakeClock:
    """Time passes only when a block or a pager says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Block(nn.Module):
    forward_cost = 0.0

    def __init__(self, clock: FakeClock | None) -> None:
        super().__init__()
        self.clock = clock
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.clock is not None:
            self.clock.now += self.forward_cost
        return x + self.down(torch.tanh(self.up(x)))


class SlowBlock(Block):
    forward_cost = 1.0  # recomputing costs a second


class FastBlock(Block):
    forward_cost = 0.001


class Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


SECONDS_PER_BYTE = {"host": 0.5e-6, "disk": 0.2e-6}


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(cost, "clock", fake)
    pack = apply._Pager.pack

    def charged_pack(self: Any, t: torch.Tensor) -> Any:
        fake.now += t.numel() * t.element_size() * SECONDS_PER_BYTE[self.tier]
        return pack(self, t)

    monkeypatch.setattr(apply._Pager, "pack", charged_pack)
    return fake


def test_costs_are_timed_per_choice_and_the_plan_takes_the_cheapest(
    clock: FakeClock, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    model = Stack([SlowBlock(clock), FastBlock(clock), SlowBlock(clock), FastBlock(clock)])
    x = torch.randn(64, WIDTH)
    options: dict[str, Any] = {"blocks": Block, "min_bytes": 1024, "directory": tmp_path}
    probe = MemoryPlanner(10**12, **options).plan(model, lambda: model(x))
    budget = probe.least_peak + (probe.keep_peak - probe.least_peak) // 3
    model = Stack([SlowBlock(clock), FastBlock(clock), SlowBlock(clock), FastBlock(clock)])
    planner = MemoryPlanner(budget, cost_trials=2, **options)
    plan = planner.plan(model, lambda: model(x))
    for d in plan.decisions:
        assert d.costs_measured
        costs = dict(d.costs)
        forward = 1.0 if d.name in ("layers.0", "layers.2") else 0.001
        assert costs["keep"] == 0.0
        assert costs["recompute"] == pytest.approx(forward)  # the forward runs again
        assert costs["page_host"] == pytest.approx(d.copy_bytes * SECONDS_PER_BYTE["host"])
        assert costs["page_disk"] == pytest.approx(d.copy_bytes * SECONDS_PER_BYTE["disk"])
        assert d.cost_seconds == costs[d.choice]
    # the slow blocks are cheapest paged to disk, the fast one recomputed; the last block
    # is kept (its backward comes first, so moving it would not lower the peak)
    assert plan.choices == {
        "layers.0": "page_disk",
        "layers.1": "recompute",
        "layers.2": "page_disk",
        "layers.3": "keep",
    }
    assert plan.estimated_peak <= budget
    assert plan.cost_trials == 2
    copied = sum(d.copy_bytes for d in plan.decisions)
    assert plan.host_bandwidth == pytest.approx(1 / SECONDS_PER_BYTE["host"])  # effective
    assert plan.disk_bandwidth == pytest.approx(copied / (copied * SECONDS_PER_BYTE["disk"]))
    assert "costs measured (2 timed forward + backward" in plan.table()


def test_a_given_bandwidth_is_used_and_not_timed(clock: FakeClock) -> None:
    torch.manual_seed(0)
    model = Stack([SlowBlock(clock), SlowBlock(clock)])
    planner = MemoryPlanner(10**12, blocks=Block, min_bytes=1024, disk=False, host_bandwidth=1e6)
    plan = planner.plan(model, lambda: model(torch.randn(64, WIDTH)))
    for d in plan.decisions:
        costs = dict(d.costs)
        assert costs["page_host"] == pytest.approx(d.copy_bytes / 1e6)
        assert costs["recompute"] == pytest.approx(1.0)
        assert set(costs) == {"keep", "page_host", "recompute"}
    assert plan.host_bandwidth == 1e6


def test_without_trials_costs_are_estimated(clock: FakeClock) -> None:
    torch.manual_seed(0)
    model = Stack([SlowBlock(clock), FastBlock(clock)])
    planner = MemoryPlanner(10**12, blocks=Block, min_bytes=1024, disk=False, cost_trials=0)
    plan = planner.plan(model, lambda: model(torch.randn(64, WIDTH)))
    for d in plan.decisions:
        assert not d.costs_measured
        assert dict(d.costs)["recompute"] == d.forward_seconds  # the wall-clock forward time
    assert plan.cost_trials == 0 and "costs estimated; copy round trip" in plan.table()


class NoisyBlock(nn.Module):
    """Dropout draws random numbers; BatchNorm updates running statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.BatchNorm1d(WIDTH)
        self.drop = nn.Dropout(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.norm(torch.relu(self.lin(x))))


def _noisy_plan(cost_trials: int) -> tuple[Stack, torch.Tensor]:
    torch.manual_seed(0)
    model = Stack([NoisyBlock() for _ in range(3)])
    x = torch.randn(32, WIDTH)
    planner = MemoryPlanner(10**12, blocks=NoisyBlock, min_bytes=1024, cost_trials=cost_trials)
    plan = planner.plan(model, lambda: model(x))
    assert all(d.costs_measured == (cost_trials > 0) for d in plan.decisions)
    return model, torch.get_rng_state()


def test_trials_leave_rng_buffers_and_gradients_as_they_were() -> None:
    timed, rng_timed = _noisy_plan(cost_trials=2)
    untimed, rng_untimed = _noisy_plan(cost_trials=0)
    assert torch.equal(rng_timed, rng_untimed)
    for (name, a), b in zip(timed.named_buffers(), untimed.buffers(), strict=True):
        assert torch.equal(a, b), name
    assert all(p.grad is None for p in timed.parameters())


class Counter:
    def __init__(self) -> None:
        self.calls = 0


class CountingBlock(Block):
    def forward(self, x: torch.Tensor, counter: Counter) -> torch.Tensor:  # type: ignore[override]
        counter.calls += 1
        return super().forward(x)


def test_a_block_given_an_object_is_not_run_again() -> None:
    counter = Counter()
    torch.manual_seed(0)
    blocks = nn.ModuleList([CountingBlock(None), CountingBlock(None)])
    x = torch.randn(16, WIDTH)

    def sample() -> torch.Tensor:
        h = x
        for block in blocks:
            h = block(h, counter)
        return h.sum()

    planner = MemoryPlanner(10**12, blocks=CountingBlock, min_bytes=1024, disk=False)
    plan = planner.plan(blocks, sample, trials=2)
    assert counter.calls == 4  # two measuring passes of two blocks, nothing more
    assert not any(d.costs_measured for d in plan.decisions)
    assert "costs estimated" in plan.table()


def test_the_option_is_validated() -> None:
    with pytest.raises(OptionError, match="MemoryPlanner: cost_trials=-1"):
        MemoryPlanner(1, cost_trials=-1)
    with pytest.raises(OptionError, match="cost_trials='3'"):
        MemoryPlanner(1, cost_trials="3")  # type: ignore[arg-type]
    assert MemoryPlannerService(1, cost_trials=0).planner.cost_trials == 0


class InPlaceBlock(Block):
    """Doubles its input in place before using it (its input is the previous block's
    output, which training may still hold)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.mul_(2.0)
        return super().forward(x) * 0.5


class InPlaceStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, WIDTH)
        self.layers = nn.ModuleList(InPlaceBlock(None) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        return h.square().mean()


def test_trials_in_the_service_change_nothing_the_training_holds() -> None:
    """The memory_plan service times the choices at the end of a training forward, while
    that step's graph is alive: a block that changes its input in place changes a copy,
    and a choice it cannot run under (recomputation) is ruled out, not raised."""
    from sakura import SakuraRuntime

    torch.manual_seed(0)
    plain = InPlaceStack()
    planned = InPlaceStack()
    planned.load_state_dict(plain.state_dict())
    with SakuraRuntime() as rt:
        service = rt.install(
            MemoryPlannerService(
                "1GB", blocks=InPlaceBlock, min_bytes=0, cost_trials=2, report=False
            )
        )
        planned, _ = rt.prepare(planned, None)
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, planned)]
        for step in range(4):
            x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step))
            for model, optimizer in zip((plain, planned), optimizers, strict=True):
                optimizer.zero_grad()
                rt.backward(model(x))
                optimizer.step()
        plan = service.plan
    assert plan is not None and all(d.costs_measured for d in plan.decisions)
    # checkpointing cannot recompute a block that changes its input in place: never chosen
    assert all(dict(d.costs)["recompute"] == float("inf") for d in plan.decisions)
    assert all(dict(d.costs)["page_host"] < float("inf") for d in plan.decisions)
    for a, b in zip(plain.parameters(), planned.parameters(), strict=True):
        assert torch.equal(a, b)
