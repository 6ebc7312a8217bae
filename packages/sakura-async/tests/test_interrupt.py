"""Ctrl+C and a normal exit complete the checkpoint writes in flight."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from sakura_async import load_latest

HARNESS = Path(__file__).with_name("interrupt_harness.py")


def test_ctrl_c_and_a_normal_exit_complete_pending_writes(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(HARNESS), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        start_new_session=True,  # its own process group: the SIGINT stays there
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pending at the interrupt: 1" in done.stdout
    assert "interrupted, drained: 1" in done.stdout
    assert "leaving without closing the runtime" in done.stdout
    for scenario in ("ctrl-c", "exit-thread", "exit-process"):
        latest = load_latest(tmp_path / scenario)
        assert latest is not None and latest.step == 1, scenario
        assert torch.equal(latest.state["w"], torch.full((4_000_000,), 3.0))
