"""AsyncCheckpoint: checkpoints written off the training thread, atomically.

The training thread only copies the state into reusable host buffers (the snapshot) and
submits the write; the dispatcher writes it (:func:`~sakura_async.checkpoint.store.
write_checkpoint`: temporary directory, fsync, rename, directory fsync, manifest with
checksums, retention after durability).  Failures are delivered as ``OnError`` when the
training thread next looks, and :meth:`AsyncCheckpoint.drain` (run when the runtime exits,
normally or after Ctrl+C) waits for every write and raises
:class:`~sakura_async.errors.CheckpointWriteError` if any failed, so a lost checkpoint is
never silent.

A model with DTensor parameters (FSDP2's ``fully_shard``) is written by every rank with
torch.distributed.checkpoint through :class:`~sakura_async.checkpoint.sharded.
ShardedCheckpoint` (the one implementation of that protocol: DCP's async save, a commit
vote on a side gloo group, an atomic rename by rank 0).  Each finished checkpoint, full or
sharded, is announced with :class:`~sakura_async.checkpoint.durable.OnCheckpointDurable`.

Long file: one service class whose event handlers share one piece of state — the save
schedule, the copy and the writes in flight, the best metric so far — and the order in
which they touch it is the crash-safety argument. The parts without that state live beside
it: ``schedule`` (the ``every=`` option), ``pending`` (saves in flight), ``encoding`` (file
formats), ``store`` (the directory on disk).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import tempfile
import time
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sakura import (
    OnBeforeOptimizerStep,
    OnEpochEnd,
    OnError,
    OnOptimizerStep,
    OnTrainBegin,
    OnTrainEnd,
    OnTrainStepEnd,
    OnValidationEnd,
    Service,
)
from sakura.events import Event
from sakura.loop import LoopContext
from sakura.options import (
    OptionError,
    check_bool,
    check_choice,
    check_int,
    check_number,
    option_error,
)
from sakura.runtime import SakuraRuntime
from sakura_async._model import unwrap_model
from sakura_async.checkpoint.durable import OnCheckpointDurable
from sakura_async.checkpoint.encoding import FORMATS
from sakura_async.checkpoint.pending import (
    PendingCopy,
    PendingWrite,
    SaveTiming,
    current_cuda_stream,
)
from sakura_async.checkpoint.schedule import parse_every
from sakura_async.checkpoint.sharded import ShardedCheckpoint, is_sharded, load_sharded
from sakura_async.checkpoint.store import (
    load_latest,
    remove_stale_temporaries,
    write_checkpoint,
)
from sakura_async.dispatch.base import Dispatcher
from sakura_async.dispatch.resolve import DispatcherSlot
from sakura_async.errors import CheckpointWriteError
from sakura_async.snapshot import Snapshot, SnapshotPool

__all__ = ["AsyncCheckpoint", "SaveTiming", "parse_every"]

_OWNER = "AsyncCheckpoint"

logger = logging.getLogger("sakura.async")


def _check_dir(value: Any, *, option: str = "dir") -> str:
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise option_error(option, value, "a non-empty path (str or os.PathLike)", owner=_OWNER)
    return os.path.abspath(os.fspath(value))


def _describe(exc: BaseException) -> str:
    """``Type: message`` and the notes the error collected (the option and path)."""
    notes = getattr(exc, "__notes__", None) or []
    return "; ".join([f"{type(exc).__name__}: {exc}", *map(str, notes)])


def _plain_optimizer(optimizer: Any) -> Any:
    """The torch optimizer under a framework's wrapper (Lightning's ``LightningOptimizer``,
    accelerate's ``AcceleratedOptimizer``), which DCP's state-dict helpers need."""
    import torch

    for _ in range(3):
        if optimizer is None or isinstance(optimizer, torch.optim.Optimizer):
            return optimizer
        inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        if inner is None:
            return optimizer
        optimizer = inner
    return optimizer


class AsyncCheckpoint(Service):
    """Write checkpoints on a dispatcher while training continues.

    Args:
        dir: the checkpoint root directory (created if missing).  Required, except under
            a loop that publishes its output directory (``OnTrainBegin.loop.output_dir``):
            then it defaults, at training start, to ``<output dir>/<service name>`` (a
            Lightning Trainer's ``default_root_dir``, a Hugging Face Trainer's
            ``args.output_dir``, ``DDPAdapter(output_dir=...)``).  With nothing known, the
            first save fails with an error naming ``dir``.
        every: when to save: an int (every that many epochs), ``"N epochs"``,
            ``"N steps"``, a duration (``"30s"``, ``"10 min"``, ``"1h"``), or ``"best"`` (each
            time ``metric`` improves).
        metric: the metric name read from ``OnValidationEnd``/``OnEpochEnd`` metrics;
            required for ``every="best"``, and otherwise recorded in each manifest (for
            :func:`~sakura_async.checkpoint.store.load_best`) when known.
        mode: ``"min"`` or ``"max"``: which direction of ``metric`` is better.
        keep: how many of the newest checkpoints that verify to keep (None keeps all);
            corrupt ones are not counted, so the newest intact checkpoint is never deleted.
        state_provider: ``state_provider() -> state tree`` to save instead of the default
            (``{"model": model.state_dict(), "optimizer": optimizer.state_dict()}`` plus
            the services' state under ``"sakura"``; for ``format="loop"`` and
            ``"lightning"``, the loop's own checkpoint dict).
        dispatcher: a dispatcher object (yours to close), a name/spec such as ``"thread"``
            or ``"process"`` (the service closes it), or None for a ThreadDispatcher.
        format: ``"torch"`` (``torch.load(weights_only=True)``-loadable), ``"safetensors"``,
            ``"loop"`` (the loop's own full checkpoint, ``OnTrainBegin.loop.checkpoint_state()``,
            saved with ``torch.save`` as its framework would: any adapter that offers it),
            or ``"lightning"`` (the same, checked to be Lightning's layout: a file
            ``lightning.Trainer.fit(ckpt_path=...)`` resumes from; needs the
            LightningAdapter).
        max_pending: writes allowed in flight; a save beyond that waits for the oldest.
        compress: a zstd level (1-22) to compress the state file, or None.
        overlap: copy the weights and optimizer state (which only the optimizer step
            changes) on a background thread while the next step's forward and backward run;
            the service waits for the copy at ``OnBeforeOptimizerStep``.  Other tensors
            (buffers such as BatchNorm statistics, which a forward pass changes) are still
            copied at once.  Needs a loop that emits ``OnBeforeOptimizerStep`` (the
            Lightning and Hugging Face adapters and ``DDPAdapter.step`` do); if an optimizer
            step arrives without it, that checkpoint is discarded with an ``OnError`` and
            overlapping is switched off.
        ranks: ``"zero"`` (only rank 0 writes, the DDP norm) or ``"all"``.  A sharded
            model is written by every rank whatever this says.
        timeout_s: a sharded model only: how long a rank waits for the others in a write's
            collectives before the write is reported as failed (a rank that died or never
            came to the save), ``> 0``.
        name: the service name.

    A model with DTensor parameters (FSDP2) is saved with torch.distributed.checkpoint by
    every rank into ``<dir>/step-<N>`` (see :class:`~sakura_async.checkpoint.sharded.
    ShardedCheckpoint`): ``every`` in epochs or steps, ``keep``, ``format="torch"``, no
    ``state_provider`` or ``compress``, one write in flight; ``overlap=True`` runs the host
    copy on DCP's staging thread and waits for it at ``OnBeforeOptimizerStep``;
    :meth:`resume` loads it at any world size.
    """

    name = "async_checkpoint"
    priority = 70  # after AsyncEval, whose results may make a checkpoint the best

    @property
    def dispatcher(self) -> Dispatcher | None:
        """The dispatcher: the object given, or (from setup until teardown) the one built
        from a name or None."""
        return self._dispatch.dispatcher

    def __init__(
        self,
        dir: str | os.PathLike[str] | None = None,
        every: Any = 1,
        metric: str | None = None,
        mode: str = "min",
        keep: int | None = 3,
        state_provider: Callable[[], Any] | None = None,
        dispatcher: Any = None,
        format: str = "torch",
        *,
        max_pending: int = 1,
        compress: int | None = None,
        overlap: bool = False,
        ranks: str = "zero",
        timeout_s: float = 300.0,
        name: str | None = None,
    ) -> None:
        self.dir: str | None = None if dir is None else _check_dir(dir)
        """The checkpoint root (absolute), or None until the loop gives its output dir."""
        self._loop: LoopContext | None = None
        """What the loop offers (``OnTrainBegin.loop``): its output dir and checkpoint."""
        self._dir_error: BaseException | None = None
        self.unit, self.amount = parse_every(every)
        self.every = every
        if metric is not None and (not isinstance(metric, str) or not metric):
            raise option_error("metric", metric, "a metric name (str) or None", owner=_OWNER)
        if self.unit == "best" and metric is None:
            raise option_error(
                "metric", metric, "the name of the metric to watch with every='best'", owner=_OWNER
            )
        self.metric = metric
        self.mode: str = check_choice("mode", mode, ("min", "max"), owner=_OWNER)
        self.keep: int | None = check_int("keep", keep, minimum=1, allow_none=True, owner=_OWNER)
        if state_provider is not None and not callable(state_provider):
            raise TypeError(
                f"{_OWNER}: state_provider={state_provider!r} is not accepted; accepted: a "
                f"callable with no arguments returning the state to save"
            )
        self.state_provider = state_provider
        self.format: str = check_choice("format", format, FORMATS, owner=_OWNER)
        self.max_pending: int = check_int("max_pending", max_pending, minimum=1, owner=_OWNER)
        if compress is not None and (
            isinstance(compress, bool) or not isinstance(compress, int) or not 1 <= compress <= 22
        ):
            raise option_error(
                "compress", compress, "a zstd level from 1 to 22, or None", owner=_OWNER
            )
        self.compress: int | None = compress
        if compress and format == "lightning":
            raise option_error(
                "compress",
                compress,
                "None with format='lightning' (Lightning loads the file itself)",
                owner=_OWNER,
            )
        self.overlap: bool = check_bool("overlap", overlap, owner=_OWNER)
        self.ranks: str = check_choice("ranks", ranks, ("zero", "all"), owner=_OWNER)
        self.timeout_s: float = check_number(
            "timeout_s", timeout_s, minimum=0, min_inclusive=False, owner=_OWNER
        )
        self._sharded = False
        """The model has DTensor parameters: every rank writes through ``_writer``."""
        self._writer: ShardedCheckpoint | None = None
        self._sharded_error: BaseException | None = None
        self._staging_timing: SaveTiming | None = None
        """overlap=True on a sharded model: the save whose background copy is running."""
        # A wrong type or a misspelt name fails here, not only at install.
        self._dispatch = DispatcherSlot(dispatcher, owner=_OWNER)
        if name is not None and (not isinstance(name, str) or not name):
            raise option_error("name", name, "a non-empty string", owner=_OWNER)
        if name is not None:
            self.name = name
        self.rt: SakuraRuntime | None = None
        self._pool: SnapshotPool | None = None
        self._pending: deque[PendingWrite] = deque()
        self._held: OrderedDict[int, tuple[int, Snapshot]] = OrderedDict()
        self._hold = 0
        self._model: Any = None
        self._optimizer: Any = None
        self._best: float | None = None
        self._last_metric: float | None = None
        self._metric_steps: set[int] = set()
        self._last_step = 0
        self._last_time = time.monotonic()
        self._unraised: list[BaseException] = []
        self._atexit: Callable[[], None] | None = None
        self.saved: list[str] = []
        """Directories of the checkpoints written so far, in completion order."""
        self.errors: list[BaseException] = []
        """Every failed write."""
        self.timings: list[SaveTiming] = []
        """How long each save blocked the training thread, by cause."""
        self._copier: ThreadPoolExecutor | None = None
        self._copying: PendingCopy | None = None
        # Subscribe only to the events this configuration needs: no per-step event is built
        # for a service that checkpoints per epoch.
        handlers: dict[type[Event], Callable[[Any], None]] = {
            OnTrainBegin: self._on_train_begin,
            OnEpochEnd: self._on_epoch_end,
            OnValidationEnd: self._on_validation_end,
            OnTrainEnd: self._on_train_end,
        }
        if self.unit in ("steps", "seconds"):
            handlers[OnTrainStepEnd] = self._on_train_step_end
        if overlap:
            handlers[OnBeforeOptimizerStep] = self._on_before_optimizer_step
            handlers[OnOptimizerStep] = self._on_optimizer_step
        self._handlers = handlers
        self.event_types = frozenset(handlers)

    # --- lifecycle --------------------------------------------------------------------------

    def setup(self, runtime: SakuraRuntime) -> None:
        self.rt = runtime
        if not self._active():
            return
        dispatcher = self._dispatch.acquire()
        dispatcher.start()
        if self.unit == "best":
            from sakura_async.eval import AsyncEval

            evals = [s for s in runtime.services if isinstance(s, AsyncEval)]
            self._hold = max((s.max_pending for s in evals), default=0) + (1 if evals else 0)
        self._pool = SnapshotPool(dispatcher.empty, max_sets=self.max_pending + self._hold + 2)
        if self.overlap:
            self._copier = ThreadPoolExecutor(1, thread_name_prefix="sakura-snapshot")
        if self.dir is not None:
            self._prepare_dir(self.dir)
        ref = weakref.ref(self)

        def at_exit() -> None:  # the runtime was never closed: still finish and report
            service = ref()
            if service is not None and (service._pending or service._copying is not None):
                service._barrier()
                service._collect(wait=True)
                for exc in service._unraised:
                    logger.error("sakura AsyncCheckpoint: a checkpoint write failed: %r", exc)

        self._atexit = at_exit
        atexit.register(at_exit)

    def drain(self) -> None:
        self._barrier()
        self._collect(wait=True)
        if self._unraised:
            failures, self._unraised = self._unraised, []
            raise CheckpointWriteError(
                f"{len(failures)} checkpoint write(s) to {self.dir} failed "
                f"({len(self.saved)} succeeded); first error: {_describe(failures[0])}"
            ) from failures[0]

    def teardown(self) -> None:
        self._barrier()
        self._collect(wait=True)
        if self._writer is not None:
            self._writer.close()  # nothing in flight any more: stops the committer thread
            self._writer = None
        if self._copier is not None:
            self._copier.shutdown(wait=True)
            self._copier = None
        for _, snapshot in self._held.values():
            snapshot.release()
        self._held.clear()
        if self._pool is not None:
            self._pool.clear()
        if self._atexit is not None:
            atexit.unregister(self._atexit)
            self._atexit = None
        self._dispatch.release()
        self.rt = None

    # --- events -----------------------------------------------------------------------------

    def on_event(self, event: Any) -> None:
        self._handlers[type(event)](event)

    # --- where checkpoints go ---------------------------------------------------------------

    def _use(self, directory: str) -> None:
        self.dir = directory
        if self.rt is not None and self._on_rank():
            self._prepare_dir(directory)

    def _prepare_dir(self, directory: str) -> None:
        """Create ``directory``, prove it writable, remove what interrupted writers left."""
        try:
            os.makedirs(directory, exist_ok=True)
            fd, probe = tempfile.mkstemp(prefix=".sakura-probe-", dir=directory)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise option_error(
                "dir",
                directory,
                f"a writable directory (it failed with {type(exc).__name__}: {exc})",
                owner=_OWNER,
            ) from exc
        for stale in remove_stale_temporaries(directory):
            logger.info("sakura AsyncCheckpoint: removed %s left by an interrupted write", stale)

    def _resolve_dir(self, event: Any) -> None:
        """At training start: the loop's output directory when ``dir`` was not given."""
        if self.dir is not None:
            return
        loop = self._loop
        out = None if loop is None else loop.output_dir
        if not out:
            return
        try:
            self._use(os.path.join(os.path.abspath(out), self.name))
        except OptionError as exc:  # an unwritable output directory: no save can succeed
            self.dir = None
            self._dir_error = exc
            self._fail(exc, event.step, event.epoch)

    def _require_dir(self, step: int, epoch: int) -> bool:
        """Whether a save can go ahead; without a ``dir`` the first save fails loudly."""
        if self.dir is not None:
            return True
        if self._dir_error is None:
            self._dir_error = option_error(
                "dir",
                None,
                "a directory: pass AsyncCheckpoint(dir=...); it defaults to the run's output "
                "directory only under a loop whose adapter publishes one "
                "(OnTrainBegin.loop.output_dir: LightningAdapter, HFAdapter, "
                "DDPAdapter(output_dir=...))",
                owner=_OWNER,
            )
            self._fail(self._dir_error, step, epoch)
        return False

    # --- events -----------------------------------------------------------------------------

    def _on_train_begin(self, event: Any) -> None:
        self._remember(event)
        loop = getattr(event, "loop", None)
        if loop is not None:
            self._loop = loop
        if self._active():
            self._resolve_dir(event)
        if self._sharded and self._check_sharded(event.step, event.epoch) and self.dir:
            # Every rank is here: the writer's process group is created at the same point.
            self._sharded_writer(event.step, event.epoch)
        self._last_step = event.step
        self._last_time = time.monotonic()

    def _on_before_optimizer_step(self, event: Any) -> None:
        if self._copying is not None or self._staging_timing is not None:
            self._barrier()

    def _on_optimizer_step(self, event: Any) -> None:
        if self._staging_timing is not None and self._writer is not None:
            step = self._staging_timing.step
            self._staging_timing = None
            self.overlap = False
            logger.error(
                "sakura AsyncCheckpoint %r: the sharded checkpoint of step %d is discarded "
                "(overlap=True needs OnBeforeOptimizerStep); overlapping is now off",
                self.name,
                step,
            )
            self._writer.discard_staging(
                f"overlap=True needs the loop to emit OnBeforeOptimizerStep before each "
                f"optimizer step; the checkpoint of step {step} was discarded (it could mix "
                f"two steps) and overlapping is now off"
            )
        copy = self._copying
        if copy is None:
            return
        # The weights changed while the copy may still have been reading them.
        self._copying = None
        self.overlap = False
        with contextlib.suppress(BaseException):
            copy.future.result()
        copy.snapshot.release()
        self._fail(
            RuntimeError(
                f"AsyncCheckpoint {self.name!r}: overlap=True needs the loop to emit "
                f"OnBeforeOptimizerStep before each optimizer step; the checkpoint of step "
                f"{copy.step} was discarded (it could mix two steps) and overlapping is now off"
            ),
            copy.step,
            copy.epoch,
        )

    def _on_train_step_end(self, event: Any) -> None:
        # A sharded write is collected only where every rank is (below, and in _save): a
        # poll here would see it finished at different steps on different ranks.
        if self._pending and not self._sharded and self._pending[0].future.done():
            self._collect(wait=False)
        unit = self.unit
        if unit == "steps":
            if event.step - self._last_step >= self.amount:
                self._save(event)
        elif unit == "seconds" and time.monotonic() - self._last_time >= self.amount:
            self._save(event)

    def _on_epoch_end(self, event: Any) -> None:
        self._remember(event)
        self._collect(wait=self._sharded)
        if not self._active():
            return
        if event.metrics and self.metric is not None and self.metric in event.metrics:
            self._metric(event, event.metrics[self.metric])
        if self.unit == "epochs" and (event.epoch + 1) % self.amount == 0:
            self._save(event)
        elif self._hold and not self._sharded and event.step not in self._held:
            self._hold_snapshot(event)

    def _on_validation_end(self, event: Any) -> None:
        if self.metric is None or not event.metrics or self.metric not in event.metrics:
            return
        if self._active():
            self._metric(event, event.metrics[self.metric])

    def _on_train_end(self, event: Any) -> None:
        self._barrier()
        self._collect(wait=True)

    # --- internals --------------------------------------------------------------------------

    def _active(self) -> bool:
        return self._sharded or self._on_rank()

    def _on_rank(self) -> bool:
        rt = self.rt
        return rt is not None and (self.ranks == "all" or rt.rank == 0)

    def _remember(self, event: Any) -> None:
        model = getattr(event, "model", None)
        if model is not None:
            if model is not self._model:
                self._sharded = is_sharded(unwrap_model(model))
            self._model = model
        optimizer = getattr(event, "optimizer", None)
        if optimizer is not None:
            self._optimizer = optimizer

    def _metric(self, event: Any, raw: Any) -> None:
        try:
            value = float(raw.item() if hasattr(raw, "item") else raw)
        except (TypeError, ValueError):
            return
        self._last_metric = value
        if self.unit != "best" or event.step in self._metric_steps:
            return
        if math.isnan(value):  # NaN compares false with everything: never the best
            logger.warning(
                "sakura AsyncCheckpoint %r: %s is NaN at step %d; not a candidate for the best",
                self.name,
                self.metric,
                event.step,
            )
            return
        self._metric_steps.add(event.step)
        if len(self._metric_steps) > 64:
            self._metric_steps = set(sorted(self._metric_steps)[-16:])
        best = self._best
        better = best is None or (value < best if self.mode == "min" else value > best)
        if not better:
            return
        if not self._require_dir(event.step, event.epoch):
            return
        if event.model is not None:  # the live weights are the evaluated ones
            self._best = value
            self._save(event, metric=value)
            return
        held = self._held.pop(event.step, None)
        if held is None:
            exc = RuntimeError(
                f"AsyncCheckpoint {self.name!r}: {self.metric}={value} at step {event.step} is "
                f"the best so far, but the weights of that step are no longer held (the "
                f"result came from an evaluation of earlier weights); install AsyncEval before "
                f"training starts so AsyncCheckpoint holds a snapshot per epoch"
            )
            self._fail(exc, event.step, event.epoch)
            return
        self._best = value
        epoch, snapshot = held
        self._save(event, metric=value, snapshot=snapshot, epoch=epoch)

    def _hold_snapshot(self, event: Any) -> None:
        if self.dir is None:  # nothing can be written: the first save reports it
            return
        while len(self._held) >= self._hold:
            _, (_, old) = self._held.popitem(last=False)
            old.release()
        self._held[event.step] = (event.epoch, self._ready_pool().take(self._state()))

    @property
    def blocked_s(self) -> list[float]:
        """Seconds each save blocked the training thread: the wait for a free write slot,
        the snapshot copy and (``overlap=True``) the wait for the background copy."""
        return [t.blocked_s for t in self.timings]

    def _ready_pool(self) -> SnapshotPool:
        if self._pool is None:
            raise RuntimeError(
                f"AsyncCheckpoint {self.name!r} is not set up (install it on a running runtime)"
            )
        return self._pool

    def _loop_checkpoint(self) -> Any:
        """The loop's own full checkpoint (``format="loop"`` or ``"lightning"``), built on
        the training thread (it reads live state) by the adapter's ``checkpoint_state``."""
        loop = self._loop
        make = None if loop is None else loop.checkpoint_state
        wanted = "Lightning's (use LightningAdapter)" if self.format == "lightning" else "its own"
        if loop is None or make is None:
            where = (
                "no adapter published a loop context (OnTrainBegin.loop)"
                if loop is None
                else f"the {loop.framework!r} loop offers none (its checkpoint_state)"
            )
            raise ValueError(
                f"format={self.format!r} saves the loop's own checkpoint, but {where}: run "
                f"under an adapter that offers {wanted}, pass a state_provider, or use "
                f"format='torch'"
            )
        if self.format == "lightning" and loop.checkpoint_format != "lightning":
            raise ValueError(
                f"format='lightning' needs a Lightning checkpoint, but the "
                f"{loop.framework!r} loop's checkpoint is in the "
                f"{loop.checkpoint_format!r} layout: use format='loop' for it, or run "
                f"under LightningAdapter"
            )
        return make()

    def _state(self) -> Any:
        if self.state_provider is not None:
            return self.state_provider()
        model = self._model
        if self.format in ("loop", "lightning"):
            return self._loop_checkpoint()
        if model is None:
            raise ValueError(
                "AsyncCheckpoint has seen no model yet (no OnTrainBegin/OnEpochEnd with a "
                "model); pass state_provider=... to save something else"
            )
        state: dict[str, Any] = {"model": unwrap_model(model).state_dict()}
        if self._optimizer is not None and hasattr(self._optimizer, "state_dict"):
            state["optimizer"] = self._optimizer.state_dict()
        services = self.rt.state_dict() if self.rt is not None else {}
        if services:
            state["sakura"] = services
        return state

    def _save(
        self,
        event: Any,
        *,
        metric: float | None = None,
        snapshot: Snapshot | None = None,
        epoch: int | None = None,
    ) -> None:
        if not self._active() or not self._require_dir(event.step, event.epoch):
            if snapshot is not None:
                snapshot.release()
            return
        if self._sharded:
            self._save_sharded(event, metric)
            return
        try:
            self._barrier()
            t0 = time.perf_counter()
            while len(self._pending) >= self.max_pending:
                self._collect_one()
            t1 = time.perf_counter()
            if snapshot is None:
                self._remember(event)
                defer = self._stable_tensors() if self.overlap else None
                snapshot = self._ready_pool().take(self._state(), defer=defer)
        except BaseException:
            if snapshot is not None:
                snapshot.release()
            raise
        timing = SaveTiming(step=event.step, wait_s=t1 - t0)
        self.timings.append(timing)
        epoch = event.epoch if epoch is None else epoch
        if snapshot.deferred and self._copier is not None:
            stream = current_cuda_stream(snapshot)
            future = self._copier.submit(snapshot.finish, stream)
            self._copying = PendingCopy(future, snapshot, event.step, epoch, metric, timing)
            self._last_step = event.step
            self._last_time = time.monotonic()
            timing.copy_s = time.perf_counter() - t1
            return
        self._submit_write(snapshot, event.step, epoch, metric)
        timing.copy_s = time.perf_counter() - t1

    # --- sharded (FSDP2 / DTensor) models: every rank writes through ShardedCheckpoint -----

    def _check_sharded(self, step: int, epoch: int) -> bool:
        """Whether this configuration can write a sharded model; the first option that
        cannot is reported once (OnError, then CheckpointWriteError at drain)."""
        if self._sharded_error is not None:
            return False
        problem: tuple[str, Any, str] | None = None
        if self.format != "torch":
            problem = ("format", self.format, "'torch' for a sharded (FSDP2 / DTensor) model")
        elif self.state_provider is not None:
            problem = (
                "state_provider",
                self.state_provider,
                "None for a sharded (FSDP2 / DTensor) model: every rank saves its own shards "
                "of the model and optimizer",
            )
        elif self.compress:
            problem = ("compress", self.compress, "None for a sharded (FSDP2 / DTensor) model")
        elif self.unit in ("seconds", "best"):
            problem = (
                "every",
                self.every,
                "epochs or steps for a sharded (FSDP2 / DTensor) model: every rank must save "
                "at the same step, which a clock or a metric seen on one rank cannot promise",
            )
        if problem is None:
            return True
        self._sharded_error = option_error(*problem, owner=_OWNER)
        self._fail(self._sharded_error, step, epoch)
        return False

    def _sharded_writer(self, step: int, epoch: int) -> ShardedCheckpoint | None:
        """The ShardedCheckpoint, created (a collective: every rank at the same point) at
        training start, or at the first save of a model first seen later."""
        if self._writer is None and self._sharded_error is None and self.dir is not None:
            try:
                self._writer = ShardedCheckpoint(
                    self.dir, keep=self.keep, timeout_s=self.timeout_s, owner=_OWNER
                )
            except Exception as exc:  # no process group, or a rank never came
                self._sharded_error = CheckpointWriteError(
                    f"AsyncCheckpoint {self.name!r}: the sharded (FSDP2 / DTensor) "
                    f"checkpointer could not be set up on rank {self._rank()} "
                    f"({type(exc).__name__}: {exc}); no checkpoint will be written"
                )
                self._fail(self._sharded_error, step, epoch)
        return self._writer

    def _rank(self) -> int:
        return 0 if self.rt is None else self.rt.rank

    def _save_sharded(self, event: Any, metric: float | None) -> None:
        """Every rank: collect the previous write (every rank does it here, at the same
        step), then hand the model and optimizer to ShardedCheckpoint."""
        if not self._check_sharded(event.step, event.epoch) or self.dir is None:
            return
        self._remember(event)
        t0 = time.perf_counter()
        self._collect(wait=True)
        t1 = time.perf_counter()
        writer = self._sharded_writer(event.step, event.epoch)
        if writer is None:
            return
        try:
            future = writer.save(
                event.step,
                unwrap_model(self._model),
                _plain_optimizer(self._optimizer),
                background_staging=self.overlap,
            )
        except Exception as exc:  # the ranks could not agree to start the write
            self._fail(exc, event.step, event.epoch)
            return
        timing = SaveTiming(step=event.step, wait_s=t1 - t0)
        timing.copy_s = time.perf_counter() - t1
        self.timings.append(timing)
        if writer.staging:  # overlap=True: the copy runs during the next forward/backward
            self._staging_timing = timing
        record = self._last_metric if metric is None else metric
        self._pending.append(PendingWrite(future, None, event.step, event.epoch, record))
        self._last_step = event.step
        self._last_time = time.monotonic()

    def resume(self, model: Any, optimizer: Any = None) -> int | None:
        """Load the newest checkpoint of ``dir`` into ``model`` (and ``optimizer``); return
        its step, or None when there is none.

        A sharded (FSDP2 / DTensor) model loads the newest published ``step-<N>`` folder at
        any world size (DCP reshards; every rank must call it).  Otherwise the newest
        verified checkpoint (``format="torch"`` or ``"safetensors"``, loaded with
        ``weights_only=True``) gives ``model`` its ``"model"`` entry and ``optimizer`` its
        ``"optimizer"`` entry; the services' state (``"sakura"``) is left to
        ``rt.load_state_dict``.
        """
        if self.dir is None:
            raise option_error("dir", None, "the directory to resume from", owner=_OWNER)
        target = unwrap_model(model)
        if is_sharded(target):
            return load_sharded(self.dir, target, _plain_optimizer(optimizer))
        ckpt = load_latest(self.dir)
        if ckpt is None:
            return None
        state = ckpt.state
        if not isinstance(state, dict) or "model" not in state:
            raise ValueError(
                f"AsyncCheckpoint.resume: {ckpt.path} holds no 'model' entry (a loop's own "
                f"checkpoint or a state_provider's tree); load it with load_latest and "
                f"restore it yourself"
            )
        target.load_state_dict(state["model"])
        if optimizer is not None and "optimizer" in state:
            optimizer.load_state_dict(state["optimizer"])
        return ckpt.step

    def _barrier(self) -> None:
        """Wait for an overlapped copy, then submit its write (before the weights change)."""
        staging = self._staging_timing
        if staging is not None and self._writer is not None:  # a sharded model's copy
            t0 = time.perf_counter()
            self._staging_timing = None
            self._writer.finish_staging()
            staging.barrier_s += time.perf_counter() - t0
        copy = self._copying
        if copy is None:
            return
        t0 = time.perf_counter()
        self._copying = None
        try:
            copy.future.result()
        except BaseException as exc:
            copy.snapshot.release()
            self._fail(exc, copy.step, copy.epoch)
            return
        self._submit_write(copy.snapshot, copy.step, copy.epoch, copy.metric)
        copy.timing.barrier_s += time.perf_counter() - t0

    def _stable_tensors(self) -> Callable[[Any], bool]:
        """A predicate for the tensors only the optimizer step changes: the model's
        parameters and the optimizer's state."""
        stable: set[tuple[int, int, Any]] = set()
        model = unwrap_model(self._model) if self._model is not None else None
        if model is not None and hasattr(model, "parameters"):
            for p in model.parameters():
                stable.add((p.data_ptr(), p.numel(), p.dtype))
        optimizer = self._optimizer
        for group_state in getattr(optimizer, "state", {}).values():
            if isinstance(group_state, dict):
                for value in group_state.values():
                    if hasattr(value, "data_ptr") and value.numel() > 1:
                        stable.add((value.data_ptr(), value.numel(), value.dtype))
        return lambda t: (t.data_ptr(), t.numel(), t.dtype) in stable

    def _submit_write(
        self, snapshot: Snapshot, step: int, epoch: int, metric: float | None
    ) -> None:
        if metric is None:
            metric = self._last_metric
        record = (
            {"name": self.metric, "value": metric, "mode": self.mode}
            if self.metric is not None and metric is not None
            else None
        )
        dispatcher = self.dispatcher
        if dispatcher is None or self.dir is None:
            snapshot.release()
            raise RuntimeError(
                f"AsyncCheckpoint {self.name!r} is not set up (install it on a running runtime)"
            )
        try:
            future = dispatcher.submit(
                write_checkpoint,
                self.dir,
                snapshot.tree,
                format=self.format,
                step=step,
                epoch=epoch,
                metric=record,
                keep=self.keep,
                compress=self.compress,
            )
        except BaseException:
            snapshot.release()
            raise
        self._pending.append(PendingWrite(future, snapshot, step, epoch, metric))
        self._last_step = step
        self._last_time = time.monotonic()

    def _collect(self, *, wait: bool) -> None:
        while self._pending and (wait or self._pending[0].future.done()):
            self._collect_one()

    def _collect_one(self) -> None:
        item = self._pending[0]
        if item.snapshot is None:  # sharded: the writer's own wait collects it
            # A background copy still running (overlap=True) holds the write back; no
            # optimizer step came since the save, so waiting for it here is safe.
            self._barrier()
            self._pending.popleft()
            writer = self._writer
            try:
                path = None if writer is None else writer.wait()
            except BaseException as exc:
                self._fail(exc, item.step, item.epoch)
                return
            if path is not None:
                self._published(path, item, sharded=True)
            return
        error = item.future.exception()  # waits for the oldest write
        self._pending.popleft()
        item.snapshot.release()
        if error is None:
            self._published(item.future.result(), item, sharded=False)
        else:
            self._fail(error, item.step, item.epoch)

    def _published(self, path: str, item: PendingWrite, *, sharded: bool) -> None:
        """Record a durable checkpoint and announce it (OnCheckpointDurable)."""
        self.saved.append(path)
        rt = self.rt
        if rt is None:
            return
        rt.emit(
            OnCheckpointDurable,
            step=item.step,
            epoch=item.epoch,
            path=path,
            format="dcp" if sharded else self.format,
            sharded=sharded,
            metric=item.metric,
            source=self.name,
        )

    def _fail(self, error: BaseException, step: int, epoch: int) -> None:
        self.errors.append(error)
        self._unraised.append(error)
        logger.error(
            "sakura AsyncCheckpoint %r: checkpoint of step %d failed: %r", self.name, step, error
        )
        if self.rt is not None:
            self.rt.emit(OnError, step=step, epoch=epoch, exception=error, source=self.name)

    def __repr__(self) -> str:
        return (
            f"<AsyncCheckpoint name={self.name!r} dir={self.dir!r} every={self.every!r} "
            f"format={self.format!r} keep={self.keep}>"
        )
