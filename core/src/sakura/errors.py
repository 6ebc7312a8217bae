"""Exceptions raised by sakura.  Each message says what was wrong and what is accepted."""

from __future__ import annotations

from collections.abc import Iterable

from sakura.suggest import suggest_hook

__all__ = [
    "ConfigError",
    "InvalidServiceError",
    "PluginConflictError",
    "SakuraError",
    "SpecError",
    "UnknownNameError",
    "add_note",
    "nearest",
]


class SakuraError(Exception):
    """Base class of sakura's own errors."""


class InvalidServiceError(SakuraError, TypeError):
    """A service does not follow the service protocol (name, priority, hook names)."""


class SpecError(SakuraError, ValueError):
    """A spec string (``name``, ``name:arg``, ``name:key=value,...``) is malformed or the
    service/dispatcher it names rejects its arguments."""


class ConfigError(SakuraError, ValueError):
    """A configuration file or environment variable holds an invalid value."""


class UnknownNameError(SakuraError, LookupError):
    """No installed plugin provides the requested service, dispatcher or adapter."""

    def __str__(self) -> str:  # LookupError would repr() the message
        return str(self.args[0]) if self.args else ""


class PluginConflictError(SakuraError, RuntimeError):
    """Two plugins claim the same name."""


def nearest(name: str, candidates: Iterable[str]) -> str | None:
    """The candidate closest to ``name``, if any is reasonably close.

    Another framework's name for a sakura hook counts as closest to that hook
    (Lightning's ``on_train_start`` -> ``on_train_begin``, not the nearer spelling
    ``on_train_step_end``); see :func:`sakura.suggest.suggest_hook`.
    """
    return suggest_hook(name, candidates)


def add_note(error: BaseException, note: str) -> None:
    """``error.add_note(note)`` (Python 3.11+); on 3.10 the note is kept in ``__notes__``
    the same way, so code and tests can read it on every supported Python."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:  # pragma: no cover - Python 3.10
        notes = getattr(error, "__notes__", None)
        if not isinstance(notes, list):
            notes = []
            error.__notes__ = notes  # type: ignore[attr-defined]
        notes.append(note)
