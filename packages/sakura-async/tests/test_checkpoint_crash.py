"""Crash safety: a process writing checkpoints in a loop is SIGKILLed at random moments and
inside the fsyncs and the rename of a write; the next AsyncCheckpoint removes every
temporary directory a dead writer left, and never one of a live writer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HARNESS = Path(__file__).with_name("checkpoint_crash_harness.py")
needs_fork = pytest.mark.skipif(
    not hasattr(os, "fork") or not os.path.isdir("/proc/self/fd"),
    reason="the harness forks writer processes and reads /proc (Linux)",
)


def run_harness(root: Path, kills: int, seed: int, mode: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, str(HARNESS), str(root), str(kills), str(seed), mode],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["problems"] == []
    return summary


@needs_fork
def test_sigkill_at_random_moments_never_leaves_a_partial_latest(tmp_path: Path) -> None:
    kills = 20
    summary = run_harness(tmp_path / "ckpt", kills, 1234, "random")
    assert summary["kills"] == kills
    assert summary["survivors"] == 0
    assert len(summary["loaded_steps"]) == kills  # every kill left a loadable checkpoint
    # Each writer completed at least one checkpoint before it was killed: progress.
    assert summary["loaded_steps"] == sorted(summary["loaded_steps"])
    assert summary["loaded_steps"][0] > 0


@needs_fork
@pytest.mark.parametrize(("mode", "kills"), [("fsync", 24), ("rename", 12)])
def test_a_writer_killed_inside_fsync_or_rename_leaves_no_temporary_behind(
    tmp_path: Path, mode: str, kills: int
) -> None:
    """The writer's lock outlives every step until the rename: a complete temporary
    directory left by a SIGKILL there belongs to a dead writer and is removed at once."""
    summary = run_harness(tmp_path / "ckpt", kills, 99, mode)
    assert summary["kills"] == kills
    assert summary["temporaries_seen"] >= kills  # every kill left one (the harness checks)
    assert summary["survivors"] == 0
    assert len(summary["loaded_steps"]) == kills  # and the latest good one still loads


@needs_fork
def test_a_live_writer_paused_inside_fsync_or_rename_keeps_its_temporary(
    tmp_path: Path,
) -> None:
    kills = 10  # rounds: a writer stopped at each of the 4 fsyncs and before the rename
    summary = run_harness(tmp_path / "ckpt", kills, 5, "pause")
    assert summary["live_temporaries_kept"] == kills
    assert summary["loaded_steps"] == list(range(1, kills + 1))  # each write then completed
