"""docs/hooks.md and docs/events.md run as written.

Their ``python`` blocks are executed in order, in one namespace, in an empty directory;
blocks that are fragments of a larger loop are fenced ``python norun`` and must still
compile.  Every service class the blocks define must pass install-time validation, so an
example with a misspelt hook name fails here.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[2] / "docs"
FENCE = re.compile(r"^```(?P<info>[^\n]*)\n(?P<body>.*?)^```[ ]*$", re.MULTILINE | re.DOTALL)
PAGES = ("hooks.md", "events.md")

# Appended to the blocks: validate every service class they defined, print their names.
VALIDATE = """
import inspect as _inspect
import json as _json
from sakura.service import validate_service as _validate

_checked = []
for _name, _obj in list(globals().items()):
    if _inspect.isclass(_obj) and _obj.__module__ == "__main__" and hasattr(_obj, "name"):
        _validate(_obj.__new__(_obj))
        _checked.append(_name)
print(_json.dumps(sorted(_checked)))
"""


def _python_blocks(page: str) -> list[tuple[str, str]]:
    text = (DOCS / page).read_text()
    return [
        (m["info"].strip(), m["body"])
        for m in FENCE.finditer(text)
        if m["info"].startswith("python")
    ]


@pytest.mark.parametrize("page", PAGES)
def test_python_blocks_are_runnable_or_marked_and_compile(page: str) -> None:
    blocks = _python_blocks(page)
    assert blocks
    for info, body in blocks:
        assert info in ("python", "python norun"), f"{page}: unknown fence info {info!r}"
        compile(body, f"{page} ({info})", "exec")


def test_hooks_md_runs_and_its_services_are_valid(tmp_path: Path) -> None:
    pytest.importorskip("torch")  # the loss-scaling and gradient examples import it
    runnable = [body for info, body in _python_blocks("hooks.md") if info == "python"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAKURA_")}
    result = subprocess.run(
        [sys.executable, "-c", "\n\n".join([*runnable, VALIDATE])],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    checked = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(checked) >= {
        "PrintEpochs",
        "JsonlLog",
        "StaticLossScale",
        "GradNormMonitor",
        "MetricsTap",
        "CountParams",
        "RecordGitRevision",
        "ReportErrors",
    }
    assert list(tmp_path.iterdir()) == []  # the examples write nothing when only defined


def test_a_doc_example_with_a_misspelt_hook_fails(tmp_path: Path) -> None:
    example = (
        "class Late:\n    name = 'late'\n\n    def on_train_start(self, event):\n        pass\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", example + VALIDATE],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert "'on_train_start', which is not a sakura hook" in result.stderr
