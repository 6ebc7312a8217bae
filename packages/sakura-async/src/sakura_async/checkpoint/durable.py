"""The event "a checkpoint is durable": :class:`OnCheckpointDurable`, and its delivery.

AsyncCheckpoint publishes it once a checkpoint's write is complete and published (after
the rename and the directory fsync; for a sharded checkpoint, after every rank voted
success and rank 0 renamed the folder), so a consumer (RayReport hands the directory to
``ray.train.report``) never sees a checkpoint that a crash could still lose.

Why the delivery is here and not ``rt.emit``: the runtime routes only the event classes of
:mod:`sakura.events` (its routing tables are built from ``sakura.events.EVENT_TYPES``, and a
service method named ``on_*`` that is not a core hook is refused at install).  Until the
class moves into the core, :func:`publish` delivers it the way the runtime delivers a core
event to a subscriber that names it in ``event_types``: to each installed service that lists
:class:`OnCheckpointDurable` in its ``event_types``, through its ``on_event``, in priority
order, with the runtime's failure isolation (a handler that raises is logged, recorded in
``rt.errors`` and reported as ``OnError``; under ``strict=True`` it raises).
Catch-all services (``event_types`` None, such as Telemetry) do not receive it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sakura.events import Event, OnError
from sakura.runtime import HandlerError, SakuraRuntime

__all__ = ["OnCheckpointDurable", "publish"]

logger = logging.getLogger("sakura.async")


@dataclass(frozen=True, slots=True, kw_only=True)
class OnCheckpointDurable(Event):
    """A checkpoint's write is complete and published; it survives a crash from now on.

    ``step`` and ``epoch`` are those of the saved state (not of the moment it became
    durable).  Published on the training thread of every rank that wrote the checkpoint:
    rank 0 for a full-state checkpoint (``ranks="zero"``), every rank for a sharded one,
    where each rank receives it for the same checkpoints, in the same order, at the same
    point of the loop (the next save, an epoch end, the end of training).
    """

    path: str = ""
    """The published checkpoint directory (absolute)."""
    format: str = "torch"
    """``"torch"``, ``"safetensors"``, ``"loop"``, ``"lightning"``, or ``"dcp"`` (sharded)."""
    sharded: bool = False
    """True for a torch.distributed.checkpoint folder (every rank wrote its shards)."""
    metric: float | None = None
    """The monitored metric's value recorded with it, when known."""
    source: str = ""
    """The name of the service that wrote it (``"async_checkpoint"``)."""


def publish(runtime: SakuraRuntime, event: OnCheckpointDurable) -> None:
    """Deliver ``event`` to the services of ``runtime`` that subscribe to it (see the
    module docstring)."""
    for service in runtime.services:
        wanted = getattr(service, "event_types", None)
        handler = getattr(service, "on_event", None)
        if wanted is None or OnCheckpointDurable not in wanted or handler is None:
            continue
        try:
            handler(event)
        except Exception as exc:
            if runtime.strict:
                raise
            name = getattr(service, "name", repr(service))
            logger.error(
                "sakura service %r raised in on_event(OnCheckpointDurable); training continues",
                name,
                exc_info=exc,
            )
            runtime.errors.append(HandlerError(name, event, exc))
            runtime.emit(
                OnError,
                step=event.step,
                epoch=event.epoch,
                exception=exc,
                source=name,
                event=event,
            )
