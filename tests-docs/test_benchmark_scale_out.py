"""``benchmarks/scale_out.py --quick`` end to end, on the source tree: its printed structure
and the per-rank bytes it reads from the local shards (never its timings: the machine is
shared).

Run with the sakura variants only (the bitsandbytes one adds two slow-importing processes;
the benchmark itself runs it by default): 1 + 2 + 2 memory processes and one timing pair.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "scale_out.py"
VARIANTS = ("unsharded", "fsdp2-shardable", "fsdp2-naive")


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("scale-out-bench") / "result.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAKURA_")}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--variants", *VARIANTS, "--json", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout, json.loads(out.read_text(encoding="utf-8"))


def test_prints_every_section(quick: tuple[str, dict[str, Any]]) -> None:
    text, _ = quick
    for line in (
        "FSDP2 QLoRA scale-out: Llama",
        "| variant | ranks | step time | peak RSS / rank (MB) |",
        "| unsharded | 1 | ",
        "| fsdp2-shardable | 2 | ",
        "| fsdp2-naive | 2 | ",
        "fsdp2-shardable / unsharded: quantized base ",
        "fsdp2-shardable / fsdp2-naive: quantized base ",
        "step time ",
        "machine: CPU: ",
        "load average ",
    ):
        assert line in text, f"{line!r} missing from:\n{text}"
    assert "cannot run" not in text, text


def _ranks(figures: dict[str, Any], name: str) -> list[dict[str, Any]]:
    ranks: list[dict[str, Any]] = figures["variants"][name]["ranks"]
    return ranks


def test_shardable_halves_the_quantized_base(quick: tuple[str, dict[str, Any]]) -> None:
    _, figures = quick
    (whole,) = _ranks(figures, "unsharded")
    sharded = _ranks(figures, "fsdp2-shardable")
    naive = _ranks(figures, "fsdp2-naive")
    assert len(sharded) == len(naive) == 2
    for rank in sharded:
        # 1/2 of the bytes, up to FSDP2's padding of each tensor to a multiple of 2
        assert rank["quantized_bytes"] == pytest.approx(whole["quantized_bytes"] / 2, rel=0.01)
        assert rank["param_bytes"] == pytest.approx(whole["param_bytes"] / 2, rel=0.01)
        assert rank["optimizer_bytes"] == pytest.approx(whole["optimizer_bytes"] / 2, rel=0.01)
    for rank in naive:  # without shardable every rank keeps the whole quantized base
        assert rank["quantized_bytes"] == whole["quantized_bytes"]
    ratio = figures["ratios"]["unsharded"]["quantized_bytes"]
    assert ratio == pytest.approx(0.5, rel=0.01)
    assert figures["ratios"]["fsdp2-naive"]["quantized_bytes"] == pytest.approx(0.5, rel=0.01)


def test_sharded_runs_compute_the_unsharded_loss(quick: tuple[str, dict[str, Any]]) -> None:
    _, figures = quick
    (whole,) = _ranks(figures, "unsharded")
    for name in ("fsdp2-shardable", "fsdp2-naive"):
        ranks = _ranks(figures, name)
        mean = sum(r["first_loss"] for r in ranks) / len(ranks)
        # same weights, same global batch split in two halves: fp32 sums in another order
        assert mean == pytest.approx(whole["first_loss"], rel=1e-5), name


def test_every_variant_was_timed(quick: tuple[str, dict[str, Any]]) -> None:
    _, figures = quick
    for name in VARIANTS:
        times = figures["variants"][name]["step_s"]
        assert len(times) == 5 and all(t > 0 for t in times), (name, times)
