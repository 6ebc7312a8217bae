"""Marks that one service leaves on a model's blocks for others to read.

When ``ActivationCheckpoint`` makes a block recompute its activations in backward, a memory
planner must not also page that block's activations; when a block's frozen weights are
streamed from host memory, a fused kernel must not cache them.  The service that did the
work marks the block; any other service (first-party or not) reads the mark.  Marks are
plain attributes in one dictionary on the object, so they cost nothing at run time and
survive ``copy.deepcopy``.

The mark names in use are the constants below; a third party may add its own, prefixed with
its distribution name (``"acme.pinned"``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["RECOMPUTED", "WEIGHTS_STREAMED", "clear_mark", "get_mark", "has_mark", "set_mark"]

RECOMPUTED = "recomputed"
"""The block's activations are not kept for backward: its forward runs again there
(activation checkpointing).  Value: the name of the service that did it."""

WEIGHTS_STREAMED = "weights_streamed"
"""The block's frozen weights live off the device and are brought in for each forward and
backward.  Value: the name of the service that did it."""

_ATTRIBUTE = "__sakura_marks__"


def _marks(obj: Any) -> dict[str, Any] | None:
    marks = getattr(obj, "__dict__", {}).get(_ATTRIBUTE)
    return marks if isinstance(marks, dict) else None


def set_mark(obj: Any, name: str, value: Any = True) -> None:
    """Mark ``obj`` (a block) with ``name`` (set to ``value``)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"set_mark: name must be a non-empty string, got {name!r}")
    marks = _marks(obj)
    if marks is None:
        marks = {}
        # object.__setattr__: nn.Module.__setattr__ would be fine too, but this works on any
        # object with a __dict__ and never goes through a framework's attribute hooks.
        object.__setattr__(obj, _ATTRIBUTE, marks)
    marks[name] = value


def get_mark(obj: Any, name: str, default: Any = None) -> Any:
    """The value of mark ``name`` on ``obj``, or ``default``."""
    marks = _marks(obj)
    return default if marks is None else marks.get(name, default)


def has_mark(obj: Any, name: str) -> bool:
    """Whether ``obj`` carries mark ``name``."""
    marks = _marks(obj)
    return marks is not None and name in marks


def clear_mark(obj: Any, name: str) -> None:
    """Remove mark ``name`` from ``obj`` (nothing happens when it has none)."""
    marks = _marks(obj)
    if marks is not None:
        marks.pop(name, None)
