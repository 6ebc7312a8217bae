"""AsyncCheckpoint on an FSDP2 model, the failure paths (real gloo ranks, a small MLP): a
rank that never comes to a save is reported within ``timeout_s``, not waited on; the
options a sharded model cannot honour are each reported, naming the option."""

from __future__ import annotations

import json
from pathlib import Path

from sakura.testing import launch_ranks

WORKER = Path(__file__).with_name("_async_dcp_rank.py")


def _read(path: Path) -> dict:  # type: ignore[type-arg]
    return json.loads(path.read_text())


def test_rank_that_never_saves_is_reported_not_waited_on(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    launch_ranks(WORKER, 2, tmp_path, "hang", str(ckpt), timeout=90)
    result = _read(tmp_path / "hang-rank0.json")
    assert "could not agree" in result["drained"]  # DCP's planning timed out (timeout_s=3)
    assert result["published"] == []


def test_options_a_sharded_model_cannot_honour_are_reported(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    launch_ranks(WORKER, 1, tmp_path, "refuse", str(ckpt), timeout=90)
    result = _read(tmp_path / "refuse.json")
    expected = ["every='30s'", "every='best'", "format='safetensors'", "compress=3"]
    expected += ["state_provider=<class 'dict'>"]
    for message, option in zip(result["messages"], expected, strict=True):
        assert f"AsyncCheckpoint: {option} is not accepted" in message, message
        assert "sharded (FSDP2 / DTensor) model" in message
    assert result["written"] == []  # no checkpoint, no temporary folder
