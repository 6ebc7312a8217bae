"""Asynchronous, atomic checkpoints: the :class:`AsyncCheckpoint` service and the on-disk
store (:func:`write_checkpoint`, :func:`load_latest`, :func:`load_best`,
:func:`find_checkpoints`)."""

from __future__ import annotations

from sakura_async.checkpoint.service import AsyncCheckpoint, parse_every
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
    "find_checkpoints",
    "load_best",
    "load_latest",
    "parse_every",
    "verify",
    "write_checkpoint",
]
