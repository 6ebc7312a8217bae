"""The workloads and frameworks offered by plugins through sakura-bench's hooks.

sakura-bench's hookspecs are added to sakura's own plugin manager (the one every sakura
plugin is loaded by), so third-party packages register workloads and frameworks exactly
as they register services.  The registries themselves are the core's
(:meth:`sakura.plugins.PluginManager.collect`, a :class:`sakura.registry.NamedRegistry` per
kind): the same name matching (``mnist-mlp`` finds ``mnist_mlp``), conflict errors, lazy
``"module:Name"`` targets and failure reporting as for services.  This module only adds
the bench's hookspecs and its error type.
"""

from __future__ import annotations

from typing import Any

from sakura.plugins import PluginManager, get_plugin_manager
from sakura.registry import Entry, NamedRegistry
from sakura_bench.errors import BenchError

__all__ = ["KINDS", "Entry", "Registry", "get_registry"]

KINDS = {"workload": "sakura_register_workloads", "framework": "sakura_register_frameworks"}


class Registry:
    """Workloads and frameworks by name, with the plugin and distribution of each."""

    def __init__(self, manager: PluginManager) -> None:
        from sakura_bench import hookspecs

        self.manager = manager
        manager.load()
        # Where sakura-bench's own plugin is disabled (SAKURA_DISABLED_PLUGINS) its hooks
        # are still needed for third-party workloads.
        hookspecs.add_to(manager.pm)
        self.kinds: dict[str, NamedRegistry[Any]] = {
            kind: manager.collect(kind, hook_name, error=BenchError)
            for kind, hook_name in KINDS.items()
        }

    def names(self, kind: str) -> list[str]:
        return self.kinds[kind].names()

    def get(self, kind: str, name: str) -> Entry[Any]:
        """The entry called ``name``; BenchError naming the choices if none."""
        return self.kinds[kind].get(name)

    def workload(self, name: str) -> Any:
        """The workload class called ``name``."""
        return self.get("workload", name).load()

    def framework(self, name: str) -> Any:
        """The framework class called ``name``."""
        return self.get("framework", name).load()


def get_registry(manager: PluginManager | None = None) -> Registry:
    """The registry of ``manager`` (default: sakura's shared plugin manager); the core
    collects each kind once per manager."""
    return Registry(manager or get_plugin_manager())
