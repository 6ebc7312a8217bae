"""docs/writing-a-plugin.md shows the example plugin's real files, verbatim.

A code block preceded by ``<!-- file: PATH -->`` (PATH relative to the repository root)
must equal that file; every Python and TOML block of the page must be such a block; and
every Python and TOML file of the example plugin must be shown.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "writing-a-plugin.md"
EXAMPLE = REPO / "tests-integration" / "sakura-example-plugin"

FENCE = re.compile(
    r"(?:^<!-- (?P<marker>file: \S+) -->\n(?:\n)?)?"
    r"^(?P<indent>[ ]*)```(?P<lang>[\w-]*)\n(?P<body>.*?)^(?P=indent)```[ ]*$",
    re.MULTILINE | re.DOTALL,
)


def _blocks() -> list[tuple[str | None, str, str]]:
    """(marker, language, body) of every fenced block of the page, in order."""
    text = DOC.read_text(encoding="utf-8")
    blocks = []
    for match in FENCE.finditer(text):
        indent = match["indent"]
        body = "".join(
            line[len(indent) :] if line.startswith(indent) else line
            for line in match["body"].splitlines(keepends=True)
        )
        blocks.append((match["marker"], match["lang"], body))
    return blocks


def _shown_files() -> dict[str, str]:
    return {
        marker.removeprefix("file: "): body
        for marker, _, body in _blocks()
        if marker and marker.startswith("file: ")
    }


def test_the_page_has_code_blocks() -> None:
    assert len(_blocks()) > 10
    assert len(_shown_files()) >= 6


@pytest.mark.parametrize("path", sorted(_shown_files()))
def test_shown_file_is_the_real_file(path: str) -> None:
    real = (REPO / path).read_text(encoding="utf-8")
    assert _shown_files()[path] == real, f"docs/writing-a-plugin.md shows an outdated {path}"


def test_every_python_and_toml_block_is_a_real_file() -> None:
    unchecked = [
        body.splitlines()[0] if body else "(empty)"
        for marker, lang, body in _blocks()
        if lang in {"python", "py", "toml"} and marker is None
    ]
    assert unchecked == [], "Python/TOML blocks without a <!-- file: PATH --> marker"


def test_every_source_file_of_the_example_is_shown() -> None:
    sources = [
        p
        for p in EXAMPLE.rglob("*")
        if p.is_file() and p.suffix in {".py", ".toml"} and "__pycache__" not in p.parts
    ]
    shown = {REPO / path for path in _shown_files()}
    missing = sorted(str(p.relative_to(REPO)) for p in sources if p not in shown)
    assert missing == []
