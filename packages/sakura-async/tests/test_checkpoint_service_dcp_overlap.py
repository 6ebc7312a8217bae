"""AsyncCheckpoint(overlap=True) on an FSDP2 model (2 gloo ranks, a tiny Llama): the host
copy of each sharded save runs on DCP's staging thread during the next step's forward and
backward and is waited for at OnBeforeOptimizerStep; the checkpoint holds exactly the
state of its step (resumed at 1 rank, torch.equal); a step taken without
OnBeforeOptimizerStep discards the checkpoint whose copy it could have torn (reported on
every rank, nothing published) and switches overlapping off."""

from __future__ import annotations

import json
from pathlib import Path

from sakura.testing import launch_ranks

WORKER = Path(__file__).with_name("_async_dcp_rank.py")


def _read(path: Path) -> dict:  # type: ignore[type-arg]
    return json.loads(path.read_text())


def test_background_copy_is_exact_and_a_torn_one_is_discarded(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    launch_ranks(WORKER, 2, tmp_path, "overlap", str(ckpt), timeout=150, init_name="i2")
    for rank in (0, 1):
        result = _read(tmp_path / f"overlap-rank{rank}.json")
        assert result["saved"] == ["step-00000001", "step-00000002", "step-00000003"]
        assert result["published"] == [1, 2, 3]  # step 4's copy may be torn: not published
        assert "step-00000004" in result["drained"]
        assert "OnBeforeOptimizerStep" in result["drained"]
        assert result["overlap_after"] is False
    launch_ranks(WORKER, 1, tmp_path, "load", str(ckpt), timeout=150, init_name="l1")
    loaded = _read(tmp_path / "load1-rank0.json")
    assert loaded["step"] == 3
    assert loaded["keys"] > 100
    assert loaded["unequal"] == []  # the state of step 3 exactly, though copied in overlap
