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
from sakura.env import env_flag, env_list
from sakura.errors import UnknownNameError, nearest
from sakura.registry import Entry, NamedRegistry, fill_from_hook
from sakura.specs import Spec

__all__ = [
    "ENTRY_POINT_GROUP",
    "KINDS",
    "KNOWN_PROVIDERS",
    "PluginFailure",
    "PluginInfo",
    "PluginLoadWarning",
    "PluginManager",
    "Provided",
    "SkippedPlugin",
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
    "hf_trainer": "sakura-adapters",
    "LightningAdapter": "sakura-adapters",
    "HFAdapter": "sakura-adapters",
    "SakuraTrainer": "sakura-adapters",
    "DDPAdapter": "sakura-adapters",
    "quant": "sakura-quant",
    "Quantization": "sakura-quant",
    "offload_adamw": "sakura-offload",
    "OffloadAdamWService": "sakura-offload",
    "memory_plan": "sakura-offload",
    "MemoryPlannerService": "sakura-offload",
    "fit": "sakura-offload",
    "Fit": "sakura-offload",
}
"""Names provided by first-party packages (spec names and facade class names), so a
missing one says what to install.  ``core/tests/test_known_providers.py`` checks it against
what each installed first-party package registers; names compare with ``-``/``_`` alike."""


Provided = Entry
"""What a plugin registered under a name (the core's name for :class:`sakura.registry.Entry`)."""


class PluginLoadWarning(RuntimeWarning):
    """Issued once per plugin that failed to load and per plugin filter that names nothing
    installed.  The ``sakura`` command prints these itself, so it silences this category."""


@dataclass(frozen=True)
class PluginFailure:
    """A plugin that could not be loaded."""

    name: str
    distribution: str | None
    error: BaseException
    traceback: str

    def __str__(self) -> str:
        return f"plugin {self.name!r} from {self.distribution or 'unknown distribution'} failed to load: {self.error!r}"


@dataclass(frozen=True)
class SkippedPlugin:
    """An installed plugin that was not loaded, and why."""

    name: str
    distribution: str | None
    version: str | None
    reason: str
    """``"disabled"`` (listed in the disabled plugins), ``"not selected"`` (a plugin list
    is given and does not name it) or ``"autoload off"``."""

    def explain(self) -> str:
        """The reason in words, with the setting that causes it."""
        return {
            "disabled": "disabled by SAKURA_DISABLED_PLUGINS / disabled_plugins",
            "not selected": "not named in SAKURA_PLUGINS / plugins",
            "autoload off": "plugin autoload is off (SAKURA_DISABLE_PLUGIN_AUTOLOAD / "
            "autoload = false) and it is not named in SAKURA_PLUGINS / plugins",
        }.get(self.reason, self.reason)


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


def _version(dist: str | None) -> str | None:
    if not dist:
        return None
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


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
        """Plugins that failed to import, register or run a registration hook."""
        self.problems: list[str] = []
        """Plugin filters (disabled / selected names) that match no installed plugin."""
        self.skipped: list[SkippedPlugin] = []
        """Installed plugins that the filters kept from loading."""
        self._info: dict[str, PluginInfo] = {}
        self._installed: dict[str, tuple[str, str | None]] = {}
        self._registries: dict[str, NamedRegistry[Any]] = {}
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
            self._load_entry_points()
            installed = sorted({n for pair in self._installed.values() for n in pair if n})
            self._check_disabled_names(installed)
            self._load_named_modules(installed)
            self._check_hook_names()

    def _load_entry_points(self) -> None:
        """Import every entry point of the group that the filters let through; record the
        others in :attr:`skipped` with the reason."""
        wanted = {_normalize(n) for n in self.only} if self.only is not None else None
        disabled = {_normalize(n) for n in self.disabled}
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = ep.dist.name if ep.dist is not None else None
            names = {_normalize(ep.name)} | ({_normalize(dist)} if dist else set())
            for key in names:
                self._installed.setdefault(key, (ep.name, dist))
            if ep.name in self._info or any(s.name == ep.name for s in self.skipped):
                continue  # the same distribution seen twice on sys.path
            reason = None
            if names & disabled:
                reason = "disabled"
            elif wanted is not None:
                if not names & wanted:
                    reason = "not selected" if self.autoload else "autoload off"
            elif not self.autoload:
                reason = "autoload off"
            if reason is not None:
                self.skipped.append(SkippedPlugin(ep.name, dist, _version(dist), reason))
                continue
            try:
                module = ep.load()
            except Exception as exc:
                self._fail(ep.name, dist, exc)
                continue
            self._register_module(module, ep.name, dist)

    def _check_disabled_names(self, installed: list[str]) -> None:
        """A disabled name that matches nothing installed is most likely misspelt, and the
        plugin meant is then loaded: report it with the nearest installed name."""
        for item in self.disabled:
            if _normalize(item) not in self._installed:
                self._problem(
                    f"the disabled plugin {item!r} (SAKURA_DISABLED_PLUGINS / "
                    f"disabled_plugins) is not an installed plugin"
                    f"{self._did_you_mean(item, installed)}"
                )

    def _load_named_modules(self, installed: list[str]) -> None:
        """Import the items of the plugin list that are not entry points: module paths."""
        disabled = {_normalize(n) for n in self.disabled}
        for item in self.only or ():
            if _normalize(item) in self._installed or _normalize(item) in disabled:
                continue  # an entry point or distribution name, handled above
            try:
                module = importlib.import_module(item)
            except ImportError as exc:
                self._fail(
                    item,
                    None,
                    exc,
                    hint="not an installed plugin, distribution or importable module"
                    + self._did_you_mean(item, installed),
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
                        f"{self._did_you_mean(item, installed)}"
                    ),
                )
                continue
            self._register_module(module, item, None)

    def _check_hook_names(self) -> None:
        """Unregister plugins that implement a ``sakura_*`` hook nobody declares.  Checked
        once everything is registered, because a package may add hookspecs
        (``sakura_add_hookspecs``) that plugins loaded before it implement."""
        for name, info in list(self._info.items()):
            plugin = self.pm.get_plugin(name)
            problem = self._misnamed_hook(plugin) if plugin is not None else None
            if problem:
                self.pm.unregister(name=name)
                del self._info[name]
                self._fail(name, info.distribution, ValueError(problem))

    @staticmethod
    def _did_you_mean(item: str, installed: list[str]) -> str:
        hint = nearest(item, installed) or nearest(_normalize(item), installed)
        return f"; did you mean {hint!r}?" if hint else ""

    def _register_module(self, module: ModuleType, name: str, dist: str | None) -> None:
        try:
            self.pm.register(module, name=name)
        except Exception as exc:
            self._fail(name, dist, exc)
            return
        self._info[name] = PluginInfo(
            name=name, distribution=dist, version=_version(dist), module=module.__name__
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
        warnings.warn(message, PluginLoadWarning, stacklevel=3)

    def _problem(self, message: str) -> None:
        self.problems.append(message)
        warnings.warn(message, PluginLoadWarning, stacklevel=3)

    # --- what is installed --------------------------------------------------------------

    def provider_status(self, distribution: str) -> str:
        """Why ``distribution`` provides nothing here, as a sentence that says what to do:
        not installed (``pip install ...``), installed but disabled or not selected, or
        installed but failed to load."""
        self.load()
        key = _normalize(distribution)
        failed = [
            str(f) for f in self.failures if f.distribution and _normalize(f.distribution) == key
        ]
        if failed:
            return f"It is provided by {distribution}, which failed to load: {'; '.join(failed)}."
        for skipped in self.skipped:
            if skipped.distribution and _normalize(skipped.distribution) == key:
                return (
                    f"It is provided by {distribution}, which is installed but disabled "
                    f"({skipped.explain()})."
                )
        if key in self._installed or any(
            i.distribution and _normalize(i.distribution) == key for i in self._info.values()
        ):
            version = _version(distribution)
            return (
                f"It is provided by {distribution}, which is installed"
                f"{f' (version {version})' if version else ''} but does not provide it; "
                f"upgrade it: pip install -U {distribution}."
            )
        return (
            f"It is provided by {distribution}, which is not installed: pip install {distribution}."
        )

    # --- registries -----------------------------------------------------------------------

    def registry(self, kind: str) -> NamedRegistry[Any]:
        """Everything of ``kind`` ("service", "dispatcher", "adapter") the plugins offer."""
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        return self.collect(kind, _HOOK_FOR_KIND[kind], providers=KNOWN_PROVIDERS)

    def collect(
        self,
        kind: str,
        hook_name: str,
        *,
        providers: Mapping[str, str] | None = None,
        error: Callable[[str], Exception] = UnknownNameError,
    ) -> NamedRegistry[Any]:
        """The registry of ``kind`` filled, once, by every implementation of the plugin hook
        ``hook_name`` (``register(name, target, *, parse=None, description="")``).

        This is how a package that adds its own hookspecs gets a registry of what plugins
        register through them.  Failures of individual plugins are recorded in
        :attr:`failures`; a failed lookup's error (``error``) names them.
        """
        self.load()
        with self._lock:
            found = self._registries.get(hook_name)
            if found is not None:
                return found
            hook = getattr(self.pm.hook, hook_name, None)
            if hook is None or getattr(hook, "spec", None) is None:
                raise ValueError(
                    f"no plugin hook {hook_name!r} is declared; a package declares it with "
                    f"sakura_add_hookspecs{self._did_you_mean(hook_name, sorted(h for h in dir(self.pm.hook) if h.startswith('sakura_register_')))}"
                )
            registry: NamedRegistry[Any] = NamedRegistry(
                kind,
                providers=providers,
                error=error,
                missing=lambda _name, provider: self.provider_status(provider),
                notes=self._failure_notes,
            )

            def record(plugin: str, entry: Entry[Any]) -> None:
                info = self._info.get(plugin)
                if info is not None:
                    info.provides.setdefault(kind, []).append(entry.name)

            fill_from_hook(
                registry,
                hook,
                {name: info.distribution for name, info in self._info.items()},
                on_error=self._fail,
                on_register=record,
            )
            self._registries[hook_name] = registry
            return registry

    def _failure_notes(self) -> list[str]:
        broken = [str(f) for f in self.failures]
        return ["Plugins that failed to load: " + "; ".join(broken) + "."] if broken else []

    def resolve(self, kind: str, name: str) -> Provided[Any]:
        """The registration called ``name``; UnknownNameError listing the choices if none."""
        return self.registry(kind).get(name)

    def create(self, kind: str, spec: str | Spec | Mapping[str, Any]) -> Any:
        """Build a service/dispatcher/adapter from a spec string, Spec, or a mapping with a
        ``name`` key and keyword options (as config files write it)."""
        return self.registry(kind).create(spec)

    def export(self, kind: str, attribute: str) -> Any:
        """The class a facade exports as ``attribute`` (``MixedPrecision``)."""
        found = self.registry(kind).exports().get(attribute)
        if found is None:
            raise UnknownNameError(attribute)
        return found.load()

    def exports(self, kind: str) -> dict[str, Provided[Any]]:
        """Facade attribute name -> registration, for every class-valued registration."""
        return self.registry(kind).exports()

    def plugins(self) -> list[PluginInfo]:
        """Loaded plugins with what each provides."""
        for kind in KINDS:
            self.registry(kind)
        return list(self._info.values())


_MANAGERS: dict[tuple[Any, ...], PluginManager] = {}
_MANAGERS_LOCK = threading.Lock()


def get_plugin_manager(
    *,
    plugins: Iterable[str] | None = None,
    disabled: Iterable[str] | None = None,
    autoload: bool | None = None,
) -> PluginManager:
    """The shared plugin manager for these settings (environment fills what is not given:
    ``SAKURA_PLUGINS``, ``SAKURA_DISABLED_PLUGINS``, ``SAKURA_DISABLE_PLUGIN_AUTOLOAD``,
    parsed by :mod:`sakura.env` as the config reader parses them)."""
    if plugins is None:
        plugins = env_list("SAKURA_PLUGINS")
    if disabled is None:
        disabled = env_list("SAKURA_DISABLED_PLUGINS") or []
    if autoload is None:
        autoload = not env_flag("SAKURA_DISABLE_PLUGIN_AUTOLOAD", False)
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
