"""``benchmarks/checkpoint_stall.py --fsdp`` at its smallest, on the source tree: every
method runs on 2 gloo ranks and is reported (never its timings: the machine is shared).
The service's run raises inside the benchmark if AsyncCheckpoint reported an error or
published another number of checkpoints than the loop asked for."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "checkpoint_stall.py"
METHODS = (
    "AsyncCheckpoint",
    "AsyncCheckpoint overlap",
    "ShardedCheckpoint",
    "dcp.async_save",
    "dcp.save",
)


def test_every_method_runs_and_is_reported(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAKURA_")}
    args = ["--fsdp", "--steps", "4", "--every", "2", "--trials", "1", "--dir", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    text = done.stdout
    assert "FSDP2 checkpoint stall on 2 gloo ranks" in text, text
    assert "CPU: " in text and "load average" in text, text
    for method in METHODS:
        row = re.search(rf"^\| {re.escape(method)} \| ([0-9.]+) ms .*\| ([0-9.]+)x", text, re.M)
        assert row is not None, f"{method!r} missing from:\n{text}"
        assert float(row.group(1)) > 0
    assert re.search(r"^\| dcp\.save \| .*\| 1\.00x", text, re.M), text
