"""Sharded (FSDP2 / DTensor) checkpoints with torch.distributed.checkpoint, written off the
training thread and published atomically.

:class:`ShardedCheckpoint` keeps the guarantees of :class:`~sakura_async.checkpoint.
AsyncCheckpoint` for a model whose parameters are DTensors:

* **Only the copy stalls.**  :meth:`ShardedCheckpoint.save` gathers the model and optimizer
  state with :func:`torch.distributed.checkpoint.state_dict.get_state_dict` and hands it to
  DCP's own :func:`~torch.distributed.checkpoint.async_save`, whose default stager copies
  every local shard into host memory on the calling (training) thread and then writes on
  DCP's background thread.  We use DCP's staging and writer rather than our own so that the
  shard layout, the planner and the ``.metadata`` file stay DCP's, and any world size can
  load the result (DCP reshards on load).
* **Atomic publication.**  Every rank writes into ``<dir>/.tmp-step-<N>``; a committer
  thread then all-gathers each rank's success and rank 0 renames the folder to
  ``<dir>/step-<N>`` (and fsyncs the parent) only when *every* rank succeeded.  The
  previous good checkpoint is kept until then (retention runs after the rename), so a crash
  or an exception mid-write leaves the last good one loadable: :func:`load_sharded` only
  looks at ``step-<N>`` folders.
* **A side process group.**  DCP's planning collectives and our commit vote run on a gloo
  group created for the checkpointer (``dist.new_group(backend="gloo")``), never on the
  training's default group: collectives issued from another thread on the group the
  training uses would interleave with the training's own, and gloo groups are not safe for
  concurrent collectives.  One write is in flight at a time, so the side group never
  carries two collectives at once either.
* **Failures are reported, not waited on forever.**  The side group has ``timeout_s``; a
  rank that died or never joined the write makes the others' collectives time out, and the
  error is raised from the next :meth:`~ShardedCheckpoint.save` or from
  :meth:`~ShardedCheckpoint.wait` as :class:`~sakura_async.errors.CheckpointWriteError`.

This class is the one implementation of the protocol: the
:class:`~sakura_async.checkpoint.AsyncCheckpoint` service drives it when its model has
DTensor parameters (it creates one at training start and collects each write with
:meth:`~ShardedCheckpoint.wait` at points every rank reaches in the same order).
"""

from __future__ import annotations

import os
import re
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save
from torch.distributed.tensor import DTensor

from sakura.options import check_int, check_number, option_error
from sakura_async.errors import CheckpointWriteError

__all__ = ["ShardedCheckpoint", "find_sharded", "is_sharded", "load_sharded"]

_OWNER = "ShardedCheckpoint"
_FINAL = re.compile(r"^step-(\d{8,})$")


def is_sharded(model: nn.Module) -> bool:
    """Whether any parameter of ``model`` is a DTensor (FSDP2's ``fully_shard``)."""
    return any(isinstance(p, DTensor) for p in model.parameters())


def _final_name(step: int) -> str:
    return f"step-{step:08d}"


def find_sharded(directory: str | os.PathLike[str]) -> list[tuple[int, str]]:
    """``(step, path)`` of every published sharded checkpoint in ``directory``, oldest
    first.  Temporary folders (a write that never committed) are not listed."""
    root = os.fspath(directory)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _FINAL.match(name)
        path = os.path.join(root, name)
        if match and os.path.isfile(os.path.join(path, ".metadata")):
            found.append((int(match.group(1)), path))
    return sorted(found)


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    optimizers = [] if optimizer is None else [optimizer]
    model_sd, optim_sd = get_state_dict(model, optimizers, options=StateDictOptions())
    state: dict[str, Any] = {"model": model_sd}
    if optimizer is not None:
        state["optim"] = optim_sd
    return state


def _vote(error: BaseException | None) -> str | None:
    """What a rank tells the others about its write: None for success, else the error in
    one line (DCP's CheckpointException carries every rank's exception and traceback; the
    exceptions are enough)."""
    if error is None:
        return None
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        return "; ".join(
            f"rank {rank}: {(value[0] if isinstance(value, tuple) else value)!r}"
            for rank, value in sorted(failures.items())
        )
    return repr(error)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class ShardedCheckpoint:
    """Asynchronous, atomic DCP checkpoints of a sharded model (see the module docstring).

    Args:
        dir: the folder holding ``step-<N>`` checkpoints (the same path on every rank: a
            shared filesystem, or one machine).
        keep: how many published checkpoints to keep (oldest removed after a new one is
            published), ``>= 1``, or None to keep all.
        timeout_s: how long a collective of the checkpointer's side group may wait for the
            other ranks before the write is reported as failed, ``> 0``.
        owner: the name error messages give for the options (AsyncCheckpoint passes its
            own).

    Must be created on every rank after ``dist.init_process_group``, at the same point
    (``new_group`` is collective).
    """

    def __init__(
        self,
        dir: str | os.PathLike[str],
        *,
        keep: int | None = 2,
        timeout_s: float = 300.0,
        owner: str = _OWNER,
    ) -> None:
        if not isinstance(dir, (str, os.PathLike)) or not os.fspath(dir):
            raise option_error("dir", dir, "a non-empty path (str or os.PathLike)", owner=owner)
        self.dir = os.path.abspath(os.fspath(dir))
        self.keep: int | None = check_int("keep", keep, minimum=1, allow_none=True, owner=owner)
        self.timeout_s: float = check_number(
            "timeout_s", timeout_s, minimum=0, min_inclusive=False, owner=owner
        )
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                f"{owner} needs an initialized default process group to write a sharded "
                "(DTensor) model (call torch.distributed.init_process_group first)"
            )
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))
        self._committer = ThreadPoolExecutor(1, thread_name_prefix="sakura-dcp-commit")
        self._pending: Future[str] | None = None
        self._stager: DefaultStager | None = None
        self._staging: Future[Any] | None = None
        self._released = threading.Event()
        self._discarded: str | None = None
        os.makedirs(self.dir, exist_ok=True)
        if self.rank == 0:  # writes that crashed before their commit
            for entry in os.listdir(self.dir):
                if entry.startswith(".tmp-step-"):
                    shutil.rmtree(os.path.join(self.dir, entry), ignore_errors=True)
        dist.barrier(group=self._group)

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        background_staging: bool = False,
    ) -> Future[str]:
        """Stage ``model`` (and ``optimizer``) state to host memory and write it in the
        background as checkpoint ``step``; returns a future of the published path.

        Waits for the previous write first (one in flight) and raises its error, if any.

        ``background_staging=True``: the host copy itself runs on DCP's staging thread
        (``DefaultStager`` with ``use_async_staging``), so this returns at once; the caller
        must call :meth:`finish_staging` before the weights or the optimizer state change
        (before the next optimizer step), or :meth:`discard_staging` if they changed
        first.  The write is not published until one of them was called.
        """
        check_int("step", step, minimum=0, owner=_OWNER)
        self.wait()
        name = _final_name(step)
        tmp = os.path.join(self.dir, f".tmp-{name}")
        stager = None
        if background_staging:
            if self._stager is None:  # reused: it keeps its staging buffers between saves
                self._stager = DefaultStager(
                    StagingOptions(
                        use_pinned_memory=False,
                        use_shared_memory=False,
                        use_async_staging=True,
                        use_non_blocking_copy=False,
                    )
                )
            stager = self._stager
        self._released = threading.Event()
        self._discarded = None
        if not background_staging:
            self._released.set()
        try:
            writing = async_save(
                _state(model, optimizer),
                storage_writer=FileSystemWriter(tmp, sync_files=True),
                process_group=self._group,
                async_stager=stager,
            )
        except BaseException as exc:  # a rank died or never came to this save
            raise CheckpointWriteError(
                f"sharded checkpoint {name!r} was not started: the ranks could not agree "
                f"within timeout_s={self.timeout_s} ({type(exc).__name__}: {exc})"
            ) from exc
        if isinstance(writing, Future):
            future, self._staging = writing, None
        else:
            future, self._staging = writing.upload_completion, writing.staging_completion
        if not background_staging:
            self._staging = None
        self._pending = self._committer.submit(self._commit, future, tmp, name, self._released)
        return self._pending

    @property
    def staging(self) -> bool:
        """Whether a background copy (``background_staging=True``) awaits
        :meth:`finish_staging` or :meth:`discard_staging`."""
        return self._staging is not None

    def finish_staging(self) -> None:
        """Wait until the background copy of the last save is complete (a failed copy
        fails the write itself, reported by :meth:`wait`); the weights may change after."""
        staging, self._staging = self._staging, None
        try:
            if staging is not None:
                staging.exception(timeout=self.timeout_s)
        finally:
            self._released.set()

    def discard_staging(self, reason: str) -> None:
        """The weights changed before the background copy was known to be complete: the
        write in flight is not published (every rank's vote fails with ``reason``)."""
        self._staging = None
        self._discarded = reason
        self._released.set()

    @property
    def writing(self) -> bool:
        """Whether a write was started and not yet collected by :meth:`wait`."""
        return self._pending is not None

    def wait(self) -> str | None:
        """Wait for the write in flight and return the folder it published (None when no
        write was in flight); raise :class:`CheckpointWriteError` if it failed."""
        pending, self._pending = self._pending, None
        return None if pending is None else pending.result()

    def close(self) -> None:
        """Wait for the write in flight (raising its error) and stop the committer."""
        try:
            if self._staging is not None:
                self.finish_staging()
            self.wait()
        finally:
            self._committer.shutdown(wait=True)
            if self._stager is not None:
                self._stager.close()
                self._stager = None

    def _commit(self, writing: Future[Any], tmp: str, name: str, released: threading.Event) -> str:
        """Runs on the committer thread: waits for DCP's write (and, with background
        staging, for the training thread's word that the copy preceded any change of the
        weights), votes on the side group, and rank 0 publishes the folder only when every
        rank succeeded."""
        error: BaseException | None = None
        try:
            writing.result(timeout=self.timeout_s)
        except BaseException as exc:  # reported below, after the vote
            error = exc
        if not released.wait(self.timeout_s) and error is None:
            error = TimeoutError(
                f"the background copy was not confirmed within timeout_s={self.timeout_s}"
            )
        if self._discarded is not None and error is None:
            error = RuntimeError(self._discarded)
        votes: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(votes, _vote(error), group=self._group)
        except BaseException as exc:  # a rank died or hung: the vote itself failed
            raise CheckpointWriteError(
                f"sharded checkpoint {name!r} was not published: the ranks could not agree "
                f"within timeout_s={self.timeout_s} ({type(exc).__name__}: {exc}); "
                f"this rank's write: {error!r}"
            ) from (error or exc)
        failed = {rank: vote for rank, vote in enumerate(votes) if vote is not None}
        if failed:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            dist.barrier(group=self._group)  # gone before any rank writes that step again
            raise CheckpointWriteError(
                f"sharded checkpoint {name!r} was not published; failed ranks: {failed}; "
                "the previous checkpoint is kept"
            ) from error
        final = os.path.join(self.dir, name)
        if self.rank == 0:
            if os.path.exists(final):
                shutil.rmtree(final)  # the same step saved again: the new write wins
            os.replace(tmp, final)
            _fsync_dir(self.dir)
            if self.keep is not None:
                for _, old in find_sharded(self.dir)[: -self.keep]:
                    shutil.rmtree(old, ignore_errors=True)
        dist.barrier(group=self._group)  # every rank sees the published folder
        return final

    def __repr__(self) -> str:
        return f"ShardedCheckpoint(dir={self.dir!r}, keep={self.keep}, timeout_s={self.timeout_s})"


def load_sharded(
    directory: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    process_group: dist.ProcessGroup | None = None,
) -> int | None:
    """Load the newest published checkpoint of ``directory`` into ``model`` (and
    ``optimizer``), at any world size (DCP reshards); returns its step, or ``None`` when
    there is none.  Every rank must call it."""
    found = find_sharded(directory)
    if not found:
        return None
    step, path = found[-1]
    state = _state(model, optimizer)
    dcp_load(state, storage_reader=FileSystemReader(path), process_group=process_group)
    optimizers = [] if optimizer is None else [optimizer]
    set_state_dict(
        model,
        optimizers,
        model_state_dict=state["model"],
        optim_state_dict=state.get("optim", {}),
    )
    return step
