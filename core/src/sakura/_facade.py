"""Shared machinery of the ``sakura.services`` / ``sakura.adapters`` / ``sakura.dispatch``
facades: module attributes resolved lazily through the installed plugins."""

from __future__ import annotations

from typing import Any

from sakura.errors import UnknownNameError

__all__ = ["facade_dir", "resolve_export"]


def resolve_export(kind: str, module: str, attribute: str) -> Any:
    """Return the class a plugin exports as ``attribute``, or raise a helpful error.

    ImportError when ``attribute`` belongs to a known package that provides nothing here,
    saying why (not installed: the ``pip install`` line; installed but disabled or not
    selected: the setting; failed to load: the error); AttributeError listing what is
    available otherwise.
    """
    if attribute.startswith("__"):
        raise AttributeError(f"module {module!r} has no attribute {attribute!r}")
    from sakura.plugins import KNOWN_PROVIDERS, get_plugin_manager

    manager = get_plugin_manager()
    try:
        return manager.export(kind, attribute)
    except UnknownNameError:
        pass
    available = sorted(manager.exports(kind))
    provider = KNOWN_PROVIDERS.get(attribute)
    if provider is not None:
        raise ImportError(
            f"cannot import {attribute!r} from {module}: {manager.provider_status(provider)}",
            name=module,
        )
    raise AttributeError(
        f"module {module!r} has no attribute {attribute!r}; available {kind}s: "
        f"{', '.join(available) or 'none'}"
    )


def facade_dir(kind: str, own: list[str]) -> list[str]:
    from sakura.plugins import get_plugin_manager

    return sorted(set(own) | set(get_plugin_manager().exports(kind)))
