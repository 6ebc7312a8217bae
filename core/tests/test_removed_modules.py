"""The v0.1.x modules fail with an error that names their replacement (issue 19, point 13).

Before ``sakura._removed``, ``import sakura.lightning`` raised Python's bare
"No module named 'sakura.lightning'"."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import sakura
from sakura._removed import MIGRATION_GUIDE, REMOVED_MODULES, RemovedModuleFinder

REPO = Path(__file__).resolve().parents[2]

REPLACEMENTS = {
    "sakura.lightning": "LightningAdapter",
    "sakura.huggingface": "HFAdapter",
    "sakura.ddp": "DDPAdapter",
    "sakura.tensorflow": "PyTorch only",
    "sakura.ml": "sakura.services",
}


@pytest.mark.parametrize(("module", "replacement"), sorted(REPLACEMENTS.items()))
def test_a_removed_module_names_its_replacement(module: str, replacement: str) -> None:
    with pytest.raises(ModuleNotFoundError) as caught:
        importlib.import_module(module)
    assert caught.value.name == module
    message = str(caught.value)
    assert replacement in message
    assert "removed in Sakura v1.0" in message
    assert MIGRATION_GUIDE in message


def test_a_submodule_of_a_removed_module_fails_on_its_parent() -> None:
    with pytest.raises(ModuleNotFoundError, match=r"sakura\.tensorflow was removed") as caught:
        importlib.import_module("sakura.tensorflow.keras")
    assert caught.value.name == "sakura.tensorflow"


def test_from_import_of_the_old_class_fails_with_the_replacement() -> None:
    code = "from sakura.lightning import SakuraTrainer"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 1
    assert "ModuleNotFoundError: sakura.lightning was removed" in done.stderr
    assert "LightningAdapter" in done.stderr


def test_other_names_are_left_to_the_real_finders() -> None:
    assert RemovedModuleFinder.find_spec("sakura.lightningx") is None
    assert RemovedModuleFinder.find_spec("lightning") is None
    assert RemovedModuleFinder.find_spec("sakura.services") is None
    # After the path finder on the meta path: real modules always win, and ordinary imports
    # never ask it (other libraries may append finders after it).
    from importlib.machinery import PathFinder

    assert sys.meta_path.index(RemovedModuleFinder) > sys.meta_path.index(PathFinder)
    assert sys.meta_path.count(RemovedModuleFinder) == 1
    importlib.reload(sakura)
    assert sys.meta_path.count(RemovedModuleFinder) == 1


def test_the_migration_guide_covers_every_removed_module() -> None:
    text = (REPO / MIGRATION_GUIDE).read_text(encoding="utf-8")
    missing = [module for module in REMOVED_MODULES if f"`{module}." not in text]
    assert not missing, f"{MIGRATION_GUIDE} does not mention {missing}"
    assert set(REPLACEMENTS) == set(REMOVED_MODULES)
