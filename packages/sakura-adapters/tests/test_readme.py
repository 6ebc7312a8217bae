"""The README runs as written: its ``python`` blocks (not ``python norun``) are executed in
order, in one namespace, in an empty directory; the others must still compile."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")
pytest.importorskip("transformers")

README = Path(__file__).resolve().parents[1] / "README.md"
FENCE = re.compile(r"^```(?P<info>[^\n]*)\n(?P<body>.*?)^```[ ]*$", re.MULTILINE | re.DOTALL)


def _blocks() -> list[tuple[str, str]]:
    return [(m["info"].strip(), m["body"]) for m in FENCE.finditer(README.read_text())]


def test_every_python_block_is_runnable_or_marked_norun() -> None:
    infos = [info for info, _ in _blocks()]
    assert set(infos) <= {"python", "python norun", "bash"}, infos
    assert infos.count("python") >= 4
    for info, body in _blocks():
        if info.startswith("python"):
            compile(body, f"{README.name} ({info})", "exec")


def test_the_python_blocks_run(tmp_path: Path) -> None:
    script = "\n\n".join(body for info, body in _blocks() if info == "python")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAKURA_")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    # Telemetry wrote one line per event of each run; the strict resume named the new service.
    lightning_events = (tmp_path / "events.jsonl").read_text().splitlines()
    hf_events = (tmp_path / "hf-events.jsonl").read_text().splitlines()
    assert any('"OnOptimizerStep"' in line for line in lightning_events)
    assert any('"OnOptimizerStep"' in line for line in hf_events)
    assert "no state for installed service(s) ['step_count']" in result.stdout
    assert (tmp_path / "hf-out" / "checkpoint-4").is_dir()
