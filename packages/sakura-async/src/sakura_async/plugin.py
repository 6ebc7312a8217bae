"""sakura-async's plugin module (entry point ``sakura``): registers the services and the
dispatchers lazily ("module:Class" targets), so listing plugins never imports torch."""

from __future__ import annotations

from typing import Any

from sakura.hookspecs import Register, hookimpl
from sakura.specs import Spec


def _async_eval(spec: Spec) -> Any:
    from sakura_async.specs import build_async_eval

    return build_async_eval(spec)


def _async_checkpoint(spec: Spec) -> Any:
    from sakura_async.specs import build_async_checkpoint

    return build_async_checkpoint(spec)


@hookimpl
def sakura_register_services(register: Register) -> None:
    register(
        "async_eval",
        "sakura_async.eval:AsyncEval",
        parse=_async_eval,
        description="evaluate each epoch's weights on a dispatcher while training goes on",
    )
    register(
        "async_checkpoint",
        "sakura_async.checkpoint.service:AsyncCheckpoint",
        parse=_async_checkpoint,
        description="atomic checkpoints written on a dispatcher (torch, safetensors, the loop's own, lightning)",
    )


@hookimpl
def sakura_register_dispatchers(register: Register) -> None:
    register(
        "inthread",
        "sakura_async.dispatch.inthread:InThreadDispatcher",
        description="runs each task synchronously in the calling thread (tests)",
    )
    register(
        "thread",
        "sakura_async.dispatch.thread:ThreadDispatcher",
        description="background threads of the training process",
    )
    register(
        "process",
        "sakura_async.dispatch.local:LocalDispatcher",
        description="an auto-spawned sakura-worker process; tensors through shared memory",
    )
    register(
        "remote",
        "sakura_async.dispatch.remote:RemoteDispatcher",
        description="a sakura-worker --listen on another host (TLS + token)",
    )
    register(
        "cluster",
        "sakura_async.dispatch.cluster:ClusterDispatcher",
        description="a Dask distributed cluster (pip install 'sakura-async[dask]')",
    )
