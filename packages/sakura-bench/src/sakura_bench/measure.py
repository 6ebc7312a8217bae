"""Measuring: the statistics every sakura benchmark reports, the machine it ran on, and a
trial's step and epoch times, memory and environment.

The statistics (no torch needed; ``benchmarks/*.py`` use them too):

- :func:`summary` of repeated measurements: median, min-max (the spread), quartiles and
  mean, as a :class:`Summary` that formats itself (:meth:`Summary.format`);
- :func:`ratios` / :func:`ratio_summary`: per-trial ratios of paired measurements (trial
  ``i`` of A over trial ``i`` of B: the same moment of a shared machine on both sides);
- :func:`interleaved`: trials of two or more contenders, interleaved (A B C, B C A, ...)
  after an untimed warm-up, so that drift in machine speed lands on all alike;
- :func:`load_note`, :func:`cpu_description` and :func:`machine_note`: the load average and
  the CPU model and instruction-set flags, printed with every figure so that figures from
  different machines (or a busy one) are not mixed.

Step times are taken without synchronising with the device on every step (that would
change what is measured): on CPU a ``perf_counter`` stamp per step; on CUDA an event
recorded per step, read after the epoch's one synchronisation.  Epoch and trial
boundaries synchronise CUDA so that their wall times cover the device's work.  torch is
imported when a trial is measured, not with this module.
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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    import torch

__all__ = [
    "Recorder",
    "Summary",
    "cpu_description",
    "cpu_flags",
    "cpu_model",
    "environment",
    "interleaved",
    "load_average",
    "load_note",
    "machine_note",
    "peak_memory",
    "ratio_summary",
    "ratios",
    "rotated",
    "stats",
    "summary",
    "versions",
]

T = TypeVar("T")

# --- statistics -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Summary:
    """Repeated measurements of one quantity: the median, the min-max spread, the quartiles
    (``q1``/``q3``: the inner half of the values) and the mean; ``values`` in the order
    measured."""

    median: float
    min: float
    max: float
    q1: float
    q3: float
    mean: float
    values: tuple[float, ...]

    @property
    def n(self) -> int:
        return len(self.values)

    def scaled(self, factor: float) -> Summary:
        """The same summary in another unit (``factor``: 1e3 for seconds to ms)."""
        return summary([v * factor for v in self.values])

    def format(
        self, digits: int = 3, unit: str = "", *, scale: float = 1.0, iqr: bool = False
    ) -> str:
        """``"median<unit> (min-max)"``, e.g. ``summary(ts).format(1, " ms", scale=1e3)`` ->
        ``"12.3 ms (11.9-14.0)"``, ``ratio.format(2, "x")`` -> ``"1.52x (1.40-1.61)"``;
        with ``iqr`` the quartiles too: ``"1.0040 (IQR 0.9990-1.0100, min-max 0.9800-1.0200)"``.
        One value: no spread."""

        def f(value: float) -> str:
            return f"{value * scale:.{digits}f}"

        text = f"{f(self.median)}{unit}"
        if self.n < 2:
            return text
        span = f"{f(self.min)}-{f(self.max)}"
        if iqr:
            return f"{text} (IQR {f(self.q1)}-{f(self.q3)}, min-max {span})"
        return f"{text} ({span})"

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: median, min, max, q1, q3, mean, n, values."""
        return {
            "median": self.median,
            "min": self.min,
            "max": self.max,
            "q1": self.q1,
            "q3": self.q3,
            "mean": self.mean,
            "n": self.n,
            "values": list(self.values),
        }


def summary(values: Iterable[float]) -> Summary:
    """The :class:`Summary` of ``values`` (at least one).  Quartiles are
    ``statistics.quantiles(values, n=4)`` (the exclusive method); with one value all
    figures are that value."""
    data = tuple(float(v) for v in values)
    if not data:
        raise ValueError("summary() needs at least one value, got none")
    q1, q3 = (data[0], data[0])
    if len(data) >= 2:
        q1, _, q3 = statistics.quantiles(data, n=4)
    return Summary(
        median=statistics.median(data),
        min=min(data),
        max=max(data),
        q1=q1,
        q3=q3,
        mean=statistics.fmean(data),
        values=data,
    )


def ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    """Per-trial ratios of paired measurements: ``numerators[i] / denominators[i]``.
    Both must hold one figure per trial, in the same trial order."""
    if len(numerators) != len(denominators):
        raise ValueError(
            f"ratios() pairs trial by trial: {len(numerators)} numerators against "
            f"{len(denominators)} denominators"
        )
    return [a / b for a, b in zip(numerators, denominators, strict=True)]


def ratio_summary(numerators: Sequence[float], denominators: Sequence[float]) -> Summary:
    """The :class:`Summary` of the per-trial :func:`ratios`: a ratio with its spread (the
    median of the ratios, not the ratio of the medians)."""
    return summary(ratios(numerators, denominators))


def rotated(items: Sequence[T], shift: int) -> list[T]:
    """``items`` rotated left by ``shift`` (modulo their number): the order of trial
    ``shift`` in :func:`interleaved`."""
    if not items:
        return []
    shift %= len(items)
    return [*items[shift:], *items[:shift]]


def interleaved(
    contenders: Mapping[str, Callable[[int], T]],
    trials: int,
    *,
    warmup: int = 0,
    on_trial: Callable[[int, dict[str, T]], None] | None = None,
) -> dict[str, list[T]]:
    """Run trials of every contender, interleaved: trial ``i`` calls each contender once
    with ``i``, in their order rotated by ``i`` (A B C, B C A, C A B, ...), so that no
    contender always runs first or after the same neighbour and drift in machine speed
    lands on all alike.  First ``warmup`` untimed rounds (each contender called with
    ``-1 - round``; results dropped).  Returns ``{name: [result of trial 0, 1, ...]}``;
    ``on_trial(i, {name: result})`` is called after each trial (progress lines).

    A contender measures itself and returns what it measured (seconds, a tuple of clocks,
    anything): ``interleaved`` only decides who runs when."""
    if trials < 1:
        raise ValueError(f"trials must be >= 1, got {trials}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if not contenders:
        raise ValueError("interleaved() needs at least one contender, got none")
    names = list(contenders)
    for rnd in range(warmup):
        for name in rotated(names, rnd):
            contenders[name](-1 - rnd)
    results: dict[str, list[T]] = {name: [] for name in names}
    for trial in range(trials):
        this: dict[str, T] = {}
        for name in rotated(names, trial):
            this[name] = contenders[name](trial)
        for name in names:
            results[name].append(this[name])
        if on_trial is not None:
            on_trial(trial, {name: this[name] for name in names})
    return results


def stats(values: list[float]) -> dict[str, float] | None:
    """median, min, max, mean and spread (max - min) of ``values``; None if empty (the
    RunReport's summaries)."""
    if not values:
        return None
    s = summary(values)
    return {
        "median": s.median,
        "min": s.min,
        "max": s.max,
        "mean": s.mean,
        "spread": s.max - s.min,
        "n": s.n,
    }


# --- the machine ----------------------------------------------------------------------------

# Instruction-set flags that decide how fast a CPU kernel runs (x86 /proc/cpuinfo names,
# then Arm's): a figure from a CPU without one of them is not comparable with one from a
# CPU that has it.
SIMD_FLAGS = (
    "sse4_2",
    "avx",
    "f16c",
    "fma",
    "avx2",
    "avx_vnni",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "asimd",
    "asimdhp",
    "bf16",
    "i8mm",
    "sve",
    "sve2",
)


def _cpuinfo(cpuinfo: str | None) -> str:
    if cpuinfo is not None:
        return cpuinfo
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name (``/proc/cpuinfo``; elsewhere ``platform``'s word for it).
    ``cpuinfo``: that file's text (tests)."""
    for line in _cpuinfo(cpuinfo).splitlines():
        if line.startswith(("model name", "Model", "Hardware")) and ":" in line:
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_flags(cpuinfo: str | None = None) -> tuple[str, ...]:
    """The :data:`SIMD_FLAGS` the CPU has, in that order (empty where ``/proc/cpuinfo``
    does not exist)."""
    for line in _cpuinfo(cpuinfo).splitlines():
        if line.startswith(("flags", "Features")) and ":" in line:
            present = set(line.split(":", 1)[1].split())
            return tuple(flag for flag in SIMD_FLAGS if flag in present)
    return ()


def _usable_cpus() -> int | None:
    """The CPUs this process may run on (None where the platform cannot say)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return None


def cpu_description(cpuinfo: str | None = None) -> str:
    """``"<model>, <n> CPUs usable; flags avx2 fma ..."``: what a CPU figure depends on."""
    flags = cpu_flags(cpuinfo)
    return (
        f"{cpu_model(cpuinfo)}, {_usable_cpus() or os.cpu_count()} CPUs usable; "
        f"flags {' '.join(flags) if flags else 'unknown'}"
    )


def load_average() -> tuple[float, float, float] | None:
    """The 1, 5 and 15 minute load averages (None where the platform has none)."""
    try:
        one, five, fifteen = os.getloadavg()
    except (OSError, AttributeError):
        return None
    return (one, five, fifteen)


def load_note(load: tuple[float, float, float] | None = None) -> str:
    """``"1.52 1.20 0.98"`` (1, 5, 15 minutes) of ``load`` (default: now), ``"n/a"``
    where there is none."""
    if load is None:
        load = load_average()
    return "n/a" if load is None else " ".join(f"{x:.2f}" for x in load)


def machine_note(load_before: tuple[float, float, float] | None = None) -> str:
    """One line on the machine: CPU (model, usable CPUs, SIMD flags) and load average (with
    ``load_before``: before the run and now)."""
    load = f"load average {load_note()}"
    if load_before is not None:
        load = f"load average {load_note(load_before)} before, {load_note()} after"
    return f"CPU: {cpu_description()}; {load}"


def versions(distributions: Iterable[str]) -> dict[str, str | None]:
    """The installed version of each distribution (None: not installed)."""
    out: dict[str, str | None] = {}
    for name in distributions:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


# --- a trial --------------------------------------------------------------------------------


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
            import torch

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
            import torch

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
        import torch

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
    import torch

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
    """Versions, CPU (model and SIMD flags), threads, GPU, git revision and machine load of
    this run."""
    import psutil
    import torch

    installed: dict[str, str | None] = {"python": platform.python_version()}
    installed.update(versions(_PACKAGES))
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
    load = load_average()
    return {
        "versions": installed,
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_flags": list(cpu_flags()),
        "cpu_physical_cores": psutil.cpu_count(logical=False),
        "cpu_logical_cores": psutil.cpu_count(logical=True),
        "cpu_affinity": _usable_cpus(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "mkl_num_threads": os.environ.get("MKL_NUM_THREADS"),
        "device": str(device),
        "gpu": gpu,
        "git": _git(),
        "load_average": None if load is None else list(load),
    }
