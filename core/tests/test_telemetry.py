from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from sakura import OnEpochEnd, OnError, OnTrainBegin, OnTrainStepEnd, SakuraRuntime, Telemetry
from sakura.telemetry import summarize
from sakura.testing import (
    check_exceptions_isolated,
    check_no_work_on_unhandled_events,
    expected_event_names,
)


def read(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_one_line_per_event_with_scalar_fields_only(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    with SakuraRuntime([Telemetry(path)]) as rt:
        rt.emit(OnTrainBegin, model=object(), optimizer=object())
        rt.emit(
            OnTrainStepEnd, step=1, epoch=0, batch=[1, 2], batch_idx=0, loss=0.5, outputs=object()
        )
        rt.emit(
            OnEpochEnd, step=1, epoch=0, metrics={"val_loss": 0.25, "note": "ok", "skip": object()}
        )
        rt.emit(OnError, exception=ValueError("bad"), source="svc")
    lines = read(path)
    assert [line["event"] for line in lines] == [
        "OnTrainBegin",
        "OnTrainStepEnd",
        "OnEpochEnd",
        "OnError",
    ]
    # objects are never written; scalars (accumulation_steps, None here) are
    assert set(lines[0]) == {"event", "rank", "step", "epoch", "time", "accumulation_steps"}
    assert lines[1]["loss"] == 0.5 and lines[1]["batch_idx"] == 0 and "batch" not in lines[1]
    assert lines[2]["metrics"] == {"val_loss": 0.25, "note": "ok"}
    assert lines[3]["exception"] == "ValueError: bad" and lines[3]["source"] == "svc"
    assert lines[3]["failed_event"] is None  # no event was being handled
    assert all(line["rank"] == 0 for line in lines)
    assert lines[0]["time"] <= lines[-1]["time"]


def test_buffered_until_epoch_end_then_flushed(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    telemetry = Telemetry(path)
    with SakuraRuntime([telemetry]) as rt:
        rt.emit(OnTrainStepEnd, step=1)
        rt.emit(OnTrainStepEnd, step=2)
        assert path.read_text() == ""  # no per-step write
        rt.emit(OnEpochEnd, step=2)
        assert len(read(path)) == 3
        rt.emit(OnTrainStepEnd, step=3)
    assert [line["step"] for line in read(path)] == [1, 2, 2, 3]  # flushed at exit too


def test_max_buffer_bounds_memory(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    with SakuraRuntime([Telemetry(path, max_buffer=2)]) as rt:
        for step in range(5):
            rt.emit(OnTrainStepEnd, step=step)
        assert len(read(path)) == 4


def test_loss_tensors_are_kept_detached_and_written_as_numbers(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    path = tmp_path / "t.jsonl"
    weight = torch.tensor(2.0, requires_grad=True)
    with SakuraRuntime([Telemetry(path)]) as rt:
        rt.emit(OnTrainStepEnd, loss=weight * 3, outputs=torch.ones(3))
        rt.emit(OnEpochEnd, metrics={"acc": torch.tensor(0.75), "inf": float("inf")})
    lines = read(path)
    assert lines[0]["loss"] == 6.0 and "outputs" not in lines[0]
    assert lines[1]["metrics"] == {"acc": 0.75, "inf": "inf"}


def test_multi_process_runs_write_one_file_per_rank(tmp_path: Path) -> None:
    for rank in (0, 1):
        with SakuraRuntime([Telemetry(tmp_path / "t.jsonl")], rank=rank, world_size=2) as rt:
            rt.emit(OnEpochEnd)
    assert read(tmp_path / "t.rank1.jsonl")[0]["rank"] == 1
    with SakuraRuntime([Telemetry(tmp_path / "run-{rank}.jsonl")], rank=1, world_size=2) as rt:
        rt.emit(OnEpochEnd)
    assert (tmp_path / "run-1.jsonl").exists()


def test_event_filter_records_only_chosen_events(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    telemetry = Telemetry(path, events=["OnTrainBegin"])
    with SakuraRuntime([telemetry]) as rt:
        rt.emit(OnTrainBegin)
        rt.emit(OnTrainStepEnd)
        rt.emit(OnEpochEnd)
        assert not rt.handles(OnTrainStepEnd)
    assert [line["event"] for line in read(path)] == ["OnTrainBegin"]
    check_no_work_on_unhandled_events(lambda: Telemetry(tmp_path / "x.jsonl", events=[OnEpochEnd]))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"path": ""}, "path must be a non-empty file path"),
        ({"max_buffer": 0}, "max_buffer must be a positive int"),
        ({"events": ["OnEpochEdn"]}, "did you mean 'OnEpochEnd'"),
        ({"events": [3]}, "events must hold event classes"),
        ({"append": "yes"}, "append must be a bool"),
    ],
)
def test_options_are_validated(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Telemetry(**kwargs)


def test_append_mode_and_summary(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    for _ in range(2):
        telemetry = Telemetry(path, append=True)
        with SakuraRuntime([telemetry]) as rt:
            rt.emit(OnTrainStepEnd, loss=1.5)
            rt.emit(OnEpochEnd, metrics={"val_loss": 0.5})
    summary = summarize(path)
    assert summary["events"] == {"OnTrainStepEnd": 2, "OnEpochEnd": 2}
    assert summary["last_loss"] == 1.5 and summary["last_metrics"] == {"val_loss": 0.5}
    live = telemetry.summary()
    assert live["events"] == {"OnTrainStepEnd": 1, "OnEpochEnd": 1} and live["loss"] == 1.5
    (tmp_path / "bad.jsonl").write_text("{not json}\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: not a JSON line"):
        summarize(tmp_path / "bad.jsonl")


def test_full_tiny_loop_is_recorded_in_order(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from sakura.testing import run_tiny_loop

    path = tmp_path / "t.jsonl"
    with SakuraRuntime([Telemetry(path)]) as rt:
        run_tiny_loop(rt, epochs=2, steps_per_epoch=3, val_batches=2)
    assert [line["event"] for line in read(path)] == expected_event_names(2, 3, 2)


def test_telemetry_is_isolation_conformant(tmp_path: Path) -> None:
    check_exceptions_isolated(lambda: Telemetry(tmp_path / "iso.jsonl"))


def test_buffer_without_running_runtime_is_a_clear_error(tmp_path: Path) -> None:
    telemetry = Telemetry(tmp_path / "t.jsonl")
    rt = SakuraRuntime([telemetry], strict=True)  # not entered: no file was opened
    with pytest.raises(RuntimeError, match="use `with SakuraRuntime"):
        rt.emit(OnEpochEnd)
