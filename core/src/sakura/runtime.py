"""SakuraRuntime: the event bus and service registry.

Hot-path design: every install/uninstall rebuilds, per event class, the tuple of bound
handlers of the services that implement it (in priority order), and per coordinated call
the tuple of implementing methods.  ``emit`` is then one dict lookup and a loop; an event
nobody handles is never built.  Nothing on the per-step path logs, formats strings,
reads the environment or talks to a device.
"""

from __future__ import annotations

import logging
import os
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import Any, TypeVar, overload

from sakura._coordinated import CoordinatedCalls, annotate, invoke
from sakura._routing import build_routes, make_dispatcher
from sakura.config import SakuraConfig, load_config
from sakura.env import env_int
from sakura.errors import InvalidServiceError, SakuraError, nearest
from sakura.events import Event, OnError
from sakura.options import check_bool, check_int, option_error
from sakura.resume import ServiceStateError, ServiceStateWarning
from sakura.service import validate_service

__all__ = ["HandlerError", "SakuraRuntime", "ServiceStateError", "ServiceStateWarning"]

logger = logging.getLogger("sakura")

E = TypeVar("E", bound=Event)
S = TypeVar("S")

_LOOP_SOURCE = "training loop"
_OWNER = "SakuraRuntime"


class HandlerError:
    """A record of an exception raised by a service's event handler."""

    __slots__ = ("event", "exception", "service")

    def __init__(self, service: str, event: Event, exception: BaseException) -> None:
        self.service = service
        self.event = event
        self.exception = exception

    def __repr__(self) -> str:
        return (
            f"HandlerError(service={self.service!r}, event={type(self.event).__name__}, "
            f"exception={self.exception!r})"
        )


class SakuraRuntime(CoordinatedCalls):
    """The event bus and service registry.

    Args:
        services: services (or spec strings such as ``"telemetry"``) to install at once.
        rank: this process's data-parallel rank; defaults to ``$RANK`` or 0.
        world_size: number of data-parallel processes; defaults to ``$WORLD_SIZE`` or 1.
        strict: re-raise exceptions from event handlers instead of isolating them
            (for tests).
        history: count delivered events per class in :attr:`event_counts`.  Costs one
            integer increment per handled event; pass False to opt out.

    Use as a context manager: entering calls every service's ``setup``; leaving (normally,
    on an exception or on KeyboardInterrupt) calls every ``drain`` and then every
    ``teardown``.
    """

    def __init__(
        self,
        services: Iterable[Any] = (),
        *,
        rank: int | None = None,
        world_size: int | None = None,
        strict: bool = False,
        history: bool = True,
    ) -> None:
        if rank is None:
            rank = env_int("RANK", 0, minimum=0)
        if world_size is None:
            world_size = env_int("WORLD_SIZE", 1, minimum=1)
        world_size = check_int("world_size", world_size, minimum=1, owner=_OWNER)
        rank = check_int("rank", rank, minimum=0, owner=_OWNER)
        if rank >= world_size:
            raise option_error(
                "rank", rank, f"an int >= 0 and < world_size={world_size}", owner=_OWNER
            )
        check_bool("strict", strict, owner=_OWNER)
        check_bool("history", history, owner=_OWNER)
        self.rank: int = rank
        self.world_size: int = world_size
        self.strict: bool = strict
        self.history: bool = history
        self._counted: Counter[str] = Counter()  # counts of dispatchers replaced by a rebuild
        self._counters: dict[str, Callable[[], int]] = {}
        self.errors: deque[HandlerError] = deque(maxlen=100)
        """The most recent handler exceptions (at most 100)."""
        self._services: list[Any] = []
        self._order: dict[str, int] = {}
        self._seq = 0
        self._running = False
        self._set_up: set[str] = set()
        self._table: dict[type[Event], tuple[Callable[[Any], Any], ...]] = {}
        self._dispatch: dict[type[Event], Callable[[Any], None]] = {}
        self._calls: dict[str, tuple[tuple[Any, Callable[..., Any]], ...]] = {}
        self._implementers: dict[str, tuple[str, ...]] = {}
        self.last_step_skipped: bool = False
        """Whether the last :meth:`optimizer_step` was owned by a service that skipped it
        (it returned :data:`~sakura.STEP_SKIPPED`); a loop leaves its LR scheduler alone then."""
        self.orphaned_state: dict[str, Any] = {}
        """Service state from the last :meth:`load_state_dict` that no installed service
        could load; :meth:`state_dict` writes it again (see :mod:`sakura.resume`)."""
        for service in services:
            self.install(service)

    # --- configuration ----------------------------------------------------------------

    @classmethod
    def from_config(
        cls,
        path: str | os.PathLike[str] | None = None,
        *,
        services: Iterable[Any] | None = None,
        plugins: Iterable[str] | None = None,
        disabled_plugins: Iterable[str] | None = None,
        strict: bool | None = None,
        history: bool | None = None,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> SakuraRuntime:
        """Build a runtime from arguments, environment and configuration files.

        Precedence, highest first: the arguments given here (an explicit ``path``
        included); the environment (``SAKURA_PLUGINS``, ``SAKURA_DISABLED_PLUGINS``,
        ``SAKURA_DISABLE_PLUGIN_AUTOLOAD``, ``SAKURA_CONFIG``); ``./sakura.toml``;
        ``[tool.sakura]`` in ``./pyproject.toml``.  See ``docs/configuration.md``: the
        configuration is read by :func:`sakura.config.load_config`, and the runtime built
        from it by :meth:`from_loaded_config`.
        """
        config = load_config(
            path,
            services=services,
            plugins=plugins,
            disabled_plugins=disabled_plugins,
            strict=strict,
            history=history,
        )
        return cls.from_loaded_config(config, rank=rank, world_size=world_size)

    @classmethod
    def from_loaded_config(
        cls, config: SakuraConfig, *, rank: int | None = None, world_size: int | None = None
    ) -> SakuraRuntime:
        """Build a runtime from an already loaded :class:`~sakura.config.SakuraConfig`: its
        plugins loaded, its services created from their specs and installed."""
        from sakura.plugins import get_plugin_manager

        manager = get_plugin_manager(
            plugins=config.plugins, disabled=config.disabled_plugins, autoload=config.autoload
        )
        rt = cls(rank=rank, world_size=world_size, strict=config.strict, history=config.history)
        for spec in config.services:
            service = manager.create("service", spec) if isinstance(spec, (str, Mapping)) else spec
            rt.install(service)
        return rt

    # --- registry ---------------------------------------------------------------------

    @property
    def services(self) -> tuple[Any, ...]:
        """Installed services, in priority order (lowest first, then install order)."""
        return tuple(self._services)

    @property
    def running(self) -> bool:
        """True between ``__enter__`` (or :meth:`start`) and ``__exit__`` (or :meth:`close`)."""
        return self._running

    def get(self, name: str) -> Any:
        """The installed service called ``name``; KeyError naming the installed ones if none."""
        for service in self._services:
            if service.name == name:
                return service
        raise KeyError(self._unknown_service_message(name))

    def __contains__(self, name: object) -> bool:
        return any(s.name == name for s in self._services)

    @overload
    def install(self, service: str) -> Any: ...
    @overload
    def install(self, service: S) -> S: ...
    def install(self, service: Any) -> Any:
        """Install ``service`` (an object, or a spec string resolved through the plugins).

        Validates the service (name, priority, hook names and signatures), rejects a
        duplicate name, and rebuilds the dispatch tables.  If the runtime is running, the
        service's ``setup`` runs now.  Returns the service.
        """
        if isinstance(service, str):
            from sakura.plugins import get_plugin_manager

            service = get_plugin_manager().create("service", service)
        if isinstance(service, type):
            raise InvalidServiceError(
                f"install() needs a service instance, got the class {service.__name__}; "
                f"did you mean rt.install({service.__name__}())?"
            )
        validate_service(service)
        if service.name in self:
            raise ValueError(
                f"a service named {service.name!r} is already installed; service names must be "
                f"unique within a runtime (installed: {self._names()})"
            )
        self._order[service.name] = self._seq
        self._seq += 1
        self._services.append(service)
        self._services.sort(key=self._sort_key)
        self._rebuild()
        if self._running:
            try:
                self._setup(service)
            except BaseException:
                self._services.remove(service)
                self._rebuild()
                raise
        return service

    def uninstall(self, service: Any) -> Any:
        """Remove a service (by name or object); drain and tear it down if running."""
        name = service if isinstance(service, str) else getattr(service, "name", None)
        target = self.get(name) if isinstance(name, str) else None
        if target is None:
            raise KeyError(self._unknown_service_message(repr(service)))
        self._services.remove(target)
        self._rebuild()
        if target.name in self._set_up:
            self._set_up.discard(target.name)
            try:
                drain = getattr(target, "drain", None)
                if drain is not None:
                    invoke(target, "drain", drain)
            finally:
                teardown = getattr(target, "teardown", None)
                if teardown is not None:
                    invoke(target, "teardown", teardown)
        return target

    def _sort_key(self, service: Any) -> tuple[float, int]:
        return (getattr(service, "priority", 100), self._order[service.name])

    def _names(self) -> str:
        return ", ".join(repr(s.name) for s in self._services) or "none"

    def _unknown_service_message(self, name: str) -> str:
        hint = nearest(str(name), [s.name for s in self._services])
        extra = f"; did you mean {hint!r}?" if hint else ""
        return f"no service named {name!r} is installed (installed: {self._names()}){extra}"

    def _rebuild(self) -> None:
        """Resolve the routing tables again (see :mod:`sakura._routing`); the counts of the
        dispatchers being replaced are kept."""
        routes = build_routes(self._services)
        self._table = routes.handlers
        for name, read in self._counters.items():
            self._counted[name] += read()
        self._counters = {}
        self._dispatch = {}
        for cls, handlers in self._table.items():
            dispatch, reader = make_dispatcher(handlers, self._handler_failed, self.history)
            self._dispatch[cls] = dispatch
            if reader is not None:
                self._counters[cls.__name__] = reader
        self._calls = routes.calls
        self._implementers = routes.implementers

    # --- events -----------------------------------------------------------------------

    def handles(self, event_type: type[Event]) -> bool:
        """True when at least one installed service handles ``event_type``.

        Loops may use it to skip computing an expensive field nobody will read.
        """
        return event_type in self._table

    @property
    def event_counts(self) -> Counter[str]:
        """How many times each event class was delivered (empty with ``history=False``)."""
        counts = Counter(self._counted)
        for name, read in self._counters.items():
            counts[name] += read()
        return +counts

    def emit(self, event: type[E] | E, /, **fields: Any) -> E | None:
        """Deliver an event to the services that handle it, in priority order.

        Pass the event class and its fields (``rt.emit(OnEpochEnd, epoch=3, metrics=m)``):
        the event is built only if a service handles it, always with this runtime's
        ``rank`` and ``world_size`` (adapters set those on the runtime).  A ready event object is accepted too (:meth:`deliver` is the
        slightly faster form for that).  Returns the delivered event, or None when nobody
        handles it.

        An exception in a handler is logged, recorded in :attr:`errors` and delivered to
        the other services as :class:`~sakura.events.OnError`; training goes on.  With
        ``strict=True`` it propagates instead.
        """
        if isinstance(event, type):
            dispatch = self._dispatch.get(event)
            if dispatch is None:
                return None
            fields["rank"] = self.rank
            fields["world_size"] = self.world_size
            built: E = event(**fields)
        else:
            if fields:
                raise TypeError("emit() takes field keywords only together with an event class")
            dispatch = self._dispatch.get(type(event))
            if dispatch is None:
                return None
            built = event
        dispatch(built)
        return built

    def deliver(self, event: Event, /) -> None:
        """Deliver a ready event object (the per-step fast path of :meth:`emit`)."""
        dispatch = self._dispatch.get(type(event))
        if dispatch is not None:
            dispatch(event)

    def _handler_failed(self, handler: Callable[[Any], Any], event: Event, exc: Exception) -> None:
        service = getattr(handler, "__self__", None)
        name = getattr(service, "name", repr(handler))
        if self.strict:
            annotate(exc, service, getattr(handler, "__name__", "handler"))
            raise exc
        logger.error(
            "sakura service %r raised in %s(%s); training continues",
            name,
            getattr(handler, "__name__", "handler"),
            type(event).__name__,
            exc_info=exc,
        )
        self.errors.append(HandlerError(name, event, exc))
        if isinstance(event, OnError):
            return  # never recurse: an OnError handler that fails is only logged
        report = OnError(
            rank=self.rank,
            world_size=self.world_size,
            step=event.step,
            epoch=event.epoch,
            exception=exc,
            source=name,
            event=event,
        )
        for other in self._table.get(OnError, ()):
            if getattr(other, "__self__", None) is service:
                continue
            try:
                other(report)
            except Exception as nested:
                logger.error("sakura OnError handler %r raised", other, exc_info=nested)

    # --- coordinated calls (the methods themselves: sakura._coordinated) ----------------

    def implements(self, call: str) -> tuple[str, ...]:
        """Names of the installed services implementing the coordinated call or lifecycle
        hook ``call`` (``"optimizer_step"``, ``"autocast"``...), in priority order.

        Adapters use it to check, before training starts, that every installed service
        can take effect in their framework.
        """
        return self._implementers.get(call, ())  # built at install: adapters ask per step

    # --- lifecycle ----------------------------------------------------------------------

    def start(self) -> SakuraRuntime:
        """Set up every service (what entering the context manager does)."""
        if self._running:
            raise SakuraError("this SakuraRuntime is already running")
        self._running = True
        try:
            for service in list(self._services):
                self._setup(service)
        except BaseException:
            self._shutdown(failing=True)
            raise
        return self

    def _setup(self, service: Any) -> None:
        setup = getattr(service, "setup", None)
        if setup is not None:
            invoke(service, "setup", setup, self)
        self._set_up.add(service.name)

    def close(self) -> None:
        """Drain then tear down every service (what leaving the context manager does)."""
        if self._running:
            self._shutdown(failing=False)

    def __enter__(self) -> SakuraRuntime:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None:
            self.emit(OnError, exception=exc, source=_LOOP_SOURCE)
        self._shutdown(failing=exc is not None)

    def _shutdown(self, *, failing: bool) -> None:
        """Drain (priority order) then tear down (reverse order) every set-up service.

        Every service gets both calls even if others fail.  Failures are logged; when the
        runtime is not already unwinding an exception, the first one is raised at the end.
        """
        problems: list[BaseException] = []
        set_up = [s for s in self._services if s.name in self._set_up]
        for service in set_up:
            drain = getattr(service, "drain", None)
            if drain is None:
                continue
            try:
                drain()
            except BaseException as exc:  # KeyboardInterrupt while draining: still tear down
                annotate(exc, service, "drain")
                problems.append(exc)
        for service in reversed(set_up):
            teardown = getattr(service, "teardown", None)
            self._set_up.discard(service.name)
            if teardown is None:
                continue
            try:
                teardown()
            except BaseException as exc:
                annotate(exc, service, "teardown")
                problems.append(exc)
        self._running = False
        for problem in problems:
            logger.error("sakura service failed while shutting down", exc_info=problem)
        if problems and not failing:
            raise problems[0]

    def __repr__(self) -> str:
        state = "running" if self._running else "stopped"
        return (
            f"<SakuraRuntime {state} rank={self.rank}/{self.world_size} services=[{self._names()}]>"
        )
