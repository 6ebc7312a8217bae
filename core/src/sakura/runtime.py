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
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar, overload

from sakura.errors import InvalidServiceError, SakuraError, nearest
from sakura.events import EVENT_TYPES, Event, OnError
from sakura.service import EVENT_HOOKS, implemented_hooks, validate_service
from sakura.step import STEP_SKIPPED

if TYPE_CHECKING:
    from sakura.config import SakuraConfig

__all__ = ["HandlerError", "SakuraRuntime"]

logger = logging.getLogger("sakura")

E = TypeVar("E", bound=Event)
S = TypeVar("S")

_NULL_CONTEXT: AbstractContextManager[None] = nullcontext()
_LOOP_SOURCE = "training loop"


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


def _annotate(exc: BaseException, service: Any, call: str) -> None:
    note = f"raised by sakura service {getattr(service, 'name', service)!r} in {call}()"
    if hasattr(exc, "add_note"):  # Python >= 3.11
        exc.add_note(note)


class SakuraRuntime:
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
            rank = _env_int("RANK", 0)
        if world_size is None:
            world_size = _env_int("WORLD_SIZE", 1)
        _check_int("world_size", world_size, minimum=1)
        _check_int("rank", rank, minimum=0)
        if rank >= world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got rank={rank}")
        if not isinstance(strict, bool):
            raise TypeError(f"strict must be a bool, got {strict!r}")
        if not isinstance(history, bool):
            raise TypeError(f"history must be a bool, got {history!r}")
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
        ``[tool.sakura]`` in ``./pyproject.toml``.  See ``docs/configuration.md``.
        """
        from sakura.config import load_config

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
        """Build a runtime from an already loaded :class:`~sakura.config.SakuraConfig`."""
        from sakura.plugins import get_plugin_manager

        manager = get_plugin_manager(
            plugins=config.plugins, disabled=config.disabled_plugins, autoload=config.autoload
        )
        rt = cls(rank=rank, world_size=world_size, strict=config.strict, history=config.history)
        for spec in config.services:
            if isinstance(spec, (str, Mapping)):
                spec = manager.create("service", spec)
            rt.install(spec)
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
                    drain()
            finally:
                teardown = getattr(target, "teardown", None)
                if teardown is not None:
                    teardown()
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
        table: dict[type[Event], list[Callable[[Any], Any]]] = {}
        calls: dict[str, list[tuple[Any, Callable[..., Any]]]] = {}
        for service in self._services:
            hooks = implemented_hooks(service)
            catch_all = hooks.get("on_event")
            wanted = getattr(service, "event_types", None)
            wanted_set = frozenset(wanted) if wanted is not None else None
            for event_cls in EVENT_TYPES:
                specific = hooks.get(event_cls.hook)
                if specific is not None:
                    table.setdefault(event_cls, []).append(specific)
                if catch_all is not None and (wanted_set is None or event_cls in wanted_set):
                    table.setdefault(event_cls, []).append(catch_all)
            for hook, method in hooks.items():
                if hook not in EVENT_HOOKS and hook != "on_event":
                    calls.setdefault(hook, []).append((service, method))
        self._table = {cls: tuple(handlers) for cls, handlers in table.items()}
        for name, read in self._counters.items():
            self._counted[name] += read()
        self._counters = {}
        self._dispatch = {}
        for cls, handlers in self._table.items():
            dispatch, reader = _make_dispatcher(handlers, self._handler_failed, self.history)
            self._dispatch[cls] = dispatch
            if reader is not None:
                self._counters[cls.__name__] = reader
        self._calls = {hook: tuple(impls) for hook, impls in calls.items()}
        self._implementers = {
            hook: tuple(service.name for service, _ in impls) for hook, impls in calls.items()
        }

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
            _annotate(exc, service, getattr(handler, "__name__", "handler"))
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

    # --- coordinated calls --------------------------------------------------------------

    def prepare(self, model: Any, optimizer: Any = None) -> tuple[Any, Any]:
        """Thread ``model`` through every ``wrap_model`` and then ``optimizer`` through every
        ``wrap_optimizer``, in priority order.  Returns ``(model, optimizer)``."""
        model = self.wrap_model(model)
        if optimizer is not None:
            optimizer = self.wrap_optimizer(optimizer)
        return model, optimizer

    def wrap_model(self, model: Any) -> Any:
        """Thread ``model`` through every service's ``wrap_model`` (what ``prepare`` does
        first); for adapters whose framework sets up the model and optimizers apart."""
        for service, wrap in self._calls.get("wrap_model", ()):
            try:
                model = wrap(model)
            except BaseException as exc:
                _annotate(exc, service, "wrap_model")
                raise
        return model

    def wrap_optimizer(self, optimizer: Any) -> Any:
        """Thread ``optimizer`` through every service's ``wrap_optimizer``."""
        for service, wrap in self._calls.get("wrap_optimizer", ()):
            try:
                optimizer = wrap(optimizer)
            except BaseException as exc:
                _annotate(exc, service, "wrap_optimizer")
                raise
        return optimizer

    def implements(self, call: str) -> tuple[str, ...]:
        """Names of the installed services implementing the coordinated call or lifecycle
        hook ``call`` (``"optimizer_step"``, ``"autocast"``...), in priority order.

        Adapters use it to check, before training starts, that every installed service
        can take effect in their framework.
        """
        return self._implementers.get(call, ())  # built at install: adapters ask per step

    def autocast(self) -> AbstractContextManager[Any]:
        """A context manager for the forward pass that enters every service's ``autocast()``
        in priority order (a shared no-op context when no service provides one)."""
        impls = self._calls.get("autocast")
        if impls is None:
            return _NULL_CONTEXT
        if len(impls) == 1:
            service, make = impls[0]
            try:
                return make()  # type: ignore[no-any-return]
            except BaseException as exc:
                _annotate(exc, service, "autocast")
                raise
        return self._stacked_autocast(impls)

    @contextmanager
    def _stacked_autocast(
        self, impls: tuple[tuple[Any, Callable[..., Any]], ...]
    ) -> Iterator[None]:
        with ExitStack() as stack:
            for service, make in impls:
                try:
                    stack.enter_context(make())
                except BaseException as exc:
                    _annotate(exc, service, "autocast")
                    raise
            yield

    def scale_loss(self, loss: Any) -> Any:
        """Thread ``loss`` through every service's ``wrap_loss`` in priority order."""
        for service, wrap in self._calls.get("wrap_loss", ()):
            try:
                loss = wrap(loss)
            except BaseException as exc:
                _annotate(exc, service, "wrap_loss")
                raise
        return loss

    def backward(self, loss: Any, **kwargs: Any) -> None:
        """``scale_loss(loss).backward(**kwargs)``.  Emits no events: the loop or adapter
        emits OnBeforeBackward / OnAfterBackward around it."""
        self.scale_loss(loss).backward(**kwargs)

    def unscale_gradients(self, optimizer: Any) -> None:
        """Ask every service to bring ``optimizer``'s gradients back to their true scale."""
        for service, unscale in self._calls.get("unscale_gradients", ()):
            try:
                unscale(optimizer)
            except BaseException as exc:
                _annotate(exc, service, "unscale_gradients")
                raise

    def clip_grad_norm_(
        self,
        optimizer: Any,
        max_norm: float,
        norm_type: float = 2.0,
        *,
        parameters: Iterable[Any] | None = None,
        error_if_nonfinite: bool = False,
    ) -> Any:
        """Clip gradients by norm after unscaling them (once) through the services.

        ``parameters`` defaults to every parameter of ``optimizer``'s param groups.
        Returns the total norm, as ``torch.nn.utils.clip_grad_norm_`` does.
        """
        import torch

        if not (isinstance(max_norm, (int, float)) and max_norm > 0):
            raise ValueError(f"max_norm must be a positive number, got {max_norm!r}")
        self.unscale_gradients(optimizer)
        if parameters is None:
            parameters = [p for group in optimizer.param_groups for p in group["params"]]
        return torch.nn.utils.clip_grad_norm_(
            parameters, max_norm, norm_type=norm_type, error_if_nonfinite=error_if_nonfinite
        )

    def optimizer_step(self, optimizer: Any) -> bool:
        """Offer the step to the services in priority order.

        Returns True when one of them owned it (performed or deliberately skipped it): the
        loop must then not call ``optimizer.step()`` itself.  :attr:`last_step_skipped`
        says whether the owner skipped it (returned :data:`~sakura.STEP_SKIPPED`).  Usage::

            if not rt.optimizer_step(optimizer):
                optimizer.step()
            if not rt.last_step_skipped:
                scheduler.step()
        """
        for service, step in self._calls.get("optimizer_step", ()):
            try:
                owned = step(optimizer)
            except BaseException as exc:
                self.last_step_skipped = False
                _annotate(exc, service, "optimizer_step")
                raise
            if owned:
                self.last_step_skipped = owned is STEP_SKIPPED
                return True
        self.last_step_skipped = False
        return False

    def state_dict(self) -> dict[str, Any]:
        """The state of every service that has one, keyed by service name."""
        state: dict[str, Any] = {}
        for service, get_state in self._calls.get("state_dict", ()):
            try:
                state[service.name] = get_state()
            except BaseException as exc:
                _annotate(exc, service, "state_dict")
                raise
        return state

    def load_state_dict(self, state: Mapping[str, Any], *, strict: bool = True) -> None:
        """Give each service its entry of ``state`` (from :meth:`state_dict`).

        With ``strict=True`` (the default) an entry for a service that is not installed,
        or an installed stateful service without an entry, is an error.
        """
        if not isinstance(state, Mapping):
            raise TypeError(
                f"state must be a mapping of service name -> state, got {type(state).__name__}"
            )
        loaders = {
            service.name: (service, load)
            for service, load in self._calls.get("load_state_dict", ())
        }
        if strict:
            unknown = sorted(set(state) - set(loaders))
            if unknown:
                raise KeyError(
                    f"checkpoint has state for service(s) {unknown} that are not installed or cannot "
                    f"load state (installed stateful services: {sorted(loaders) or 'none'}); "
                    f"install them or pass strict=False"
                )
            stateful = {service.name for service, _ in self._calls.get("state_dict", ())}
            missing = sorted((stateful & set(loaders)) - set(state))
            if missing:
                raise KeyError(
                    f"checkpoint has no state for installed service(s) {missing}; pass strict=False "
                    f"to start them fresh"
                )
        for name, service_state in state.items():
            entry = loaders.get(name)
            if entry is None:
                continue
            service, load = entry
            try:
                load(service_state)
            except BaseException as exc:
                _annotate(exc, service, "load_state_dict")
                raise

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
            try:
                setup(self)
            except BaseException as exc:
                _annotate(exc, service, "setup")
                raise
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
                _annotate(exc, service, "drain")
                problems.append(exc)
        for service in reversed(set_up):
            teardown = getattr(service, "teardown", None)
            self._set_up.discard(service.name)
            if teardown is None:
                continue
            try:
                teardown()
            except BaseException as exc:
                _annotate(exc, service, "teardown")
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


def _make_dispatcher(
    handlers: tuple[Callable[[Any], Any], ...],
    failed: Callable[[Callable[[Any], Any], Event, Exception], None],
    count: bool,
) -> tuple[Callable[[Any], None], Callable[[], int] | None]:
    """Generate ``dispatch(event)`` calling ``handlers`` in order, each under its own
    ``try``, plus a reader of how many events it delivered (when ``count``).

    Unrolled straight-line code with the handlers and the counter in closure cells is
    what makes an emit cost about what a hand-written ``for`` loop over bound methods
    costs: no per-event dict update, no loop, no attribute lookups.
    """
    names = [f"h{i}" for i in range(len(handlers))]
    lines = [f"def _factory(failed, {', '.join(names)}):"]
    if count:
        lines += ["    count = 0", "    def read():", "        return count"]
    lines.append("    def dispatch(event):")
    if count:
        lines += ["        nonlocal count", "        count += 1"]
    for name in names:
        lines += [
            "        try:",
            f"            {name}(event)",
            "        except Exception as exc:",
            f"            failed({name}, event, exc)",
        ]
    lines.append("    return dispatch, " + ("read" if count else "None"))
    namespace: dict[str, Any] = {}
    exec("\n".join(lines), namespace)  # noqa: S102 - generated from the handler count only
    dispatch, read = namespace["_factory"](failed, *handlers)
    return dispatch, read


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None


def _check_int(option: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{option} must be an int >= {minimum}, got {value!r}")
