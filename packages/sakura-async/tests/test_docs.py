"""sakura-async's documentation runs as written: the ``python`` blocks of
``docs/async.md`` and of the package README are executed in order, in one namespace, in an
empty directory; ``python norun`` blocks (fragments) must still be valid Python."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sakura_async.checkpoint import find_checkpoints

PACKAGE = Path(__file__).resolve().parents[1]
DOCS = {"docs/async.md": PACKAGE.parents[1] / "docs" / "async.md", "README": PACKAGE / "README.md"}
FENCE = re.compile(r"^```(?P<info>[^\n]*)\n(?P<body>.*?)^```[ ]*$", re.MULTILINE | re.DOTALL)


def _blocks(doc: Path) -> list[tuple[str, str]]:
    return [(m["info"].strip(), m["body"]) for m in FENCE.finditer(doc.read_text())]


@pytest.mark.parametrize("name", sorted(DOCS))
def test_python_blocks_are_valid_and_marked(name: str) -> None:
    blocks = _blocks(DOCS[name])
    assert any(info == "python" for info, _ in blocks), f"{name} has no runnable example"
    for info, body in blocks:
        assert info in ("", "python", "python norun"), info
        if info.startswith("python"):
            compile(body, f"{name} ({info})", "exec")


@pytest.mark.parametrize("name", sorted(DOCS))
def test_the_python_blocks_run(name: str, tmp_path: Path) -> None:
    script = "\n\n".join(body for info, body in _blocks(DOCS[name]) if info == "python")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAKURA_")}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    epoch, rest = result.stdout.strip().splitlines()[-1].split(" ", 1)
    assert int(epoch) >= 0 and "'name': 'val_loss'" in rest and "['model', 'optimizer']" in rest
    kept = find_checkpoints(tmp_path / "ckpt", verify=True)
    assert 1 <= len(kept) <= 2  # every="best" with keep=2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # nothing else written
