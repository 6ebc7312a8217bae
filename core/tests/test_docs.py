"""The docs cover every framework hook and name only real events."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from sakura.events import EVENT_TYPES

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def _package_event_names() -> set[str]:
    """Event classes a package defines for itself (``class OnX(Event)`` in its source);
    read as text, since the core's tests import no package."""
    pattern = re.compile(r"^class (On[A-Z][A-Za-z]+)\(Event\):", re.MULTILINE)
    return {
        name
        for source in ROOT.glob("packages/*/src/**/*.py")
        for name in pattern.findall(source.read_text())
    }


def _events_md() -> str:
    return (DOCS / "events.md").read_text()


def test_every_event_class_is_in_the_event_table() -> None:
    text = _events_md()
    missing = [cls.__name__ for cls in EVENT_TYPES if f"`{cls.__name__}`" not in text]
    assert not missing


def test_every_lightning_callback_hook_is_mapped() -> None:
    pl = pytest.importorskip("lightning.pytorch")
    hooks = [n for n in dir(pl.Callback) if n.startswith("on_") or n in ("setup", "teardown")]
    text = _events_md()
    missing = [hook for hook in hooks if f"`{hook}" not in text]
    assert not missing, f"Lightning hooks missing from docs/events.md: {missing}"


def test_every_transformers_callback_event_is_mapped() -> None:
    transformers = pytest.importorskip("transformers")
    hooks = [n for n in dir(transformers.TrainerCallback) if n.startswith("on_")]
    text = _events_md()
    missing = [hook for hook in hooks if f"`{hook}" not in text]
    assert not missing, f"TrainerCallback events missing from docs/events.md: {missing}"


def test_docs_name_only_existing_events() -> None:
    known = {cls.__name__ for cls in EVENT_TYPES} | {"OnEvent"} | _package_event_names()
    assert "OnCheckpointDurable" in known  # sakura-async's, found by the scan
    for page in DOCS.glob("*.md"):
        for name in set(re.findall(r"\bOn[A-Z][A-Za-z]+\b(?!\*)", page.read_text())):
            assert name in known, f"{page.name} mentions unknown event {name}"


def test_import_sakura_does_not_import_torch() -> None:
    code = "import sys, sakura, sakura.testing, sakura.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
