"""Old public names that keep working, with a warning, for one minor version.

When a public name changes (an exception gains its ``Error`` suffix, a module moves), the
old name stays importable from the same module and warns with a ``DeprecationWarning``
that names the new one and the version that removes the old.  One helper does it for every
package::

    # at the end of the module that used to define ShardFailed (released in 0.2)
    __getattr__ = deprecated_aliases(__name__, {"ShardFailed": ShardFailedError}, removed_in="0.4")

``from module import ShardFailed`` then returns ``ShardFailedError`` (the same class, so
``except ShardFailed`` still catches it) and warns.  Only released names need this: a name
that never shipped is simply renamed.  A module that already defines
``__getattr__`` passes it as ``fallback``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["deprecated_aliases"]


def deprecated_aliases(
    module: str,
    aliases: Mapping[str, Any],
    *,
    removed_in: str,
    fallback: Callable[[str], Any] | None = None,
) -> Callable[[str], Any]:
    """A module ``__getattr__`` that resolves each old name in ``aliases`` to its new
    object with a DeprecationWarning, and any other name through ``fallback`` (or an
    AttributeError naming the module)."""
    table = dict(aliases)

    def __getattr__(name: str) -> Any:
        if name in table:
            new = table[name]
            where = getattr(new, "__module__", None) or module
            new_name = getattr(new, "__qualname__", None) or getattr(new, "__name__", repr(new))
            warnings.warn(
                f"{module}.{name} is deprecated and will be removed in {removed_in}; "
                f"use {where}.{new_name}",
                DeprecationWarning,
                stacklevel=2,
            )
            return new
        if fallback is not None:
            return fallback(name)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
