"""What makes a checkpoint loadable: a protected manifest, NaN never the best, readers
that never miss a checkpoint while a writer replaces it, and retention that never deletes
the newest checkpoint that verifies."""

from __future__ import annotations

import json
import logging
import math
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from sakura import OnEpochEnd, SakuraRuntime
from sakura_async import AsyncCheckpoint
from sakura_async.checkpoint import (
    find_checkpoints,
    load_best,
    load_latest,
    store,
    write_checkpoint,
)
from sakura_async.checkpoint.store import MANIFEST, manifest_digest

# --- every="best" and NaN -----------------------------------------------------------------


def test_a_nan_metric_never_becomes_the_best(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 1)
    state: dict[str, Any] = {}
    with SakuraRuntime(strict=True) as rt:
        ckpt = rt.install(
            AsyncCheckpoint(
                tmp_path,
                every="best",
                metric="val_loss",
                keep=None,
                dispatcher="inthread",
                state_provider=lambda: dict(state),
            )
        )
        for step, value in enumerate([math.nan, 0.5, math.nan, 0.7, 0.3, math.nan], start=1):
            state["step"] = torch.tensor(step)
            rt.emit(OnEpochEnd, epoch=step - 1, step=step, model=model, metrics={"val_loss": value})
    assert not ckpt.errors
    assert [(c.step, c.metric_value) for c in find_checkpoints(tmp_path)] == [(2, 0.5), (5, 0.3)]
    best = load_best(tmp_path)
    assert best is not None and best.step == 5 and int(best.state["step"]) == 5


@pytest.mark.parametrize("mode", ["min", "max"])
def test_load_best_ignores_nan_and_non_numbers(tmp_path: Path, mode: str) -> None:
    root = str(tmp_path)
    values = [math.nan, 0.4, "high", 0.9, math.nan]
    for step, value in enumerate(values, start=1):
        metric = {"name": "val_loss", "value": value, "mode": mode}
        write_checkpoint(root, {"w": torch.tensor(float(step))}, step=step, metric=metric)
    best = load_best(tmp_path)
    assert best is not None and best.step == (2 if mode == "min" else 4)
    only_nan = tmp_path / "nan"
    write_checkpoint(str(only_nan), {"w": torch.ones(1)}, metric={"name": "m", "value": math.nan})
    assert load_best(only_nan) is None


# --- the manifest protects itself -------------------------------------------------------


def _three(root: Path) -> list[str]:
    return [
        write_checkpoint(str(root), {"w": torch.full((3,), float(s))}, step=s, epoch=0)
        for s in (1, 2, 3)
    ]


def _edit(directory: str, change: Any, *, reseal: bool) -> None:
    path = Path(directory, MANIFEST)
    manifest = json.loads(path.read_text())
    change(manifest)
    if reseal:  # a tool that rewrote the manifest "properly": the digest matches again
        manifest["manifest_sha256"] = manifest_digest(manifest)
    path.write_text(json.dumps(manifest))


def _set(key: str, value: Any) -> Any:
    return lambda m: m.__setitem__(key, value)


@pytest.mark.parametrize(
    ("change", "reseal", "warning"),
    [
        (_set("step", 2), False, "does not match its own sha256"),
        (_set("step", 7), True, "directory name does not match the manifest's step 7"),
        (_set("epoch", 4), True, "directory name does not match"),
        (_set("files", {}), False, "does not match its own sha256"),
        (_set("files", {}), True, "the manifest lists no files"),
        (_set("main", "other.pt"), True, "the state file 'other.pt' is not listed"),
        (
            lambda m: m["files"].__setitem__("../../escape", {"sha256": "0" * 64, "bytes": 1}),
            True,
            "a file outside the checkpoint",
        ),
        (_set("sakura_checkpoint", 1), True, "manifest version 1 is not supported"),
        (lambda m: m.pop("manifest_sha256"), False, "does not match its own sha256"),
    ],
)
def test_a_changed_manifest_is_skipped_with_a_warning(
    tmp_path: Path, caplog: Any, change: Any, reseal: bool, warning: str
) -> None:
    paths = _three(tmp_path)
    _edit(paths[-1], change, reseal=reseal)
    with caplog.at_level(logging.WARNING, logger="sakura.async"):
        latest = load_latest(tmp_path)
    assert latest is not None and latest.step == 2
    assert torch.equal(latest.state["w"], torch.full((3,), 2.0))
    assert any(warning in r.getMessage() and paths[-1] in r.getMessage() for r in caplog.records)
    assert [c.step for c in find_checkpoints(tmp_path)] == [1, 2]


@pytest.mark.parametrize(
    ("damage", "warning"),
    [
        (lambda p: p.unlink(), "it has no manifest.json"),
        (lambda p: p.write_text('{"sakura_checkpoint": 2, "form'), "is not valid JSON"),
        (lambda p: p.write_text("[1, 2]"), "does not hold an object"),
        (lambda p: (p.unlink(), p.mkdir()), "cannot be read"),
    ],
)
def test_a_missing_or_unreadable_manifest_is_skipped_with_a_warning(
    tmp_path: Path, caplog: Any, damage: Any, warning: str
) -> None:
    paths = _three(tmp_path)
    damage(Path(paths[-1], MANIFEST))
    with caplog.at_level(logging.WARNING, logger="sakura.async"):
        latest = load_latest(tmp_path)
    assert latest is not None and latest.step == 2
    assert any(warning in r.getMessage() for r in caplog.records), caplog.text


def test_an_intact_checkpoint_checks_out(tmp_path: Path) -> None:
    path = write_checkpoint(str(tmp_path), {"w": torch.ones(2)}, step=5, epoch=1)
    manifest = json.loads(Path(path, MANIFEST).read_text())
    assert manifest["manifest_sha256"] == manifest_digest(manifest)
    assert manifest["main"] in manifest["files"] and manifest["step"] == 5
    assert {p.name for p in Path(path).iterdir()} == {"manifest.json", "state.pt"}


# --- a reader polling while a writer replaces the checkpoint -------------------------------


def test_a_reader_polling_load_latest_never_misses_the_checkpoint_with_keep_1(
    tmp_path: Path,
) -> None:
    """keep=1: each write adds the new checkpoint and then removes the old one.  Readers
    hammering load_latest meanwhile must always get a complete checkpoint (never None,
    never FileNotFoundError), holding what its step says."""
    root = str(tmp_path / "ckpt")
    write_checkpoint(root, {"w": torch.full((256,), 0.0), "step": torch.tensor(0)}, step=0, keep=1)
    stop = threading.Event()
    problems: list[str] = []
    reads = [0, 0]

    def reader(index: int) -> None:
        last = -1
        while not stop.is_set():
            try:
                ckpt = load_latest(root)
            except BaseException as exc:
                problems.append(f"reader {index}: {exc!r}")
                return
            if ckpt is None:
                problems.append(f"reader {index}: load_latest returned None")
                return
            step = int(ckpt.state["step"])
            if step != ckpt.step or not torch.equal(ckpt.state["w"], torch.full((256,), step)):
                problems.append(f"reader {index}: {ckpt.path} does not hold step {ckpt.step}")
            if step < last:
                problems.append(f"reader {index}: went back from step {last} to {step}")
            last = step
            reads[index] += 1

    threads = [threading.Thread(target=reader, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    try:
        for step in range(1, 151):
            state = {"w": torch.full((256,), float(step)), "step": torch.tensor(step)}
            write_checkpoint(root, state, step=step, keep=1)
            if problems:
                break
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert problems == []
    assert min(reads) > 0
    assert [c.step for c in find_checkpoints(root)] == [150]


def test_a_damaged_checkpoint_is_warned_about_once_not_at_every_listing(
    tmp_path: Path, caplog: Any
) -> None:
    paths = _three(tmp_path)
    Path(paths[0], MANIFEST).unlink()
    with caplog.at_level(logging.WARNING, logger="sakura.async"):
        for step in (4, 5, 6):  # retention lists the directory at every write
            write_checkpoint(str(tmp_path), {"w": torch.ones(1)}, step=step, keep=10)
        load_latest(tmp_path)
    warned = [r for r in caplog.records if paths[0] in r.getMessage()]
    assert len(warned) == 1 and "no manifest.json" in warned[0].getMessage()


# --- retention counts only verified checkpoints -------------------------------------------


class RottingDisk:
    """A file that silently flips one bit of every chunk it stores (bit rot between the
    write and retention): the bytes on disk no longer match the hash of what was written."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw

    def write(self, data: Any) -> int:
        stored = bytearray(data)
        stored[len(stored) // 2] ^= 0x01
        return int(self._raw.write(stored))

    def flush(self) -> None:
        self._raw.flush()


def test_retention_never_deletes_the_newest_verified_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    root = str(tmp_path)
    state = lambda step: {"w": torch.full((64,), float(step))}  # noqa: E731
    write_checkpoint(root, state(1), step=1, keep=2)
    real = store.write_state
    monkeypatch.setattr(store, "write_state", lambda t, raw, *a: real(t, RottingDisk(raw), *a))
    with caplog.at_level(logging.WARNING, logger="sakura.async"):
        write_checkpoint(root, state(2), step=2, keep=2)
        write_checkpoint(root, state(3), step=3, keep=2)  # the two newest are both rotten
    assert [c.step for c in find_checkpoints(root)] == [1, 2, 3]  # the intact one was kept
    assert [c.step for c in find_checkpoints(root, verify=True)] == [1]
    assert any("does not match its sha256" in r.getMessage() for r in caplog.records)
    latest = load_latest(root)
    assert latest is not None and latest.step == 1
    assert torch.equal(latest.state["w"], state(1)["w"])

    monkeypatch.setattr(store, "write_state", real)  # the disk is healthy again
    write_checkpoint(root, state(4), step=4, keep=2)
    # Two verified (4 and 1): the rotten ones between them are neither counted nor deleted.
    assert [c.step for c in find_checkpoints(root)] == [1, 2, 3, 4]
    write_checkpoint(root, state(5), step=5, keep=2)
    # Once older than the oldest kept checkpoint, intact or rotten, they go.
    assert [c.step for c in find_checkpoints(root)] == [4, 5]
    assert load_latest(root).step == 5  # type: ignore[union-attr]
