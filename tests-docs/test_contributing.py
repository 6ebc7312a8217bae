"""CONTRIBUTING.md's layout rules, checked on the source tree.

* A package's tests import another ``sakura_*`` package only when its ``pyproject.toml``
  declares it (``dependencies`` or the ``test`` extra).
* A source file under ``packages/*/src`` over ``MAX_LINES`` lines says why at the top of
  its module docstring, in a line starting ``Long file:``.

Each checker is also run on a made-up tree, to show that it catches what it is for.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
PACKAGES = REPO / "packages"
MAX_LINES = 600
_NAME = re.compile(r"^([A-Za-z0-9_.-]+)")


def _declared(project: Path) -> set[str]:
    """The import names of the sakura distributions ``project`` declares (itself included)."""
    data = tomllib.loads((project / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    requirements = [*data.get("dependencies", [])]
    requirements += data.get("optional-dependencies", {}).get("test", [])
    names = {data["name"]}
    for requirement in requirements:
        match = _NAME.match(requirement.strip())
        if match:
            names.add(match[1])
    return {n.replace("-", "_").lower() for n in names if n.lower().startswith("sakura-")}


def _imported_packages(source: str) -> set[str]:
    """Every top-level ``sakura_*`` name that ``source`` imports, anywhere in the file
    (also inside functions), or names in ``pytest.importorskip("sakura_x")``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in {"importorskip", "import_module"}
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add(node.args[0].value.split(".")[0])
    return {name for name in found if name.startswith("sakura_")}


def undeclared_test_imports(packages: Path) -> list[str]:
    """``"<package>/tests/<file>: sakura_x"`` for each import of an undeclared package."""
    problems = []
    for project in sorted(p.parent for p in packages.glob("*/pyproject.toml")):
        tests = project / "tests"
        if not tests.is_dir():
            continue
        declared = _declared(project)
        for path in sorted(tests.rglob("*.py")):
            used = _imported_packages(path.read_text(encoding="utf-8"))
            for name in sorted(used - declared):
                problems.append(f"{path.relative_to(packages)}: {name}")
    return problems


def long_files_without_a_reason(packages: Path, max_lines: int = MAX_LINES) -> list[str]:
    """Source files over ``max_lines`` lines whose module docstring has no ``Long file:``."""
    problems = []
    for path in sorted(packages.glob("*/src/**/*.py")):
        text = path.read_text(encoding="utf-8")
        lines = len(text.splitlines())
        if lines <= max_lines:
            continue
        docstring = ast.get_docstring(ast.parse(text)) or ""
        if not any(line.startswith("Long file:") for line in docstring.splitlines()):
            problems.append(f"{path.relative_to(packages)}: {lines} lines")
    return problems


def test_package_tests_import_only_declared_sakura_packages() -> None:
    assert undeclared_test_imports(PACKAGES) == []


def test_long_source_files_say_why() -> None:
    assert long_files_without_a_reason(PACKAGES) == []


def _project(root: Path, name: str, test_extra: list[str]) -> Path:
    project = root / name
    (project / "tests").mkdir(parents=True)
    (project / "src" / name.replace("-", "_")).mkdir(parents=True)
    extra = ", ".join(f'"{r}"' for r in test_extra)
    (project / "pyproject.toml").write_text(
        f'[project]\nname = "{name}"\ndependencies = ["sakura-core>=0.1,<0.2"]\n'
        f"[project.optional-dependencies]\ntest = [{extra}]\n"
    )
    return project


def test_the_checkers_catch_what_they_are_for(tmp_path: Path) -> None:
    project = _project(tmp_path, "sakura-x", ["pytest", "sakura-adapters>=0.1"])
    (project / "tests" / "test_a.py").write_text(
        "import sakura_x\nfrom sakura_adapters import DDPAdapter\nimport torch\n"
        "def test():\n    from sakura_precision import MixedPrecision\n"
        "    pytest.importorskip('sakura_zero')\n"
    )
    assert undeclared_test_imports(tmp_path) == [
        "sakura-x/tests/test_a.py: sakura_precision",
        "sakura-x/tests/test_a.py: sakura_zero",
    ]

    body = "x = 1\n" * 20
    source = project / "src" / "sakura_x"
    (source / "short.py").write_text('"""Short."""\nx = 1\n')
    (source / "long.py").write_text('"""Long, no reason."""\n' + body)
    (source / "reasoned.py").write_text('"""Long.\n\nLong file: one state machine."""\n' + body)
    assert long_files_without_a_reason(tmp_path, max_lines=10) == [
        "sakura-x/src/sakura_x/long.py: 21 lines"
    ]


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(pytest.main([__file__, "-q"]))
