"""Which sakura events an adapter can emit, read from the adapter's own code.

A service may handle any event, but an adapter only emits the events its framework has a
moment for (the stock Hugging Face Trainer tells a callback nothing about backward; the
Lightning Trainer has no "push to the Hub").  A handler for an event that is never emitted
never runs, silently.  So at train start the adapters compare the events the installed
services handle with the events they can emit and warn (:class:`UnemittedEventWarning`)
naming the service, the event and the fix.

The events an adapter can emit are not a hand-kept list: :func:`events_emitted` reads them
from the adapter's source, as the event classes each method refers to, following calls
to the adapter's other methods from the framework's entry points (the hooks the
framework calls).  The source is parsed once per class.  Where the source is not
available (a build without ``.py`` files) the answer is None and no warning is given.
"""

from __future__ import annotations

import ast
import functools
import inspect
import logging
import textwrap
import warnings
from collections.abc import Callable, Iterable

from sakura.events import EVENT_TYPES, Event, OnError
from sakura.runtime import SakuraRuntime
from sakura.service import EVENT_HOOKS

__all__ = ["UnemittedEventWarning", "events_emitted", "handled_events", "warn_unemitted"]

logger = logging.getLogger("sakura.adapters")

_BY_NAME: dict[str, type[Event]] = {cls.__name__: cls for cls in EVENT_TYPES}

# The runtime itself emits OnError (a failing handler, an exception leaving the runtime),
# whatever the adapter.
_ALWAYS_EMITTED: frozenset[type[Event]] = frozenset({OnError})


class UnemittedEventWarning(UserWarning):
    """An installed service handles an event that the attached adapter never emits."""


_MethodFacts = dict[str, tuple[frozenset[str], frozenset[str]]]


@functools.cache
def _method_facts(cls: type) -> _MethodFacts | None:
    """Per method defined in ``cls``'s own body: the event class names it refers to and
    the attributes of ``self`` it uses (the calls to follow)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        logger.debug("sakura: no source for %s; its emitted events are unknown", cls)
        return None
    node = ast.parse(source).body[0]
    if not isinstance(node, ast.ClassDef):
        return None
    facts: _MethodFacts = {}
    for item in node.body:
        if not isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        events: set[str] = set()
        uses: set[str] = set()
        for sub in ast.walk(item):
            if isinstance(sub, ast.Attribute):
                if sub.attr in _BY_NAME:
                    events.add(sub.attr)
                if isinstance(sub.value, ast.Name) and sub.value.id == "self":
                    uses.add(sub.attr)
            elif isinstance(sub, ast.Name) and sub.id in _BY_NAME:
                events.add(sub.id)
        facts[item.name] = (frozenset(events), frozenset(uses))
    return facts


def events_emitted(
    cls: type, entries: Iterable[str] | None = None, *, stop_at: type = object
) -> frozenset[type[Event]] | None:
    """The events that ``cls``'s methods ``entries`` (every method when None) emit,
    directly or through other methods of ``self``.

    Methods are looked up along ``cls``'s MRO up to ``stop_at`` (the framework's base
    class, whose own methods emit nothing), so a subclass that overrides a hook is read
    as the framework will call it.  None when some class's source is not available.
    """
    methods: _MethodFacts = {}
    for klass in cls.__mro__:
        if klass is stop_at or klass is object:
            break
        facts = _method_facts(klass)
        if facts is None:
            return None
        for name, fact in facts.items():
            methods.setdefault(name, fact)  # the subclass's override wins
    todo = list(methods if entries is None else (e for e in entries if e in methods))
    seen: set[str] = set()
    found: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        events, uses = methods[name]
        found |= events
        todo.extend(use for use in uses if use in methods)
    return frozenset(_BY_NAME[name] for name in found)


def handled_events(service: object) -> frozenset[type[Event]]:
    """The events ``service`` handles by name (``on_<event>`` methods) or lists in
    ``event_types`` for its ``on_event``; a catch-all ``on_event`` without
    ``event_types`` takes whatever comes and is left out."""
    return _named_handlers(service) | _on_event_types(service)


def _named_handlers(service: object) -> frozenset[type[Event]]:
    return frozenset(
        cls for hook, cls in EVENT_HOOKS.items() if callable(getattr(service, hook, None))
    )


def _on_event_types(service: object) -> frozenset[type[Event]]:
    wanted = getattr(service, "event_types", None)
    if wanted is None or not callable(getattr(service, "on_event", None)):
        return frozenset()
    return frozenset(cls for cls in wanted if cls in _BY_NAME.values())


def warn_unemitted(
    rt: SakuraRuntime,
    emitted: frozenset[type[Event]] | None,
    *,
    where: str,
    fix: Callable[[type[Event]], str],
) -> list[tuple[str, type[Event]]]:
    """Warn once per installed service and event it handles that is not in ``emitted``
    (for an ``on_event`` with ``event_types``: when none of those events is emitted).

    ``where`` names the adapter and framework (``"HFAdapter under the stock
    transformers.Trainer"``); ``fix(event)`` says what to do.  Returns the (service name,
    event) pairs warned about; nothing when ``emitted`` is None (unknown).
    """
    if emitted is None:
        return []
    reachable = emitted | _ALWAYS_EMITTED
    found: list[tuple[str, type[Event]]] = []
    for service in rt.services:
        dead = _named_handlers(service) - reachable
        # One on_event handler listening to several events (the first of whichever moments
        # this loop has, say) is dead only when none of them can come.
        listened = _on_event_types(service)
        if listened and not listened & reachable:
            dead |= listened
        for event in sorted(dead, key=EVENT_TYPES.index):
            found.append((service.name, event))
            warnings.warn(
                f"sakura service {service.name!r} handles {event.hook} ({event.__name__}), "
                f"which {where} never emits, so that handler will never run; {fix(event)}",
                UnemittedEventWarning,
                stacklevel=3,
            )
    return found
