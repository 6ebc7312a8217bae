"""The workloads and frameworks offered by plugins through sakura-bench's hooks.

sakura-bench's hookspecs are added to sakura's own plugin manager (the one every sakura
plugin is loaded by), so third-party packages register workloads and frameworks exactly
as they register services.  Lookups go through :func:`get_registry`, which collects the
registrations once per plugin manager.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sakura.errors import PluginConflictError, nearest
from sakura.plugins import PluginManager, get_plugin_manager
from sakura_bench.errors import BenchError

__all__ = ["Entry", "Registry", "get_registry"]

KINDS = {"workload": "sakura_register_workloads", "framework": "sakura_register_frameworks"}


@dataclass(frozen=True)
class Entry:
    """One registered workload or framework."""

    kind: str
    name: str
    target: Any
    description: str
    plugin: str
    distribution: str | None

    @property
    def provider(self) -> str:
        return self.distribution or self.plugin

    def load(self) -> Any:
        """The class itself (importing a lazy ``"module:Name"`` target)."""
        if not isinstance(self.target, str):
            return self.target
        module, _, attribute = self.target.partition(":")
        try:
            return getattr(importlib.import_module(module), attribute)
        except (ImportError, AttributeError) as exc:
            raise ImportError(
                f"the {self.kind} {self.name!r} from {self.provider} could not be imported "
                f"({self.target}): {exc}"
            ) from exc


class Registry:
    """Workloads and frameworks by name, with the plugin and distribution of each."""

    def __init__(self, manager: PluginManager) -> None:
        self.manager = manager
        manager.load()
        pm = manager.pm
        from sakura_bench import hookspecs

        # Where sakura-bench's own plugin is disabled (SAKURA_DISABLED_PLUGINS) its hooks
        # are still needed for third-party workloads.
        hookspecs.add_to(pm)
        dists = {info.name: info.distribution for info in manager.plugins()}
        self.entries: dict[str, dict[str, Entry]] = {kind: {} for kind in KINDS}
        self.failures: list[str] = []
        for kind, hook_name in KINDS.items():
            hook = getattr(pm.hook, hook_name)
            for impl in reversed(hook.get_hookimpls()):
                register = self._register_fn(kind, impl.plugin_name, dists.get(impl.plugin_name))
                try:
                    impl.function(register=register)
                except PluginConflictError:
                    raise
                except Exception as exc:
                    self.failures.append(
                        f"plugin {impl.plugin_name!r} failed in {hook_name}: {exc!r}"
                    )

    def _register_fn(self, kind: str, plugin: str, dist: str | None) -> Callable[..., None]:
        entries = self.entries[kind]

        def register(name: str, target: Any, *, description: str = "") -> None:
            if not isinstance(name, str) or not name:
                raise ValueError(
                    f"plugin {plugin!r} registered a {kind} with invalid name {name!r}"
                )
            if not (callable(target) or (isinstance(target, str) and ":" in target)):
                raise TypeError(
                    f"plugin {plugin!r}: {kind} {name!r} target must be a class or a "
                    f"'module.path:Name' string, got {target!r}"
                )
            old = entries.get(name)
            if old is not None:
                raise PluginConflictError(
                    f"two plugins provide the {kind} {name!r}: {old.provider} and "
                    f"{dist or plugin}; disable one with SAKURA_DISABLED_PLUGINS"
                )
            entries[name] = Entry(kind, name, target, description, plugin, dist)

        return register

    def names(self, kind: str) -> list[str]:
        return sorted(self.entries[kind])

    def get(self, kind: str, name: str) -> Entry:
        """The entry called ``name``; BenchError naming the choices if none."""
        found = self.entries[kind].get(name)
        if found is not None:
            return found
        available = self.names(kind)
        hint = nearest(name, available)
        parts = [f"unknown {kind} {name!r}."]
        if hint:
            parts.append(f"Did you mean {hint!r}?")
        parts.append(f"Available {kind}s: {', '.join(available) or 'none'}.")
        if self.failures:
            parts.append("Plugins that failed: " + "; ".join(self.failures) + ".")
        broken = [str(f) for f in self.manager.failures]
        if broken:
            parts.append("Plugins that failed to load: " + "; ".join(broken) + ".")
        raise BenchError(" ".join(parts))

    def workload(self, name: str) -> Any:
        """The workload class called ``name``."""
        return self.get("workload", name).load()

    def framework(self, name: str) -> Any:
        """The framework class called ``name``."""
        return self.get("framework", name).load()


_REGISTRIES: dict[int, Registry] = {}
_LOCK = threading.Lock()


def get_registry(manager: PluginManager | None = None) -> Registry:
    """The registry of ``manager`` (default: sakura's shared plugin manager)."""
    manager = manager or get_plugin_manager()
    with _LOCK:
        registry = _REGISTRIES.get(id(manager))
        if registry is None or registry.manager is not manager:
            registry = Registry(manager)
            _REGISTRIES[id(manager)] = registry
        return registry
