"""Building the ``sakura`` runner's services from spec strings, through sakura's plugins.

Every ``--service SPEC`` is created by the core plugin manager
(``get_plugin_manager().create("service", spec)``), so any installed plugin's service
works, and an unknown name says which package provides it.  Services that evaluate need
the workload's evaluation, which a spec string cannot carry:

* ``async_eval[:DISPATCHER][,key=value...]`` is built as ``AsyncEval(eval_fn=...,
  eval_payload=..., dispatcher=DISPATCHER, pass_task=True, state_provider=..., **options)``
  (the task form: ``eval_fn(epoch, task)`` evaluates the weights the task carries) with the class
  that the installed plugin registers under ``async_eval`` (sakura-async);
* any other service that has an ``eval_fn`` attribute left None and a
  ``configure(eval_fn, eval_payload)`` method is configured with them.

Either way it is an *evaluating* service, and the training loop does not evaluate itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sakura import Service, SpecError, parse_spec
from sakura.plugins import get_plugin_manager
from sakura_bench.evaluation import EvalPayload, evaluate_snapshot
from sakura_bench.framework import unwrap

__all__ = ["BenchProbe", "BuiltServices", "build_services", "check_service_specs"]

ASYNC_EVAL = "async_eval"


@dataclass
class BuiltServices:
    services: list[Any] = field(default_factory=list)
    evaluating: list[Any] = field(default_factory=list)


class BenchProbe(Service):
    """Installed by the ``sakura`` runner: evaluation results that arrive as events
    (``OnValidationEnd`` from an asynchronous evaluation) go into the trial's record."""

    name = "sakura_bench_probe"
    priority = 1000

    def __init__(self, recorder: Any) -> None:
        self.recorder = recorder

    def on_validation_end(self, event: Any) -> None:
        if event.metrics:
            self.recorder.add_eval(event.epoch, event.metrics)


def check_service_specs(specs: Sequence[str]) -> None:
    """Parse every spec and resolve its name (no import): SpecError/UnknownNameError now,
    before any trial starts."""
    manager = get_plugin_manager()
    seen: set[str] = set()
    for spec in specs:
        parsed = parse_spec(spec)
        manager.resolve("service", parsed.name)
        if parsed.name == ASYNC_EVAL:
            dispatcher = parsed.args[0] if parsed.args else parsed.kwargs.get("dispatcher")
            if dispatcher is not None:
                manager.resolve("dispatcher", str(dispatcher))
        if parsed.name in seen:
            raise SpecError(f"--service {parsed.name} is given twice")
        seen.add(parsed.name)


def build_services(specs: Sequence[Any], *, workload: Any, payload: EvalPayload) -> BuiltServices:
    """The services of ``specs`` (spec strings, or service objects used as they are)."""
    manager = get_plugin_manager()
    built = BuiltServices()
    for spec in specs:
        if not isinstance(spec, str):
            built.services.append(spec)
            continue
        parsed = parse_spec(spec)
        provided = manager.resolve("service", parsed.name)
        if parsed.name == ASYNC_EVAL:
            service = _async_eval(provided, parsed, workload, payload)
            built.evaluating.append(service)
        else:
            service = provided.create(parsed)
            if getattr(service, "eval_fn", False) is None and callable(
                getattr(service, "configure", None)
            ):
                service.configure(evaluate_snapshot, payload)
                built.evaluating.append(service)
        built.services.append(service)
    return built


def _async_eval(provided: Any, parsed: Any, workload: Any, payload: EvalPayload) -> Any:
    cls = provided.load()
    args, options = list(parsed.args), dict(parsed.kwargs)
    if len(args) > 1:
        raise SpecError(
            f"--service {parsed}: async_eval takes one positional value, the dispatcher "
            f"(async_eval:thread, async_eval:process), then key=value options"
        )
    if args and "dispatcher" in options:
        raise SpecError(f"--service {parsed}: the dispatcher is given twice")
    dispatcher = args[0] if args else options.pop("dispatcher", None)
    for reserved in ("eval_fn", "eval_payload", "pass_task", "state_provider"):
        if reserved in options:
            raise SpecError(f"--service {parsed}: {reserved} is set by sakura-bench")
    try:
        return cls(
            eval_fn=evaluate_snapshot,
            eval_payload=payload,
            dispatcher=None if dispatcher is None else str(dispatcher),
            pass_task=True,
            state_provider=lambda model: workload.eval_state(unwrap(model)),
            **options,
        )
    except (TypeError, ValueError) as exc:
        raise SpecError(f"--service {parsed} was rejected by {provided.describe()}: {exc}") from exc
