"""AsyncEval on an FSDP2 (DTensor) model on 2 and 3 real gloo ranks: the full-state
snapshot gathered at each epoch end and evaluated in the worker on rank 0 gives the same
metrics as a synchronous evaluation of an unsharded model trained on the same data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sakura.testing import launch_ranks

WORKER = Path(__file__).with_name("_eval_sharded_rank.py")


@pytest.mark.parametrize("world", [2, 3])
def test_async_eval_of_sharded_model_equals_sync_eval_of_unsharded(
    tmp_path: Path, world: int
) -> None:
    launch_ranks(WORKER, world, tmp_path, timeout=120)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    rank0 = results[0]
    assert rank0["errors"] == []
    assert len(rank0["async"]) == 2
    for got, want in zip(rank0["async"], rank0["reference"], strict=True):
        assert got["val_loss"] == pytest.approx(want["val_loss"], rel=1e-5, abs=1e-6)
    for other in results[1:]:  # ranks="zero": only rank 0 evaluates, the others gather
        assert other["async"] == [] and other["errors"] == []
    # the two epochs differ, so a stale snapshot would be caught
    assert rank0["async"][0]["val_loss"] != pytest.approx(rank0["async"][1]["val_loss"], rel=1e-4)
