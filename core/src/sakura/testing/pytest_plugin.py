"""sakura's pytest plugin (entry point ``pytest11``: loaded by pytest only).

Fixtures:

* ``sakura_runtime`` -- a started, strict :class:`~sakura.SakuraRuntime`, closed after the test;
* ``recording_service`` -- a :class:`~sakura.testing.RecordingService`;
* ``tiny_loop`` -- :func:`~sakura.testing.run_tiny_loop`, to train a small MLP through a runtime;
* ``sakura_plugins`` -- a function ``(names, *, autoload=False)`` that restricts which
  plugins load for the test (plugin managers are reset before and after).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from sakura.runtime import SakuraRuntime
from sakura.testing.recording import RecordingService


@pytest.fixture
def sakura_runtime() -> Iterator[SakuraRuntime]:
    with SakuraRuntime(strict=True) as rt:
        yield rt


@pytest.fixture
def recording_service() -> RecordingService:
    return RecordingService()


@pytest.fixture
def tiny_loop() -> Callable[..., Any]:
    from sakura.testing.loop import TESTING_EXTRA, run_tiny_loop

    pytest.importorskip("torch", reason=f"tiny_loop needs torch: pip install '{TESTING_EXTRA}'")

    return run_tiny_loop


@pytest.fixture
def sakura_plugins(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    from sakura.plugins import reset_plugin_managers

    def choose(names: list[str], *, autoload: bool = False) -> None:
        monkeypatch.setenv("SAKURA_PLUGINS", ",".join(names))
        monkeypatch.setenv("SAKURA_DISABLE_PLUGIN_AUTOLOAD", "0" if autoload else "1")
        reset_plugin_managers()

    reset_plugin_managers()
    yield choose
    reset_plugin_managers()
