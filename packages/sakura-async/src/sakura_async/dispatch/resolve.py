"""Turn a ``dispatcher=`` option (an object, a name or spec string, or None) into a
dispatcher, and say whether the caller owns it (and must close it)."""

from __future__ import annotations

from typing import Any

from sakura_async.dispatch.base import Dispatcher

__all__ = ["resolve_dispatcher"]


def resolve_dispatcher(value: Any, *, option: str = "dispatcher") -> tuple[Dispatcher, bool]:
    """``(dispatcher, owned)``: None builds a :class:`ThreadDispatcher`; a string such as
    ``"thread"``, ``"process"`` or ``"remote:uri=..."`` builds the dispatcher registered
    under that name (see ``sakura services``/``sakura plugins``); both are marked
    :attr:`~Dispatcher.owned_by_service` and owned.  A dispatcher object is used as is: it
    is owned when its ``owned_by_service`` is set (a dispatcher built for this service
    alone), otherwise it stays the caller's to close."""
    if value is None:
        from sakura_async.dispatch.thread import ThreadDispatcher

        thread = ThreadDispatcher()
        thread.owned_by_service = True
        return thread, True
    if isinstance(value, Dispatcher):
        return value, bool(value.owned_by_service)
    if isinstance(value, str):
        from sakura.plugins import get_plugin_manager

        built = get_plugin_manager().create("dispatcher", value)
        if not isinstance(built, Dispatcher):
            raise TypeError(f"{option}={value!r} built a {type(built).__name__}, not a dispatcher")
        built.owned_by_service = True
        return built, True
    raise TypeError(
        f"{option} must be a sakura_async dispatcher (InThreadDispatcher, ThreadDispatcher, "
        f"LocalDispatcher, RemoteDispatcher, ClusterDispatcher), a dispatcher name such as "
        f"'thread' or 'process', or None for a ThreadDispatcher; got {value!r}"
    )
