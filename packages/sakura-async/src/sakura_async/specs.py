"""Spec strings for the bench and config files.

Services::

    async_eval[:DISPATCHER][,fn=package.module:function][,payload=package.module:name]
              [,pass_task=true|false][,every=N][,max_pending=N][,ranks=zero|all]
              [,<dispatcher option>=...]
    async_checkpoint[:DISPATCHER][,dir=PATH][,every=N|"N steps"|30s|best][,metric=NAME]
              [,mode=min|max][,keep=N|none][,format=torch|safetensors|loop|lightning]
              [,compress=LEVEL][,max_pending=N][,timeout_s=SECONDS (sharded models)]
              [,<dispatcher option>=...]

``DISPATCHER`` is a registered dispatcher name: sakura-async's own (``inthread``,
``thread`` (default), ``process``, ``remote``, ``cluster``) or one that another installed
plugin registers (``sakura dispatchers`` lists them all); options the service does not take go to the
dispatcher (``async_eval:process,threads=2``, ``async_checkpoint:remote,uri=tls://h:4433,
token_file=t,cert_file=c.pem``).

An evaluation function cannot be written in a spec string except by naming one:
``fn=package.module:function`` (importable where training runs, and by the workers).
Without ``fn``, ``async_eval:...`` builds an AsyncEval that has none yet: the program that
built it (the benchmark harness, with its workload's evaluation) must call
``service.configure(eval_fn, eval_payload)`` before training, or installing it fails with
an error that says so.  ``payload=package.module:name`` names the payload; a callable is
called with no arguments to build it.  ``pass_task=true`` gives ``fn`` an ``EvalTask``
(the epoch's weights) instead of the payload.  ``async_checkpoint`` needs ``dir=``, unless
the loop publishes its output directory (``OnTrainBegin.loop.output_dir``: a Lightning
Trainer's ``default_root_dir``, a Hugging Face Trainer's ``output_dir``,
``DDPAdapter(output_dir=...)``); otherwise the first save fails with an error naming
``dir``.

Dispatchers::

    inthread                       thread[:threads=N,max_pending=N]
    process[:threads=N,max_pending=N]
    remote:uri=tls://HOST:PORT,token_file=PATH,cert_file=PEM_OR_DER  (or cert_sha256=HEX)
    cluster[:address=tcp://HOST:8786][,n_workers=N,threads_per_worker=N]
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from sakura.errors import SpecError
from sakura.specs import Spec
from sakura_async.dispatch.resolve import unknown_dispatcher

__all__ = ["build_async_checkpoint", "build_async_eval", "import_object"]

DISPATCHERS = ("inthread", "thread", "process", "remote", "cluster")
"""sakura-async's own dispatchers; a spec string may name any registered one."""


def _registered_dispatchers() -> list[str]:
    from sakura.plugins import get_plugin_manager

    return get_plugin_manager().registry("dispatcher").names()


def import_object(text: str, option: str) -> Any:
    """``package.module:name`` -> the object."""
    module_name, sep, attribute = str(text).partition(":")
    if not sep or not module_name or not attribute:
        raise SpecError(f"{option} must be written package.module:name, got {text!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise SpecError(f"{option}={text!r}: cannot import {module_name!r}: {exc}") from exc
    try:
        obj = module
        for part in attribute.split("."):
            obj = getattr(obj, part)
    except AttributeError:
        raise SpecError(
            f"{option}={text!r}: {module_name!r} has no attribute {attribute!r}"
        ) from None
    return obj


def _split(
    spec: Spec, service_cls: type, own: set[str]
) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    if len(spec.args) > 1:
        raise SpecError(
            f"{spec.text or spec.name!r}: only one positional value, the dispatcher "
            f"({', '.join(_registered_dispatchers())}), is accepted; write other options as "
            "key=value"
        )
    dispatcher_name = spec.args[0] if spec.args else spec.kwargs.get("dispatcher", "thread")
    accepted = unknown_dispatcher(str(dispatcher_name))
    if accepted is not None:
        raise SpecError(
            f"{spec.text or spec.name!r}: unknown dispatcher {dispatcher_name!r}; accepted: "
            f"{accepted}"
        )
    service_params = set(inspect.signature(service_cls).parameters) | own
    service_kwargs: dict[str, Any] = {}
    dispatcher_kwargs: dict[str, Any] = {}
    for key, value in spec.kwargs.items():
        if key == "dispatcher":
            continue
        (service_kwargs if key in service_params else dispatcher_kwargs)[key] = value
    return dispatcher_name, service_kwargs, dispatcher_kwargs


def _dispatcher(name: str, options: dict[str, Any], spec: Spec) -> Any:
    from sakura.plugins import get_plugin_manager

    provided = get_plugin_manager().resolve("dispatcher", name)
    try:
        return provided.create(Spec(name=name, kwargs=options, text=name))
    except SpecError as exc:
        raise SpecError(f"{spec.text or spec.name!r}: {exc}") from exc


def build_async_eval(spec: Spec) -> Any:
    from sakura_async.eval import AsyncEval

    name, kwargs, dispatcher_kwargs = _split(spec, AsyncEval, {"fn", "payload"})
    for forbidden in ("eval_fn", "eval_payload", "state_provider", "report_to"):
        if forbidden in kwargs:
            raise SpecError(
                f"{spec.text!r}: {forbidden} cannot be given in a spec string"
                + (
                    "; name a function with fn=package.module:function"
                    if forbidden == "eval_fn"
                    else ""
                )
            )
    fn = kwargs.pop("fn", None)
    payload = kwargs.pop("payload", None)
    eval_fn = import_object(fn, "fn") if fn is not None else None
    if eval_fn is not None and not callable(eval_fn):
        raise SpecError(f"fn={fn!r} is not callable")
    eval_payload = None
    if payload is not None:
        eval_payload = import_object(payload, "payload")
        if callable(eval_payload):
            eval_payload = eval_payload()
    dispatcher = _dispatcher(name, dispatcher_kwargs, spec)
    dispatcher.owned_by_service = True  # built here for the service: the service closes it
    try:
        return AsyncEval(eval_fn, eval_payload, dispatcher, **kwargs)
    except (TypeError, ValueError):
        dispatcher.close(wait=False)
        raise


def build_async_checkpoint(spec: Spec) -> Any:
    from sakura_async.checkpoint.service import AsyncCheckpoint

    name, kwargs, dispatcher_kwargs = _split(spec, AsyncCheckpoint, set())
    if "state_provider" in kwargs:
        raise SpecError(f"{spec.text!r}: state_provider cannot be given in a spec string")
    if isinstance(kwargs.get("every"), str) and kwargs["every"].isdigit():
        kwargs["every"] = int(kwargs["every"])
    dispatcher = _dispatcher(name, dispatcher_kwargs, spec)
    dispatcher.owned_by_service = True
    try:
        return AsyncCheckpoint(dispatcher=dispatcher, **kwargs)
    except (TypeError, ValueError):
        dispatcher.close(wait=False)
        raise
