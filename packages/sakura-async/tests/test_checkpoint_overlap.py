"""AsyncCheckpoint(overlap=True): the copy of the weights runs during the next step's
forward and backward and must still hold exactly the weights of the checkpointed step."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from sakura import (
    OnBeforeOptimizerStep,
    OnError,
    OnOptimizerStep,
    OnTrainBegin,
    OnTrainEnd,
    OnTrainStepEnd,
    SakuraRuntime,
)
from sakura.testing import RecordingService
from sakura_async import AsyncCheckpoint
from sakura_async.checkpoint import find_checkpoints
from sakura_async.checkpoint.encoding import read_state
from sakura_async.snapshot import Snapshot


def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)
    )
    return model, torch.optim.Adam(model.parameters(), lr=0.05)


def loop(rt: SakuraRuntime, steps: int, *, barrier: bool = True) -> list[dict[str, Any]]:
    """A raw loop; returns the full state after each step (the reference)."""
    model, opt = make()
    g = torch.Generator().manual_seed(3)
    seen = []
    rt.emit(OnTrainBegin, model=model, optimizer=opt)
    for step in range(1, steps + 1):
        x, y = torch.randn(16, 6, generator=g), torch.randn(16, 2, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)  # BatchNorm buffers change here
        opt.zero_grad()
        loss.backward()
        if barrier:
            rt.emit(OnBeforeOptimizerStep, step=step - 1, model=model, optimizer=opt)
        opt.step()
        rt.emit(OnOptimizerStep, step=step, model=model, optimizer=opt)
        rt.emit(OnTrainStepEnd, step=step, model=model)
        seen.append(
            {
                "model": {k: v.clone() for k, v in model.state_dict().items()},
                "exp_avg": [opt.state[p]["exp_avg"].clone() for p in model.parameters()],
            }
        )
    rt.emit(OnTrainEnd, step=steps, model=model)
    return seen


def test_overlapped_copies_hold_exactly_the_checkpointed_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: set[str] = set()
    original = Snapshot.finish

    def finish(self: Snapshot, stream: Any = None) -> None:
        threads.add(threading.current_thread().name)
        original(self, stream)

    monkeypatch.setattr(Snapshot, "finish", finish)
    with SakuraRuntime(strict=True) as rt:
        ckpt = rt.install(
            AsyncCheckpoint(tmp_path, every="2 steps", keep=None, overlap=True, dispatcher="thread")
        )
        reference = loop(rt, 6)
    assert threads and all(name.startswith("sakura-snapshot") for name in threads)
    found = find_checkpoints(tmp_path, verify=True)
    assert [c.step for c in found] == [2, 4, 6]
    for c in found:
        state = read_state(c.file, "torch")
        ref = reference[c.step - 1]
        assert all(
            torch.equal(state["model"][k], v) for k, v in ref["model"].items()
        )  # incl. BN stats
        exp_avg = [s["exp_avg"] for s in state["optimizer"]["state"].values()]
        assert all(torch.equal(a, b) for a, b in zip(exp_avg, ref["exp_avg"], strict=True))
    assert ckpt.errors == [] and len(ckpt.blocked_s) == 3


def test_without_the_barrier_event_the_checkpoint_is_discarded_and_overlap_stops(
    tmp_path: Path,
) -> None:
    rec = RecordingService(event_types={OnError})
    with SakuraRuntime([rec]) as rt:
        ckpt = rt.install(
            AsyncCheckpoint(tmp_path, every="2 steps", keep=None, overlap=True, dispatcher="thread")
        )
        reference = loop(rt, 4, barrier=False)
        with pytest.raises(Exception, match="1 checkpoint write"):
            rt.close()
    (error,) = rec.of(OnError)
    assert "overlap=True needs the loop to emit OnBeforeOptimizerStep" in str(error.exception)
    assert ckpt.overlap is False
    found = find_checkpoints(tmp_path, verify=True)
    assert [c.step for c in found] == [4]  # the later one, copied at once
    state = read_state(found[0].file, "torch")
    assert all(torch.equal(state["model"][k], v) for k, v in reference[3]["model"].items())


def test_overlap_must_be_a_bool(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="overlap='yes' is not accepted; accepted: True or False"):
        AsyncCheckpoint(tmp_path, overlap="yes")  # type: ignore[arg-type]
