"""``pip install sakura-ml`` and ``pip install 'sakura-ml[lightning,huggingface]'``, the
reference README's install lines, resolve to our packages (issue 19, point 13)."""

from __future__ import annotations

import importlib.metadata as md
import json
import sys
from pathlib import Path

from conftest import Run

DIST = Path(__file__).resolve().parent.parent / "dist"
CORE_SERVICES = [
    "sakura-core",
    "sakura-precision",
    "sakura-zero",
    "sakura-async",
    "sakura-adapters",
]


def _runtime_requirements() -> list[str]:
    return [r for r in md.requires("sakura-ml") or [] if "extra ==" not in r]


def test_sakura_ml_installs_the_reference_services() -> None:
    names = sorted(r.split("<")[0].split(">")[0].split("[")[0] for r in _runtime_requirements())
    assert names == sorted(CORE_SERVICES)
    for name in CORE_SERVICES:
        md.version(name)  # installed alongside it


def test_sakura_ml_has_the_reference_extras() -> None:
    extras = set(md.metadata("sakura-ml").get_all("Provides-Extra") or [])
    assert {"lightning", "huggingface", "offload", "quant", "bench", "all"} <= extras


def test_the_reference_install_line_resolves_against_our_wheels(run: Run, tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    args = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--report"]
    args += [str(report), "--find-links", str(DIST), "sakura-ml[lightning,huggingface]"]
    run(args)
    # Everything is installed here already (the frameworks through the test extras): the
    # extras resolve against the wheels in dist/ and what is installed, nothing is missing.
    assert json.loads(report.read_text())["install"] == []


def test_old_v01_modules_name_their_replacement(run: Run) -> None:
    done = run([sys.executable, "-c", "import sakura.huggingface"], check=False)
    assert done.returncode == 1
    assert "HFAdapter" in done.stderr
