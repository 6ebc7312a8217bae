"""``sakura-bench run``: validate the settings, run every trial in a fresh process, write
the RunReport.

Each trial is ``python -m sakura_bench.trial`` in its own interpreter: no state (warm
caches, allocator pools, a compiled graph, a worker process, the thread pool) carries from
one trial to the next, and the order of runs cannot favour either side.  ``--threads T``
sets ``torch.set_num_threads(T)`` in the trial and ``OMP_NUM_THREADS``/``MKL_NUM_THREADS``
in its environment, so worker processes the trial starts use the same setting.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sakura_bench.errors import BenchError, TrialFailed
from sakura_bench.trial import PROGRESS_PREFIX, RUNNERS, TrialConfig

__all__ = ["RunOptions", "ValidatedRun", "execute", "execute_interleaved", "validate"]

Progress = Callable[[dict[str, Any]], None]


@dataclass
class RunOptions:
    config: TrialConfig
    output: Path
    trials: int = 3
    nproc: int = 1
    in_process: bool = False


@dataclass
class ValidatedRun:
    options: RunOptions
    epochs: int
    provided_by: dict[str, str | None]


def _positive(option: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise BenchError(f"{option} must be an integer >= {minimum}, got {value!r}")


def validate(options: RunOptions) -> ValidatedRun:
    """Every check that can fail before a trial starts, with an error naming the option,
    the value and what is accepted."""
    from sakura_bench.registry import get_registry
    from sakura_bench.services import check_service_specs
    from sakura_bench.trial import check_compatible, resolve_device

    c = options.config
    if c.runner not in RUNNERS:
        raise BenchError(f"--runner {c.runner!r} is not accepted; use one of {', '.join(RUNNERS)}")
    _positive("--trials", options.trials)
    _positive("--nproc", options.nproc)
    _positive("--warmup-steps", c.warmup_steps, 0)
    _positive("--seed", c.seed, 0)
    if c.epochs is not None:
        _positive("--epochs", c.epochs)
    if c.threads is not None:
        _positive("--threads", c.threads)
    if c.data_dir is not None and not Path(c.data_dir).is_dir():
        raise BenchError(f"--data {c.data_dir!r} is not a directory")
    if c.runner == "baseline" and c.services:
        raise BenchError(
            f"--service {' '.join(c.services)}: services are used by --runner sakura only; "
            f"the baseline is the framework's vanilla loop"
        )
    registry = get_registry()
    workload_entry = registry.get("workload", c.workload)
    framework_entry = registry.get("framework", c.framework)
    workload_cls = workload_entry.load()
    framework = framework_entry.load()()
    check_compatible(c.workload, workload_cls, c.framework, framework)
    if c.scale == "auto":
        c = options.config = replace(c, scale=workload_cls.default_scale(resolve_device(c.device)))
    if c.scale not in workload_cls.configs:
        raise BenchError(
            f"--scale {c.scale!r} is not a scale of workload {c.workload!r}; accepted: "
            f"auto, {', '.join(workload_cls.configs)}"
        )
    if options.nproc > 1 and c.framework != "pytorch-ddp":
        raise BenchError(
            f"--nproc {options.nproc}: several ranks are supported by --framework pytorch-ddp "
            f"only (got {c.framework})"
        )
    if options.nproc > 1 and options.in_process:
        raise BenchError("--in-process runs one rank; it cannot be combined with --nproc > 1")
    device = resolve_device(c.device)
    variant = {"variant": c.variant} if c.variant is not None else {}
    probe = workload_cls(c.scale, data_dir=c.data_dir, seed=c.seed, name=c.workload, **variant)
    probe.check_device(device)
    check_service_specs(c.services)
    epochs = c.epochs if c.epochs is not None else workload_cls.default_epochs
    return ValidatedRun(
        options,
        epochs,
        {"workload": workload_entry.provider, "framework": framework_entry.provider},
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def trial_environment(threads: int | None) -> dict[str, str]:
    env = dict(os.environ)
    if threads is not None:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    return env


@contextlib.contextmanager
def _log_files(directory: Path, count: int) -> Iterator[list[Any]]:
    files = [open(directory / f"rank{r}.log", "w+", encoding="utf-8") for r in range(count)]  # noqa: SIM115
    try:
        yield files
    finally:
        for f in files:
            f.close()


def spawn_trial(config: TrialConfig, nproc: int, progress: Progress | None) -> dict[str, Any]:
    """Run one trial as ``nproc`` fresh processes (ranks); return rank 0's result."""
    with tempfile.TemporaryDirectory(prefix="sakura-bench-trial-") as tmp:
        directory = Path(tmp)
        result_path = directory / "result.json"
        command = [
            sys.executable,
            "-m",
            "sakura_bench.trial",
            "--config",
            config.to_json(),
            "--result",
            str(result_path),
        ]
        base = trial_environment(config.threads)
        port = _free_port() if nproc > 1 else None
        started = time.perf_counter()
        tail: collections.deque[str] = collections.deque(maxlen=60)
        with _log_files(directory, nproc) as logs:
            procs = []
            for rank in range(nproc):
                env = dict(base)
                if nproc > 1:
                    env.update(
                        RANK=str(rank),
                        LOCAL_RANK=str(rank),
                        WORLD_SIZE=str(nproc),
                        LOCAL_WORLD_SIZE=str(nproc),
                        MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(port),
                    )
                    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
                procs.append(
                    subprocess.Popen(
                        command,
                        stdout=subprocess.PIPE if rank == 0 else logs[rank],
                        stderr=logs[rank],
                        env=env,
                        text=True,
                    )
                )

            def read_progress() -> None:
                for line in procs[0].stdout or ():
                    if line.startswith(PROGRESS_PREFIX):
                        if progress is not None:
                            with contextlib.suppress(ValueError):
                                progress(json.loads(line[len(PROGRESS_PREFIX) :]))
                    else:
                        tail.append(line.rstrip("\n"))

            reader = threading.Thread(target=read_progress, daemon=True)
            reader.start()
            failed = None
            while True:
                codes = [p.poll() for p in procs]
                failed = next((r for r, c in enumerate(codes) if c not in (None, 0)), None)
                if failed is not None or all(c == 0 for c in codes):
                    break
                time.sleep(0.05)
            if failed is not None:
                for p in procs:
                    if p.poll() is None:
                        p.terminate()
                for p in procs:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        p.wait(timeout=10)
            reader.join(timeout=10)
            process_s = time.perf_counter() - started
            if failed is not None:
                logs[failed].seek(0)
                lines = logs[failed].read().splitlines()[-40:]
                if failed == 0:
                    lines = [*tail, *lines][-40:]
                raise TrialFailed(
                    f"trial {config.trial} failed (rank {failed} exited with "
                    f"{procs[failed].returncode}):\n" + "\n".join(lines)
                )
        if not result_path.is_file():
            raise TrialFailed(f"trial {config.trial} wrote no result")
        result: dict[str, Any] = json.loads(result_path.read_text())
        result["process_s"] = process_s
        return result


def _run_one(run: ValidatedRun, i: int, on_progress: Progress | None) -> dict[str, Any]:
    """Trial ``i`` of ``run``: in this process or, normally, in a fresh one."""
    from sakura_bench.report import report_filename
    from sakura_bench.trial import run_trial

    options = run.options
    c = options.config
    artifacts = (
        options.output / Path(report_filename(c.workload, c.runner, c.framework, c.variant)).stem
    )
    config = replace(c, trial=i, output_dir=str(artifacts.resolve() / f"trial-{i}"))
    if options.in_process:
        started = time.perf_counter()
        result = run_trial(config, progress=on_progress)
        result["process_s"] = time.perf_counter() - started
        return result
    return spawn_trial(config, options.nproc, on_progress)


def _write(
    run: ValidatedRun, results: list[dict[str, Any]], schedule: str
) -> tuple[Path, dict[str, Any]]:
    from sakura_bench.report import build_report, report_filename, write_report

    options = run.options
    c = options.config
    settings = {
        "trials": options.trials,
        "epochs": run.epochs,
        "seed": c.seed,
        "scale": c.scale,
        "data": c.data_dir,
        "threads": c.threads,
        "device": c.device,
        "warmup_steps": c.warmup_steps,
        "isolation": "in-process" if options.in_process else "process per trial",
        "nproc": options.nproc,
        "schedule": schedule,
        "variant": c.variant,
    }
    report = build_report(
        workload=c.workload,
        runner=c.runner,
        framework=c.framework,
        services=c.services,
        settings=settings,
        trials=results,
        provided_by=run.provided_by,
    )
    name = report_filename(c.workload, c.runner, c.framework, c.variant)
    path = write_report(report, options.output / name)
    return path, report


def execute(
    run: ValidatedRun,
    *,
    on_trial_start: Callable[[int], None] | None = None,
    on_progress: Progress | None = None,
    on_trial_end: Callable[[int, dict[str, Any]], None] | None = None,
) -> tuple[Path, dict[str, Any]]:
    """Run the trials and write the report; return its path and contents."""
    results = []
    for i in range(run.options.trials):
        if on_trial_start is not None:
            on_trial_start(i)
        result = _run_one(run, i, on_progress)
        results.append(result)
        if on_trial_end is not None:
            on_trial_end(i, result)
    return _write(run, results, "sequential")


def execute_interleaved(
    runs: Sequence[ValidatedRun],
    *,
    on_trial_start: Callable[[int, int], None] | None = None,
    on_progress: Progress | None = None,
    on_trial_end: Callable[[int, int, dict[str, Any]], None] | None = None,
) -> list[tuple[Path, dict[str, Any]]]:
    """Run the trials of several runs in turn -- round ``i`` runs trial ``i`` of each, in
    the given order on even rounds and reversed on odd ones (A B, B A, A B...) -- so that a
    shared machine's slow drift and any order effect land on every side alike; then write
    each run's report.  Callbacks get ``(run index, trial)``."""
    if not runs:
        raise BenchError("execute_interleaved needs at least one run")
    trials = {run.options.trials for run in runs}
    if len(trials) != 1:
        raise BenchError(f"interleaved runs need the same number of trials, got {sorted(trials)}")
    results: list[list[dict[str, Any]]] = [[] for _ in runs]
    for i in range(trials.pop()):
        order = range(len(runs)) if i % 2 == 0 else range(len(runs) - 1, -1, -1)
        for k in order:
            if on_trial_start is not None:
                on_trial_start(k, i)
            result = _run_one(runs[k], i, on_progress)
            results[k].append(result)
            if on_trial_end is not None:
                on_trial_end(k, i, result)
    schedule = "interleaved: " + " | ".join(
        " ".join(
            [
                r.options.config.runner
                + (f"[{r.options.config.variant}]" if r.options.config.variant else ""),
                *r.options.config.services,
            ]
        )
        for r in runs
    )
    return [_write(run, rs, schedule) for run, rs in zip(runs, results, strict=True)]
