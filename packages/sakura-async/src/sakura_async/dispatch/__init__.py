"""Dispatchers: one interface (:class:`Dispatcher`), five places to run work.

=======================  ===============================================================
``InThreadDispatcher``   in the calling thread, synchronously (tests, debugging)
``ThreadDispatcher``     background threads of this process
``LocalDispatcher``      an auto-spawned ``sakura-worker`` process (separate interpreter
                         and GIL; tensors through shared memory)
``RemoteDispatcher``     a ``sakura-worker --listen`` on another host (TLS + token)
``ClusterDispatcher``    a Dask distributed cluster (``pip install 'sakura-async[dask]'``)
=======================  ===============================================================

Imports are lazy: ``from sakura_async.dispatch import LocalDispatcher`` loads only what
that dispatcher needs.
"""

from __future__ import annotations

import importlib
from typing import Any

from sakura_async.dispatch.base import Dispatcher, TaskFuture, Timings

_LAZY = {
    "InThreadDispatcher": "sakura_async.dispatch.inthread",
    "ThreadDispatcher": "sakura_async.dispatch.thread",
    "LocalDispatcher": "sakura_async.dispatch.local",
    "RemoteDispatcher": "sakura_async.dispatch.remote",
    "ClusterDispatcher": "sakura_async.dispatch.cluster",
}

__all__ = ["Dispatcher", "TaskFuture", "Timings", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'sakura_async.dispatch' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
