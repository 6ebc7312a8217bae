"""The README and docs/quant.md run as written: their ``python`` blocks are executed in a
fresh process in an empty directory; fragments are fenced ``python norun`` and must still
compile."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1]
PAGES = {
    "README.md": PACKAGE / "README.md",
    "docs/quant.md": PACKAGE.parents[1] / "docs" / "quant.md",
}
FENCE = re.compile(r"^```(?P<info>[^\n]*)\n(?P<body>.*?)^```[ ]*$", re.MULTILINE | re.DOTALL)


@pytest.mark.parametrize("page", sorted(PAGES))
def test_python_blocks_run(page: str, tmp_path: Path) -> None:
    pytest.importorskip("peft")
    blocks = [
        (m["info"].strip(), m["body"])
        for m in FENCE.finditer(PAGES[page].read_text())
        if m["info"].startswith("python")
    ]
    for info, body in blocks:
        assert info in ("python", "python norun"), f"{page}: unknown fence info {info!r}"
        compile(body, f"{page} ({info})", "exec")
    runnable = [body for info, body in blocks if info == "python"]
    assert runnable, f"{page} has no runnable example"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAKURA_")}
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(
        [sys.executable, "-c", "\n\n".join(runnable)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    if page == "README.md":
        assert (
            "{'tensors': 2, 'kept_precise': 0, 'bytes_before': 18432, 'bytes_after': 2592}"
            in result.stdout
        )
