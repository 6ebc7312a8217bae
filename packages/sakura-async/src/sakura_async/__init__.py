"""sakura-async: evaluation and checkpointing off the training thread, and the dispatchers
that run them (a background thread, a worker process, a remote worker, a Dask cluster).

::

    from sakura_async import AsyncEval, AsyncCheckpoint, load_latest
    from sakura_async.dispatch import ThreadDispatcher, LocalDispatcher

or through the core facades: ``sakura.services.AsyncEval``, ``sakura.dispatch.LocalDispatcher``.
Nothing heavy is imported until used.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "AsyncEval": "sakura_async.eval",
    "EvalTask": "sakura_async.eval",
    "AsyncCheckpoint": "sakura_async.checkpoint.service",
    "write_checkpoint": "sakura_async.checkpoint.store",
    "Checkpoint": "sakura_async.checkpoint.store",
    "find_checkpoints": "sakura_async.checkpoint.store",
    "load_latest": "sakura_async.checkpoint.store",
    "load_best": "sakura_async.checkpoint.store",
    "OnCheckpointDurable": "sakura_async.checkpoint.durable",
    "InThreadDispatcher": "sakura_async.dispatch.inthread",
    "ThreadDispatcher": "sakura_async.dispatch.thread",
    "LocalDispatcher": "sakura_async.dispatch.local",
    "RemoteDispatcher": "sakura_async.dispatch.remote",
    "ClusterDispatcher": "sakura_async.dispatch.cluster",
    "Dispatcher": "sakura_async.dispatch.base",
    "TaskFuture": "sakura_async.dispatch.base",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sakura_async' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
