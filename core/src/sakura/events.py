"""The event vocabulary of the runtime.

Every event is a small frozen, slotted dataclass.  All of them carry ``rank`` and
``world_size`` (so a DDP-aware service branches on ``event.rank`` without bookkeeping of
its own) plus ``step`` (the global optimizer step) and ``epoch``; each adds the objects of
its moment: model, optimizer, batch, loss, metrics, checkpoint dict.

Each event class names the service method that receives it in its ``hook`` class
attribute (``OnTrainBegin.hook == "on_train_begin"``).  The loop the events fire in,
as pseudocode::

    OnSetup(stage="fit")
    OnFitBegin
    OnSanityCheckBegin / OnValidation* ... / OnSanityCheckEnd      (Lightning only)
    OnTrainBegin
    for epoch:
        OnEpochBegin
        for batch:
            OnTrainStepBegin
            OnBeforeBackward -> backward -> OnAfterBackward
            OnSubstepEnd                                  (gradient accumulation micro-step)
            OnBeforeOptimizerStep -> step -> OnOptimizerStep
            OnBeforeZeroGrad -> zero_grad
            OnTrainStepEnd
            OnLog                                         (when the loop logs)
        OnValidationBegin
            OnValidationEpochBegin
                OnValidationBatchBegin / OnValidationBatchEnd   (per batch)
            OnValidationEpochEnd
        OnValidationEnd(metrics)
        OnEpochEnd(metrics)
        OnSaveCheckpoint                                   (when the loop checkpoints)
    OnTrainEnd
    OnFitEnd
    OnTeardown(stage="fit")
    OnError                                              (whenever something failed)

``docs/events.md`` maps every Lightning callback hook and every
``transformers.TrainerCallback`` event onto these classes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from sakura.loop import LoopContext

__all__ = [
    "EVENT_TYPES",
    "Event",
    "OnAfterBackward",
    "OnBeforeBackward",
    "OnBeforeOptimizerStep",
    "OnBeforeZeroGrad",
    "OnEpochBegin",
    "OnEpochEnd",
    "OnError",
    "OnFitBegin",
    "OnFitEnd",
    "OnLoadCheckpoint",
    "OnLog",
    "OnOptimizerStep",
    "OnPredictBatchBegin",
    "OnPredictBatchEnd",
    "OnPredictBegin",
    "OnPredictEnd",
    "OnPredictEpochBegin",
    "OnPredictEpochEnd",
    "OnPushBegin",
    "OnSanityCheckBegin",
    "OnSanityCheckEnd",
    "OnSaveCheckpoint",
    "OnSetup",
    "OnSubstepEnd",
    "OnTeardown",
    "OnTestBatchBegin",
    "OnTestBatchEnd",
    "OnTestBegin",
    "OnTestEnd",
    "OnTestEpochBegin",
    "OnTestEpochEnd",
    "OnTrainBegin",
    "OnTrainEnd",
    "OnTrainStepBegin",
    "OnTrainStepEnd",
    "OnValidationBatchBegin",
    "OnValidationBatchEnd",
    "OnValidationBegin",
    "OnValidationEnd",
    "OnValidationEpochBegin",
    "OnValidationEpochEnd",
    "event_fields",
    "event_type",
    "specific_fields",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    """Fields every event carries."""

    hook: ClassVar[str] = ""

    rank: int = 0
    """This process's rank in the data-parallel group (0 when not distributed)."""
    world_size: int = 1
    """Number of data-parallel processes (1 when not distributed)."""
    step: int = 0
    """Global optimizer step reached so far."""
    epoch: int = 0
    """Current epoch, counted from 0."""


# --- lifecycle ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class OnSetup(Event):
    """The loop is being set up for ``stage`` ("fit", "validate", "test", "predict", "init")."""

    hook: ClassVar[str] = "on_setup"
    stage: str = "fit"
    model: Any = None


@dataclass(frozen=True, slots=True, kw_only=True)
class OnTeardown(Event):
    """The loop finished ``stage`` and is releasing what it set up."""

    hook: ClassVar[str] = "on_teardown"
    stage: str = "fit"
    model: Any = None


@dataclass(frozen=True, slots=True, kw_only=True)
class OnFitBegin(Event):
    """``fit``/``train`` was called: before the sanity check and training start."""

    hook: ClassVar[str] = "on_fit_begin"
    model: Any = None


@dataclass(frozen=True, slots=True, kw_only=True)
class OnFitEnd(Event):
    """``fit``/``train`` is about to return."""

    hook: ClassVar[str] = "on_fit_end"
    model: Any = None


@dataclass(frozen=True, slots=True, kw_only=True)
class OnSanityCheckBegin(Event):
    """A validation sanity check runs before training (Lightning's ``num_sanity_val_steps``)."""

    hook: ClassVar[str] = "on_sanity_check_begin"
    model: Any = None


@dataclass(frozen=True, slots=True, kw_only=True)
class OnSanityCheckEnd(Event):
    """The sanity check finished."""

    hook: ClassVar[str] = "on_sanity_check_end"
    model: Any = None


# --- training ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class OnTrainBegin(Event):
    """Training starts; the model and optimizer are ready.  ``trainer`` is the framework
    object driving the loop when there is one: the ``lightning.Trainer``, the
    ``transformers.Trainer`` (``SakuraTrainer``), or its ``TrainerState`` under the stock
    Trainer (a callback is not given the Trainer itself).  ``accumulation_steps``: the
    backward passes per optimizer step the loop is configured for (Lightning's
    ``accumulate_grad_batches``, the Trainer's ``gradient_accumulation_steps``), so a
    service need not ask the user to repeat it; None when the loop did not say.  ``loop``:
    the :class:`sakura.loop.LoopContext` the adapter publishes (output directory, the
    framework's checkpoint, metric reporting, the wrapped model); services read what they
    need there, never from ``trainer``, which is for user code that knows its framework."""

    hook: ClassVar[str] = "on_train_begin"
    model: Any = None
    optimizer: Any = None
    train_loader: Any = None
    trainer: Any = None
    accumulation_steps: int | None = None
    loop: LoopContext | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class OnTrainEnd(Event):
    """Training finished (normally or after ``max_steps``)."""

    hook: ClassVar[str] = "on_train_end"
    model: Any = None
    metrics: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class OnEpochBegin(Event):
    """A training epoch starts."""

    hook: ClassVar[str] = "on_epoch_begin"
    model: Any = None


@dataclass(frozen=True, slots=True, kw_only=True)
class OnEpochEnd(Event):
    """A training epoch ended; ``metrics`` holds what the loop measured in it.
    ``monitored`` names the metrics that the loop's monitors (early stopping, best-checkpoint
    selection, an LR scheduler on plateau) read right after this event: a service that
    computes one of them for this epoch (``AsyncEval``) delivers it, to the event bus and
    the framework's metrics, before its handler returns."""

    hook: ClassVar[str] = "on_epoch_end"
    model: Any = None
    optimizer: Any = None
    metrics: Mapping[str, Any] | None = None
    monitored: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True, kw_only=True)
class OnTrainStepBegin(Event):
    """A training batch is about to be processed."""

    hook: ClassVar[str] = "on_train_step_begin"
    model: Any = None
    batch: Any = None
    batch_idx: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class OnTrainStepEnd(Event):
    """A training batch was processed (after the optimizer step when one happened)."""

    hook: ClassVar[str] = "on_train_step_end"
    model: Any = None
    batch: Any = None
    batch_idx: int = 0
    loss: Any = None
    outputs: Any = None


@dataclass(frozen=True, slots=True, kw_only=True)
class OnSubstepEnd(Event):
    """A gradient-accumulation micro-batch finished without an optimizer step."""

    hook: ClassVar[str] = "on_substep_end"
    model: Any = None
    batch_idx: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class OnBeforeBackward(Event):
    """``loss.backward()`` is about to run; ``loss`` is the unscaled loss."""

    hook: ClassVar[str] = "on_before_backward"
    model: Any = None
    loss: Any = None


@dataclass(frozen=True, slots=True, kw_only=True)
class OnAfterBackward(Event):
    """Gradients were accumulated (they may still be scaled by a loss scaler)."""

    hook: ClassVar[str] = "on_after_backward"
    model: Any = None
    loss: Any = None


@dataclass(frozen=True, slots=True, kw_only=True)
class OnBeforeOptimizerStep(Event):
    """The optimizer is about to step; gradients are final (unscaled when a scaler runs)."""

    hook: ClassVar[str] = "on_before_optimizer_step"
    model: Any = None
    optimizer: Any = None


@dataclass(frozen=True, slots=True, kw_only=True)
class OnOptimizerStep(Event):
    """The optimizer stepped, or a service owned the step; ``skipped`` is True when that
    service skipped it (``rt.last_step_skipped``: inf/NaN gradients under a loss scaler)."""

    hook: ClassVar[str] = "on_optimizer_step"
    model: Any = None
    optimizer: Any = None
    skipped: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class OnBeforeZeroGrad(Event):
    """Gradients are about to be cleared."""

    hook: ClassVar[str] = "on_before_zero_grad"
    model: Any = None
    optimizer: Any = None


@dataclass(frozen=True, slots=True, kw_only=True)
class OnLog(Event):
    """The loop logged ``logs`` (HF's ``on_log``; Lightning's logged metrics)."""

    hook: ClassVar[str] = "on_log"
    logs: Mapping[str, Any] | None = None


# --- validation / test / predict -------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class OnValidationBegin(Event):
    """Validation starts."""

    hook: ClassVar[str] = "on_validation_begin"
    model: Any = None


@dataclass(frozen=True, slots=True, kw_only=True)
class OnValidationEnd(Event):
    """Validation finished; ``metrics`` holds its results."""

    hook: ClassVar[str] = "on_validation_end"
    model: Any = None
    metrics: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class OnValidationEpochBegin(Event):
    """The validation pass over the loaders starts."""

    hook: ClassVar[str] = "on_validation_epoch_begin"
    model: Any = None


@dataclass(frozen=True, slots=True, kw_only=True)
class OnValidationEpochEnd(Event):
    """The validation pass over the loaders finished."""

    hook: ClassVar[str] = "on_validation_epoch_end"
    model: Any = None
    metrics: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class OnValidationBatchBegin(Event):
    """A validation batch is about to be evaluated."""

    hook: ClassVar[str] = "on_validation_batch_begin"
    model: Any = None
    batch: Any = None
    batch_idx: int = 0
    dataloader_idx: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class OnValidationBatchEnd(Event):
    """A validation batch was evaluated."""

    hook: ClassVar[str] = "on_validation_batch_end"
    model: Any = None
    batch: Any = None
    batch_idx: int = 0
    dataloader_idx: int = 0
    outputs: Any = None


@dataclass(frozen=True, slots=True, kw_only=True)
class OnTestBegin(Event):
    """Testing starts."""

    hook: ClassVar[str] = "on_test_begin"
    model: Any = None


@dataclass(frozen=True, slots=True, kw_only=True)
class OnTestEnd(Event):
    """Testing finished; ``metrics`` holds its results."""

    hook: ClassVar[str] = "on_test_end"
    model: Any = None
    metrics: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class OnTestEpochBegin(Event):
    """The test pass over the loaders starts."""

    hook: ClassVar[str] = "on_test_epoch_begin"
    model: Any = None


@dataclass(frozen=True, slots=True, kw_only=True)
class OnTestEpochEnd(Event):
    """The test pass over the loaders finished."""

    hook: ClassVar[str] = "on_test_epoch_end"
    model: Any = None
    metrics: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class OnTestBatchBegin(Event):
    """A test batch is about to be evaluated."""

    hook: ClassVar[str] = "on_test_batch_begin"
    model: Any = None
    batch: Any = None
    batch_idx: int = 0
    dataloader_idx: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class OnTestBatchEnd(Event):
    """A test batch was evaluated."""

    hook: ClassVar[str] = "on_test_batch_end"
    model: Any = None
    batch: Any = None
    batch_idx: int = 0
    dataloader_idx: int = 0
    outputs: Any = None


@dataclass(frozen=True, slots=True, kw_only=True)
class OnPredictBegin(Event):
    """Prediction starts."""

    hook: ClassVar[str] = "on_predict_begin"
    model: Any = None


@dataclass(frozen=True, slots=True, kw_only=True)
class OnPredictEnd(Event):
    """Prediction finished; ``metrics`` holds any metrics computed on the predictions."""

    hook: ClassVar[str] = "on_predict_end"
    model: Any = None
    metrics: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class OnPredictEpochBegin(Event):
    """The prediction pass over the loaders starts."""

    hook: ClassVar[str] = "on_predict_epoch_begin"
    model: Any = None


@dataclass(frozen=True, slots=True, kw_only=True)
class OnPredictEpochEnd(Event):
    """The prediction pass over the loaders finished."""

    hook: ClassVar[str] = "on_predict_epoch_end"
    model: Any = None


@dataclass(frozen=True, slots=True, kw_only=True)
class OnPredictBatchBegin(Event):
    """A prediction batch is about to run."""

    hook: ClassVar[str] = "on_predict_batch_begin"
    model: Any = None
    batch: Any = None
    batch_idx: int = 0
    dataloader_idx: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class OnPredictBatchEnd(Event):
    """A prediction batch ran."""

    hook: ClassVar[str] = "on_predict_batch_end"
    model: Any = None
    batch: Any = None
    batch_idx: int = 0
    dataloader_idx: int = 0
    outputs: Any = None


# --- checkpoints, publishing, errors ----------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class OnSaveCheckpoint(Event):
    """A checkpoint is being written.

    ``checkpoint`` is the mutable dict about to be saved when the loop exposes one
    (Lightning); services may add entries to it.  ``path`` is where it goes, when known.
    """

    hook: ClassVar[str] = "on_save_checkpoint"
    model: Any = None
    checkpoint: dict[str, Any] | None = None
    path: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class OnLoadCheckpoint(Event):
    """A checkpoint was loaded; ``checkpoint`` is its dict when the loop exposes one."""

    hook: ClassVar[str] = "on_load_checkpoint"
    model: Any = None
    checkpoint: dict[str, Any] | None = None
    path: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class OnPushBegin(Event):
    """The trained model is about to be published (HF's ``on_push_begin``)."""

    hook: ClassVar[str] = "on_push_begin"
    model: Any = None
    path: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class OnError(Event):
    """Something failed.

    ``source`` is the name of the service whose handler raised, or the name of the loop
    (``"lightning"``, ``"transformers"``, ``"training loop"``) for an exception in training
    itself.  ``event`` is the event being handled when a handler raised, else ``None``.
    """

    hook: ClassVar[str] = "on_error"
    exception: BaseException | None = None
    source: str = ""
    event: Event | None = None


def _install_fast_init(cls: type[Event]) -> None:
    """Give ``cls`` an ``__init__`` that sets slots through their descriptors.

    A frozen dataclass's generated ``__init__`` goes through ``object.__setattr__`` once per
    field, which makes building an event about 50 % slower than a plain slotted object.
    Events are built on the per-step path whenever a service handles them, so we generate
    an equivalent keyword-only ``__init__`` (same names, same defaults) that calls each
    slot's ``__set__`` directly.  The instances stay frozen: ``__setattr__`` still raises.
    """
    names = [f.name for f in fields(cls)]
    namespace: dict[str, Any] = {}
    params = []
    body = []
    for i, f in enumerate(fields(cls)):
        if not isinstance(f.default, (int, str, frozenset, type(None))):  # pragma: no cover
            raise TypeError(f"{cls.__name__}.{f.name}: only immutable defaults are allowed")
        namespace[f"_d{i}"] = f.default
        namespace[f"_s{i}"] = getattr(cls, f.name).__set__
        params.append(f"{f.name}=_d{i}")
        body.append(f"    _s{i}(self, {f.name})")
    src = f"def __init__(self, *, {', '.join(params)}):\n" + "\n".join(body) + "\n"
    exec(src, namespace)  # noqa: S102 - generated from the dataclass fields above
    init = namespace["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__doc__ = f"Build a {cls.__name__} from keyword arguments: {', '.join(names)}."
    cls.__init__ = init  # type: ignore[method-assign]


EVENT_TYPES: tuple[type[Event], ...] = tuple(
    cls
    for cls in list(globals().values())
    if isinstance(cls, type) and issubclass(cls, Event) and cls is not Event
)
"""Every event class, in the order they are defined above."""

_ALL_EVENT_CLASSES: tuple[type[Event], ...] = (Event, *EVENT_TYPES)
for _cls in _ALL_EVENT_CLASSES:
    _install_fast_init(_cls)
del _cls

_BY_NAME: dict[str, type[Event]] = {cls.__name__: cls for cls in EVENT_TYPES}
_BY_NAME.update({cls.hook: cls for cls in EVENT_TYPES})


def event_type(name: str) -> type[Event]:
    """Return the event class called ``name`` (``"OnTrainBegin"`` or ``"on_train_begin"``)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        import difflib

        close = difflib.get_close_matches(name, list(_BY_NAME), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise KeyError(f"unknown event {name!r}{hint}") from None


def event_fields(event: Event) -> dict[str, Any]:
    """The event's fields as a dict (shallow: the objects themselves, not copies)."""
    return {f.name: getattr(event, f.name) for f in fields(event)}


def specific_fields(event_class: type[Event]) -> tuple[str, ...]:
    """The field names of ``event_class`` beyond those every event carries (``rank``,
    ``world_size``, ``step``, ``epoch``), in declaration order: the one source for the field
    lists of the hook reference and the docs."""
    common = {f.name for f in fields(Event)}
    return tuple(f.name for f in fields(event_class) if f.name not in common)
