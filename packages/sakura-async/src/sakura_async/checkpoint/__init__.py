"""Asynchronous, atomic checkpoints: the :class:`AsyncCheckpoint` service and the on-disk
store, :class:`ShardedCheckpoint` (FSDP2 / DTensor state written with
torch.distributed.checkpoint, which AsyncCheckpoint drives for a sharded model) and
:class:`OnCheckpointDurable` (a checkpoint became durable) (:func:`write_checkpoint`, :func:`load_latest`, :func:`load_best`,
:func:`find_checkpoints`)."""

from __future__ import annotations

from sakura_async.checkpoint.durable import OnCheckpointDurable
from sakura_async.checkpoint.service import AsyncCheckpoint, parse_every
from sakura_async.checkpoint.sharded import (
    ShardedCheckpoint,
    find_sharded,
    is_sharded,
    load_sharded,
)
from sakura_async.checkpoint.store import (
    Checkpoint,
    find_checkpoints,
    load_best,
    load_latest,
    verify,
    write_checkpoint,
)

__all__ = [
    "AsyncCheckpoint",
    "Checkpoint",
    "OnCheckpointDurable",
    "ShardedCheckpoint",
    "find_checkpoints",
    "find_sharded",
    "is_sharded",
    "load_best",
    "load_latest",
    "load_sharded",
    "parse_every",
    "verify",
    "write_checkpoint",
]
