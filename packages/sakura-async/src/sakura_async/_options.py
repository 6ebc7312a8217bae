"""Validation helpers: every public option error names the option, the value and what is
accepted."""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any

__all__ = ["check_choice", "check_int", "check_positive_number"]


def check_int(
    option: str, value: Any, *, minimum: int | None = None, allow_none: bool = False
) -> Any:
    if value is None and allow_none:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or (minimum is not None and value < minimum)
    ):
        accepted = f"an int >= {minimum}" if minimum is not None else "an int"
        if allow_none:
            accepted += " or None"
        raise ValueError(f"{option} must be {accepted}, got {value!r}")
    return value


def check_positive_number(option: str, value: Any, *, allow_none: bool = False) -> Any:
    if value is None and allow_none:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        accepted = "a finite number > 0" + (" or None" if allow_none else "")
        raise ValueError(f"{option} must be {accepted}, got {value!r}")
    return value


def check_choice(option: str, value: Any, choices: Collection[Any]) -> Any:
    if value not in choices:
        raise ValueError(
            f"{option} must be one of {', '.join(repr(c) for c in choices)}, got {value!r}"
        )
    return value
