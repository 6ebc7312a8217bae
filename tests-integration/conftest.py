"""Shared helpers for the integration tests.

These tests run in a fresh virtualenv where sakura-core, sakura-example-plugin (and the
other workspace distributions) and torch are installed from built wheels, as a user would
have them (``nox -s integration``).  Commands run in subprocesses with that virtualenv's
interpreter and console scripts, and with no ``SAKURA_*`` variable or ``PYTHONPATH``
inherited (in-process tests see none either), so each test states exactly the configuration
it uses.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent

Run = Callable[..., subprocess.CompletedProcess[str]]


def pytest_configure(config: pytest.Config) -> None:
    # torch warns at import when numpy is missing; the tests do not need numpy.
    config.addinivalue_line("filterwarnings", "ignore:Failed to initialize NumPy:UserWarning")


def pytest_report_header() -> list[str]:
    try:
        import sakura
    except ImportError:
        return ["sakura: not importable"]
    return [f"sakura {sakura.__version__} from {Path(sakura.__file__).parent}"]


@pytest.fixture(autouse=True)
def _no_sakura_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process tests see no SAKURA_* variable of the calling shell either."""
    for name in list(os.environ):
        if name.startswith("SAKURA_"):
            monkeypatch.delenv(name)


def clean_environ(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The current environment without SAKURA_* settings and PYTHONPATH, plus ``extra``."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("SAKURA_") and k not in {"PYTHONPATH", "PYTHONHOME"}
    }
    env["PYTHONNOUSERSITE"] = "1"
    env.update(extra or {})
    return env


def console_script(name: str) -> str:
    """The console script ``name`` of the interpreter running the tests."""
    path = BIN / (f"{name}.exe" if os.name == "nt" else name)
    if not path.exists():
        pytest.fail(f"console script {name!r} is not installed next to {sys.executable}")
    return str(path)


@pytest.fixture
def run(tmp_path: Path) -> Run:
    """Run a command (in ``tmp_path`` unless ``cwd`` is given) with a clean environment
    plus ``env``; return the completed process (text output captured)."""

    def _run(
        args: Sequence[str],
        *,
        cwd: Path | None = None,
        env: Mapping[str, str] | None = None,
        check: bool = True,
        timeout: float = 300,
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            list(args),
            cwd=cwd or tmp_path,
            env=clean_environ(env),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and result.returncode != 0:
            pytest.fail(
                f"{' '.join(args)} exited with {result.returncode}\n"
                f"--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"
            )
        return result

    return _run


@pytest.fixture
def sakura_cli(run: Run) -> Run:
    """Run the installed ``sakura`` command: ``sakura_cli(["plugins", "--json"], ...)``."""
    script = console_script("sakura")

    def _sakura(args: Sequence[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        return run([script, *args], **kwargs)

    return _sakura
