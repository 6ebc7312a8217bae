"""Test helpers for sakura plugin authors: a recording service, a tiny training loop
driven through the runtime, conformance checks (see :mod:`sakura.testing.conformance`) and
a launcher of N ranks as separate processes (:func:`launch_ranks`).

The pytest fixtures live in :mod:`sakura.testing.pytest_plugin`, which pytest loads
automatically through its ``pytest11`` entry point.
"""

from __future__ import annotations

from typing import Any

from sakura.testing.conformance import (
    ServiceConformance,
    check_exceptions_isolated,
    check_hooks_valid,
    check_no_work_on_unhandled_events,
    check_state_round_trip,
)
from sakura.testing.ranks import RanksFailedError, launch_ranks
from sakura.testing.recording import RecordingService

__all__ = [
    "RanksFailedError",
    "RecordingService",
    "ServiceConformance",
    "TinyLoopResult",
    "check_exceptions_isolated",
    "check_hooks_valid",
    "check_no_work_on_unhandled_events",
    "check_state_round_trip",
    "expected_event_names",
    "launch_ranks",
    "run_tiny_loop",
]


def __getattr__(name: str) -> Any:  # the loop module is importable without torch installed
    if name in ("run_tiny_loop", "TinyLoopResult", "expected_event_names"):
        from sakura.testing import loop

        return getattr(loop, name)
    raise AttributeError(f"module 'sakura.testing' has no attribute {name!r}")
