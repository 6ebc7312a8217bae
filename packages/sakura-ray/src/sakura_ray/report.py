"""RayReport: what Sakura's services produce, handed to Ray Train.

Ray's rules (``ray.train.report``) shape the design:

* every worker must call ``report`` the same number of times (it is a barrier), so reports
  happen only at points every rank reaches together — the end of each epoch and the end of
  training — never when an asynchronous result happens to arrive on one rank;
* only rank 0's metrics are kept, and a checkpoint is registered when any worker passes
  one: rank 0 passes the directory and the other ranks pass None in the same call (a full
  checkpoint is written by rank 0 alone, ``ranks="zero"``; a sharded one, on a folder every
  rank shares, is announced on every rank and passed by rank 0);
* a checkpoint is copied to Ray's storage during the call, so only a directory whose write
  is durable is ever passed: RayReport subscribes to sakura-async's
  :class:`~sakura_async.checkpoint.durable.OnCheckpointDurable` (published after the rename
  and the directory fsync; for a sharded checkpoint after every rank's vote) and queues each
  one until the next report point.

Several checkpoints may become durable between two report points (the one of the last
epoch is waited for at the end of training); each gets a report of its own, and the ranks
first agree (one ``all_reduce`` over the loop's process group) on how many reports follow.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from sakura import OnEpochEnd, OnLog, OnTrainEnd, OnValidationEnd, Service
from sakura.events import Event
from sakura.options import check_bool, option_error
from sakura.runtime import SakuraRuntime
from sakura_async.checkpoint.durable import OnCheckpointDurable

__all__ = ["RayReport", "in_ray_train_worker"]


def in_ray_train_worker() -> tuple[int, int] | None:
    """``(world rank, world size)`` inside a Ray Train worker's training function, else
    None."""
    import ray.train

    try:
        context = ray.train.get_context()
        return int(context.get_world_rank()), int(context.get_world_size())
    except (RuntimeError, AttributeError, ValueError):
        return None


def _number(value: Any) -> float | None:
    """A metric value as a float (Python numbers, 0-d/1-element tensors), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    numel = getattr(value, "numel", None)
    if callable(numel) and numel() == 1:
        return float(value.detach().float().cpu().item())
    return None


class RayReport(Service):
    """Report AsyncEval's metrics and each durable AsyncCheckpoint checkpoint to Ray Train.

    Install it, with the other services, inside the function ``TorchTrainer`` runs on each
    worker.  At each epoch end and at the end of training every rank calls
    ``ray.train.report`` with the newest metrics seen (``OnValidationEnd`` — AsyncEval's
    results — and ``OnLog``) plus ``step`` and ``epoch``; rank 0 attaches, one report
    each, the AsyncCheckpoint directories announced durable (``OnCheckpointDurable``)
    since the last report.

    Args:
        logs: also take the loop's logged values (``OnLog``) as metrics.
        name: the service name.

    Setting it up outside a Ray Train worker raises a RuntimeError.
    """

    name = "ray_report"
    priority = 90  # after AsyncCheckpoint (70), which collects finished writes first
    event_types = frozenset({OnValidationEnd, OnLog, OnEpochEnd, OnTrainEnd, OnCheckpointDurable})

    def __init__(self, *, logs: bool = True, name: str | None = None) -> None:
        self.logs = check_bool("logs", logs, owner="RayReport")
        if name is not None:
            if not isinstance(name, str) or not name:
                raise option_error("name", name, "a non-empty str", owner="RayReport")
            self.name = name
        self.rt: SakuraRuntime | None = None
        self.rank = 0
        self.world_size = 1
        self.metrics: dict[str, float] = {}
        """The newest value of each metric seen (what the next report carries)."""
        self.reported: list[str] = []
        """The checkpoint directories handed to Ray, in order (rank 0)."""
        self.reports = 0
        """How many times ``ray.train.report`` was called on this rank."""
        self._history: list[tuple[int, bool, dict[str, float]]] = []
        self._durable: list[OnCheckpointDurable] = []
        """Checkpoints announced durable since the last report point."""

    def setup(self, runtime: SakuraRuntime) -> None:
        where = in_ray_train_worker()
        if where is None:
            raise RuntimeError(
                "RayReport must run inside a Ray Train worker (the training function of "
                "ray.train.torch.TorchTrainer or another Ray Train trainer): "
                "ray.train.get_context() is not available in this process"
            )
        self.rank, self.world_size = where
        self.rt = runtime

    def teardown(self) -> None:
        self.rt = None

    def on_event(self, event: Event) -> None:
        if isinstance(event, OnCheckpointDurable):
            self._durable.append(event)
        elif isinstance(event, OnValidationEnd):
            self._take(event.step, event.metrics, validated=True)
        elif isinstance(event, OnLog):
            if self.logs:
                self._take(event.step, event.logs)
        else:  # OnEpochEnd, OnTrainEnd: points every rank reaches together
            self._take(event.step, getattr(event, "metrics", None))
            self._report(event.step, event.epoch)

    def _take(
        self, step: int, metrics: Mapping[str, Any] | None, *, validated: bool = False
    ) -> None:
        """Remember ``metrics`` measured at ``step``.  A validation result (AsyncEval's
        ``OnValidationEnd``) outranks the loop's own values of the same step: the loop's
        epoch-end metrics and logs may still carry the previous evaluation's value."""
        values = {}
        for key, value in (metrics or {}).items():
            number = _number(value)
            if number is not None:
                values[str(key)] = number
        if values:
            self._history.append((step, validated, values))
            self.metrics = self._metrics_at(step=None)

    def _metrics_at(self, step: int | None) -> dict[str, float]:
        """The newest value of each metric measured at or before ``step`` (what a
        checkpoint of that step is reported with; None: all of them)."""
        merged: dict[str, float] = {}
        for seen_step, _, values in sorted(self._history, key=lambda item: item[:2]):
            if step is None or seen_step <= step:
                merged.update(values)
        return merged

    def _take_durable(self) -> list[OnCheckpointDurable]:
        """The checkpoints announced since the last report that this rank passes to Ray
        (rank 0's share of a sharded one; none that retention removed meanwhile), oldest
        first."""
        announced, self._durable = self._durable, []
        mine = [e for e in announced if not e.sharded or self.rank == 0]
        return sorted((e for e in mine if os.path.isdir(e.path)), key=lambda e: e.step)

    def _agreed_count(self, mine: int) -> int:
        """How many reports every rank makes now: the most any rank needs."""
        if self.world_size > 1:
            import torch
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                device = "cuda" if dist.get_backend() == "nccl" else "cpu"
                count = torch.tensor([mine], dtype=torch.int64, device=device)
                dist.all_reduce(count, op=dist.ReduceOp.MAX)
                mine = int(count.item())
        return mine

    def _report(self, step: int, epoch: int) -> None:
        """Each new durable checkpoint with the metrics of its step, then (unless the
        newest checkpoint is of this step) the current metrics without one."""
        import ray.train

        checkpoints = self._take_durable()
        current = checkpoints and checkpoints[-1].step == step
        mine = len(checkpoints) + (0 if current else 1)
        for i in range(self._agreed_count(mine)):
            if i < len(checkpoints):
                ckpt = checkpoints[i]
                metrics = {**self._metrics_at(ckpt.step), "step": ckpt.step, "epoch": ckpt.epoch}
                ray.train.report(
                    metrics,
                    checkpoint=ray.train.Checkpoint.from_directory(ckpt.path),
                    checkpoint_dir_name=os.path.basename(ckpt.path),
                )
                self.reported.append(ckpt.path)
            else:
                ray.train.report({**self.metrics, "step": step, "epoch": epoch})
            self.reports += 1

    def __repr__(self) -> str:
        return f"<RayReport name={self.name!r} rank={self.rank} reports={self.reports}>"
