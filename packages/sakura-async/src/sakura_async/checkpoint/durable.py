"""The event "a checkpoint is durable": :class:`OnCheckpointDurable`.

AsyncCheckpoint publishes it once a checkpoint's write is complete and published (after
the rename and the directory fsync; for a sharded checkpoint, after every rank voted
success and rank 0 renamed the folder), so a consumer (RayReport hands the directory to
``ray.train.report``) never sees a checkpoint that a crash could still lose.

It travels on the runtime's bus (``rt.emit``) like the core's events: it reaches the
services that name it in ``event_types`` (through their ``on_event``), in priority order,
with the runtime's failure isolation.  Catch-all services (``event_types`` None, such as
Telemetry) do not receive it: they are written against the core's events.
"""

from __future__ import annotations

from dataclasses import dataclass

from sakura.events import Event

__all__ = ["OnCheckpointDurable"]


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
