"""AsyncCheckpoint on an FSDP2 model (real gloo ranks, a tiny Llama built from a config):
the service detects the DTensor parameters and writes with torch.distributed.checkpoint on
every rank; each checkpoint is announced with OnCheckpointDurable on every rank at the
same loop point; a write that fails on one rank publishes nothing and keeps the previous
checkpoint; the checkpoint resumes through ``AsyncCheckpoint.resume`` at 3 ranks with
every parameter and AdamW tensor equal (torch.equal) to the state at save time.  The
resume at 1 rank is in test_checkpoint_service_dcp_overlap.py (2 -> 1), the failure paths
that need no Llama in test_checkpoint_service_dcp_failures.py (each file stays short)."""

from __future__ import annotations

import json
from pathlib import Path

from sakura.testing import launch_ranks

WORKER = Path(__file__).with_name("_async_dcp_rank.py")


def _read(path: Path) -> dict:  # type: ignore[type-arg]
    return json.loads(path.read_text())


def test_sharded_model_saved_at_2_failure_keeps_last_good_resumes_at_3(
    tmp_path: Path,
) -> None:
    ckpt = tmp_path / "ckpt"
    out = tmp_path / "s"
    launch_ranks(WORKER, 2, out, "save", str(ckpt), timeout=150, init_name="i2")
    results = [_read(out / f"save-rank{rank}.json") for rank in (0, 1)]
    for rank, saved in enumerate(results):
        # One write in flight: each is collected at the next save, or at the epoch end,
        # where every rank is; the event says so, on both ranks alike.
        assert [(d["step"], d["at"]) for d in saved["durable"]] == [
            (1, "OnTrainStepEnd@2"),
            (2, "OnTrainStepEnd@3"),
            (3, "OnEpochEnd@3"),
        ]
        assert all(d["sharded"] and d["format"] == "dcp" for d in saved["durable"])
        assert {d["rank"] for d in saved["durable"]} == {rank}
        assert saved["saved"] == ["step-00000001", "step-00000002", "step-00000003"]
        # Step 4 failed on rank 1: every rank reports it, nothing new is published, the
        # failed folder is gone and keep=2 left steps 2 and 3.
        assert len(saved["errors"]) == 1
        assert "step-00000004" in saved["errors"][0]
        assert "injected: disk full" in saved["errors"][0]
        assert "1 checkpoint write(s)" in saved["drained"]
        assert saved["published"] == [2, 3]
        assert saved["temporaries"] == []
    launch_ranks(WORKER, 3, out, "load", str(ckpt), timeout=150, init_name="l3")
    loaded = [_read(out / f"load3-rank{r}.json") for r in range(3)]
    for result in loaded:
        assert result["step"] == 3
        assert result["keys"] > 100  # the Llama's parameters and AdamW's state
        assert result["unequal"] == []  # rank 0 compared every tensor with torch.equal
    assert sum(r["local"] for r in loaded) == loaded[0]["total"]  # each rank its shard
