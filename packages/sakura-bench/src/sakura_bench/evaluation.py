"""Evaluation for services that evaluate off the training thread (``async_eval``).

Such a service receives :func:`evaluate_snapshot` as its ``eval_fn`` and an
:class:`EvalPayload` as its payload.  The payload names the workload instead of carrying
its model and data: wherever the evaluation runs (a thread of the training process, a
worker process), the first call rebuilds the workload from the plugins, its evaluation
data and a model (deterministic for the seed), and keeps them; every call then loads the
epoch's weights into that model and evaluates.  A worker process therefore receives only
the weights each epoch, never the evaluation set.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["EvalPayload", "evaluate_snapshot", "prepare", "runs_in_process", "strip_prefix"]

IN_PROCESS_KINDS = ("inthread", "thread")
"""Dispatcher kinds that run their tasks inside the training process."""

PREFIX = "bench_model."
"""State-dict prefix of the workload's model inside the Lightning module."""


@dataclass(frozen=True)
class EvalPayload:
    """How to rebuild a workload's evaluation anywhere (picklable, hashable)."""

    workload: str
    scale: str
    data_dir: str | None
    seed: int
    device: str
    threads: int
    """The training thread's torch thread count: evaluations use the same (a thread that
    torch did not start would otherwise use its default, one per core)."""
    pid: int
    variant: str | None = None
    """The workload's ``--variant`` (None: its default model)."""


_CACHE: dict[EvalPayload, tuple[Any, Any, Any]] = {}
_LOCK = threading.Lock()


def strip_prefix(state: Mapping[str, Any]) -> dict[str, Any]:
    """A state dict of the Lightning module, without its ``bench_model.`` prefix."""
    if state and all(k.startswith(PREFIX) for k in state):
        return {k[len(PREFIX) :]: v for k, v in state.items()}
    return dict(state)


def _build(payload: EvalPayload) -> tuple[Any, Any, Any]:
    import torch

    from sakura_bench.registry import get_registry

    cls = get_registry().workload(payload.workload)
    variant = {"variant": payload.variant} if payload.variant is not None else {}
    workload = cls(
        payload.scale,
        data_dir=payload.data_dir,
        seed=payload.seed,
        name=payload.workload,
        **variant,
    )
    device = torch.device(payload.device)
    workload.device = device
    model = workload.make_model().to(device)
    batches = workload.eval_batches(workload.eval_split())
    return workload, model, batches


def runs_in_process(service: Any) -> bool:
    """Whether ``service`` evaluates inside this process (its dispatcher's ``kind`` is
    ``inthread`` or ``thread``)."""
    return getattr(getattr(service, "dispatcher", None), "kind", None) in IN_PROCESS_KINDS


def prepare(payload: EvalPayload) -> None:
    """Build the evaluation model and data now, in the calling (training) thread, with the
    random state saved and restored around it.

    For evaluations that run on a thread of the training process.  Building the model
    seeds torch's random generator, which is process-wide: a background thread doing it
    in the middle of an epoch would change the training's dropout masks and data order.
    """
    import torch

    with _LOCK:
        if payload in _CACHE:
            return
        devices = (
            [torch.device(payload.device).index or 0] if payload.device.startswith("cuda") else []
        )
        with torch.random.fork_rng(devices=devices):
            _CACHE[payload] = _build(payload)


def release(payload: EvalPayload) -> None:
    """Forget what :func:`prepare` or an evaluation built for ``payload``."""
    with _LOCK:
        _CACHE.pop(payload, None)


def evaluate_snapshot(epoch: int, task: Any) -> dict[str, float]:
    """``eval_fn(epoch, task)`` of the asynchronous evaluation services: evaluate the
    weights in ``task.state_dict`` on the workload named by ``task.payload``."""
    import torch

    payload = task.payload
    if not isinstance(payload, EvalPayload):
        raise TypeError(f"the task payload must be an EvalPayload, got {type(payload).__name__}")
    if torch.get_num_threads() != payload.threads:
        torch.set_num_threads(payload.threads)
    with _LOCK:
        entry = _CACHE.get(payload)
        if entry is None:
            if payload.pid == os.getpid():
                raise RuntimeError(
                    "an evaluation on a thread of the training process found nothing prepared; "
                    "call sakura_bench.evaluation.prepare(payload) before training starts "
                    "(building here would reseed the process-wide random generator mid-training)"
                )
            entry = _CACHE[payload] = _build(payload)
        workload, model, batches = entry
        workload.load_eval_state(model, strip_prefix(task.state_dict))
        return workload.evaluate(  # type: ignore[no-any-return]
            model, batches, torch.device(payload.device), distributed=False
        )
