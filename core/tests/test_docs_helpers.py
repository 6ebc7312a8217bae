"""docs/helpers.md runs as written: its ``python`` blocks (not ``python norun``) are executed
in order, in one namespace, in an empty directory."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "helpers.md"
FENCE = re.compile(r"^```(?P<info>[^\n]*)\n(?P<body>.*?)^```[ ]*$", re.MULTILINE | re.DOTALL)


def _blocks() -> list[tuple[str, str]]:
    return [(m["info"].strip(), m["body"]) for m in FENCE.finditer(DOC.read_text())]


def test_every_helper_module_is_documented_with_a_runnable_example() -> None:
    runnable = [body for info, body in _blocks() if info == "python"]
    for module in ("sakura.options", "sakura.fileio", "sakura.env", "sakura.registry"):
        assert any(f"from {module} import" in body for body in runnable), module
    assert all(info in ("python", "python norun") for info, _ in _blocks())
    for info, body in _blocks():  # blocks that are not run must still be valid Python
        compile(body, f"{DOC.name} ({info})", "exec")


def test_the_python_blocks_run(tmp_path: Path) -> None:
    script = "\n\n".join(body for info, body in _blocks() if info == "python")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SAKURA_", "MYPLUGIN_"))}
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "state.json").read_text() == '{"step": 12}'
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "checkpoint-12",
        "state.json",
        "weights.bin",
    ]
