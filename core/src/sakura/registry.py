"""Named registries: the things plugins offer by name.

The core keeps its services, dispatchers and adapters in :class:`NamedRegistry` objects,
and a package that adds hookspecs of its own (sakura-bench's workloads and frameworks)
reuses the same class instead of writing another one.  A registry maps a name to an
:class:`Entry`: a target (a class or factory, or a lazy ``"module.path:Name"`` string
imported on first use, so listing what is installed imports no framework), an optional
spec parser, a one-line description, and who provides it (plugin and distribution).

What a registry guarantees:

* names are compared with ``-`` and ``_`` alike (``hf_trainer`` finds a registration
  called ``hf-trainer``), as PyPI compares distribution names;
* a second registration of a name is a :class:`~sakura.errors.PluginConflictError`
  naming both providers;
* a failed lookup raises an error (``UnknownNameError`` unless the registry was given
  another class) naming the nearest registered name, every available name, the package
  to install when the name belongs to a known package, and any extra notes (plugins
  that failed to load).

Filled from a plugin hook (the usual way)::

    from sakura.plugins import get_plugin_manager

    workloads = get_plugin_manager().collect("workload", "sakura_register_workloads")
    workload_class = workloads.load("mnist_mlp")

Filled by hand::

    from sakura.registry import NamedRegistry

    codecs: NamedRegistry[type] = NamedRegistry("codec")
    codecs.register("zstd", "my_package.codecs:Zstd", plugin="my-package")
    codecs.get("zstd").describe()  # "'zstd' (from my-package)"
"""

from __future__ import annotations

import importlib
import inspect
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Generic, TypeVar, cast

from sakura.errors import PluginConflictError, SpecError, UnknownNameError, nearest
from sakura.specs import Spec, parse_spec

__all__ = ["Entry", "NamedRegistry", "fill_from_hook", "normalize_name"]

T = TypeVar("T")

_LAZY_TARGET = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*\Z")


def normalize_name(name: str) -> str:
    """The form names are compared in: lower case, ``-`` and ``.`` read as ``_``."""
    return re.sub(r"[-_.]+", "_", name).lower()


@dataclass(frozen=True)
class Entry(Generic[T]):
    """One named thing a plugin offers.

    ``target`` is a class or factory, or a lazy ``"module.path:Name"`` string that
    :meth:`load` imports on first use.  ``parse``, when given, builds the object from a
    :class:`~sakura.specs.Spec`; otherwise :meth:`create` calls
    ``target(*spec.args, **spec.kwargs)``.
    """

    kind: str
    name: str
    target: T | str
    parse: Callable[[Spec], Any] | None = None
    description: str = ""
    plugin: str = ""
    distribution: str | None = None

    @property
    def provider(self) -> str:
        """The distribution that provides the entry, else the plugin's name."""
        return self.distribution or self.plugin or "unknown plugin"

    @property
    def export_name(self) -> str | None:
        """The name a facade exports it under: the class's ``__name__`` (or a lazy target's
        attribute name); ``None`` for factories that are not classes."""
        if isinstance(self.target, str):
            return self.target.rpartition(":")[2]
        return self.target.__name__ if isinstance(self.target, type) else None

    def load(self) -> T:
        """The target itself, importing a lazy ``"module:Name"`` target; ImportError naming
        the entry and its provider when that import fails."""
        if not isinstance(self.target, str):
            return self.target
        module_name, _, attribute = self.target.partition(":")
        try:
            return cast(T, getattr(importlib.import_module(module_name), attribute))
        except (ImportError, AttributeError) as exc:
            raise ImportError(
                f"the {self.kind} {self.name!r} from {self.provider} could not be imported "
                f"({self.target}): {exc}"
            ) from exc

    def create(self, spec: Spec | str) -> Any:
        """Build the object a spec describes; SpecError naming the entry (and the accepted
        arguments) when the target rejects the spec's arguments."""
        parsed = parse_spec(spec) if isinstance(spec, str) else spec
        target = self.load()
        try:
            if self.parse is not None:
                return self.parse(parsed)
            return cast(Callable[..., Any], target)(*parsed.args, **parsed.kwargs)
        except SpecError:
            raise
        except (TypeError, ValueError) as exc:
            raise SpecError(
                f"{self.kind} spec {str(parsed)!r} was rejected by {self.describe()}: {exc}"
                f"{self._accepted(target)}"
            ) from exc

    def describe(self) -> str:
        """``'name' (from distribution)``."""
        return f"{self.name!r} (from {self.provider})"

    def _accepted(self, target: Any) -> str:
        if self.parse is not None:
            return ""
        try:
            signature = inspect.signature(target)
        except (TypeError, ValueError):
            return ""
        return f"; accepted arguments: {self.name}{signature}"


def _first_doc_line(target: Any) -> str:
    if isinstance(target, str):
        return ""
    doc = (inspect.getdoc(target) or "").strip()
    return doc.splitlines()[0] if doc else ""


def _default_missing(name: str, provider: str) -> str:
    return f"It is provided by {provider}, which is not installed: pip install {provider}."


class NamedRegistry(Generic[T]):
    """Entries of one kind by name.

    It reads like a mapping (``name in registry``, ``registry[name]``, ``keys()``,
    ``values()``, ``items()``, ``len``, iteration) except that :meth:`get` raises a helpful
    error for a missing name instead of returning ``None``; :meth:`find` returns ``None``.

    Parameters:
        kind: what the entries are, in messages ("service", "workload").
        providers: known names -> the distribution that provides them, so a lookup of a
            name whose package is missing says what to install.
        error: the exception class a failed :meth:`get` raises (called with the message).
        missing: builds the sentence for a known name whose provider did not register it
            (default: "It is provided by X, which is not installed: pip install X.");
            the plugin manager uses it to say "installed but disabled" instead.
        notes: extra sentences for a failed lookup, asked for at the time of the error
            (the plugin manager passes the plugins that failed to load).
    """

    def __init__(
        self,
        kind: str,
        *,
        providers: Mapping[str, str] | None = None,
        error: Callable[[str], Exception] = UnknownNameError,
        missing: Callable[[str, str], str] | None = None,
        notes: Callable[[], Sequence[str]] | None = None,
    ) -> None:
        self.kind = kind
        self.providers: Mapping[str, str] = providers or {}
        self._error = error
        self._missing = missing or _default_missing
        self._notes = notes
        self._entries: dict[str, Entry[T]] = {}
        self._by_key: dict[str, Entry[T]] = {}
        self._lock = threading.Lock()

    # --- filling ----------------------------------------------------------------------

    def register(
        self,
        name: str,
        target: T | str,
        *,
        plugin: str = "",
        distribution: str | None = None,
        parse: Callable[[Spec], Any] | None = None,
        description: str = "",
    ) -> Entry[T]:
        """Add ``name``.  ``target``: a callable, or a lazy ``"module.path:Name"`` string.
        ValueError/TypeError for an invalid name or target; PluginConflictError when the
        name (compared with ``-``/``_`` alike) is already registered."""
        who = plugin or distribution or "unknown plugin"
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f"plugin {who!r} registered a {self.kind} with invalid name {name!r}")
        if not callable(target) and not (isinstance(target, str) and _LAZY_TARGET.match(target)):
            raise TypeError(
                f"plugin {who!r}: {self.kind} {name!r} target must be callable or a "
                f"'module.path:Name' string, got {target!r}"
            )
        if parse is not None and not callable(parse):
            raise TypeError(f"plugin {who!r}: {self.kind} {name!r}: parse must be callable")
        entry: Entry[T] = Entry(
            self.kind,
            name,
            target,
            parse,
            description or _first_doc_line(target),
            plugin,
            distribution,
        )
        key = normalize_name(name)
        with self._lock:
            old = self._by_key.get(key)
            if old is not None:
                raise PluginConflictError(
                    f"two plugins provide the {self.kind} {name!r}: {old.provider} "
                    f"(plugin {old.plugin!r}) and {entry.provider} (plugin {plugin!r}); "
                    f"disable one with SAKURA_DISABLED_PLUGINS"
                )
            self._by_key[key] = entry
            self._entries[name] = entry
        return entry

    def registrar(
        self,
        plugin: str,
        distribution: str | None = None,
        *,
        on_register: Callable[[Entry[T]], None] | None = None,
    ) -> Callable[..., None]:
        """The ``register(name, target, *, parse=None, description="")`` callback that a
        ``sakura_register_*`` hook implementation of ``plugin`` receives."""

        def register(
            name: str,
            target: T | str,
            *,
            parse: Callable[[Spec], Any] | None = None,
            description: str = "",
        ) -> None:
            entry = self.register(
                name,
                target,
                plugin=plugin,
                distribution=distribution,
                parse=parse,
                description=description,
            )
            if on_register is not None:
                on_register(entry)

        return register

    # --- lookup -----------------------------------------------------------------------

    def find(self, name: str) -> Entry[T] | None:
        """The entry called ``name`` (``-``/``_`` alike), or None."""
        found = self._entries.get(name)
        if found is None and isinstance(name, str):
            found = self._by_key.get(normalize_name(name))
        return found

    def get(self, name: str) -> Entry[T]:
        """The entry called ``name``; the registry's error, naming the nearest name, the
        available ones and the package to install, when there is none."""
        found = self.find(name)
        if found is None:
            raise self._error(self.unknown_message(name))
        return found

    def load(self, name: str) -> T:
        """The target registered as ``name`` (imported if lazy)."""
        return self.get(name).load()

    def create(self, spec: str | Spec | Mapping[str, Any]) -> Any:
        """Build an object from a spec string, a Spec, or a mapping with a ``name`` key and
        keyword options (as configuration files write it)."""
        if isinstance(spec, Mapping):
            options = dict(spec)
            name = options.pop("name", None)
            if not isinstance(name, str):
                raise SpecError(
                    f"a {self.kind} given as a table needs a 'name' key (a string); got {spec!r}"
                )
            parsed = Spec(name=name, kwargs=options, text=name)
        elif isinstance(spec, Spec):
            parsed = spec
        else:
            parsed = parse_spec(spec)
        return self.get(parsed.name).create(parsed)

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._entries)

    def exports(self) -> dict[str, Entry[T]]:
        """Facade attribute name (a class's ``__name__``) -> entry."""
        return {e.export_name: e for e in self._entries.values() if e.export_name}

    def unknown_message(self, name: str) -> str:
        """Why ``name`` is not here, and what to do about it."""
        parts = [f"unknown {self.kind} {name!r}."]
        provider = self.providers.get(name)
        if provider is None and isinstance(name, str):
            by_key = {normalize_name(k): v for k, v in self.providers.items()}
            provider = by_key.get(normalize_name(name))
        if provider:
            parts.append(self._missing(name, provider))
        available = self.names()
        hint = nearest(name, available) if isinstance(name, str) else None
        if hint:
            parts.append(f"Did you mean {hint!r}?")
        parts.append(f"Available {self.kind}s: {', '.join(available) or 'none'}.")
        if self._notes is not None:
            parts.extend(self._notes())
        return " ".join(parts)

    # --- reading like a mapping -------------------------------------------------------

    def keys(self) -> list[str]:
        """The registered names, in registration order."""
        return list(self._entries)

    def values(self) -> list[Entry[T]]:
        """The entries, in registration order."""
        return list(self._entries.values())

    def items(self) -> list[tuple[str, Entry[T]]]:
        """``(name, entry)`` pairs, in registration order."""
        return list(self._entries.items())

    def __getitem__(self, name: str) -> Entry[T]:
        found = self.find(name)
        if found is None:
            raise KeyError(name)
        return found

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.find(name) is not None

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"<NamedRegistry {self.kind}: {', '.join(self.names()) or 'empty'}>"


def fill_from_hook(
    registry: NamedRegistry[T],
    hook: Any,
    distributions: Mapping[str, str | None],
    *,
    on_error: Callable[[str, str | None, Exception], None],
    on_register: Callable[[str, Entry[T]], None] | None = None,
) -> None:
    """Call every implementation of the pluggy ``hook`` (a ``sakura_register_*`` hook) in
    registration order with a ``register`` callback that fills ``registry``.

    ``distributions`` maps plugin names to their distributions.  An implementation that
    raises is reported through ``on_error(plugin, distribution, exc)`` and the others still
    run; a :class:`~sakura.errors.PluginConflictError` propagates.
    """
    impls: Iterable[Any] = reversed(hook.get_hookimpls())
    for impl in impls:
        plugin = impl.plugin_name
        dist = distributions.get(plugin)
        callback = None if on_register is None else partial(on_register, plugin)
        register = registry.registrar(plugin, dist, on_register=callback)
        try:
            impl.function(register=register)
        except PluginConflictError:
            raise
        except Exception as exc:
            on_error(plugin, dist, exc)
