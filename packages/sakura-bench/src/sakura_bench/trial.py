"""One trial: build the workload, train it through the chosen framework and runner, and
return what was measured.  ``python -m sakura_bench.trial`` runs one trial in a fresh
process (what ``sakura-bench run`` does for every trial), printing progress lines and
writing the result as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sakura.fileio import atomic_writer

__all__ = ["PROGRESS_PREFIX", "TrialConfig", "check_compatible", "resolve_device", "run_trial"]

PROGRESS_PREFIX = "@@sakura-bench "
RUNNERS = ("baseline", "sakura")
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class TrialConfig:
    """The settings of a run (the same for each of its trials)."""

    workload: str
    runner: str
    framework: str
    services: list[str] = field(default_factory=list)
    epochs: int | None = None
    seed: int = 0
    scale: str = "auto"
    data_dir: str | None = None
    threads: int | None = None
    device: str = "auto"
    warmup_steps: int = 5
    variant: str | None = None
    """The workload's ``--variant`` (None: its default model)."""
    trial: int = 0
    # Where this trial's services write files (checkpoints ...): set per trial by the runner
    # to ``<output>/<report name>/trial-<i>``, never the current directory.
    output_dir: str | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> TrialConfig:
        return cls(**json.loads(text))


def resolve_device(option: str, local_rank: int = 0) -> Any:
    import torch

    from sakura_bench.errors import BenchError

    if option not in DEVICES:
        raise BenchError(f"--device {option!r} is not accepted; use one of {', '.join(DEVICES)}")
    if option == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda: no CUDA device is available (torch.cuda.is_available())")
    if option == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def check_compatible(
    workload_name: str, workload_cls: Any, framework_name: str, framework: Any
) -> None:
    """IncompatibleError when ``framework`` cannot run the workload."""
    from sakura_bench.errors import IncompatibleError
    from sakura_bench.registry import get_registry

    supported = workload_cls.frameworks
    reason = None
    if supported is not None and framework_name not in supported:
        reason = f"workload {workload_name!r} supports --framework {' or '.join(supported)} only"
    if reason is None:
        reason = framework.incompatibility(workload_cls)
    if reason is None:
        return
    registry = get_registry()
    fits = []
    for name in registry.names("workload"):
        try:
            cls = registry.workload(name)
        except ImportError:
            continue
        if (
            cls.frameworks is None or framework_name in cls.frameworks
        ) and framework.incompatibility(cls) is None:
            fits.append(name)
    raise IncompatibleError(
        f"--framework {framework_name} cannot run --workload {workload_name}: {reason}. "
        f"Workloads it runs: {', '.join(fits) or 'none'}"
    )


@contextlib.contextmanager
def _distributed(device_option: str) -> Iterator[tuple[int, int, Any]]:
    """``(rank, world_size, device)``; a process group when launched with several ranks."""
    import torch.distributed as dist

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    device = resolve_device(device_option, local_rank)
    if world_size <= 1:
        yield 0, 1, device
        return
    if device.type == "cuda":
        import torch

        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="env://")
    try:
        yield rank, world_size, device
    finally:
        dist.destroy_process_group()


def run_trial(
    config: TrialConfig,
    *,
    progress: Callable[[dict[str, Any]], None] | None = None,
    extra_services: Sequence[Any] = (),
) -> dict[str, Any]:
    """Run one trial in this process and return its measurements (JSON-serialisable).
    ``extra_services`` are service objects installed besides ``config.services``
    (``sakura`` runner only; for tests and programmatic use)."""
    import torch

    from sakura_bench.errors import BenchError
    from sakura_bench.framework import TrialContext
    from sakura_bench.measure import Recorder, environment, peak_memory, stats
    from sakura_bench.registry import get_registry

    started = time.perf_counter()
    if config.runner not in RUNNERS:
        raise BenchError(
            f"--runner {config.runner!r} is not accepted; use one of {', '.join(RUNNERS)}"
        )
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    registry = get_registry()
    workload_cls = registry.workload(config.workload)
    framework = registry.framework(config.framework)()
    check_compatible(config.workload, workload_cls, config.framework, framework)
    epochs = config.epochs if config.epochs is not None else workload_cls.default_epochs
    with _distributed(config.device) as (rank, world_size, device):
        variant = {"variant": config.variant} if config.variant is not None else {}
        workload = workload_cls(
            config.scale,
            data_dir=config.data_dir,
            seed=config.seed,
            name=config.workload,
            **variant,
        )
        workload.device = device
        workload.check_device(device)
        torch.manual_seed(config.seed)
        train_split = workload.train_split()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        recorder = Recorder(device, warmup_steps=config.warmup_steps, progress=progress)
        errors: list[str] = []
        with tempfile.TemporaryDirectory(prefix="sakura-bench-") as workdir:
            ctx = TrialContext(
                workload=workload,
                runtime=None,
                epochs=epochs,
                device=device,
                recorder=recorder,
                train_split=train_split,
                rank=rank,
                world_size=world_size,
                workdir=Path(workdir),
            )
            if config.runner == "baseline":
                if config.services or extra_services:
                    raise BenchError("--service is used by --runner sakura only")
                framework.run(ctx)
            else:
                errors = _run_sakura(config, ctx, framework, extra_services, rank, world_size)
        setup_s = recorder._t0 - started if recorder._t0 else None
        samples = workload.samples(train_split) * epochs
        tokens = workload.tokens(train_split)
        train_time = sum(e.train_s for e in recorder.epochs)
        times, skipped = recorder.step_times()
        model = ctx.model
        params = trainable = None
        if model is not None:
            params = sum(p.numel() for p in model.parameters())
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        final = next((e.eval for e in reversed(recorder.epochs) if e.eval), None)
        missing = [e.epoch for e in recorder.epochs if not e.eval]
        if missing:
            errors.append(f"no evaluation result for epoch(s) {missing}")
        return {
            "trial": config.trial,
            "rank": rank,
            "world_size": world_size,
            "epochs_run": len(recorder.epochs),
            "wall_s": recorder.wall_s,
            "setup_s": setup_s,
            "finish_s": recorder.finish_s,
            "epochs": [asdict(e) for e in recorder.epochs],
            "steps": recorder.total_steps,
            "warmup_steps_excluded": skipped,
            "step_time_s": stats(times),
            "samples_per_epoch": workload.samples(train_split),
            "samples_per_s": samples / recorder.wall_s if recorder.wall_s else None,
            "train_samples_per_s": samples / train_time if train_time else None,
            "tokens_per_s": tokens * epochs / recorder.wall_s
            if tokens and recorder.wall_s
            else None,
            "final_metrics": final,
            "params": params,
            "trainable_params": trainable,
            "memory": peak_memory(device),
            "errors": errors,
            "workload": workload.describe(),
            "epochs_setting": epochs,
            "environment": environment(device),
        }


def _run_sakura(
    config: TrialConfig,
    ctx: Any,
    framework: Any,
    extra_services: Sequence[Any],
    rank: int,
    world_size: int,
) -> list[str]:
    import torch

    from sakura import SakuraRuntime
    from sakura_bench.evaluation import EvalPayload, prepare, release, runs_in_process
    from sakura_bench.services import BenchProbe, build_services

    payload = EvalPayload(
        workload=config.workload,
        scale=config.scale,
        data_dir=config.data_dir,
        seed=config.seed,
        device=str(ctx.device),
        threads=torch.get_num_threads(),
        pid=os.getpid(),
        variant=config.variant,
    )
    built = build_services(
        [*config.services, *extra_services], workload=ctx.workload, payload=payload
    )
    ctx.eval_services = built.evaluating
    if config.output_dir is not None:  # the loop publishes it (OnTrainBegin.loop.output_dir)
        ctx.output_dir = Path(config.output_dir)
        ctx.output_dir.mkdir(parents=True, exist_ok=True)
    rt = SakuraRuntime(rank=rank, world_size=world_size)
    for service in built.services:
        rt.install(service)
    if built.evaluating:  # results arrive as OnValidationEnd events
        rt.install(BenchProbe(ctx.recorder))
    try:
        with rt:
            if any(runs_in_process(s) for s in built.evaluating):
                prepare(payload)  # before training: see prepare()'s docstring
            ctx.runtime = rt
            framework.run(ctx)
    finally:
        release(payload)
    errors = [f"{e.service}: {e.exception!r}" for e in rt.errors]
    for service in built.evaluating:
        for failure in getattr(service, "errors", []) or []:
            errors.append(
                f"{service.name}: evaluation of epoch {getattr(failure, 'epoch', '?')} failed: {getattr(failure, 'error', failure)!r}"
            )
    return errors


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sakura_bench.trial")
    parser.add_argument("--config", required=True, help="TrialConfig as JSON")
    parser.add_argument("--result", required=True, help="where to write the result JSON")
    args = parser.parse_args(argv)
    config = TrialConfig.from_json(args.config)

    def progress(info: dict[str, Any]) -> None:
        if int(os.environ.get("RANK", "0")) == 0:
            print(PROGRESS_PREFIX + json.dumps(info), flush=True)

    result = run_trial(config, progress=progress)
    if result["rank"] == 0:
        with atomic_writer(args.result, "w") as f:
            f.write(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
