"""The runtime's routing tables: which bound methods run for each event and each call.

:class:`~sakura.SakuraRuntime` rebuilds these on every install/uninstall, never per step.
For each event class it resolves the tuple of handlers (specific hooks and ``on_event``
catch-alls, in service priority order; a package's own event class, to the services whose
``event_types`` name it) and generates a straight-line ``dispatch(event)``
function over them; for each coordinated call it resolves the tuple of
``(service, bound method)`` pairs.  Kept apart from the runtime so that the registry
(install, uninstall, lifecycle) and the hot-path machinery can be read separately, as
pluggy keeps ``_manager`` apart from ``_callers``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from sakura.events import EVENT_TYPES, Event
from sakura.service import EVENT_HOOKS, implemented_hooks

__all__ = ["Routes", "build_routes", "make_dispatcher"]

Handler = Callable[[Any], Any]
Failed = Callable[[Handler, Event, Exception], None]
Calls = dict[str, tuple[tuple[Any, Callable[..., Any]], ...]]


@dataclass(frozen=True)
class Routes:
    """What :func:`build_routes` resolved for one set of services."""

    handlers: dict[type[Event], tuple[Handler, ...]]
    """Event class -> handlers in priority order (only classes somebody handles)."""
    calls: Calls
    """Coordinated call or lifecycle hook name -> ``(service, bound method)`` pairs."""
    implementers: dict[str, tuple[str, ...]]
    """Call name -> names of the services implementing it, in priority order."""


def build_routes(services: Iterable[Any]) -> Routes:
    """Resolve the handlers and coordinated calls of ``services`` (already in priority
    order)."""
    table: dict[type[Event], list[Handler]] = {}
    calls: dict[str, list[tuple[Any, Callable[..., Any]]]] = {}
    for service in services:
        hooks = implemented_hooks(service)
        catch_all = hooks.get("on_event")
        wanted = getattr(service, "event_types", None)
        wanted_set = frozenset(wanted) if wanted is not None else None
        for event_cls in EVENT_TYPES:
            specific = hooks.get(event_cls.hook)
            if specific is not None:
                table.setdefault(event_cls, []).append(specific)
            if catch_all is not None and (wanted_set is None or event_cls in wanted_set):
                table.setdefault(event_cls, []).append(catch_all)
        if catch_all is not None and wanted_set is not None:
            # A package's own event class (not one of the core's) reaches the services
            # that name it; catch-alls are written against the core's events and skip it.
            for event_cls in wanted_set.difference(EVENT_TYPES):
                table.setdefault(event_cls, []).append(catch_all)
        for hook, method in hooks.items():
            if hook not in EVENT_HOOKS and hook != "on_event":
                calls.setdefault(hook, []).append((service, method))
    return Routes(
        handlers={cls: tuple(handlers) for cls, handlers in table.items()},
        calls={hook: tuple(impls) for hook, impls in calls.items()},
        implementers={
            hook: tuple(service.name for service, _ in impls) for hook, impls in calls.items()
        },
    )


def make_dispatcher(
    handlers: tuple[Handler, ...], failed: Failed, count: bool
) -> tuple[Callable[[Any], None], Callable[[], int] | None]:
    """Generate ``dispatch(event)`` calling ``handlers`` in order, each under its own
    ``try``, plus a reader of how many events it delivered (when ``count``).

    Unrolled straight-line code with the handlers and the counter in closure cells is
    what makes an emit cost about what a hand-written ``for`` loop over bound methods
    costs: no per-event dict update, no loop, no attribute lookups.
    """
    names = [f"h{i}" for i in range(len(handlers))]
    lines = [f"def _factory(failed, {', '.join(names)}):"]
    if count:
        lines += ["    count = 0", "    def read():", "        return count"]
    lines.append("    def dispatch(event):")
    if count:
        lines += ["        nonlocal count", "        count += 1"]
    for name in names:
        lines += [
            "        try:",
            f"            {name}(event)",
            "        except Exception as exc:",
            f"            failed({name}, event, exc)",
        ]
    lines.append("    return dispatch, " + ("read" if count else "None"))
    namespace: dict[str, Any] = {}
    exec("\n".join(lines), namespace)  # noqa: S102 - generated from the handler count only
    dispatch, read = namespace["_factory"](failed, *handlers)
    return dispatch, read
