"""The host side of ``fit``'s re-plan (``sakura_offload.fit.host_replan``): the reserve kept
from an explicit ``host_budget`` is measured in the first planned step, its unused part goes
to the activation planner's host paging, a shortfall is taken back from it, an explicit
``host_reserve`` is left alone, and the trained values do not depend on it.

The model: a 4-layer Llama (hidden 128) trained in full, so the host optimizer's moments
(8 MiB) fill most of a 12 MiB host budget and the activation planner's host paging gets
little; the 11 MiB device budget leaves the activations about 3 MiB of their 7.7 MiB, so
blocks page or recompute.  The RSS the measurement sees is injected (``read_rss``) where a
test needs exact figures."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import sakura_offload
from sakura_offload.fit.host_replan import MIN_CHANGE, HostReserve, reserve_needed

pytest.importorskip("transformers")

MB = 2**20
DEVICE = 11 * MB
HOST = 12 * MB
RESERVE = HOST // 8
STEPS = 4


def llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="eager",
        use_cache=False,
    )
    return LlamaForCausalLM(config).train()


def wrapped(tmp: Path, **options: Any) -> tuple[Any, Any]:
    model = llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    kwargs: dict[str, Any] = {
        "device_budget": DEVICE, "host_budget": HOST, "disk_offload": tmp / "disk",
        "cost_trials": 0, "choices": None, "report": False,
    }  # fmt: skip
    kwargs.update(options)
    return sakura_offload.wrap(model, optimizer, **kwargs)


def train(model: Any, optimizer: Any, steps: int = STEPS, on_step: Any = None) -> None:
    g = torch.Generator().manual_seed(3)
    for step in range(steps):
        ids = torch.randint(0, 256, (2, 64), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if on_step is not None:
            on_step(step)


class FakeRss:
    """RSS as the test decides: the reference, then the reference plus what the plan
    accounts for the step plus ``overhead`` at every later sample."""

    def __init__(self, overhead: int) -> None:
        self.overhead = overhead
        self.host: HostReserve | None = None
        self.calls = 0

    def __call__(self) -> int:
        self.calls += 1
        base = 1 << 32
        if self.calls == 1 or self.host is None:
            return base
        return base + self.host.accounted + self.overhead


def run_with(tmp: Path, overhead: int) -> tuple[Any, int, FakeRss]:
    """Wrap, inject ``FakeRss(overhead)``, train; returns the state and the planner's host
    budget before the re-plan."""
    model, optimizer = wrapped(tmp)
    state = model.sakura_fit
    host = state.replanner.host
    assert host is not None and state.budgets.host_reserve == RESERVE
    fake = FakeRss(overhead)
    fake.host = host
    host.read_rss = fake
    before = state.planner.host_budget
    assert before == HOST - state.plan.host_bytes
    train(model, optimizer)
    return model, before, fake


def test_the_margin_rule() -> None:
    assert reserve_needed(0) == MB
    assert reserve_needed(2 * MB) == 3 * MB
    assert reserve_needed(8 * MB) == 10 * MB
    with pytest.raises(ValueError, match="overhead must be >= 0"):
        reserve_needed(-1)


def host_paged(plan: Any) -> int:
    return sum(d.copy_bytes for d in plan.decisions if d.choice == "page_host")


def test_the_unused_reserve_goes_to_the_activations_host_paging(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    overhead = 200 * 2**10
    with caplog.at_level(logging.INFO, logger="sakura_offload.fit"):
        model, before, fake = run_with(tmp_path, overhead)
    state = model.sakura_fit
    host = state.replanner.host
    assert host.overhead == overhead
    given = RESERVE - reserve_needed(overhead)
    assert given >= MIN_CHANGE
    assert state.planner.host_budget == before + given
    assert host_paged(state.planner.applied) <= state.planner.host_budget
    # measured once: the reference, 4 blocks forward and backward, the model, the step
    assert fake.calls == 1 + 2 * 4 + 2
    [record] = state.replans
    assert (record.what, record.measured, record.estimated, record.step) == (
        "host reserve", overhead, RESERVE, 2
    )  # fmt: skip
    assert state.budgets.host_reserve == reserve_needed(overhead)
    assert state.plan.host_bytes + state.planner.host_budget == HOST  # the budget holds
    report = sakura_offload.memory_report(model)
    assert report["replans"] == [record.describe()]
    assert "host memory no part accounts for measured 204800 bytes" in report["table"]
    assert "the rest goes to the activations' host paging" in caplog.text
    sakura_offload.unwrap(model)


def test_an_overhead_above_the_reserve_takes_host_room_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    overhead = RESERVE + 512 * 2**10
    with caplog.at_level(logging.WARNING, logger="sakura_offload.fit"):
        model, before, _ = run_with(tmp_path, overhead)
    state = model.sakura_fit
    taken = reserve_needed(overhead) - RESERVE
    assert 0 < taken <= before
    assert state.planner.host_budget == before - taken
    assert host_paged(state.planner.applied) <= state.planner.host_budget
    assert [r.what for r in state.replans] == ["host reserve"]
    assert "the difference comes from the activations' host paging" in caplog.text
    assert state.plan.host_bytes + state.planner.host_budget == HOST
    sakura_offload.unwrap(model)


def test_a_shortfall_beyond_the_activations_host_paging_is_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    overhead = 16 * MB
    with caplog.at_level(logging.WARNING, logger="sakura_offload.fit"):
        model, before, _ = run_with(tmp_path, overhead)
    state = model.sakura_fit
    assert state.planner.host_budget == 0
    assert host_paged(state.planner.applied) == 0
    short = reserve_needed(overhead) - RESERVE - before
    assert f"may exceed host_budget={HOST} by about {short} bytes" in caplog.text
    sakura_offload.unwrap(model)


def test_an_explicit_reserve_and_the_default_budget_are_left_alone(tmp_path: Path) -> None:
    for options in ({"host_reserve": RESERVE}, {"host_budget": None}):
        model, optimizer = wrapped(tmp_path, **options)
        state = model.sakura_fit
        assert state.replanner.host is None
        before = state.planner.host_budget
        train(model, optimizer)
        assert state.planner.host_budget == before
        assert state.replans == []
        sakura_offload.unwrap(model)


def test_the_real_reader_keeps_the_budget_s_sum(tmp_path: Path) -> None:
    model, optimizer = wrapped(tmp_path)
    state = model.sakura_fit
    before = state.planner.host_budget
    train(model, optimizer)
    host = state.replanner.host
    assert host.done and host.overhead is not None and host.overhead >= 0
    assert host.peak >= host.reference > 0
    change = RESERVE - reserve_needed(host.overhead)
    if abs(change) < MIN_CHANGE:
        assert state.planner.host_budget == before and state.replans == []
    else:
        assert state.planner.host_budget == max(0, before + change)
        assert [r.measured for r in state.replans] == [host.overhead]
    assert host_paged(state.planner.applied) <= state.planner.host_budget
    sakura_offload.unwrap(model)


@pytest.mark.parametrize("overhead", [0, RESERVE + 512 * 2**10])
def test_the_re_plan_does_not_change_the_trained_values(tmp_path: Path, overhead: int) -> None:
    model, _, _ = run_with(tmp_path / "a", overhead)
    assert model.sakura_fit.replans
    replanned = {n: p.detach().clone() for n, p in model.named_parameters()}
    sakura_offload.unwrap(model)
    reference, optimizer = wrapped(tmp_path / "b", replan=False)
    assert reference.sakura_fit.replanner is None
    train(reference, optimizer)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(replanned[name], p.detach(), rtol=0, atol=1e-7, msg=name)
    sakura_offload.unwrap(reference)
