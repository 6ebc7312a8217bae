"""The service protocol: what ``rt.install`` accepts, and the checks it makes.

A service is any object with a ``name`` (str) and a numeric ``priority`` that implements
some of the hooks in :mod:`sakura.hookspecs`.  Subclassing :class:`Service` is optional;
it only supplies defaults.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

from sakura.errors import InvalidServiceError, nearest
from sakura.events import EVENT_TYPES, Event
from sakura.hookspecs import SERVICE_HOOKS

__all__ = [
    "COORDINATED_CALLS",
    "EVENT_HOOKS",
    "LIFECYCLE_HOOKS",
    "SERVICE_HOOKS",
    "Service",
    "validate_service",
]

DEFAULT_PRIORITY = 100

EVENT_HOOKS: dict[str, type[Event]] = {cls.hook: cls for cls in EVENT_TYPES}
"""Event hook name -> event class."""

LIFECYCLE_HOOKS = frozenset({"setup", "drain", "teardown"})
COORDINATED_CALLS = frozenset(
    {
        "wrap_model",
        "wrap_optimizer",
        "autocast",
        "wrap_loss",
        "unscale_gradients",
        "loss_scale",
        "optimizer_step",
        "state_dict",
        "load_state_dict",
    }
)
# SERVICE_HOOKS (every service hook name) is declared beside the specs, in sakura.hookspecs,
# so that sakura.suggest can name hooks without importing this module.

# Names that look like hooks: a public method with one of these prefixes must be a hook.
_HOOK_PREFIXES = ("on_", "wrap_", "sakura_")
_ONE_ARG_HOOKS = (
    set(EVENT_HOOKS)
    | {"on_event", "wrap_model", "wrap_optimizer", "wrap_loss"}
    | {"unscale_gradients", "optimizer_step", "load_state_dict", "setup"}
)
_NO_ARG_HOOKS = {"drain", "teardown", "autocast", "state_dict", "loss_scale"}


class Service:
    """Convenience base class: a ``name`` (the class name by default) and a ``priority``.

    Lower priorities run earlier.  Override only the hooks you need; see
    :mod:`sakura.hookspecs` for all of them.
    """

    name: str = ""
    priority: float = DEFAULT_PRIORITY

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.__dict__.get("name"):
            cls.name = _snake(cls.__name__)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} name={self.name!r} priority={self.priority}>"


def _snake(name: str) -> str:
    out = []
    for i, ch in enumerate(name):
        if (
            ch.isupper()
            and i
            and (not name[i - 1].isupper() or (i + 1 < len(name) and name[i + 1].islower()))
        ):
            out.append("_")
        out.append(ch.lower())
    return "".join(out)


def implemented_hooks(service: Any) -> dict[str, Callable[..., Any]]:
    """The service's bound hook methods, by hook name."""
    found: dict[str, Callable[..., Any]] = {}
    for name in SERVICE_HOOKS:
        method = getattr(service, name, None)
        if method is not None and callable(method):
            found[name] = method
    return found


def validate_service(service: Any) -> None:
    """Raise :class:`InvalidServiceError` if ``service`` breaks the protocol.

    Checks the name and priority, that every public method named like a hook is one
    (naming the nearest valid hook otherwise), and that hooks take the arguments the
    runtime passes.
    """
    kind = type(service).__name__
    name = getattr(service, "name", None)
    if not isinstance(name, str) or not name.strip():
        raise InvalidServiceError(
            f"service {kind} has no valid 'name': expected a non-empty str, got {name!r}"
        )
    priority = getattr(service, "priority", DEFAULT_PRIORITY)
    if (
        isinstance(priority, bool)
        or not isinstance(priority, (int, float))
        or not math.isfinite(priority)
    ):
        raise InvalidServiceError(
            f"service {name!r}: 'priority' must be a finite int or float, got {priority!r}"
        )
    for attr in dir(service):
        if attr.startswith(_HOOK_PREFIXES) and attr not in SERVICE_HOOKS:
            if not callable(getattr(service, attr, None)):
                continue
            hint = nearest(attr, SERVICE_HOOKS)
            suggestion = f"; did you mean {hint!r}?" if hint else ""
            raise InvalidServiceError(
                f"service {name!r} ({kind}) has method {attr!r}, which is not a sakura hook"
                f"{suggestion} (names starting with 'on_', 'wrap_' or 'sakura_' are reserved "
                f"for hooks; see `sakura hooks` for the list)"
            )
    for hook, method in implemented_hooks(service).items():
        _check_arity(name, hook, method)
    event_types = getattr(service, "event_types", None)
    if event_types is not None:
        try:
            bad = [t for t in event_types if not (isinstance(t, type) and issubclass(t, Event))]
        except TypeError:
            bad = [event_types]
        if bad:
            raise InvalidServiceError(
                f"service {name!r}: 'event_types' must be a collection of sakura event classes "
                f"(e.g. {{OnEpochEnd, OnTrainEnd}}) or None; got {bad[0]!r}"
            )


def _check_arity(service_name: str, hook: str, method: Callable[..., Any]) -> None:
    try:
        sig = inspect.signature(method)
    except (TypeError, ValueError):  # builtins without signatures: trust them
        return
    sentinel = object()
    args: tuple[Any, ...] = (sentinel,) if hook in _ONE_ARG_HOOKS else ()
    try:
        sig.bind(*args)
    except TypeError:
        expected = (
            f"{hook}(self, {'event' if hook in EVENT_HOOKS or hook == 'on_event' else 'arg'})"
            if args
            else f"{hook}(self)"
        )
        raise InvalidServiceError(
            f"service {service_name!r}: hook {hook}{sig} cannot be called as {expected}"
        ) from None
