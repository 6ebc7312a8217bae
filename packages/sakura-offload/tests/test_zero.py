"""OffloadAdamW under sakura-zero's ZeRO1 on 2 real gloo ranks: the offload_adamw service
swaps the loop's AdamW (priority 80), ZeRO1 shards it (90). Each rank keeps only its
shard's host moments, the steps equal an unsharded OffloadAdamW bit for bit, the
consolidated state is torch.optim.AdamW's layout, and it resumes into a fresh sharding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("sakura_zero")

from sakura.testing import launch_ranks

WORKER = Path(__file__).with_name("_zero_rank.py")


@pytest.mark.parametrize("moments", ["float32", "bfloat16", "int8"])
def test_zero1_shards_offload_adamw_bit_identically(tmp_path: Path, moments: str) -> None:
    launch_ranks(WORKER, 2, tmp_path, moments, timeout=240)
    ranks = [json.loads((tmp_path / f"{moments}-rank{r}.json").read_text()) for r in (0, 1)]
    for result in ranks:
        assert result["type"] == "OffloadAdamW"  # the user's optimizer, sharded in place
        assert result["diffs"] == [0.0] * 5  # every step equal to the unsharded one
        assert result["resumed_diff"] == 0.0
    held = [r["held_states"] for r in ranks]
    assert sum(held) == ranks[0]["total_params"] and min(held) >= 1  # each keeps its shard
    assert [r["resumed_held_states"] for r in ranks] == held
    assert ranks[0]["moment_diff"] == 0.0  # consolidated moments == unsharded ones
