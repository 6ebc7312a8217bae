"""Exceptions of sakura-async.  Each message says what failed and what to do about it."""

from __future__ import annotations

from sakura.errors import SakuraError

__all__ = [
    "AuthenticationError",
    "CheckpointError",
    "CheckpointWriteError",
    "DispatchError",
    "DispatcherClosed",
    "RemoteTaskError",
    "WorkerCrashed",
]


class DispatchError(SakuraError, RuntimeError):
    """Base class of dispatcher failures (the task itself never ran to completion)."""


class DispatcherClosed(DispatchError):
    """``submit`` was called on a dispatcher that was closed."""


class WorkerCrashed(DispatchError):
    """The worker process running the task died (killed, crashed, or its connection broke).

    The task's future fails with this error; the dispatcher starts a fresh worker for the
    next task.
    """


class AuthenticationError(DispatchError):
    """A remote worker and its client could not authenticate each other."""


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
