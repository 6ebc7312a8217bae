"""Seeing through the proxies that frameworks hand out in place of the user's optimizer.

Lightning gives ``training_step`` a ``LightningOptimizer``, accelerate gives the HF Trainer
an ``AcceleratedOptimizer``, and an adapter may put a proxy of its own in between.  They all
share the wrapped optimizer's ``param_groups``, so a service that keeps per-optimizer state
(a GradScaler's "already unscaled" record, for instance) must treat the proxy and the real
optimizer as one object.

One protocol, open to every integration: whoever introduces a proxy type registers it with
:func:`register_optimizer_proxy` (an adapter does it when it is imported, for its own
framework's types), and every service calls :func:`unwrap_optimizer`.  Nothing here imports
a framework or looks one up.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["register_optimizer_proxy", "registered_optimizer_proxies", "unwrap_optimizer"]

_MAX_DEPTH = 32
_lock = threading.Lock()
_proxies: dict[type, Callable[[Any], Any]] = {}


def register_optimizer_proxy(cls: type, inner: str | Callable[[Any], Any]) -> None:
    """Declare ``cls`` an optimizer proxy; ``inner`` is the attribute holding the wrapped
    optimizer (``"optimizer"``) or a function returning it.  Registering the same class again
    replaces its entry.  Subclasses of ``cls`` are proxies too."""
    if not isinstance(cls, type):
        raise TypeError(f"register_optimizer_proxy: cls must be a class, got {cls!r}")
    getter: Callable[[Any], Any]
    if isinstance(inner, str):
        if not inner.isidentifier():
            raise ValueError(
                f"register_optimizer_proxy: inner must be an attribute name or a callable, "
                f"got {inner!r}"
            )
        getter = operator.attrgetter(inner)

    elif callable(inner):
        getter = inner
    else:
        raise TypeError(
            f"register_optimizer_proxy: inner must be an attribute name or a callable, "
            f"got {inner!r}"
        )
    with _lock:
        _proxies[cls] = getter


def registered_optimizer_proxies() -> tuple[type, ...]:
    """The registered proxy classes, in registration order."""
    with _lock:
        return tuple(_proxies)


def _getter_for(obj: Any) -> Callable[[Any], Any] | None:
    for klass in type(obj).__mro__:
        getter = _proxies.get(klass)
        if getter is not None:
            return getter
    return None


def unwrap_optimizer(optimizer: Any) -> Any:
    """``optimizer`` without the registered proxies around it (any number of layers)."""
    for _ in range(_MAX_DEPTH):
        getter = _getter_for(optimizer)
        if getter is None:
            return optimizer
        inner = getter(optimizer)
        if inner is optimizer or inner is None:
            return optimizer
        optimizer = inner
    raise RuntimeError(
        f"unwrap_optimizer: more than {_MAX_DEPTH} proxy layers around {type(optimizer)!r} "
        "(a proxy that returns another proxy of itself?)"
    )
