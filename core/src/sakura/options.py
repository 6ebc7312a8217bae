"""Option validation with one wording, for the core, the first-party packages and third parties.

Every check raises :class:`OptionError` (a ``ValueError``) whose message names the option,
the value given and what is accepted::

    OffloadAdamW: moment_dtype='fp4' is not accepted; accepted: 'float32', 'bfloat16', 'int8'

``owner`` (a class or function name) prefixes the message when given.  Each check returns
the value (converted where it says so), so validation reads as assignment::

    self.block_size = check_int("block_size", block_size, minimum=2, owner="quantize_model")
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, TypeVar

from sakura.errors import SakuraError

__all__ = [
    "OptionError",
    "check_bool",
    "check_choice",
    "check_int",
    "check_number",
    "option_error",
]

T = TypeVar("T")


class OptionError(SakuraError, ValueError):
    """A public option got a value it does not accept."""

    def __init__(self, message: str, *, option: str, value: Any, accepted: str) -> None:
        super().__init__(message)
        self.option = option
        self.value = value
        self.accepted = accepted


def option_error(
    option: str, value: Any, accepted: str, *, owner: str | None = None
) -> OptionError:
    """The error for ``option=value`` (``accepted`` says what would have been accepted).

    For checks the helpers below do not cover: ``raise option_error("dir", path, "a
    writable directory", owner="AsyncCheckpoint")``.
    """
    prefix = f"{owner}: " if owner else ""
    return OptionError(
        f"{prefix}{option}={value!r} is not accepted; accepted: {accepted}",
        option=option,
        value=value,
        accepted=accepted,
    )


def _same(value: Any, choice: Any) -> bool:
    # True == 1 and 1.0 == 1 in Python; an option that accepts 1 does not accept True.
    if isinstance(value, bool) or isinstance(choice, bool):
        return type(value) is type(choice) and bool(value == choice)
    return bool(value == choice)


def check_choice(option: str, value: T, choices: Iterable[Any], *, owner: str | None = None) -> T:
    """``value`` if it is one of ``choices`` (``True`` never matches ``1``)."""
    listed = list(choices)
    try:
        found = any(_same(value, choice) for choice in listed)
    except Exception:  # an object whose __eq__ raises is simply not accepted
        found = False
    if not found:
        raise option_error(option, value, ", ".join(repr(c) for c in listed), owner=owner)
    return value


def check_bool(option: str, value: Any, *, owner: str | None = None) -> bool:
    """``value`` if it is ``True`` or ``False`` (not 0/1, not a string)."""
    if not isinstance(value, bool):
        raise option_error(option, value, "True or False", owner=owner)
    return value


def _range_text(
    kind: str,
    minimum: float | None,
    maximum: float | None,
    *,
    min_inclusive: bool = True,
    max_inclusive: bool = True,
    allow_none: bool = False,
) -> str:
    bounds = []
    if minimum is not None:
        bounds.append(f"{'>=' if min_inclusive else '>'} {minimum}")
    if maximum is not None:
        bounds.append(f"{'<=' if max_inclusive else '<'} {maximum}")
    text = kind + (" " + " and ".join(bounds) if bounds else "")
    return text + (" or None" if allow_none else "")


def check_int(
    option: str,
    value: Any,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    allow_none: bool = False,
    owner: str | None = None,
) -> Any:
    """``value`` if it is an ``int`` (not a bool) within ``[minimum, maximum]``, or ``None``
    when ``allow_none``."""
    if value is None and allow_none:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or (minimum is not None and value < minimum)
        or (maximum is not None and value > maximum)
    ):
        accepted = _range_text("an int", minimum, maximum, allow_none=allow_none)
        raise option_error(option, value, accepted, owner=owner)
    return value


def check_number(
    option: str,
    value: Any,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    min_inclusive: bool = True,
    max_inclusive: bool = True,
    allow_none: bool = False,
    owner: str | None = None,
) -> Any:
    """``float(value)`` if it is a finite real number (int or float, not a bool) within the
    bounds, or ``None`` when ``allow_none``."""
    if value is None and allow_none:
        return None
    ok = (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(value)
        and (minimum is None or (value >= minimum if min_inclusive else value > minimum))
        and (maximum is None or (value <= maximum if max_inclusive else value < maximum))
    )
    if not ok:
        accepted = _range_text(
            "a finite number",
            minimum,
            maximum,
            min_inclusive=min_inclusive,
            max_inclusive=max_inclusive,
            allow_none=allow_none,
        )
        raise option_error(option, value, accepted, owner=owner)
    return float(value)
