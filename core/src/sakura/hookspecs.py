"""Every hook of sakura, in one place: the reference for service and plugin authors.

There are two kinds of hooks.

**Service hooks** are methods of a *service*: an object with a ``name`` and a numeric
``priority`` (lower runs earlier) that is installed on a :class:`~sakura.SakuraRuntime`
with ``rt.install(service)``.  A service implements any subset of them:

* the *event hooks* (``on_train_begin(event)``, ...) receive one event each; an
  exception in one is isolated (see :meth:`ServiceHooks.on_error`);
* the *lifecycle hooks* (``setup``, ``drain``, ``teardown``) run when the runtime starts
  and stops;
* the *coordinated calls* (``wrap_model``, ``wrap_optimizer``, ``autocast``, ``wrap_loss``,
  ``unscale_gradients``, ``loss_scale``, ``optimizer_step``, ``state_dict``,
  ``load_state_dict``) are made by the runtime on behalf of the training loop; an exception
  in one propagates, because skipping it would silently corrupt training.

The docstrings of the event hooks are generated from the event classes in
:mod:`sakura.events` (their docstrings and fields), the single source of what each event
carries.

The runtime does not call service hooks through pluggy: on every install/uninstall it
resolves, per event, a tuple of the bound methods that implement it, in priority order,
so an emit is a dict lookup and a loop.  The specs below are pluggy hookspecs all the same,
and the runtime checks every service against them: a public method whose name looks like
a hook (``on_*``, ``wrap_*``, ``sakura_*``) but is not one fails at install with the
nearest valid name.

**Plugin hooks** (``sakura_*``) are module-level functions of a *plugin*: a module that
a distribution registers under the ``sakura`` entry-point group.  They are called through
pluggy once, when the plugins load, and offer services, dispatchers and adapters by name.
Packages may add hookspecs of their own through :func:`sakura_add_hookspecs`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, TypeVar

import pluggy

from sakura.events import (
    Event,
    OnAfterBackward,
    OnBeforeBackward,
    OnBeforeOptimizerStep,
    OnBeforeZeroGrad,
    OnEpochBegin,
    OnEpochEnd,
    OnError,
    OnFitBegin,
    OnFitEnd,
    OnLoadCheckpoint,
    OnLog,
    OnOptimizerStep,
    OnPredictBatchBegin,
    OnPredictBatchEnd,
    OnPredictBegin,
    OnPredictEnd,
    OnPredictEpochBegin,
    OnPredictEpochEnd,
    OnPushBegin,
    OnSanityCheckBegin,
    OnSanityCheckEnd,
    OnSaveCheckpoint,
    OnSetup,
    OnSubstepEnd,
    OnTeardown,
    OnTestBatchBegin,
    OnTestBatchEnd,
    OnTestBegin,
    OnTestEnd,
    OnTestEpochBegin,
    OnTestEpochEnd,
    OnTrainBegin,
    OnTrainEnd,
    OnTrainStepBegin,
    OnTrainStepEnd,
    OnValidationBatchBegin,
    OnValidationBatchEnd,
    OnValidationBegin,
    OnValidationEnd,
    OnValidationEpochBegin,
    OnValidationEpochEnd,
    specific_fields,
)

if TYPE_CHECKING:
    from sakura.runtime import SakuraRuntime
    from sakura.step import StepSkipped

PROJECT_NAME = "sakura"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

F = TypeVar("F", bound=Callable[..., Any])


def event_hook_doc(event_class: type[Event]) -> str:
    """The docstring of ``event_class``'s hook, generated from the class itself: its
    docstring and its fields (``dataclasses.fields``), which live in :mod:`sakura.events`
    only, so the hook reference cannot drift from the events."""
    own = ", ".join(f"``{name}``" for name in specific_fields(event_class)) or "none"
    summary = inspect.cleandoc(event_class.__doc__ or "")
    return (
        f"Receives :class:`~sakura.events.{event_class.__name__}`.  {summary}\n\n"
        f"Fields beyond rank/world_size/step/epoch: {own}."
    )


def _receives(event_class: type[Event]) -> Callable[[F], F]:
    """Give an event hookspec the docstring :func:`event_hook_doc` generates."""

    def decorate(function: F) -> F:
        function.__doc__ = event_hook_doc(event_class)
        return function

    return decorate


Register = Callable[..., None]
"""The ``register`` callback handed to the ``sakura_register_*`` hooks."""


class ServiceHooks:
    """Methods a service may implement.  All are optional; ``self`` is the service."""

    # --- Lifecycle ------------------------------------------------------------------

    @hookspec
    def setup(self, runtime: SakuraRuntime) -> None:
        """Called once when the runtime starts (``with SakuraRuntime() as rt``), or at install
        when the runtime is already running.  Acquire threads, workers, files here, not in
        ``__init__``.  An exception propagates and the runtime does not start."""

    @hookspec
    def drain(self) -> None:
        """Called when the runtime stops, before any ``teardown``: finish outstanding work
        (pending evaluations, checkpoint writes).  Runs on normal exit, on exceptions and on
        KeyboardInterrupt.  An exception is reported after every service was torn down."""

    @hookspec
    def teardown(self) -> None:
        """Called last, in reverse priority order, after every service drained, and when a
        service is uninstalled.  Release what ``setup`` acquired.  Always called once
        ``setup`` ran, even when training failed."""

    # --- Coordinated calls ------------------------------------------------------------

    @hookspec
    def wrap_model(self, model: Any) -> Any:
        """Called by ``rt.prepare(model, optimizer)``, in priority order; return the model to
        use from here on (compiled, checkpointed, quantized, sharded...).  Each service
        receives what the previous one returned."""

    @hookspec
    def wrap_optimizer(self, optimizer: Any) -> Any:
        """Called by ``rt.prepare(model, optimizer)`` after every ``wrap_model``, in priority
        order; return the optimizer to use (sharded, offloaded...)."""

    @hookspec
    def autocast(self) -> AbstractContextManager[Any]:
        """Called by ``with rt.autocast():`` around the forward pass; return a context
        manager.  The managers of all services are entered in priority order."""

    @hookspec
    def wrap_loss(self, loss: Any) -> Any:
        """Called by ``rt.scale_loss(loss)`` (and ``rt.backward(loss)``) before backward, in
        priority order; return the loss to call ``backward`` on (a loss scaler multiplies
        it here).  Each service receives what the previous one returned."""

    @hookspec
    def unscale_gradients(self, optimizer: Any) -> None:
        """Called by ``rt.unscale_gradients(optimizer)`` and ``rt.clip_grad_norm_`` before the
        gradients are read: bring them back to their true scale, in place.  Must be
        idempotent within one step, so clipping never unscales twice."""

    @hookspec
    def loss_scale(self) -> float | None:
        """Called by ``rt.loss_scale()``: return the factor by which this service's
        ``wrap_loss`` multiplied the current step's loss (and therefore its gradients), or
        None when it scales nothing now.  The runtime returns the product over the services
        (None when none scales), so that a monitor reading gradients in
        ``on_after_backward``, before ``unscale_gradients``, can divide by it.  May read the
        device; it is called only when someone asks."""

    @hookspec
    def optimizer_step(self, optimizer: Any) -> bool | StepSkipped:
        """Called by ``rt.optimizer_step(optimizer)``, in priority order, until one service
        returns a truthy value: that service owned the step and the loop must not call
        ``optimizer.step()`` itself.  Return True when the step was performed,
        :data:`~sakura.STEP_SKIPPED` when it was deliberately skipped (the runtime sets
        ``rt.last_step_skipped``, and loops leave their LR scheduler alone), False to leave
        the step to the loop."""

    @hookspec
    def state_dict(self) -> Mapping[str, Any]:
        """Called by ``rt.state_dict()``; return the service state that belongs in a
        checkpoint (tensors, numbers, strings, containers of those), stored under the
        service's name."""

    @hookspec
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Called by ``rt.load_state_dict(state)`` with what ``state_dict`` returned in the
        run that saved the checkpoint."""

    # --- Catch-all --------------------------------------------------------------------

    @hookspec
    def on_event(self, event: Event) -> None:
        """Receives every event, after the service's own specific handler for it (if any).
        A service that only wants some events sets ``event_types`` to a collection of
        event classes; the runtime then calls ``on_event`` for those alone, so unwanted
        events cost nothing.  Used by Telemetry and by recording test services."""

    # --- Lifecycle events ----------------------------------------------------
    # Each event hook's docstring is generated from its event class (``event_hook_doc``):
    # what the event means and which fields it carries are written in sakura.events only.

    @hookspec
    @_receives(OnSetup)
    def on_setup(self, event: OnSetup) -> None: ...

    @hookspec
    @_receives(OnTeardown)
    def on_teardown(self, event: OnTeardown) -> None: ...

    @hookspec
    @_receives(OnFitBegin)
    def on_fit_begin(self, event: OnFitBegin) -> None: ...

    @hookspec
    @_receives(OnFitEnd)
    def on_fit_end(self, event: OnFitEnd) -> None: ...

    @hookspec
    @_receives(OnSanityCheckBegin)
    def on_sanity_check_begin(self, event: OnSanityCheckBegin) -> None: ...

    @hookspec
    @_receives(OnSanityCheckEnd)
    def on_sanity_check_end(self, event: OnSanityCheckEnd) -> None: ...

    # --- Training events -----------------------------------------------------

    @hookspec
    @_receives(OnTrainBegin)
    def on_train_begin(self, event: OnTrainBegin) -> None: ...

    @hookspec
    @_receives(OnTrainEnd)
    def on_train_end(self, event: OnTrainEnd) -> None: ...

    @hookspec
    @_receives(OnEpochBegin)
    def on_epoch_begin(self, event: OnEpochBegin) -> None: ...

    @hookspec
    @_receives(OnEpochEnd)
    def on_epoch_end(self, event: OnEpochEnd) -> None: ...

    @hookspec
    @_receives(OnTrainStepBegin)
    def on_train_step_begin(self, event: OnTrainStepBegin) -> None: ...

    @hookspec
    @_receives(OnTrainStepEnd)
    def on_train_step_end(self, event: OnTrainStepEnd) -> None: ...

    @hookspec
    @_receives(OnSubstepEnd)
    def on_substep_end(self, event: OnSubstepEnd) -> None: ...

    @hookspec
    @_receives(OnBeforeBackward)
    def on_before_backward(self, event: OnBeforeBackward) -> None: ...

    @hookspec
    @_receives(OnAfterBackward)
    def on_after_backward(self, event: OnAfterBackward) -> None: ...

    @hookspec
    @_receives(OnBeforeOptimizerStep)
    def on_before_optimizer_step(self, event: OnBeforeOptimizerStep) -> None: ...

    @hookspec
    @_receives(OnOptimizerStep)
    def on_optimizer_step(self, event: OnOptimizerStep) -> None: ...

    @hookspec
    @_receives(OnBeforeZeroGrad)
    def on_before_zero_grad(self, event: OnBeforeZeroGrad) -> None: ...

    @hookspec
    @_receives(OnLog)
    def on_log(self, event: OnLog) -> None: ...

    # --- Validation, test and predict events ---------------------------------

    @hookspec
    @_receives(OnValidationBegin)
    def on_validation_begin(self, event: OnValidationBegin) -> None: ...

    @hookspec
    @_receives(OnValidationEnd)
    def on_validation_end(self, event: OnValidationEnd) -> None: ...

    @hookspec
    @_receives(OnValidationEpochBegin)
    def on_validation_epoch_begin(self, event: OnValidationEpochBegin) -> None: ...

    @hookspec
    @_receives(OnValidationEpochEnd)
    def on_validation_epoch_end(self, event: OnValidationEpochEnd) -> None: ...

    @hookspec
    @_receives(OnValidationBatchBegin)
    def on_validation_batch_begin(self, event: OnValidationBatchBegin) -> None: ...

    @hookspec
    @_receives(OnValidationBatchEnd)
    def on_validation_batch_end(self, event: OnValidationBatchEnd) -> None: ...

    @hookspec
    @_receives(OnTestBegin)
    def on_test_begin(self, event: OnTestBegin) -> None: ...

    @hookspec
    @_receives(OnTestEnd)
    def on_test_end(self, event: OnTestEnd) -> None: ...

    @hookspec
    @_receives(OnTestEpochBegin)
    def on_test_epoch_begin(self, event: OnTestEpochBegin) -> None: ...

    @hookspec
    @_receives(OnTestEpochEnd)
    def on_test_epoch_end(self, event: OnTestEpochEnd) -> None: ...

    @hookspec
    @_receives(OnTestBatchBegin)
    def on_test_batch_begin(self, event: OnTestBatchBegin) -> None: ...

    @hookspec
    @_receives(OnTestBatchEnd)
    def on_test_batch_end(self, event: OnTestBatchEnd) -> None: ...

    @hookspec
    @_receives(OnPredictBegin)
    def on_predict_begin(self, event: OnPredictBegin) -> None: ...

    @hookspec
    @_receives(OnPredictEnd)
    def on_predict_end(self, event: OnPredictEnd) -> None: ...

    @hookspec
    @_receives(OnPredictEpochBegin)
    def on_predict_epoch_begin(self, event: OnPredictEpochBegin) -> None: ...

    @hookspec
    @_receives(OnPredictEpochEnd)
    def on_predict_epoch_end(self, event: OnPredictEpochEnd) -> None: ...

    @hookspec
    @_receives(OnPredictBatchBegin)
    def on_predict_batch_begin(self, event: OnPredictBatchBegin) -> None: ...

    @hookspec
    @_receives(OnPredictBatchEnd)
    def on_predict_batch_end(self, event: OnPredictBatchEnd) -> None: ...

    # --- Checkpoint, publishing and error events -----------------------------

    @hookspec
    @_receives(OnSaveCheckpoint)
    def on_save_checkpoint(self, event: OnSaveCheckpoint) -> None: ...

    @hookspec
    @_receives(OnLoadCheckpoint)
    def on_load_checkpoint(self, event: OnLoadCheckpoint) -> None: ...

    @hookspec
    @_receives(OnPushBegin)
    def on_push_begin(self, event: OnPushBegin) -> None: ...

    @hookspec
    @_receives(OnError)
    def on_error(self, event: OnError) -> None: ...


SERVICE_HOOKS: frozenset[str] = frozenset(
    name
    for name, value in vars(ServiceHooks).items()
    if callable(value) and hasattr(value, f"{PROJECT_NAME}_spec")
)
"""Every service hook name declared in :class:`ServiceHooks` (also
:data:`sakura.service.SERVICE_HOOKS`)."""


# --- Plugin hooks ------------------------------------------------------------------------


@hookspec(historic=True)
def sakura_add_hookspecs(pluginmanager: pluggy.PluginManager) -> None:
    """Called when the plugin is registered, before any ``sakura_register_*`` hook: add a
    package's own hookspecs with ``pluginmanager.add_hookspecs(module)`` (sakura-bench adds
    ``sakura_register_workloads`` this way)."""


@hookspec
def sakura_register_services(register: Register) -> None:
    """Offer services by name.  Call ``register(name, target, *, parse=None,
    description="")`` once per service: ``name`` is the spec-string name
    (``"mixed_precision"``); ``target`` is the service class (exported by the
    ``sakura.services`` facade under its ``__name__``) or a factory; ``parse``, when given,
    builds the service from a :class:`~sakura.specs.Spec`, otherwise
    ``target(*spec.args, **spec.kwargs)`` is called."""


@hookspec
def sakura_register_dispatchers(register: Register) -> None:
    """Offer dispatchers by name (``"thread"``, ``"process"``), exported by the
    ``sakura.dispatch`` facade.  Same ``register`` signature as services."""


@hookspec
def sakura_register_adapters(register: Register) -> None:
    """Offer framework adapters by name (``"lightning"``), exported by the
    ``sakura.adapters`` facade.  Same ``register`` signature as services."""
