"""AsyncCheckpoint and the checkpoint store: formats, triggers, retention, verification,
errors, bounded memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from sakura import OnEpochEnd, OnError, OnTrainBegin, OnTrainStepEnd, SakuraRuntime
from sakura.testing import RecordingService
from sakura_async import AsyncCheckpoint, AsyncEval, EvalTask
from sakura_async.checkpoint import (
    find_checkpoints,
    load_best,
    load_latest,
    parse_every,
    write_checkpoint,
)
from sakura_async.checkpoint.store import remove_stale_temporaries
from sakura_async.dispatch import InThreadDispatcher, ThreadDispatcher
from sakura_async.errors import CheckpointWriteError
from sakura_async.snapshot import iter_tensors


def weights_after_each_epoch(world: Any, rt: SakuraRuntime, epochs: int) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []
    world.train(
        rt,
        epochs,
        after_epoch=lambda e, m: seen.append({k: v.clone() for k, v in m.state_dict().items()}),
    )
    return seen


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_every_epoch_with_retention(world: Any, tmp_path: Path, fmt: str) -> None:
    with SakuraRuntime(strict=True) as rt:
        ckpt = rt.install(
            AsyncCheckpoint(tmp_path, every=1, keep=2, format=fmt, dispatcher="thread")
        )
        weights = weights_after_each_epoch(world, rt, 3)
    found = find_checkpoints(tmp_path, verify=True)
    assert [(c.step, c.epoch) for c in found] == [(8, 1), (12, 2)]
    assert len(ckpt.saved) == 3 and ckpt.errors == []
    latest = load_latest(tmp_path)
    assert latest is not None and latest.step == 12 and latest.format == fmt
    assert same(latest.state["model"], weights[2])
    assert latest.state["optimizer"]["param_groups"][0]["lr"] == 0.2
    manifest = json.loads((Path(latest.path) / "manifest.json").read_text())
    assert manifest["files"][os.path.basename(latest.file)]["bytes"] == os.path.getsize(latest.file)
    if fmt == "torch":  # loadable with plain torch, weights only
        plain = torch.load(latest.file, weights_only=True)
        assert same(plain["model"], weights[2])
    else:
        from safetensors import safe_open

        with safe_open(latest.file, framework="pt") as f:
            assert len(list(f.keys())) == len(list(iter_tensors(latest.state))) == 4


def test_every_n_steps(world: Any, tmp_path: Path) -> None:
    with SakuraRuntime(strict=True) as rt:
        rt.install(AsyncCheckpoint(tmp_path, every="3 steps", keep=None, dispatcher="inthread"))
        world.train(rt, 2)
    assert [c.step for c in find_checkpoints(tmp_path)] == [3, 6]


def test_every_seconds_uses_the_clock(
    world: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sakura_async.checkpoint.service as service

    clock = iter(range(0, 1000, 10))  # each look at the clock is 10 s later
    monkeypatch.setattr(service.time, "monotonic", lambda: next(clock))
    with SakuraRuntime(strict=True) as rt:
        rt.install(AsyncCheckpoint(tmp_path, every="15s", keep=None, dispatcher="inthread"))
        world.train(rt, 1)
    # train begin t=0; steps at t=10, 20 (save, reset to 30), 40, 50 (save)
    assert [c.step for c in find_checkpoints(tmp_path)] == [2, 4]


def test_best_from_epoch_metrics(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    values = [0.5, 0.7, 0.3, 0.3, 0.9, 0.1]
    with SakuraRuntime(strict=True) as rt:
        rt.install(
            AsyncCheckpoint(
                tmp_path, every="best", metric="val_loss", keep=None, dispatcher="thread"
            )
        )
        rt.emit(OnTrainBegin, model=model)
        for epoch, value in enumerate(values):
            with torch.no_grad():
                model.weight.fill_(epoch)
            rt.emit(
                OnEpochEnd, epoch=epoch, step=epoch + 1, model=model, metrics={"val_loss": value}
            )
    found = find_checkpoints(tmp_path)
    assert [(c.epoch, c.metric_value) for c in found] == [(0, 0.5), (2, 0.3), (5, 0.1)]
    best = load_best(tmp_path)
    assert best is not None and best.epoch == 5 and best.metric["mode"] == "min"
    assert torch.equal(best.state["model"]["weight"], torch.full((2, 2), 5.0))


def test_best_from_async_eval_saves_the_evaluated_epochs_weights(
    world: Any, tmp_path: Path
) -> None:
    """AsyncEval's result for epoch e arrives during epoch e+1: the checkpoint must hold the
    weights of epoch e, not the live ones."""

    def eval_fn(epoch: int, task: EvalTask) -> dict[str, float]:
        return {"score": [0.5, 0.2, 0.4, 0.1][epoch]}

    with SakuraRuntime(strict=True) as rt:
        rt.install(AsyncEval(eval_fn, dispatcher=ThreadDispatcher()))
        rt.install(AsyncCheckpoint(tmp_path, every="best", metric="score", keep=None))
        weights = weights_after_each_epoch(world, rt, 4)
    found = find_checkpoints(tmp_path, verify=True)
    assert [(c.epoch, c.metric_value) for c in found] == [(0, 0.5), (1, 0.2), (3, 0.1)]
    from sakura_async.checkpoint.encoding import read_state

    for ckpt in found:
        assert same(read_state(ckpt.file, "torch")["model"], weights[ckpt.epoch])


def test_state_provider_and_bounded_memory(tmp_path: Path) -> None:
    live = {"w": torch.zeros(256, 256)}
    with SakuraRuntime(strict=True) as rt:
        ckpt = rt.install(
            AsyncCheckpoint(
                tmp_path, every=1, keep=1, dispatcher="thread", state_provider=lambda: live
            )
        )
        for epoch in range(6):
            live["w"].fill_(epoch)
            rt.emit(OnEpochEnd, epoch=epoch, step=epoch)
        assert ckpt._pool is not None
        assert ckpt._pool.allocations == 1  # one buffer, reused for all six saves
    latest = load_latest(tmp_path)
    assert latest is not None and torch.equal(latest.state["w"], torch.full((256, 256), 5.0))
    assert len(ckpt.blocked_s) == 6


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_mixed_dtypes_round_trip_exactly(tmp_path: Path, fmt: str) -> None:
    g = torch.Generator().manual_seed(0)
    live = {
        "w": torch.randn(5, 3, generator=g),
        "h": torch.randn(7, generator=g).to(torch.bfloat16),
        "step": torch.tensor(12),
        "mask": torch.tensor([True, False, True]),
        "nested": [torch.arange(4, dtype=torch.int32), {"empty": torch.zeros(0, 2)}],
    }
    with SakuraRuntime(strict=True) as rt:
        ckpt = rt.install(
            AsyncCheckpoint(tmp_path, format=fmt, dispatcher="thread", state_provider=lambda: live)
        )
        rt.emit(OnEpochEnd, epoch=0, step=12)
    assert ckpt._pool is not None and ckpt._pool.allocations == 5  # one flat buffer per dtype
    state = load_latest(tmp_path).state
    for key in ("w", "h", "step", "mask"):
        assert state[key].dtype == live[key].dtype and torch.equal(state[key], live[key])
    assert torch.equal(state["nested"][0], live["nested"][0])
    assert state["nested"][1]["empty"].shape == (0, 2)


def test_a_failed_write_is_an_on_error_and_raises_when_the_runtime_drains(tmp_path: Path) -> None:
    rec = RecordingService(event_types={OnError})
    good = {"w": torch.ones(3)}
    state: dict[str, Any] = {"w": torch.ones(3)}
    rt = SakuraRuntime([rec])
    ckpt = rt.install(
        AsyncCheckpoint(
            tmp_path,
            every=1,
            keep=1,
            format="safetensors",
            dispatcher="thread",
            state_provider=lambda: state,
        )
    )
    rt.start()
    rt.emit(OnEpochEnd, epoch=0, step=1)
    state["bad"] = object()  # not storable as safetensors: the next write fails
    rt.emit(OnEpochEnd, epoch=1, step=2)
    rt.emit(OnEpochEnd, epoch=2, step=3)
    with pytest.raises(
        CheckpointWriteError, match=r"2 checkpoint write\(s\).*failed.*use format='torch'"
    ):
        rt.close()
    assert [e.source for e in rec.of(OnError)] == ["async_checkpoint", "async_checkpoint"]
    assert len(ckpt.errors) == 2
    latest = load_latest(tmp_path)  # retention never removed the last good one
    assert latest is not None and latest.step == 1 and torch.equal(latest.state["w"], good["w"])
    assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []  # no temporaries left


def test_loaders_skip_corrupt_and_incomplete_checkpoints(tmp_path: Path) -> None:
    for step in (1, 2, 3):
        write_checkpoint(str(tmp_path), {"w": torch.full((4,), float(step))}, step=step, epoch=0)
    newest = find_checkpoints(tmp_path)[-1]
    with open(newest.file, "r+b") as f:  # flip one byte of the newest
        f.seek(-20, os.SEEK_END)
        byte = f.read(1)
        f.seek(-20, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    (tmp_path / "step-0000000009-epoch-0000").mkdir()  # a directory without a manifest
    (tmp_path / ".step-0000000010-epoch-0000.x1y2.tmp").mkdir()  # a write in progress
    latest = load_latest(tmp_path)
    assert latest is not None and latest.step == 2
    assert [c.step for c in find_checkpoints(tmp_path, verify=True)] == [1, 2]
    assert load_latest(tmp_path / "missing") is None


def test_stale_temporaries_of_dead_writers_are_removed_at_setup(tmp_path: Path) -> None:
    """A temporary directory is live exactly while a process holds the lock on its marker:
    a pid in an unlocked marker, or no marker at all, is a dead writer's."""

    def building(name: str, pid: int | None) -> Path:
        path = tmp_path / name
        path.mkdir()
        if pid is not None:
            (path / ".sakura-writer").write_text(str(pid))
        (path / "state.pt").write_bytes(b"x" * 100)
        return path

    dead = building(".step-0000000001-epoch-0000.k3j2.tmp", os.getppid())  # a live pid
    alive = building(".step-0000000002-epoch-0000.a8x1.tmp", 999_999_999)
    at_birth = building(".step-0000000003-epoch-0000.zz01.tmp", None)  # died before its marker
    deleting = building(".deleting-step-0000000000-epoch-0000-1", None)
    holder = subprocess.Popen(  # another process, alive, holding the lock of `alive`
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys\n"
            "fd = os.open(sys.argv[1], os.O_RDWR)\n"
            "fcntl.flock(fd, fcntl.LOCK_EX)\n"
            "print('locked', flush=True)\n"
            "sys.stdin.read()\n",
            str(alive / ".sakura-writer"),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        with SakuraRuntime(strict=True) as rt:
            rt.install(AsyncCheckpoint(tmp_path, dispatcher="inthread"))
        assert not dead.exists() and not at_birth.exists() and not deleting.exists()
        assert sorted(os.listdir(alive)) == [".sakura-writer", "state.pt"]  # untouched
    finally:
        holder.communicate("", timeout=30)
    assert remove_stale_temporaries(str(tmp_path)) == [alive.name]  # its writer is gone now


def test_a_cleaner_that_claims_a_fresh_temporary_makes_its_writer_start_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one moment a live writer's directory has no lock yet (created, marker not yet
    made): a cleaner starting right then claims and removes it, and the writer, finding its
    marker taken, writes into a fresh directory instead of failing."""
    from sakura_async.checkpoint import store

    real, cleaned = store._lock_new, []

    def cleaner_first(tmp: str) -> int:
        if not cleaned:
            cleaned.extend(remove_stale_temporaries(str(tmp_path)))
        return real(tmp)

    monkeypatch.setattr(store, "_lock_new", cleaner_first)
    final = write_checkpoint(str(tmp_path), {"w": torch.ones(3)}, step=1)
    assert len(cleaned) == 1 and cleaned[0].startswith(".step-0000000001-epoch-0000.")
    assert os.listdir(tmp_path) == [os.path.basename(final)]
    assert os.listdir(final) != [] and ".sakura-writer" not in os.listdir(final)
    latest = load_latest(tmp_path)
    assert latest is not None and torch.equal(latest.state["w"], torch.ones(3))


def test_train_steps_poll_without_blocking(world: Any, tmp_path: Path) -> None:
    with SakuraRuntime(strict=True) as rt:
        ckpt = rt.install(
            AsyncCheckpoint(tmp_path, every="2 steps", keep=2, dispatcher=InThreadDispatcher())
        )
        model = world.make_model()
        rt.emit(OnTrainBegin, model=model)
        for step in range(1, 7):
            rt.emit(OnTrainStepEnd, step=step, model=model)
    assert [c.step for c in find_checkpoints(tmp_path)] == [4, 6]
    assert len(ckpt.saved) == 3


@pytest.mark.parametrize(
    ("every", "expected"),
    [
        (2, ("epochs", 2)),
        ("3 epochs", ("epochs", 3)),
        ("epoch", ("epochs", 1)),
        ("500 steps", ("steps", 500)),
        ("500steps", ("steps", 500)),
        ("30s", ("seconds", 30.0)),
        ("1.5 min", ("seconds", 90.0)),
        ("2h", ("seconds", 7200.0)),
        ("best", ("best", 0)),
    ],
)
def test_parse_every(every: Any, expected: tuple[str, float]) -> None:
    assert parse_every(every) == expected


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"every": 0}, r"AsyncCheckpoint: every=0 is not accepted; accepted: an int \(epochs\)"),
        ({"every": "often"}, r"every='often' is not accepted; accepted: an int \(epochs\), 'best'"),
        ({"every": "1.5 steps"}, "accepted: a whole number >= 1 of epochs or steps"),
        ({"every": True}, "every=True is not accepted"),
        ({"every": "best"}, "metric=None is not accepted; accepted: the name of the metric"),
        ({"metric": ""}, "metric='' is not accepted"),
        ({"mode": "up"}, "AsyncCheckpoint: mode='up' is not accepted; accepted: 'min', 'max'"),
        ({"keep": 0}, "AsyncCheckpoint: keep=0 is not accepted; accepted: an int >= 1 or None"),
        (
            {"format": "pickle"},
            "format='pickle' is not accepted; accepted: 'torch', 'safetensors', 'loop', 'lightning'",
        ),
        ({"compress": 40}, "compress=40 is not accepted; accepted: a zstd level from 1 to 22"),
        ({"format": "lightning", "compress": 3}, "accepted: None with format='lightning'"),
        ({"max_pending": 0}, "max_pending=0 is not accepted; accepted: an int >= 1"),
        ({"overlap": 1}, "overlap=1 is not accepted; accepted: True or False"),
        ({"ranks": "some"}, "ranks='some' is not accepted; accepted: 'zero', 'all'"),
        ({"state_provider": 3}, "state_provider=3 is not accepted; accepted: a callable"),
        ({"dispatcher": 3}, "dispatcher must be"),
        ({"dir": ""}, "AsyncCheckpoint: dir='' is not accepted; accepted: a non-empty path"),
        ({"dir": 3}, "AsyncCheckpoint: dir=3 is not accepted; accepted: a non-empty path"),
        ({"name": ""}, "AsyncCheckpoint: name='' is not accepted"),
    ],
)
def test_options_are_validated(tmp_path: Path, kwargs: dict, match: str) -> None:
    options: dict[str, Any] = {"dir": tmp_path}
    options.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=match):
        AsyncCheckpoint(**options)
