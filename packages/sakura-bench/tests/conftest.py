"""Shared fixtures of sakura-bench's tests."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sakura.plugins import reset_plugin_managers

Run = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture(autouse=True)
def _clean_plugin_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No SAKURA_* or rank variables from the calling shell; fresh plugin managers."""
    for var in list(os.environ):
        if var.startswith("SAKURA_") or var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            monkeypatch.delenv(var, raising=False)
    reset_plugin_managers()
    yield
    reset_plugin_managers()


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """In-process trials use one torch thread: on a shared 2-core machine, OpenMP threads
    waiting on each other make tiny models tens of times slower.  Restored afterwards (the
    other packages' tests run in the same process)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def bench(tmp_path: Path) -> Run:
    """Run ``sakura-bench ARGS`` as a command (a fresh interpreter), in ``tmp_path``."""

    def run(
        *args: str, check: bool = True, timeout: float = 240
    ) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SAKURA_")}
        result = subprocess.run(
            [sys.executable, "-m", "sakura_bench.cli", *args],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and result.returncode != 0:
            pytest.fail(
                f"sakura-bench {' '.join(args)} exited with {result.returncode}\n"
                f"--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"
            )
        return result

    return run
