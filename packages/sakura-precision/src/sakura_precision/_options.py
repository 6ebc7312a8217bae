"""Validation helpers: every error names the option, the value and what is accepted."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any


def check_choice(owner: str, option: str, value: Any, accepted: Iterable[Any]) -> Any:
    choices = list(accepted)
    if isinstance(value, bool) or value not in choices:
        raise ValueError(
            f"{owner}: {option}={value!r} is not accepted; accepted: "
            f"{', '.join(repr(c) for c in choices)}"
        )
    return value


def check_bool(owner: str, option: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{owner}: {option} must be True or False, got {value!r}")
    return value


def check_positive_int(owner: str, option: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}: {option} must be an int >= 1, got {value!r}")
    return value


def check_number(
    owner: str,
    option: str,
    value: Any,
    *,
    above: float | None = None,
    below: float | None = None,
    accepted: str,
) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{owner}: {option} must be a finite number ({accepted}), got {value!r}")
    if (above is not None and value <= above) or (below is not None and value >= below):
        raise ValueError(f"{owner}: {option}={value!r} is out of range; accepted: {accepted}")
    return float(value)
