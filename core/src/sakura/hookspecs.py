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
  ``unscale_gradients``, ``optimizer_step``, ``state_dict``, ``load_state_dict``) are made by
  the runtime on behalf of the training loop; an exception in one propagates, because
  skipping it would silently corrupt training.

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

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import pluggy

from sakura.events import (
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
)

if TYPE_CHECKING:
    from sakura.events import Event
    from sakura.runtime import SakuraRuntime
    from sakura.step import StepSkipped

PROJECT_NAME = "sakura"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

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

    @hookspec
    def on_setup(self, event: OnSetup) -> None:
        """Receives :class:`~sakura.events.OnSetup`: the loop is being set up for ``stage``
        ("fit", "validate", "test", "predict", "init").

        Fields beyond rank/world_size/step/epoch: ``stage``, ``model``.
        """

    @hookspec
    def on_teardown(self, event: OnTeardown) -> None:
        """Receives :class:`~sakura.events.OnTeardown`: the loop finished ``stage`` and is
        releasing what it set up.

        Fields beyond rank/world_size/step/epoch: ``stage``, ``model``.
        """

    @hookspec
    def on_fit_begin(self, event: OnFitBegin) -> None:
        """Receives :class:`~sakura.events.OnFitBegin`: ``fit``/``train`` was called: before
        the sanity check and training start.

        Fields beyond rank/world_size/step/epoch: ``model``.
        """

    @hookspec
    def on_fit_end(self, event: OnFitEnd) -> None:
        """Receives :class:`~sakura.events.OnFitEnd`: ``fit``/``train`` is about to return.

        Fields beyond rank/world_size/step/epoch: ``model``.
        """

    @hookspec
    def on_sanity_check_begin(self, event: OnSanityCheckBegin) -> None:
        """Receives :class:`~sakura.events.OnSanityCheckBegin`: a validation sanity check runs
        before training (Lightning's ``num_sanity_val_steps``).

        Fields beyond rank/world_size/step/epoch: ``model``.
        """

    @hookspec
    def on_sanity_check_end(self, event: OnSanityCheckEnd) -> None:
        """Receives :class:`~sakura.events.OnSanityCheckEnd`: the sanity check finished.

        Fields beyond rank/world_size/step/epoch: ``model``.
        """

    # --- Training events -----------------------------------------------------

    @hookspec
    def on_train_begin(self, event: OnTrainBegin) -> None:
        """Receives :class:`~sakura.events.OnTrainBegin`: training starts; the model and
        optimizer are ready.

        Fields beyond rank/world_size/step/epoch: ``model``, ``optimizer``,
        ``train_loader``.
        """

    @hookspec
    def on_train_end(self, event: OnTrainEnd) -> None:
        """Receives :class:`~sakura.events.OnTrainEnd`: training finished (normally or after
        ``max_steps``).

        Fields beyond rank/world_size/step/epoch: ``model``, ``metrics``.
        """

    @hookspec
    def on_epoch_begin(self, event: OnEpochBegin) -> None:
        """Receives :class:`~sakura.events.OnEpochBegin`: a training epoch starts.

        Fields beyond rank/world_size/step/epoch: ``model``.
        """

    @hookspec
    def on_epoch_end(self, event: OnEpochEnd) -> None:
        """Receives :class:`~sakura.events.OnEpochEnd`: a training epoch ended; ``metrics``
        holds what the loop measured in it.

        Fields beyond rank/world_size/step/epoch: ``model``, ``optimizer``, ``metrics``.
        """

    @hookspec
    def on_train_step_begin(self, event: OnTrainStepBegin) -> None:
        """Receives :class:`~sakura.events.OnTrainStepBegin`: a training batch is about to be
        processed.

        Fields beyond rank/world_size/step/epoch: ``model``, ``batch``, ``batch_idx``.
        """

    @hookspec
    def on_train_step_end(self, event: OnTrainStepEnd) -> None:
        """Receives :class:`~sakura.events.OnTrainStepEnd`: a training batch was processed
        (after the optimizer step when one happened).

        Fields beyond rank/world_size/step/epoch: ``model``, ``batch``, ``batch_idx``,
        ``loss``, ``outputs``.
        """

    @hookspec
    def on_substep_end(self, event: OnSubstepEnd) -> None:
        """Receives :class:`~sakura.events.OnSubstepEnd`: a gradient-accumulation micro-batch
        finished without an optimizer step.

        Fields beyond rank/world_size/step/epoch: ``model``, ``batch_idx``.
        """

    @hookspec
    def on_before_backward(self, event: OnBeforeBackward) -> None:
        """Receives :class:`~sakura.events.OnBeforeBackward`: ``loss.backward()`` is about to
        run; ``loss`` is the unscaled loss.

        Fields beyond rank/world_size/step/epoch: ``model``, ``loss``.
        """

    @hookspec
    def on_after_backward(self, event: OnAfterBackward) -> None:
        """Receives :class:`~sakura.events.OnAfterBackward`: gradients were accumulated (they
        may still be scaled by a loss scaler).

        Fields beyond rank/world_size/step/epoch: ``model``, ``loss``.
        """

    @hookspec
    def on_before_optimizer_step(self, event: OnBeforeOptimizerStep) -> None:
        """Receives :class:`~sakura.events.OnBeforeOptimizerStep`: the optimizer is about to
        step; gradients are final (unscaled when a scaler runs).

        Fields beyond rank/world_size/step/epoch: ``model``, ``optimizer``.
        """

    @hookspec
    def on_optimizer_step(self, event: OnOptimizerStep) -> None:
        """Receives :class:`~sakura.events.OnOptimizerStep`: the optimizer stepped (or a
        service owned and performed the step).

        Fields beyond rank/world_size/step/epoch: ``model``, ``optimizer``.
        """

    @hookspec
    def on_before_zero_grad(self, event: OnBeforeZeroGrad) -> None:
        """Receives :class:`~sakura.events.OnBeforeZeroGrad`: gradients are about to be
        cleared.

        Fields beyond rank/world_size/step/epoch: ``model``, ``optimizer``.
        """

    @hookspec
    def on_log(self, event: OnLog) -> None:
        """Receives :class:`~sakura.events.OnLog`: the loop logged ``logs`` (HF's ``on_log``;
        Lightning's logged metrics).

        Fields beyond rank/world_size/step/epoch: ``logs``.
        """

    # --- Validation, test and predict events ---------------------------------

    @hookspec
    def on_validation_begin(self, event: OnValidationBegin) -> None:
        """Receives :class:`~sakura.events.OnValidationBegin`: validation starts.

        Fields beyond rank/world_size/step/epoch: ``model``.
        """

    @hookspec
    def on_validation_end(self, event: OnValidationEnd) -> None:
        """Receives :class:`~sakura.events.OnValidationEnd`: validation finished; ``metrics``
        holds its results.

        Fields beyond rank/world_size/step/epoch: ``model``, ``metrics``.
        """

    @hookspec
    def on_validation_epoch_begin(self, event: OnValidationEpochBegin) -> None:
        """Receives :class:`~sakura.events.OnValidationEpochBegin`: the validation pass over
        the loaders starts.

        Fields beyond rank/world_size/step/epoch: ``model``.
        """

    @hookspec
    def on_validation_epoch_end(self, event: OnValidationEpochEnd) -> None:
        """Receives :class:`~sakura.events.OnValidationEpochEnd`: the validation pass over the
        loaders finished.

        Fields beyond rank/world_size/step/epoch: ``model``, ``metrics``.
        """

    @hookspec
    def on_validation_batch_begin(self, event: OnValidationBatchBegin) -> None:
        """Receives :class:`~sakura.events.OnValidationBatchBegin`: a validation batch is about
        to be evaluated.

        Fields beyond rank/world_size/step/epoch: ``model``, ``batch``, ``batch_idx``,
        ``dataloader_idx``.
        """

    @hookspec
    def on_validation_batch_end(self, event: OnValidationBatchEnd) -> None:
        """Receives :class:`~sakura.events.OnValidationBatchEnd`: a validation batch was
        evaluated.

        Fields beyond rank/world_size/step/epoch: ``model``, ``batch``, ``batch_idx``,
        ``dataloader_idx``, ``outputs``.
        """

    @hookspec
    def on_test_begin(self, event: OnTestBegin) -> None:
        """Receives :class:`~sakura.events.OnTestBegin`: testing starts.

        Fields beyond rank/world_size/step/epoch: ``model``.
        """

    @hookspec
    def on_test_end(self, event: OnTestEnd) -> None:
        """Receives :class:`~sakura.events.OnTestEnd`: testing finished; ``metrics`` holds its
        results.

        Fields beyond rank/world_size/step/epoch: ``model``, ``metrics``.
        """

    @hookspec
    def on_test_epoch_begin(self, event: OnTestEpochBegin) -> None:
        """Receives :class:`~sakura.events.OnTestEpochBegin`: the test pass over the loaders
        starts.

        Fields beyond rank/world_size/step/epoch: ``model``.
        """

    @hookspec
    def on_test_epoch_end(self, event: OnTestEpochEnd) -> None:
        """Receives :class:`~sakura.events.OnTestEpochEnd`: the test pass over the loaders
        finished.

        Fields beyond rank/world_size/step/epoch: ``model``, ``metrics``.
        """

    @hookspec
    def on_test_batch_begin(self, event: OnTestBatchBegin) -> None:
        """Receives :class:`~sakura.events.OnTestBatchBegin`: a test batch is about to be
        evaluated.

        Fields beyond rank/world_size/step/epoch: ``model``, ``batch``, ``batch_idx``,
        ``dataloader_idx``.
        """

    @hookspec
    def on_test_batch_end(self, event: OnTestBatchEnd) -> None:
        """Receives :class:`~sakura.events.OnTestBatchEnd`: a test batch was evaluated.

        Fields beyond rank/world_size/step/epoch: ``model``, ``batch``, ``batch_idx``,
        ``dataloader_idx``, ``outputs``.
        """

    @hookspec
    def on_predict_begin(self, event: OnPredictBegin) -> None:
        """Receives :class:`~sakura.events.OnPredictBegin`: prediction starts.

        Fields beyond rank/world_size/step/epoch: ``model``.
        """

    @hookspec
    def on_predict_end(self, event: OnPredictEnd) -> None:
        """Receives :class:`~sakura.events.OnPredictEnd`: prediction finished; ``metrics``
        holds any metrics computed on the predictions.

        Fields beyond rank/world_size/step/epoch: ``model``, ``metrics``.
        """

    @hookspec
    def on_predict_epoch_begin(self, event: OnPredictEpochBegin) -> None:
        """Receives :class:`~sakura.events.OnPredictEpochBegin`: the prediction pass over the
        loaders starts.

        Fields beyond rank/world_size/step/epoch: ``model``.
        """

    @hookspec
    def on_predict_epoch_end(self, event: OnPredictEpochEnd) -> None:
        """Receives :class:`~sakura.events.OnPredictEpochEnd`: the prediction pass over the
        loaders finished.

        Fields beyond rank/world_size/step/epoch: ``model``.
        """

    @hookspec
    def on_predict_batch_begin(self, event: OnPredictBatchBegin) -> None:
        """Receives :class:`~sakura.events.OnPredictBatchBegin`: a prediction batch is about to
        run.

        Fields beyond rank/world_size/step/epoch: ``model``, ``batch``, ``batch_idx``,
        ``dataloader_idx``.
        """

    @hookspec
    def on_predict_batch_end(self, event: OnPredictBatchEnd) -> None:
        """Receives :class:`~sakura.events.OnPredictBatchEnd`: a prediction batch ran.

        Fields beyond rank/world_size/step/epoch: ``model``, ``batch``, ``batch_idx``,
        ``dataloader_idx``, ``outputs``.
        """

    # --- Checkpoint, publishing and error events -----------------------------

    @hookspec
    def on_save_checkpoint(self, event: OnSaveCheckpoint) -> None:
        """Receives :class:`~sakura.events.OnSaveCheckpoint`: a checkpoint is being written.

        ``checkpoint`` is the mutable dict about to be saved when the loop exposes one
        (Lightning); services may add entries to it.  ``path`` is where it goes, when known.

        Fields beyond rank/world_size/step/epoch: ``model``, ``checkpoint``, ``path``.
        """

    @hookspec
    def on_load_checkpoint(self, event: OnLoadCheckpoint) -> None:
        """Receives :class:`~sakura.events.OnLoadCheckpoint`: a checkpoint was loaded;
        ``checkpoint`` is its dict when the loop exposes one.

        Fields beyond rank/world_size/step/epoch: ``model``, ``checkpoint``, ``path``.
        """

    @hookspec
    def on_push_begin(self, event: OnPushBegin) -> None:
        """Receives :class:`~sakura.events.OnPushBegin`: the trained model is about to be
        published (HF's ``on_push_begin``).

        Fields beyond rank/world_size/step/epoch: ``model``, ``path``.
        """

    @hookspec
    def on_error(self, event: OnError) -> None:
        """Receives :class:`~sakura.events.OnError`: something failed.

        ``source`` is the name of the service whose handler raised, or the name of the loop
        (``"lightning"``, ``"transformers"``, ``"training loop"``) for an exception in
        training itself.  ``event`` is the event being handled when a handler raised, else
        ``None``.

        Fields beyond rank/world_size/step/epoch: ``exception``, ``source``, ``event``.
        """


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
