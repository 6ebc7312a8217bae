"""Plugin discovery and the registries of named services, dispatchers and adapters.

Plugins are modules registered by distributions under the ``sakura`` entry-point group.
Nothing is imported until something asks (a facade attribute, a spec string, the CLI).
Every entry point loads under its own ``try``: a plugin that fails to import is recorded
with its distribution name and error, a warning is issued, and the others still load.

Which plugins load:

* ``SAKURA_PLUGINS=a,b`` (or ``plugins = [...]`` in the config): only these.  An item is an
  entry-point name, a distribution name, or an importable module path (loaded directly,
  like ``PYTEST_PLUGINS``).
* ``SAKURA_DISABLED_PLUGINS=a,b``: skip these (entry-point or distribution names).
* ``SAKURA_DISABLE_PLUGIN_AUTOLOAD=1``: load no entry point except those named in
  ``SAKURA_PLUGINS``.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import threading
import traceback
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from types import ModuleType
from typing import Any

import pluggy

from sakura import hookspecs
from sakura.errors import PluginConflictError, SpecError, UnknownNameError, nearest
from sakura.specs import Spec, parse_spec

__all__ = [
    "ENTRY_POINT_GROUP",
    "KINDS",
    "KNOWN_PROVIDERS",
    "PluginFailure",
    "PluginInfo",
    "PluginManager",
    "Provided",
    "get_plugin_manager",
    "reset_plugin_managers",
]

ENTRY_POINT_GROUP = "sakura"
BUILTIN_PLUGIN = "sakura.builtin_plugin"
KINDS = ("service", "dispatcher", "adapter")
_HOOK_FOR_KIND = {
    "service": "sakura_register_services",
    "dispatcher": "sakura_register_dispatchers",
    "adapter": "sakura_register_adapters",
}

KNOWN_PROVIDERS: dict[str, str] = {
    # service spec names and facade names -> the distribution that provides them
    "mixed_precision": "sakura-precision",
    "MixedPrecision": "sakura-precision",
    "compile": "sakura-precision",
    "Compile": "sakura-precision",
    "activation_checkpoint": "sakura-precision",
    "ActivationCheckpoint": "sakura-precision",
    "zero1": "sakura-zero",
    "ZeRO1": "sakura-zero",
    "zero2": "sakura-zero",
    "ZeRO2": "sakura-zero",
    "async_eval": "sakura-async",
    "AsyncEval": "sakura-async",
    "async_checkpoint": "sakura-async",
    "AsyncCheckpoint": "sakura-async",
    "inthread": "sakura-async",
    "thread": "sakura-async",
    "process": "sakura-async",
    "remote": "sakura-async",
    "cluster": "sakura-async",
    "InThreadDispatcher": "sakura-async",
    "ThreadDispatcher": "sakura-async",
    "LocalDispatcher": "sakura-async",
    "RemoteDispatcher": "sakura-async",
    "ClusterDispatcher": "sakura-async",
    "lightning": "sakura-adapters",
    "hf": "sakura-adapters",
    "ddp": "sakura-adapters",
    "LightningAdapter": "sakura-adapters",
    "HFAdapter": "sakura-adapters",
    "DDPAdapter": "sakura-adapters",
}
"""Names provided by first-party packages, so a missing one says what to install."""


_LAZY_TARGET = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*\Z")


@dataclass(frozen=True)
class Provided:
    """One named thing a plugin offers.

    ``target`` is a class or factory, or a lazy ``"module.path:Name"`` string that is
    imported on first use, so listing plugins never imports heavy frameworks.
    """

    kind: str
    name: str
    target: Any
    parse: Callable[[Spec], Any] | None
    description: str
    plugin: str
    distribution: str | None

    @property
    def export_name(self) -> str | None:
        """The facade attribute name: the class's ``__name__`` (or a lazy target's name)."""
        if isinstance(self.target, str):
            return self.target.rpartition(":")[2]
        return self.target.__name__ if isinstance(self.target, type) else None

    def load(self) -> Any:
        """The target itself, importing a lazy ``"module:Name"`` target."""
        if not isinstance(self.target, str):
            return self.target
        module_name, _, attribute = self.target.partition(":")
        try:
            return getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError) as exc:
            where = self.distribution or self.plugin
            raise ImportError(
                f"the {self.kind} {self.name!r} from {where} could not be imported "
                f"({self.target}): {exc}"
            ) from exc

    def create(self, spec: Spec) -> Any:
        """Build the object a spec describes."""
        target = self.load()
        try:
            if self.parse is not None:
                return self.parse(spec)
            return target(*spec.args, **spec.kwargs)
        except SpecError:
            raise
        except (TypeError, ValueError) as exc:
            raise SpecError(
                f"{self.kind} spec {str(spec)!r} was rejected by {self.describe()}: {exc}"
                f"{self._accepted(target)}"
            ) from exc

    def describe(self) -> str:
        where = self.distribution or self.plugin
        return f"{self.name!r} (from {where})"

    def _accepted(self, target: Any) -> str:
        if self.parse is not None:
            return ""
        try:
            signature = inspect.signature(target)
        except (TypeError, ValueError):
            return ""
        return f"; accepted arguments: {self.name}{signature}"


@dataclass(frozen=True)
class PluginFailure:
    """A plugin that could not be loaded."""

    name: str
    distribution: str | None
    error: BaseException
    traceback: str

    def __str__(self) -> str:
        return f"plugin {self.name!r} from {self.distribution or 'unknown distribution'} failed to load: {self.error!r}"


@dataclass
class PluginInfo:
    """A loaded plugin."""

    name: str
    distribution: str | None
    version: str | None
    module: str
    provides: dict[str, list[str]] = field(default_factory=dict)


def _normalize(name: str) -> str:
    """Distribution names compare as PyPI does: case-insensitive, ``-``/``_``/``.`` alike."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _split_env(value: str | None) -> list[str]:
    return [item.strip() for item in (value or "").split(",") if item.strip()]


class PluginManager:
    """Loads plugins once, on first use, and holds what they register."""

    def __init__(
        self,
        *,
        plugins: Iterable[str] | None = None,
        disabled: Iterable[str] = (),
        autoload: bool = True,
    ) -> None:
        self.only: tuple[str, ...] | None = tuple(plugins) if plugins is not None else None
        self.disabled: tuple[str, ...] = tuple(disabled)
        self.autoload = autoload
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.pm.hook.sakura_add_hookspecs.call_historic(kwargs={"pluginmanager": self.pm})
        self.failures: list[PluginFailure] = []
        self._info: dict[str, PluginInfo] = {}
        self._registries: dict[str, dict[str, Provided]] | None = None
        self._loaded = False
        self._lock = threading.RLock()

    # --- loading ------------------------------------------------------------------------

    def load(self) -> None:
        """Discover and import the plugins (once)."""
        with self._lock:
            if self._loaded:
                return
            self._loaded = True
            self._register_module(importlib.import_module(BUILTIN_PLUGIN), "sakura", "sakura-core")
            wanted = {_normalize(n) for n in self.only} if self.only is not None else None
            disabled = {_normalize(n) for n in self.disabled}
            known: set[str] = set()
            for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
                dist = ep.dist.name if ep.dist is not None else None
                names = {_normalize(ep.name)} | ({_normalize(dist)} if dist else set())
                known |= names
                if names & disabled:
                    continue
                if wanted is not None:
                    if not names & wanted:
                        continue
                elif not self.autoload:
                    continue
                if ep.name in self._info:
                    continue  # the same distribution seen twice on sys.path
                try:
                    module = ep.load()
                except Exception as exc:
                    self._fail(ep.name, dist, exc)
                    continue
                self._register_module(module, ep.name, dist)
            for item in self.only or ():
                if _normalize(item) in known or _normalize(item) in disabled:
                    continue  # an entry point or distribution name, handled above
                try:
                    module = importlib.import_module(item)
                except ImportError as exc:
                    self._fail(
                        item,
                        None,
                        exc,
                        hint="not an installed plugin, distribution or importable module",
                    )
                    continue
                except Exception as exc:
                    self._fail(item, None, exc)
                    continue
                if not any(attr.startswith("sakura_") for attr in dir(module)):
                    self._fail(
                        item,
                        None,
                        ValueError(
                            f"module {item!r} implements no sakura_* hook; name the plugin by its "
                            f"entry-point or distribution name, or the module that holds the hooks"
                        ),
                    )
                    continue
                self._register_module(module, item, None)
            # Hook names are checked once everything is registered, because a package may
            # add hookspecs (sakura_add_hookspecs) that plugins loaded before it implement.
            for name, info in list(self._info.items()):
                plugin = self.pm.get_plugin(name)
                problem = self._misnamed_hook(plugin) if plugin is not None else None
                if problem:
                    self.pm.unregister(name=name)
                    del self._info[name]
                    self._fail(name, info.distribution, ValueError(problem))

    def _register_module(self, module: ModuleType, name: str, dist: str | None) -> None:
        try:
            self.pm.register(module, name=name)
        except Exception as exc:
            self._fail(name, dist, exc)
            return
        version = None
        if dist:
            try:
                version = metadata.version(dist)
            except metadata.PackageNotFoundError:
                version = None
        self._info[name] = PluginInfo(
            name=name, distribution=dist, version=version, module=module.__name__
        )

    def _misnamed_hook(self, module: ModuleType) -> str | None:
        known = {  # pluggy also creates callers for implementations without a spec: skip those
            h
            for h in dir(self.pm.hook)
            if h.startswith("sakura_")
            and getattr(getattr(self.pm.hook, h), "spec", None) is not None
        }
        for attr in dir(module):
            if not attr.startswith("sakura_") or attr in known:
                continue
            value = getattr(module, attr)
            if not callable(value):
                continue
            opts = getattr(value, f"{hookspecs.PROJECT_NAME}_impl", None)
            if isinstance(opts, dict) and opts.get("optionalhook"):
                continue
            hint = nearest(attr, known)
            suggestion = f"; did you mean {hint!r}?" if hint else ""
            return (
                f"{module.__name__}.{attr} is not a sakura plugin hook{suggestion} "
                f"(mark it @hookimpl(optionalhook=True) if it belongs to another package's hookspecs)"
            )
        return None

    def _fail(self, name: str, dist: str | None, exc: BaseException, hint: str = "") -> None:
        failure = PluginFailure(name, dist, exc, "".join(traceback.format_exception(exc)))
        self.failures.append(failure)
        message = str(failure) + (f" ({hint})" if hint else "")
        warnings.warn(message, RuntimeWarning, stacklevel=3)

    # --- registries -----------------------------------------------------------------------

    def registry(self, kind: str) -> Mapping[str, Provided]:
        """Everything of ``kind`` ("service", "dispatcher", "adapter") the plugins offer."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        self.load()
        with self._lock:
            if self._registries is None:
                self._registries = self._collect()
        return self._registries[kind]

    def _collect(self) -> dict[str, dict[str, Provided]]:
        registries: dict[str, dict[str, Provided]] = {kind: {} for kind in KINDS}
        for kind, hook_name in _HOOK_FOR_KIND.items():
            hook = getattr(self.pm.hook, hook_name)
            for impl in reversed(hook.get_hookimpls()):  # registration order
                info = self._info.get(impl.plugin_name)
                dist = info.distribution if info else None
                entries = registries[kind]

                def register(
                    name: str,
                    target: Any,
                    *,
                    parse: Callable[[Spec], Any] | None = None,
                    description: str = "",
                    _kind: str = kind,
                    _plugin: str = impl.plugin_name,
                    _dist: str | None = dist,
                    _entries: dict[str, Provided] = entries,
                    _info: PluginInfo | None = info,
                ) -> None:
                    if not isinstance(name, str) or not name:
                        raise ValueError(
                            f"plugin {_plugin!r} registered a {_kind} with invalid name {name!r}"
                        )
                    if not callable(target) and not (
                        isinstance(target, str) and _LAZY_TARGET.match(target)
                    ):
                        raise TypeError(
                            f"plugin {_plugin!r}: {_kind} {name!r} target must be callable or a "
                            f"'module.path:Name' string, got {target!r}"
                        )
                    new = Provided(
                        _kind, name, target, parse, description or _doc(target), _plugin, _dist
                    )
                    old = _entries.get(name)
                    if old is not None:
                        raise PluginConflictError(
                            f"two plugins provide the {_kind} {name!r}: {old.distribution or old.plugin} "
                            f"(plugin {old.plugin!r}) and {_dist or _plugin} (plugin {_plugin!r}); "
                            f"disable one with SAKURA_DISABLED_PLUGINS"
                        )
                    _entries[name] = new
                    if _info is not None:
                        _info.provides.setdefault(_kind, []).append(name)

                try:
                    impl.function(register=register)
                except PluginConflictError:
                    raise
                except Exception as exc:
                    self._fail(impl.plugin_name, dist, exc)
        return registries

    def resolve(self, kind: str, name: str) -> Provided:
        """The registration called ``name``; UnknownNameError listing the choices if none."""
        entries = self.registry(kind)
        found = entries.get(name)
        if found is not None:
            return found
        raise UnknownNameError(self.unknown_message(kind, name, list(entries)))

    def unknown_message(self, kind: str, name: str, available: list[str]) -> str:
        parts = [f"unknown {kind} {name!r}."]
        provider = KNOWN_PROVIDERS.get(name)
        if provider:
            parts.append(
                f"It is provided by {provider}, which is not installed: pip install {provider}."
            )
        hint = nearest(name, available)
        if hint:
            parts.append(f"Did you mean {hint!r}?")
        parts.append(f"Available {kind}s: {', '.join(sorted(available)) or 'none'}.")
        broken = [str(f) for f in self.failures]
        if broken:
            parts.append("Plugins that failed to load: " + "; ".join(broken) + ".")
        return " ".join(parts)

    def create(self, kind: str, spec: str | Spec | Mapping[str, Any]) -> Any:
        """Build a service/dispatcher/adapter from a spec string, Spec, or a mapping with a
        ``name`` key and keyword options (as config files write it)."""
        if isinstance(spec, Mapping):
            options = dict(spec)
            name = options.pop("name", None)
            if not isinstance(name, str):
                raise SpecError(
                    f"a {kind} given as a table needs a 'name' key (a string); got {spec!r}"
                )
            parsed = Spec(name=name, kwargs=options, text=name)
        elif isinstance(spec, Spec):
            parsed = spec
        else:
            parsed = parse_spec(spec)
        return self.resolve(kind, parsed.name).create(parsed)

    def export(self, kind: str, attribute: str) -> Any:
        """The class a facade exports as ``attribute`` (``MixedPrecision``)."""
        for provided in self.registry(kind).values():
            if provided.export_name == attribute:
                return provided.load()
        raise UnknownNameError(attribute)

    def exports(self, kind: str) -> dict[str, Provided]:
        """Facade attribute name -> registration, for every class-valued registration."""
        return {p.export_name: p for p in self.registry(kind).values() if p.export_name}

    def plugins(self) -> list[PluginInfo]:
        """Loaded plugins with what each provides."""
        for kind in KINDS:
            self.registry(kind)
        return list(self._info.values())


def _doc(target: Any) -> str:
    if isinstance(target, str):
        return ""
    doc = inspect.getdoc(target) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


_MANAGERS: dict[tuple[Any, ...], PluginManager] = {}
_MANAGERS_LOCK = threading.Lock()


def get_plugin_manager(
    *,
    plugins: Iterable[str] | None = None,
    disabled: Iterable[str] | None = None,
    autoload: bool | None = None,
) -> PluginManager:
    """The shared plugin manager for these settings (environment fills what is not given)."""
    if plugins is None and "SAKURA_PLUGINS" in os.environ:
        plugins = _split_env(os.environ["SAKURA_PLUGINS"])
    if disabled is None:
        disabled = _split_env(os.environ.get("SAKURA_DISABLED_PLUGINS"))
    if autoload is None:
        autoload = os.environ.get("SAKURA_DISABLE_PLUGIN_AUTOLOAD", "") not in (
            "1",
            "true",
            "True",
            "yes",
        )
    key = (tuple(plugins) if plugins is not None else None, tuple(disabled), autoload)
    with _MANAGERS_LOCK:
        manager = _MANAGERS.get(key)
        if manager is None:
            manager = PluginManager(plugins=plugins, disabled=disabled, autoload=autoload)
            _MANAGERS[key] = manager
        return manager


def reset_plugin_managers() -> None:
    """Forget every loaded plugin manager (tests, or after installing a plugin at run time)."""
    with _MANAGERS_LOCK:
        _MANAGERS.clear()
