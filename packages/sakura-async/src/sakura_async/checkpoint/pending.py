"""Saves in flight: the snapshot copy on the training side and the write the dispatcher
runs, with how long each save blocked the training thread."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from sakura_async.dispatch.base import TaskFuture
from sakura_async.snapshot import Snapshot

__all__ = ["PendingCopy", "PendingWrite", "SaveTiming", "current_cuda_stream"]


@dataclass
class SaveTiming:
    """How long one save blocked the training thread, by cause (seconds)."""

    step: int
    wait_s: float = 0.0
    """Waiting for a free write slot (the previous writes were still running)."""
    copy_s: float = 0.0
    """Copying the snapshot on the training thread (and submitting the write)."""
    barrier_s: float = 0.0
    """``overlap=True``: waiting at the optimizer step for the background copy."""

    @property
    def blocked_s(self) -> float:
        return self.wait_s + self.copy_s + self.barrier_s


@dataclass
class PendingCopy:
    future: Future[Any]
    snapshot: Snapshot
    step: int
    epoch: int
    metric: float | None
    timing: SaveTiming


def current_cuda_stream(snapshot: Snapshot) -> Any:
    if any(src.is_cuda for _, src in snapshot.deferred):
        import torch

        return torch.cuda.current_stream()
    return None


@dataclass
class PendingWrite:
    """A write in flight: the dispatcher's task and the snapshot it reads, or (``snapshot``
    None) a sharded write, whose future is the ShardedCheckpoint's commit."""

    future: TaskFuture | Future[Any]
    snapshot: Snapshot | None
    step: int
    epoch: int
    metric: float | None = None
