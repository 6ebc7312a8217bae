"""ShardedCheckpoint on real gloo ranks with FSDP2: saved at 2 ranks, a failed write leaves
the last good checkpoint published, a rank that never joins is reported within the
timeout, and the checkpoint resumes at 3 ranks and at 1 with the parameters and the AdamW
state equal (torch.equal) to the unsharded reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sakura.options import OptionError
from sakura.testing import launch_ranks

WORKER = Path(__file__).with_name("_dcp_rank.py")


def _read(path: Path) -> dict:  # type: ignore[type-arg]
    return json.loads(path.read_text())


def test_save_at_2_fail_keeps_last_good_resume_at_3_and_1(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    launch_ranks(WORKER, 2, tmp_path / "s", "save", str(ckpt), timeout=120, init_name="i2")
    for rank in (0, 1):
        saved = _read(tmp_path / "s" / f"save-rank{rank}.json")
        assert "step-00000004" in saved["error"] and "previous checkpoint is kept" in saved["error"]
        assert saved["steps"] == [2, 3]  # keep=2; the failed step 4 never published
    assert not list(ckpt.glob(".tmp-*"))  # the failed temporary folder was removed
    for world in (3, 1):
        out = tmp_path / "s"
        launch_ranks(WORKER, world, out, "load", str(ckpt), timeout=120, init_name=f"l{world}")
        results = [_read(out / f"load{world}-rank{r}.json") for r in range(world)]
        for result in results:
            assert result["step"] == 3
            assert result["keys"] > 10  # parameters and AdamW's step/exp_avg/exp_avg_sq
            assert result["unequal"] == []  # rank 0: every tensor torch.equal to the reference
        assert sum(r["local"] for r in results) == 8 * 30 + 30 + 30 * 7 + 7 + 7 * 3 + 3


def test_rank_that_never_joins_is_reported_not_waited_on(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    launch_ranks(WORKER, 2, tmp_path, "hang", str(ckpt), timeout=90)
    result = _read(tmp_path / "hang-rank0.json")
    assert "could not agree" in result["error"]  # DCP's planning timed out, then the vote
    assert result["steps"] == []


def test_options_are_validated() -> None:
    from sakura_async.checkpoint.sharded import ShardedCheckpoint

    with pytest.raises(OptionError, match="keep"):
        ShardedCheckpoint("x", keep=0)
    with pytest.raises(OptionError, match="timeout_s"):
        ShardedCheckpoint("x", timeout_s=0)
    with pytest.raises(OptionError, match="dir"):
        ShardedCheckpoint("")
