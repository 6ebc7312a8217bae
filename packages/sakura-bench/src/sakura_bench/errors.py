"""sakura-bench's errors.  Each message says what was wrong and what is accepted."""

from __future__ import annotations

from sakura.errors import SakuraError

__all__ = ["BenchError", "IncompatibleError", "ScaleError", "TrialFailed"]


class BenchError(SakuraError, ValueError):
    """A wrong option value, name or report file."""


class IncompatibleError(BenchError):
    """A framework cannot run a workload (``hf-trainer`` with a workload that is not
    HF-shaped), or a runner cannot use an option."""


class ScaleError(BenchError):
    """A workload scale that this machine cannot run (full size without a GPU)."""


class TrialFailed(SakuraError, RuntimeError):
    """A trial process exited with an error."""
