"""When AsyncCheckpoint saves: the ``every=`` option, parsed once."""

from __future__ import annotations

import re
from typing import Any

from sakura.options import OptionError, option_error

__all__ = ["parse_every"]

_OWNER = "AsyncCheckpoint"

_EVERY = re.compile(
    r"\s*(?P<n>\d+(?:\.\d+)?)?\s*(?P<unit>epochs?|steps?|s|secs?|seconds?|m|mins?|minutes?|h|hours?)\s*\Z"
)
_SECONDS = {"s": 1, "sec": 1, "secs": 1, "second": 1, "seconds": 1, "m": 60, "min": 60}
_SECONDS.update({"mins": 60, "minute": 60, "minutes": 60, "h": 3600, "hour": 3600, "hours": 3600})
_EVERY_HELP = (
    "an int (epochs), 'best', or a string such as '2 epochs', '500 steps', '30s', '10 min', '1h'"
)


def parse_every(every: Any) -> tuple[str, float]:
    """``every`` -> ``(unit, amount)`` with unit ``"epochs"``, ``"steps"``, ``"seconds"``
    or ``"best"``."""

    def wrong(accepted: str = _EVERY_HELP) -> OptionError:
        return option_error("every", every, accepted, owner=_OWNER)

    if isinstance(every, bool):
        raise wrong()
    if isinstance(every, int):
        if every < 1:
            raise wrong(_EVERY_HELP + " (counts >= 1)")
        return "epochs", every
    if isinstance(every, str):
        if every.strip() == "best":
            return "best", 0
        match = _EVERY.match(every)
        if match:
            amount = float(match.group("n") or 1)
            unit = match.group("unit")
            if unit.startswith("epoch") or unit.startswith("step"):
                if amount != int(amount) or amount < 1:
                    raise wrong("a whole number >= 1 of epochs or steps")
                return ("epochs" if unit.startswith("epoch") else "steps"), int(amount)
            seconds = amount * _SECONDS[unit]
            if seconds <= 0:
                raise wrong("a duration > 0")
            return "seconds", seconds
    raise wrong()
