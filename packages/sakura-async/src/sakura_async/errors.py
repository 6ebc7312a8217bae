"""Exceptions of sakura-async.  Each message says what failed and what to do about it."""

from __future__ import annotations

from sakura.errors import SakuraError

__all__ = [
    "AuthenticationError",
    "CheckpointError",
    "CheckpointWriteError",
    "DispatchError",
    "DispatcherClosedError",
    "FrameTooLargeError",
    "RemoteTaskError",
    "TaskInterruptedError",
    "TaskTimeoutError",
    "WorkerCrashedError",
    "WorkerUnresponsiveError",
]


class DispatchError(SakuraError, RuntimeError):
    """Base class of dispatcher failures (the task itself never ran to completion)."""


class DispatcherClosedError(DispatchError):
    """``submit`` was called on a closed dispatcher, or the dispatcher was closed (or
    abandoned after Ctrl+C) before the task finished."""


class TaskInterruptedError(DispatcherClosedError):
    """The task was abandoned because the program was interrupted (Ctrl+C) and the
    dispatcher stopped waiting for it."""


class TaskTimeoutError(DispatchError, TimeoutError):
    """The task did not finish within the dispatcher's ``task_timeout``.

    The message names the task, its id and the dispatcher.  Where the task ran in a worker
    process, that worker is stopped and the next task gets a fresh one.
    """


class WorkerCrashedError(DispatchError):
    """The worker process running the task died (killed, crashed, or its connection broke).

    The task's future fails with this error; the dispatcher starts a fresh worker for the
    next task.
    """


class WorkerUnresponsiveError(WorkerCrashedError):
    """The worker sent no heartbeat within the dispatcher's ``liveness_timeout`` (it is
    stopped, e.g. by SIGSTOP, or wedged): it is killed and its tasks fail with this."""


class AuthenticationError(DispatchError):
    """A remote worker and its client could not authenticate each other."""


class FrameTooLargeError(DispatchError):
    """A message announced a body larger than the receiving side accepts
    (``max_frame_bytes``); the connection is closed without reading it."""


class RemoteTaskError(DispatchError):
    """A task raised in a worker and its exception could not be sent back as itself.

    ``remote_type`` names the original exception class; the message carries the worker's
    traceback.
    """

    def __init__(self, message: str, remote_type: str = "") -> None:
        super().__init__(message)
        self.remote_type = remote_type


class CheckpointError(SakuraError, RuntimeError):
    """A checkpoint could not be read or is not valid."""


class CheckpointWriteError(CheckpointError):
    """One or more asynchronous checkpoint writes failed; raised when the runtime drains
    so that a lost checkpoint never goes unnoticed."""
