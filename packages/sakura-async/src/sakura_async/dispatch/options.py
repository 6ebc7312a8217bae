"""The dispatchers' timing and transport options, declared once and checked once.

Every dispatcher (and the ``sakura-worker --listen`` server, for its frame size) builds one
:class:`DispatchOptions` from its constructor keywords with :meth:`DispatchOptions.from_kwargs`
and reads its values from it; the rules (what each option accepts, its default) live here
only, so ``liveness_timeout=0`` or ``max_frame_bytes=10`` is refused with the same
:class:`~sakura.options.OptionError` text by :class:`~sakura_async.dispatch.LocalDispatcher`,
:class:`~sakura_async.dispatch.RemoteDispatcher` and the others that take it, prefixed with the
dispatcher's name.  A spec string's options (``process:liveness_timeout=30``) reach the same
constructor keywords, so they are checked here too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sakura.options import check_int, check_number
from sakura_async.wire.channel import DEFAULT_MAX_FRAME_BYTES

__all__ = [
    "DEFAULT_INTERRUPT_GRACE",
    "DEFAULT_TASK_TIMEOUT",
    "MIN_FRAME_BYTES",
    "DispatchOptions",
]

DEFAULT_TASK_TIMEOUT = 3600.0
"""Seconds a task may take, from ``submit`` to its result, before it fails (one hour: an
evaluation or a checkpoint write that takes longer is almost always stuck).  Pass
``task_timeout=None`` to a dispatcher to wait without bound."""

DEFAULT_INTERRUPT_GRACE = 10.0
"""Seconds the tasks in flight get to finish after one Ctrl+C."""

MIN_FRAME_BYTES = 1024
"""The smallest ``max_frame_bytes`` accepted (a handshake or a heartbeat must fit)."""


def _seconds(option: str, value: Any, owner: str) -> float:
    return float(check_number(option, value, minimum=0, min_inclusive=False, owner=owner))


_RULES: dict[str, Callable[[str, Any, str], Any]] = {
    "max_pending": lambda o, v, owner: int(check_int(o, v, minimum=1, owner=owner)),
    "task_timeout": lambda o, v, owner: check_number(
        o, v, minimum=0, min_inclusive=False, allow_none=True, owner=owner
    ),
    "interrupt_grace": lambda o, v, owner: float(check_number(o, v, minimum=0, owner=owner)),
    "start_timeout": _seconds,
    "connect_timeout": _seconds,
    "liveness_timeout": _seconds,
    "max_frame_bytes": lambda o, v, owner: int(
        check_int(o, v, minimum=MIN_FRAME_BYTES, owner=owner)
    ),
}


@dataclass(frozen=True)
class DispatchOptions:
    """The options the dispatchers share, checked (build it with :meth:`from_kwargs`).

    ``max_pending``: unfinished tasks allowed before ``submit`` blocks (>= 1);
    ``task_timeout``: seconds from ``submit`` until an unfinished task fails (> 0, or None:
    no limit); ``interrupt_grace``: seconds the tasks in flight get after a Ctrl+C (>= 0);
    ``start_timeout``: seconds for a worker (process, local cluster) to start;
    ``connect_timeout``: seconds to connect to and authenticate with a remote worker;
    ``liveness_timeout``: seconds without any message after which a worker counts as gone;
    ``max_frame_bytes``: the largest message accepted from a worker (>= 1024).
    Each dispatcher takes the ones that apply to it as constructor keywords; the others
    keep their defaults and are not read.
    """

    max_pending: int = 2
    task_timeout: float | None = DEFAULT_TASK_TIMEOUT
    interrupt_grace: float = DEFAULT_INTERRUPT_GRACE
    start_timeout: float = 120.0
    connect_timeout: float = 15.0
    liveness_timeout: float = 60.0
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES

    @classmethod
    def from_kwargs(cls, *, owner: str, **given: Any) -> DispatchOptions:
        """The options ``given`` (any of the fields), each checked once by its rule; the
        others take their defaults.  Errors name ``owner`` (the dispatcher), the option, the
        value and what is accepted."""
        unknown = sorted(set(given) - set(_RULES))
        if unknown:
            raise TypeError(f"{owner}: unknown dispatcher option(s) {', '.join(unknown)}")
        return cls(**{name: _RULES[name](name, value, owner) for name, value in given.items()})
