"""docs/precision.md and the README run as written: their ``python`` blocks are executed
in a fresh process in an empty directory; fragments are fenced ``python norun`` and must
still compile."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1]
PAGES = {
    "docs/precision.md": PACKAGE.parents[1] / "docs" / "precision.md",
    "README.md": PACKAGE / "README.md",
}
FENCE = re.compile(r"^```(?P<info>[^\n]*)\n(?P<body>.*?)^```[ ]*$", re.MULTILINE | re.DOTALL)


def _python_blocks(path: Path) -> list[tuple[str, str]]:
    return [
        (m["info"].strip(), m["body"])
        for m in FENCE.finditer(path.read_text())
        if m["info"].startswith("python")
    ]


@pytest.mark.parametrize("page", sorted(PAGES))
def test_python_blocks_run(page: str, tmp_path: Path) -> None:
    blocks = _python_blocks(PAGES[page])
    for info, body in blocks:
        assert info in ("python", "python norun"), f"{page}: unknown fence info {info!r}"
        compile(body, f"{page} ({info})", "exec")
    runnable = [body for info, body in blocks if info == "python"]
    assert runnable, f"{page} has no runnable example"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAKURA_")}
    env["OMP_NUM_THREADS"] = "1"
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")  # not the user's cache
    result = subprocess.run(
        [sys.executable, "-c", "\n\n".join(runnable)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
