"""Crash safety: a process writing checkpoints in a loop is SIGKILLed at random moments."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HARNESS = Path(__file__).with_name("checkpoint_crash_harness.py")


@pytest.mark.skipif(
    not hasattr(os, "fork"), reason="the harness forks writer processes (POSIX only)"
)
def test_sigkill_at_random_moments_never_leaves_a_partial_latest(tmp_path: Path) -> None:
    kills = 20
    done = subprocess.run(
        [sys.executable, str(HARNESS), str(tmp_path / "ckpt"), str(kills), "1234"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["kills"] == kills
    assert summary["problems"] == []
    assert len(summary["loaded_steps"]) == kills  # every kill left a loadable checkpoint
    # Each writer completed at least one checkpoint before it was killed: progress.
    assert summary["loaded_steps"] == sorted(summary["loaded_steps"])
    assert summary["loaded_steps"][0] > 0
