"""The host side of ``fit``'s re-plan (``sakura_offload.fit.host_replan``): the reserve kept
from an explicit ``host_budget`` is measured in the first planned step, its unused part goes
to the activation planner's host paging, a shortfall is taken back from it, an explicit
``host_reserve`` is left alone, and the trained values do not depend on it.

The model: a 4-layer Llama (hidden 128) trained in full, so the host optimizer's moments
(8 MiB) fill most of a 12 MiB host budget and the activation planner's host paging gets
little; the 11 MiB device budget leaves the activations about 3 MiB of their 7.7 MiB, so
blocks page or recompute.  The RSS the measurement sees is injected (``read_rss``) where a
test needs exact figures (``host_replan.rss_reader``)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import sakura_offload
from sakura_offload.fit import host_replan
from sakura_offload.fit.host_replan import (
    MIN_CHANGE,
    HostReserve,
    file_backed_bytes,
    reserve_margin,
)

pytest.importorskip("transformers")

MB = 2**20
DEVICE = 11 * MB
HOST = 12 * MB
RESERVE = HOST // 8
LIMIT = HOST + DEVICE
"""On a CPU the device is host RAM too: the anonymous RSS is held against both budgets."""
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
    """RSS as the test decides: any level at the baseline, then the baseline plus ``used``
    at every reading of the measured step."""

    def __init__(self, used: int) -> None:
        self.used = used
        self.host: HostReserve | None = None
        self.calls = 0

    def __call__(self) -> int:
        self.calls += 1
        if self.host is None:
            return 1 << 32
        return self.host.baseline + self.used


def run_with(tmp: Path, monkeypatch: pytest.MonkeyPatch, used: int) -> tuple[Any, int, FakeRss]:
    """Wrap, train with ``FakeRss(used)`` read; returns the state and the planner's host
    budget before the re-plan."""
    fake = FakeRss(used)
    monkeypatch.setattr(host_replan, "rss_reader", fake)
    model, optimizer = wrapped(tmp)
    state = model.sakura_fit
    host = state.replanner.host
    assert host is not None and state.budgets.host_reserve == RESERVE
    anonymous = sum(t.nbytes for t in [*model.parameters(), *model.buffers()])
    assert host.baseline == (1 << 32) - anonymous  # the model's tensors are anonymous here
    fake.host = host
    before = state.planner.host_budget
    assert before == HOST - state.plan.host_bytes
    train(model, optimizer)
    return model, before, fake


def test_the_margin_rule() -> None:
    assert reserve_margin(0) == MB
    assert reserve_margin(72 * MB) == 72 * MB // 50
    with pytest.raises(ValueError, match="limit must be >= 0"):
        reserve_margin(-1)


def test_file_backed_tensors_are_found_in_the_maps(tmp_path: Path) -> None:
    path = tmp_path / "w.pt"
    torch.save({"w": torch.randn(4096)}, path)
    mapped = torch.load(path, mmap=True, weights_only=True)["w"]
    anonymous = torch.randn(4096)
    assert file_backed_bytes([mapped, mapped[10:], anonymous]) == mapped.nbytes
    assert file_backed_bytes([anonymous]) == 0
    assert file_backed_bytes([mapped], maps="") == 0


def host_paged(plan: Any) -> int:
    return sum(d.copy_bytes for d in plan.decisions if d.choice == "page_host")


def test_the_unused_reserve_goes_to_the_activations_host_paging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # 1 MiB left under the limit beyond the margin: less than the reserve (1.5 MiB)
    used = LIMIT - reserve_margin(LIMIT) - MB
    with caplog.at_level(logging.INFO, logger="sakura_offload.fit"):
        model, before, fake = run_with(tmp_path, monkeypatch, used)
    state = model.sakura_fit
    host = state.replanner.host
    assert host.used == used
    assert state.planner.host_budget == before + MB
    assert host_paged(state.planner.applied) <= state.planner.host_budget
    # the baseline, then once: the step's start, 4 blocks forward and backward, the model,
    # the step's end
    assert fake.calls == 1 + 1 + 2 * 4 + 2
    [record] = state.replans
    assert (record.what, record.measured, record.estimated, record.step) == (
        "host reserve", used, LIMIT, 2
    )  # fmt: skip
    assert state.budgets.host_reserve == RESERVE - MB
    assert state.plan.host_bytes + state.planner.host_budget == HOST  # the budget holds
    report = sakura_offload.memory_report(model)
    assert report["replans"] == [record.describe()]
    assert f"anonymous RSS peaked {used} bytes above its baseline" in report["table"]
    assert "host_reserve's unused part goes to the activations' host paging" in caplog.text
    sakura_offload.unwrap(model)


def test_more_room_than_the_reserve_gives_the_reserve_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, before, _ = run_with(tmp_path, monkeypatch, 0)
    state = model.sakura_fit
    assert state.planner.host_budget == before + RESERVE
    assert state.budgets.host_reserve == 0
    sakura_offload.unwrap(model)


def test_a_peak_over_the_margin_takes_host_room_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    used = LIMIT - reserve_margin(LIMIT) + 512 * 2**10
    with caplog.at_level(logging.WARNING, logger="sakura_offload.fit"):
        model, before, _ = run_with(tmp_path, monkeypatch, used)
    state = model.sakura_fit
    assert state.planner.host_budget == before - 512 * 2**10
    assert host_paged(state.planner.applied) <= state.planner.host_budget
    assert [r.what for r in state.replans] == ["host reserve"]
    assert "host_reserve's shortfall comes from the activations' host paging" in caplog.text
    assert state.plan.host_bytes + state.planner.host_budget == HOST
    sakura_offload.unwrap(model)


def test_a_shortfall_beyond_the_activations_host_paging_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    used = LIMIT + 16 * MB
    with caplog.at_level(logging.WARNING, logger="sakura_offload.fit"):
        model, before, _ = run_with(tmp_path, monkeypatch, used)
    state = model.sakura_fit
    assert state.planner.host_budget == 0
    assert host_paged(state.planner.applied) == 0
    short = used + reserve_margin(LIMIT) - LIMIT - before
    assert f"may exceed its limit of {LIMIT} bytes by about {short}" in caplog.text
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
    assert host.done and host.used is not None and host.used >= 0
    assert host.samples == 1 + 2 * 4 + 2
    change = min(LIMIT - host.used - reserve_margin(LIMIT), RESERVE)
    if state.replans:
        assert state.planner.host_budget == max(0, before + change)
        assert [r.measured for r in state.replans] == [host.used]
    else:
        assert state.planner.host_budget == before and abs(change) < MIN_CHANGE
    assert host_paged(state.planner.applied) <= state.planner.host_budget
    sakura_offload.unwrap(model)


@pytest.mark.parametrize("room", [MB, -512 * 2**10])
def test_the_re_plan_does_not_change_the_trained_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, room: int
) -> None:
    model, _, _ = run_with(tmp_path / "a", monkeypatch, LIMIT - reserve_margin(LIMIT) - room)
    assert model.sakura_fit.replans
    replanned = {n: p.detach().clone() for n, p in model.named_parameters()}
    sakura_offload.unwrap(model)
    reference, optimizer = wrapped(tmp_path / "b", replan=False)
    assert reference.sakura_fit.replanner is None
    train(reference, optimizer)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(replanned[name], p.detach(), rtol=0, atol=1e-7, msg=name)
    sakura_offload.unwrap(reference)
