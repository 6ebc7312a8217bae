"""A service's ``dispatcher=`` option (an object, a name or spec string, or None): checked
when the service is built, turned into a dispatcher when it is set up, closed at teardown
when the service owns it.  :class:`DispatcherSlot` does all three for any service
(AsyncEval and AsyncCheckpoint use it; so may a third party's)."""

from __future__ import annotations

from typing import Any

from sakura_async.dispatch.base import Dispatcher

__all__ = ["DispatcherSlot", "check_dispatcher", "resolve_dispatcher", "unknown_dispatcher"]

_WHAT = (
    "a sakura_async dispatcher (InThreadDispatcher, ThreadDispatcher, LocalDispatcher, "
    "RemoteDispatcher, ClusterDispatcher), a dispatcher name such as 'thread' or 'process', "
    "or None for a ThreadDispatcher"
)


def unknown_dispatcher(name: str) -> str | None:
    """None when ``name`` is a registered dispatcher; else what is accepted instead: the
    registered names and the nearest one (``"cluster, inthread, ...; did you mean
    'thread'?"``)."""
    from sakura.errors import nearest
    from sakura.plugins import get_plugin_manager

    registry = get_plugin_manager().registry("dispatcher")
    if registry.find(name) is not None:
        return None
    names = registry.names()
    hint = nearest(name, names)
    return ", ".join(names) + (f"; did you mean {hint!r}?" if hint else "")


def check_dispatcher(value: Any, *, option: str = "dispatcher", owner: str | None = None) -> None:
    """Reject now what :func:`resolve_dispatcher` would reject when the service is
    installed: a value of the wrong type (TypeError) or a name no installed plugin
    registers (OptionError with the accepted names and the nearest one).  Nothing is built
    and no worker starts."""
    if value is None or isinstance(value, Dispatcher):
        return
    if not isinstance(value, str):
        prefix = f"{owner}: " if owner else ""
        raise TypeError(f"{prefix}{option} must be {_WHAT}; got {value!r}")
    from sakura.options import option_error
    from sakura.specs import parse_spec

    accepted = unknown_dispatcher(parse_spec(value).name)
    if accepted is not None:
        raise option_error(option, value, f"a registered dispatcher: {accepted}", owner=owner)


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

        check_dispatcher(value, option=option)
        built = get_plugin_manager().create("dispatcher", value)
        if not isinstance(built, Dispatcher):
            raise TypeError(f"{option}={value!r} built a {type(built).__name__}, not a dispatcher")
        built.owned_by_service = True
        return built, True
    raise TypeError(f"{option} must be {_WHAT}; got {value!r}")


class DispatcherSlot:
    """The ``dispatcher=`` option of a service, from construction to teardown.

    Built in the service's constructor (``self._dispatch = DispatcherSlot(dispatcher,
    owner="AsyncEval")``): the value is checked there (:func:`check_dispatcher`: a wrong type
    or a misspelt name fails at once, nothing is built).  :meth:`acquire` (at setup) gives
    the dispatcher, building it from a name or None the first time; :meth:`release` (at
    teardown) closes it when the service owns it -- one it built, or an object marked
    ``owned_by_service`` -- and forgets it, so a later setup builds a fresh one.
    """

    def __init__(self, value: Any, *, owner: str, option: str = "dispatcher") -> None:
        check_dispatcher(value, option=option, owner=owner)
        self.option = value
        self._name = option
        self.dispatcher: Dispatcher | None = None
        self.owned = False
        """Whether the service closes the dispatcher at teardown."""
        if isinstance(value, Dispatcher):
            self.dispatcher, self.owned = resolve_dispatcher(value, option=option)

    def acquire(self) -> Dispatcher:
        """The dispatcher, built from the option if there is none yet."""
        if self.dispatcher is None:
            self.dispatcher, self.owned = resolve_dispatcher(self.option, option=self._name)
        return self.dispatcher

    def release(self) -> None:
        """Close the dispatcher if the service owns it (then a later :meth:`acquire` builds
        a new one); a dispatcher that is the caller's stays open and kept."""
        if self.owned and self.dispatcher is not None:
            self.dispatcher.close()
            self.dispatcher = None

    def __repr__(self) -> str:
        return repr(self.dispatcher or self.option)
