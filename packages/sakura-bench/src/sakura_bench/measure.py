"""Measuring a trial: step and epoch times, memory, and the environment.

Step times are taken without synchronising with the device on every step (that would
change what is measured): on CPU a ``perf_counter`` stamp per step; on CUDA an event
recorded per step, read after the epoch's one synchronisation.  Epoch and trial
boundaries synchronise CUDA so that their wall times cover the device's work.
"""

from __future__ import annotations

import itertools
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

__all__ = ["Recorder", "environment", "peak_memory", "stats"]


def stats(values: list[float]) -> dict[str, float] | None:
    """median, min, max, mean and spread (max - min) of ``values``; None if empty."""
    if not values:
        return None
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "mean": statistics.fmean(values),
        "spread": max(values) - min(values),
        "n": len(values),
    }


@dataclass
class EpochRecord:
    epoch: int
    train_s: float = 0.0
    eval_s: float | None = None
    """Time the training thread spent evaluating (or waiting for an evaluation)."""
    steps: int = 0
    train_loss: float | None = None
    eval: dict[str, float] | None = None


@dataclass
class Recorder:
    """What a framework's loop reports while it trains: the harness owns the clock.

    The loop calls :meth:`train_begin`, then per epoch :meth:`epoch_begin`,
    :meth:`step` after every optimizer step, :meth:`train_phase_end` when the epoch's
    training batches are done, :meth:`eval_begin`/:meth:`eval_end` around a synchronous
    evaluation, :meth:`epoch_end`; finally :meth:`train_end`.  Evaluation results that
    arrive later (asynchronous evaluation) go to :meth:`add_eval`.
    """

    device: torch.device
    warmup_steps: int = 5
    progress: Callable[[dict[str, Any]], None] | None = None
    epochs: list[EpochRecord] = field(default_factory=list)
    wall_s: float = 0.0
    finish_s: float | None = None
    """Time from the last epoch's end to the end of training (pending asynchronous work)."""
    _t0: float = 0.0
    _finish_t0: float | None = None
    _epoch_t0: float = 0.0
    _eval_t0: float = 0.0
    _stamps: list[float] = field(default_factory=list)
    _events: list[Any] = field(default_factory=list)
    _step_times: list[float] = field(default_factory=list)
    _late_evals: dict[int, dict[str, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._cuda = self.device.type == "cuda"

    def _sync(self) -> None:
        if self._cuda:
            torch.cuda.synchronize(self.device)

    # --- the loop's calls ---------------------------------------------------------------

    def train_begin(self) -> None:
        self._sync()
        self._t0 = time.perf_counter()

    def epoch_begin(self, epoch: int) -> None:
        self._sync()
        self.epochs.append(EpochRecord(epoch))
        self._epoch_t0 = time.perf_counter()
        self._mark()

    def step(self) -> None:
        """After an optimizer step: one timestamp (CPU) or one recorded event (CUDA)."""
        self._mark()

    def _mark(self) -> None:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._events.append(event)
        else:
            self._stamps.append(time.perf_counter())

    def train_phase_end(self, train_loss: Any = None) -> None:
        """The epoch's training batches are done (``train_loss``: a tensor or number)."""
        self._sync()
        record = self.epochs[-1]
        record.train_s = time.perf_counter() - self._epoch_t0
        if self._cuda:
            times = [a.elapsed_time(b) / 1000.0 for a, b in itertools.pairwise(self._events)]
        else:
            times = [b - a for a, b in itertools.pairwise(self._stamps)]
        record.steps = len(times)
        self._step_times += times
        self._stamps, self._events = [], []
        if train_loss is not None:
            record.train_loss = float(train_loss)

    def eval_begin(self) -> None:
        self._sync()
        self._eval_t0 = time.perf_counter()

    def eval_end(self, metrics: Mapping[str, float] | None) -> None:
        self._sync()
        record = self.epochs[-1]
        record.eval_s = (record.eval_s or 0.0) + time.perf_counter() - self._eval_t0
        if metrics is not None:
            record.eval = dict(metrics)

    def add_eval(self, epoch: int, metrics: Mapping[str, Any]) -> None:
        """An evaluation result that arrived on its own (asynchronous evaluation)."""
        clean = {}
        for key, value in metrics.items():
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                clean[key] = float(value)
        if not clean:
            return
        for record in self.epochs:
            if record.epoch == epoch:
                record.eval = clean
                return
        self._late_evals[epoch] = clean

    def epoch_end(self, epoch: int) -> None:
        if self.progress is not None:
            record = self.epochs[-1]
            self.progress(
                {
                    "event": "epoch",
                    "epoch": epoch,
                    "train_s": record.train_s,
                    "eval_s": record.eval_s,
                }
            )

    def finish_begin(self) -> None:
        """The last epoch is over; what follows until :meth:`train_end` is the loop's
        wind-down (waiting for pending asynchronous evaluations)."""
        self._sync()
        self._finish_t0 = time.perf_counter()

    def train_end(self) -> None:
        self._sync()
        now = time.perf_counter()
        self.wall_s = now - self._t0
        if self._finish_t0 is not None:
            self.finish_s = now - self._finish_t0
        for record in self.epochs:
            if record.eval is None and record.epoch in self._late_evals:
                record.eval = self._late_evals.pop(record.epoch)

    # --- results ------------------------------------------------------------------------

    @property
    def total_steps(self) -> int:
        return len(self._step_times)

    def step_times(self) -> tuple[list[float], int]:
        """The step times after the warm-up, and how many warm-up steps were dropped
        (``warmup_steps``, but never more than half of the steps)."""
        skip = min(self.warmup_steps, len(self._step_times) // 2)
        return self._step_times[skip:], skip


def peak_memory(device: torch.device) -> dict[str, Any]:
    """Peak resident memory (MiB) and CPU time (user + system, s) of this process and of its
    waited-for children (worker processes), and CUDA's peak allocated/reserved memory."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    self_kb, children_kb = own.ru_maxrss, children.ru_maxrss
    scale = 1.0 / 1024 if sys.platform != "darwin" else 1.0 / (1024 * 1024)
    out: dict[str, Any] = {
        "peak_rss_mib": round(self_kb * scale, 1),
        "peak_rss_children_mib": round(children_kb * scale, 1) if children_kb else None,
        "cpu_s": round(own.ru_utime + own.ru_stime, 3),
        "cpu_children_s": round(children.ru_utime + children.ru_stime, 3),
        "cuda": None,
    }
    if device.type == "cuda":
        out["cuda"] = {
            "peak_allocated_mib": round(torch.cuda.max_memory_allocated(device) / 2**20, 1),
            "peak_reserved_mib": round(torch.cuda.max_memory_reserved(device) / 2**20, 1),
        }
    return out


_PACKAGES = (
    "sakura-core",
    "sakura-adapters",
    "sakura-bench",
    "sakura-async",
    "sakura-precision",
    "sakura-zero",
    "sakura-offload",
    "sakura-quant",
    "torch",
    "lightning",
    "transformers",
    "accelerate",
    "peft",
    "bitsandbytes",
)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git() -> dict[str, Any] | None:
    here = Path(__file__).resolve().parent
    for where in (here, Path.cwd()):
        try:
            rev = subprocess.run(
                ["git", "-C", str(where), "rev-parse", "HEAD"],
                capture_output=True,
                text=True,
                timeout=5,
                check=True,
            ).stdout.strip()
            status = subprocess.run(
                ["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
                capture_output=True,
                text=True,
                timeout=5,
                check=True,
            ).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        return {"revision": rev, "dirty": bool(status.strip()), "where": str(where)}
    return None


def environment(device: torch.device) -> dict[str, Any]:
    """Versions, CPU, threads, GPU, git revision and machine load of this run."""
    import psutil

    versions: dict[str, str | None] = {"python": platform.python_version()}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    gpu = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(device if device.type == "cuda" else 0)
        gpu = {
            "name": props.name,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "capability": f"{props.major}.{props.minor}",
            "count": torch.cuda.device_count(),
            "cuda": torch.version.cuda,
        }
    try:
        load = list(os.getloadavg())
    except OSError:
        load = None
    return {
        "versions": versions,
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_physical_cores": psutil.cpu_count(logical=False),
        "cpu_logical_cores": psutil.cpu_count(logical=True),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "mkl_num_threads": os.environ.get("MKL_NUM_THREADS"),
        "device": str(device),
        "gpu": gpu,
        "git": _git(),
        "load_average": load,
    }
