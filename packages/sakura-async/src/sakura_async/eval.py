"""AsyncEval: run an evaluation at the end of each epoch off the training thread.

At the end of an epoch (every ``every`` epochs) the service submits ``eval_fn(epoch, ...)``
to its dispatcher and returns; the next epoch trains while the evaluation runs.
``eval_fn``'s second argument takes one of two forms:

* **payload** (the default, the reference contract): ``eval_fn(epoch, payload)`` receives
  what you passed as ``eval_payload``.  The function evaluates whatever model it holds
  (often the live one, which may already be training the next epoch)::

      def eval_fn(epoch, payload):
          with torch.no_grad():
              return {"val_loss": F.mse_loss(model(payload["x"]), payload["y"]).item()}

A sharded model (FSDP2's ``fully_shard``: DTensor parameters) in the task form is
evaluated from a **full-state snapshot**: at the epoch end every rank enters
:func:`full_model_state` (``get_model_state_dict(full_state_dict=True,
cpu_offload=True)``, one all-gather per parameter on the training thread, the same stall
as a synchronous ``state_dict`` gather), rank 0 copies it into the snapshot buffers and
``eval_fn`` loads it into an ordinary, unsharded model in the worker.  We gather rather
than evaluate sharded because a sharded evaluation would run FSDP's collectives from the
worker thread concurrently with the training's on the same process group (not safe on
gloo, and it would hold back every rank's next step), and because ``eval_fn`` then sees
the same plain ``state_dict`` as for an unsharded model.  The gathered model must fit in
rank 0's host memory.

* **task** (``pass_task=True``, or ``eval_fn`` annotated to take an :class:`EvalTask`):
  on the training thread the service first copies the model's ``state_dict`` into
  reusable host buffers (:mod:`sakura_async.snapshot`); ``eval_fn(epoch, task)`` gets
  :class:`EvalTask` whose ``task.state_dict`` is exactly that epoch's weights and
  ``task.payload`` the ``eval_payload``::

      def eval_fn(epoch: int, task: EvalTask):
          model = task.load_into(task.payload["model"])  # the snapshot, loaded into a copy
          with torch.no_grad():
              loss = F.cross_entropy(model(task.payload["x"]), task.payload["y"])
          return {"val_loss": loss.item()}

Results come back on the training thread, in epoch order, as ``OnValidationEnd`` events
(``epoch`` and ``step`` of the evaluated epoch, ``model=None`` because the live model has
moved on; the live model when delivered at that epoch's own end), and reach the framework's
metrics through the loop's ``report_metrics`` (see :mod:`sakura_async.reporting`).  At most
``max_pending`` evaluations are in flight: at an epoch end with that many unfinished, the
training thread waits for the oldest.  Training end (``OnTrainEnd``) and the runtime's
``drain`` wait for every evaluation, so the last one is never lost.  When
``OnEpochEnd.monitored`` names one of its metrics (an adapter puts there what the
framework's early stopping, best-checkpoint and plateau monitors read right after the
event), the service waits for that epoch's result before returning, so those monitors
decide as with a synchronous evaluation; that epoch's evaluation then does not overlap
the next epoch.  A failed evaluation
(an exception in ``eval_fn``, a crashed worker) is delivered as ``OnError`` and training
goes on.
"""

from __future__ import annotations

import inspect
import logging
from collections import deque
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from sakura import OnError, OnValidationEnd, Service
from sakura.errors import add_note
from sakura.options import check_choice, check_int, option_error
from sakura.runtime import SakuraRuntime
from sakura_async._model import unwrap_model
from sakura_async.checkpoint.sharded import is_sharded
from sakura_async.dispatch.base import Dispatcher, TaskFuture
from sakura_async.dispatch.resolve import DispatcherSlot
from sakura_async.reporting import Reporter, check_report_to, make_reporter
from sakura_async.snapshot import Snapshot, SnapshotPool

__all__ = [
    "AsyncEval",
    "EvalResult",
    "EvalTask",
    "declares_task",
    "full_model_state",
    "run_eval",
]

logger = logging.getLogger("sakura.async")

_OWNER = "AsyncEval"


def full_model_state(model: Any, *, every_rank: bool) -> dict[str, Any]:
    """The full (unsharded) ``state_dict`` of an FSDP2 / DTensor ``model``, gathered with
    :func:`torch.distributed.checkpoint.state_dict.get_model_state_dict` — a collective
    that every rank must enter at the same step boundary.  With ``every_rank=False`` only
    rank 0 receives it, offloaded to host memory (``cpu_offload=True``); the other ranks
    get an empty dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=not every_rank)
    return get_model_state_dict(model, options=options)


@dataclass(frozen=True)
class EvalTask:
    """What ``eval_fn(epoch, task)`` receives in the task form (``pass_task=True``)."""

    epoch: int
    """Epoch whose end the weights come from (counted from 0)."""
    step: int
    """Global optimizer step at that moment."""
    state_dict: Mapping[str, Any]
    """A copy of the model's ``state_dict`` at that moment (host tensors)."""
    payload: Any = None
    """The service's ``eval_payload``.  Containers and values are as given; with a process
    dispatcher its tensors are shared-memory copies made once at setup (see
    :meth:`~sakura_async.dispatch.base.Dispatcher.stage`)."""

    def load_into(self, model: Any, *, strict: bool = True) -> Any:
        """Load the snapshot into ``model`` (``load_state_dict``), put it in eval mode and
        return it."""
        model.load_state_dict(self.state_dict, strict=strict)
        model.eval()
        return model


@dataclass
class EvalResult:
    """One evaluation, as recorded in :attr:`AsyncEval.history`."""

    epoch: int
    step: int
    metrics: dict[str, Any] | None = None
    error: BaseException | None = None
    timings: Any = None


def _second_parameter(fn: Callable[..., Any]) -> inspect.Parameter | None:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # builtins and some C callables have no signature
        return None
    positional = [
        p
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    return positional[1] if len(positional) >= 2 else None


def declares_task(eval_fn: Callable[..., Any]) -> bool:
    """Whether ``eval_fn``'s second parameter is annotated :class:`EvalTask` (the class, or
    the string ``"EvalTask"``/``"...EvalTask"`` that ``from __future__ import annotations``
    leaves)."""
    param = _second_parameter(eval_fn)
    if param is None or param.annotation is inspect.Parameter.empty:
        return False
    annotation = param.annotation
    if annotation is EvalTask:
        return True
    return isinstance(annotation, str) and annotation.rsplit(".", 1)[-1] == "EvalTask"


def _check_eval_fn(eval_fn: Any) -> Callable[..., Any]:
    if not callable(eval_fn):
        raise TypeError(
            f"{_OWNER}: eval_fn={eval_fn!r} is not accepted; accepted: a callable "
            f"eval_fn(epoch, payload) (or eval_fn(epoch, task) with pass_task=True)"
        )
    try:
        inspect.signature(eval_fn).bind(0, None)
    except ValueError:  # no signature to check
        pass
    except TypeError as exc:
        raise TypeError(
            f"{_OWNER}: eval_fn={eval_fn!r} is not accepted: it cannot be called with two "
            f"positional arguments ({exc}); accepted: a callable eval_fn(epoch, payload)"
        ) from None
    return eval_fn  # type: ignore[no-any-return]


def _check_pass_task(pass_task: Any) -> None:
    if pass_task is not None and not isinstance(pass_task, bool):
        raise option_error("pass_task", pass_task, "True, False or None", owner=_OWNER)


def _resolve_form(
    eval_fn: Callable[..., Any] | None, pass_task: bool | None, *, snapshots: bool = False
) -> bool:
    """The form ``eval_fn`` gets: True for an :class:`EvalTask`, False for the payload.
    Left to choose (``pass_task=None``), the task form is taken when ``eval_fn`` declares
    it or when a ``state_provider`` (``snapshots``) says what to snapshot."""
    declared = eval_fn is not None and declares_task(eval_fn)
    if pass_task is None:
        return declared or snapshots
    _check_pass_task(pass_task)
    if declared and not pass_task:
        raise option_error(
            "pass_task",
            pass_task,
            "True or None: eval_fn's second parameter is annotated EvalTask, so it expects "
            "the snapshot task, not the payload",
            owner=_OWNER,
        )
    return pass_task


_TASK_ATTRIBUTES = frozenset({"state_dict", "load_into", "payload", "epoch", "step"})


def run_eval(eval_fn: Callable[[int, Any], Any], epoch: int, argument: Any) -> dict[str, Any]:
    """What runs on the dispatcher: ``eval_fn(epoch, argument)`` (``argument`` is the
    payload, or an :class:`EvalTask`), checked to return a mapping of metric names to
    values (one-element tensors become Python numbers)."""
    try:
        result = eval_fn(epoch, argument)
    except AttributeError as exc:
        if (
            not isinstance(argument, EvalTask)
            and getattr(exc, "name", None) in _TASK_ATTRIBUTES
            and getattr(exc, "obj", argument) is argument  # raised on the payload itself
        ):
            add_note(
                exc,
                f"AsyncEval: eval_fn received eval_payload (a {type(argument).__name__}) as its "
                f"second argument, the reference contract eval_fn(epoch, payload); to receive "
                f"an EvalTask (task.state_dict, task.payload) pass AsyncEval(..., "
                f"pass_task=True) or annotate the parameter as EvalTask",
            )
        raise
    except (TypeError, KeyError) as exc:
        if isinstance(argument, EvalTask) and "EvalTask" in str(exc):
            add_note(
                exc,
                "AsyncEval: eval_fn received an EvalTask (pass_task=True or an EvalTask "
                "annotation); the eval_payload is task.payload.  Without pass_task, "
                "eval_fn(epoch, payload) receives the payload itself",
            )
        raise
    if not isinstance(result, Mapping):
        raise TypeError(
            f"eval_fn must return a mapping of metric name -> value (e.g. {{'val_loss': 0.3}}), "
            f"got {type(result).__name__}"
        )
    metrics: dict[str, Any] = {}
    for key, value in result.items():
        if not isinstance(key, str):
            raise TypeError(f"eval_fn returned a non-string metric name {key!r}")
        if hasattr(value, "numel") and hasattr(value, "item") and value.numel() == 1:
            value = value.item()
        metrics[key] = value
    return metrics


@dataclass
class _Pending:
    epoch: int
    step: int
    future: TaskFuture
    snapshot: Snapshot | None
    reporter: Reporter | None = field(default=None)


class AsyncEval(Service):
    """Evaluate at each epoch end off the training thread.

    Args:
        eval_fn: ``eval_fn(epoch, payload) -> {"metric": value, ...}`` receiving
            ``eval_payload`` (the reference contract), or, in the task form,
            ``eval_fn(epoch, task)`` receiving an :class:`EvalTask` with a snapshot of that
            epoch's weights.  With a process, remote or cluster dispatcher it is sent with
            cloudpickle (functions of ``__main__`` travel by value; functions of your own
            modules must be importable by the worker, or registered with
            ``cloudpickle.register_pickle_by_value``).  May be given later with
            :meth:`configure` (services built from a spec string), but before training.
        eval_payload: the second argument of ``eval_fn`` (``task.payload`` in the task form).
        dispatcher: a dispatcher object (yours to close), a dispatcher name or spec
            (``"thread"``, ``"process"``, ``"remote:uri=..."``; the service closes it), or
            None for a :class:`~sakura_async.dispatch.ThreadDispatcher`.
        pass_task: ``True`` for the task form: the service snapshots the model at each
            evaluated epoch end and ``eval_fn`` gets an :class:`EvalTask`.  ``None`` (the
            default) picks the task form when ``eval_fn``'s second parameter is annotated
            ``EvalTask`` or a ``state_provider`` is given, else the payload form.
            ``False`` insists on the payload form.
        every: evaluate at the end of every ``every``-th epoch.
        max_pending: evaluations allowed in flight before the training thread waits.
        state_provider: ``state_provider(model) -> state_dict`` to snapshot instead of
            ``model.state_dict()`` (implies the task form) (wrappers such as DDP and ``torch.compile``
            are removed first).
        report_to: ``"auto"``: the loop's own metric reporting, the ``report_metrics``
            its adapter publishes on ``OnTrainBegin.loop`` (Lightning's loggers and
            ``callback_metrics``, the Hugging Face Trainer's ``log_history``, what a raw
            loop passes to ``DDPAdapter(report_metrics=...)``; nothing when the loop offers
            none); ``None``/``"none"``; or a callable ``report(metrics, epoch, step)``.
        ranks: ``"zero"`` to evaluate on rank 0 only (DDP replicas hold the same weights),
            ``"all"`` to evaluate on every rank.
        name: the service name (to install two of them).
    """

    name = "async_eval"
    priority = 60

    @property
    def dispatcher(self) -> Dispatcher | None:
        """The dispatcher: the object given, or (from setup until teardown) the one built
        from a name or None."""
        return self._dispatch.dispatcher

    def __init__(
        self,
        eval_fn: Callable[[int, Any], Any] | None = None,
        eval_payload: Any = None,
        dispatcher: Any = None,
        *,
        pass_task: bool | None = None,
        every: int = 1,
        max_pending: int = 1,
        state_provider: Callable[[Any], Any] | None = None,
        report_to: Any = "auto",
        ranks: str = "zero",
        name: str | None = None,
    ) -> None:
        if eval_fn is not None:
            _check_eval_fn(eval_fn)
        _check_pass_task(pass_task)
        if state_provider is not None and not callable(state_provider):
            raise TypeError(
                f"{_OWNER}: state_provider={state_provider!r} is not accepted; accepted: a "
                f"callable state_provider(model) -> state_dict"
            )
        # A wrong type or a misspelt name fails here, not only at install.
        self._dispatch = DispatcherSlot(dispatcher, owner=_OWNER)
        if name is not None and (not isinstance(name, str) or not name):
            raise option_error("name", name, "a non-empty string", owner=_OWNER)
        if name is not None:
            self.name = name
        self.eval_fn = eval_fn
        self.eval_payload = eval_payload
        self._pass_task_option = pass_task
        self.pass_task: bool = _resolve_form(
            eval_fn, pass_task, snapshots=state_provider is not None
        )
        """Whether ``eval_fn`` receives an :class:`EvalTask` (else the payload)."""
        self.every: int = check_int("every", every, minimum=1, owner=_OWNER)
        self.max_pending: int = check_int("max_pending", max_pending, minimum=1, owner=_OWNER)
        self.state_provider = state_provider
        self._check_state_provider()
        self.report_to = check_report_to(report_to)
        self.ranks: str = check_choice("ranks", ranks, ("zero", "all"), owner=_OWNER)
        self.rt: SakuraRuntime | None = None
        self._pool: SnapshotPool | None = None
        self._pending: deque[_Pending] = deque()
        self._loop_reporter: Reporter | None = None
        """The loop's ``report_metrics`` (from ``OnTrainBegin.loop``)."""
        self._payload: Any = None
        self.history: list[EvalResult] = []
        """Every delivered evaluation, in epoch order."""
        self.errors: list[EvalResult] = []
        """The evaluations that failed."""
        self._metric_names: set[str] = set()
        """The metric names the evaluations returned so far."""

    def _check_state_provider(self) -> None:
        if self.state_provider is not None and not self.pass_task:
            raise option_error(
                "state_provider",
                self.state_provider,
                "None with pass_task=False: a state_provider chooses what the task form "
                "(eval_fn(epoch, task)) snapshots",
                owner=_OWNER,
            )

    # --- configuration --------------------------------------------------------------------

    def configure(
        self,
        eval_fn: Callable[[int, Any], Any],
        eval_payload: Any = None,
        *,
        pass_task: bool | None = None,
    ) -> AsyncEval:
        """Give the evaluation function (and payload) to a service built without one, e.g.
        from the spec string ``async_eval:thread``.  ``pass_task`` as in the constructor
        (None keeps the constructor's choice, or detects the ``EvalTask`` annotation).
        Returns the service."""
        _check_eval_fn(eval_fn)
        chosen = self._pass_task_option if pass_task is None else pass_task
        form = _resolve_form(eval_fn, chosen, snapshots=self.state_provider is not None)
        self.eval_fn = eval_fn
        self.eval_payload = eval_payload
        self._pass_task_option = chosen
        self.pass_task = form
        self._check_state_provider()
        if self.rt is not None and self.dispatcher is not None and self._active():
            # Already set up: stage the new payload, and make buffers for the task form.
            self._payload = self.dispatcher.stage(eval_payload)
            if self.pass_task and self._pool is None:
                self._pool = SnapshotPool(self.dispatcher.empty, max_sets=self.max_pending)
        return self

    # --- lifecycle --------------------------------------------------------------------------

    def setup(self, runtime: SakuraRuntime) -> None:
        if self.eval_fn is None:
            raise ValueError(
                f"AsyncEval {self.name!r} has no eval_fn: a spec string cannot carry a Python "
                f"function unless it names one (async_eval:thread,fn=package.module:function); "
                f"pass AsyncEval(eval_fn=...) or call .configure(eval_fn, eval_payload) before "
                f"installing it"
            )
        self.rt = runtime
        dispatcher = self._dispatch.acquire()
        if not self._active():
            return
        dispatcher.start()  # a worker process starts while the first epoch trains
        if self.pass_task:
            self._pool = SnapshotPool(dispatcher.empty, max_sets=self.max_pending)
        # The payload goes with every evaluation: place it once where tasks get it cheaply.
        self._payload = dispatcher.stage(self.eval_payload)

    def drain(self) -> None:
        self._deliver(wait=True)

    def teardown(self) -> None:
        self._deliver(wait=True)
        if self._pool is not None:
            self._pool.clear()
        self._payload = None
        self._dispatch.release()
        self.rt = None

    # --- events ---------------------------------------------------------------------------

    def on_train_begin(self, event: Any) -> None:
        loop = getattr(event, "loop", None)
        self._loop_reporter = None if loop is None else loop.report_metrics

    def on_epoch_end(self, event: Any) -> None:
        self._deliver(wait=False)
        if (event.epoch + 1) % self.every:
            return
        if not self._active():
            if self._gathers(event.model):  # rank 0 evaluates; this rank joins the gather
                full_model_state(unwrap_model(event.model), every_rank=False)
            return
        while len(self._pending) >= self.max_pending:
            self._deliver_one(wait=True)
        self._submit(event)
        # A monitor reads this epoch's result right after this event: wait for it, so it
        # decides as with a synchronous evaluation.  Otherwise deliver what is already done
        # (all of it with the in-thread dispatcher) and let the next epoch overlap the rest.
        # Delivered now, this epoch's result was computed from the live weights: its
        # OnValidationEnd carries the model (AsyncCheckpoint "best" saves it directly).
        monitored = self._monitored(getattr(event, "monitored", None) or ())
        self._deliver(wait=monitored, live=(event.step, event.model))

    def _monitored(self, monitored: Collection[str]) -> bool:
        """Whether a monitor may read one of this service's metrics.  Until a result has
        named them, any monitored name might be one."""
        if not monitored:
            return False
        produced = self._metric_names
        return not produced or not produced.isdisjoint(monitored)

    def on_train_end(self, event: Any) -> None:
        self._deliver(wait=True)

    # --- internals --------------------------------------------------------------------------

    def _gathers(self, model: Any) -> bool:
        """Whether this evaluation snapshots a sharded (FSDP2 / DTensor) model's full
        state, a collective every rank of the training takes part in."""
        return (
            self.pass_task
            and self.state_provider is None
            and model is not None
            and is_sharded(unwrap_model(model))
        )

    def _active(self) -> bool:
        rt = self.rt
        return rt is not None and (self.ranks == "all" or rt.rank == 0)

    def _submit(self, event: Any) -> None:
        dispatcher, pool = self.dispatcher, self._pool
        if dispatcher is None or (self.pass_task and pool is None):
            raise RuntimeError(
                f"AsyncEval {self.name!r} is not set up (install it on a running runtime)"
            )
        if not self.pass_task:  # the reference contract: eval_fn(epoch, payload)
            future = dispatcher.submit(run_eval, self.eval_fn, event.epoch, self._payload)
            self._pending.append(_Pending(event.epoch, event.step, future, None, self._reporter()))
            return
        model = event.model
        target = unwrap_model(model) if model is not None else None
        if self.state_provider is not None:
            state = self.state_provider(target)
        elif self._gathers(model):
            state = full_model_state(target, every_rank=self.ranks == "all")
        elif target is not None:
            state = target.state_dict()
        else:
            raise ValueError(
                f"{type(event).__name__} carries no model; AsyncEval(pass_task=True) needs the "
                f"model to snapshot (or a state_provider)"
            )
        if pool is None:
            raise RuntimeError(f"AsyncEval {self.name!r} has no snapshot buffers")
        snapshot = pool.take(state)
        task = EvalTask(
            epoch=event.epoch, step=event.step, state_dict=snapshot.tree, payload=self._payload
        )
        try:
            future = dispatcher.submit(run_eval, self.eval_fn, event.epoch, task)
        except BaseException:
            snapshot.release()
            raise
        self._pending.append(_Pending(event.epoch, event.step, future, snapshot, self._reporter()))

    def _reporter(self) -> Reporter | None:
        return make_reporter(self.report_to, self._loop_reporter)

    def _deliver(self, *, wait: bool, live: tuple[int, Any] = (-1, None)) -> None:
        while self._pending and (wait or self._pending[0].future.done()):
            self._deliver_one(wait=True, live=live)

    def _deliver_one(self, *, wait: bool, live: tuple[int, Any] = (-1, None)) -> None:
        item = self._pending[0]
        if not wait and not item.future.done():
            return
        # Waits; a KeyboardInterrupt here leaves the item pending for drain() to deliver.
        error = item.future.exception()
        self._pending.popleft()
        if item.snapshot is not None:
            item.snapshot.release()
        rt = self.rt
        if error is not None:
            result = EvalResult(item.epoch, item.step, None, error, item.future.timings)
            self.history.append(result)
            self.errors.append(result)
            logger.error(
                "sakura AsyncEval %r: evaluation of epoch %d (step %d) failed: %r",
                self.name,
                item.epoch,
                item.step,
                error,
            )
            if rt is not None:
                rt.emit(
                    OnError, step=item.step, epoch=item.epoch, exception=error, source=self.name
                )
            return
        metrics = item.future.result()
        self._metric_names.update(metrics)
        self.history.append(EvalResult(item.epoch, item.step, metrics, None, item.future.timings))
        if item.reporter is not None:
            try:
                item.reporter(metrics, item.epoch, item.step)
            except Exception as exc:
                logger.error("sakura AsyncEval %r: reporting failed", self.name, exc_info=exc)
                if rt is not None:
                    rt.emit(
                        OnError, step=item.step, epoch=item.epoch, exception=exc, source=self.name
                    )
        if rt is not None:
            model = live[1] if item.step == live[0] else None  # None: the model moved on
            rt.emit(OnValidationEnd, step=item.step, epoch=item.epoch, model=model, metrics=metrics)

    def __repr__(self) -> str:
        return (
            f"<AsyncEval name={self.name!r} every={self.every} max_pending={self.max_pending} "
            f"pass_task={self.pass_task} "
            f"dispatcher={self._dispatch!r}>"
        )
