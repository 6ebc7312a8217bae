"""Helpers shared by the benchmarks that are not statistics (those are
``sakura_bench.measure``'s: summaries, ratios, interleaved trials, load and CPU notes):
the overhead ones' no-op services, thread pinning and verdicts, the memory ones'
``/proc/self/status`` reader, and a JSON writer that knows ``measure.Summary``.
``nox -s bench`` skips ``_``-prefixed files, so this one only runs through them."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = [
    "make_noop_services",
    "overhead_row",
    "overhead_row_text",
    "pin_threads",
    "require_status_kib",
    "run_environment",
    "status_kib",
    "verdict",
    "write_json",
]


def pin_threads(threads: int) -> None:
    """Pin BLAS/OpenMP to ``threads`` threads; must run before torch is imported (Lightning
    also leaves torch's thread count alone when OMP_NUM_THREADS is set)."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)


def _jsonable(value: Any) -> Any:
    if hasattr(value, "as_dict"):  # sakura_bench.measure.Summary
        return value.as_dict()
    if isinstance(value, (Path, set, frozenset, tuple)):
        return str(value) if isinstance(value, Path) else list(value)
    raise TypeError(f"not JSON-serialisable: {type(value).__name__}")


def write_json(path: str | os.PathLike[str], data: Any) -> None:
    """``data`` as indented JSON at ``path`` (its folder made); summaries as their dicts."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(data, indent=2, default=_jsonable) + "\n", encoding="utf-8")


def status_kib(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ``RssAnon``, ...);
    None where that file or field does not exist (not Linux)."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def require_status_kib(field: str) -> int:
    """:func:`status_kib`, or an error naming the field where it cannot be read."""
    value = status_kib(field)
    if value is None:
        raise RuntimeError(f"{field} is not in /proc/self/status (Linux only)")
    return value


def make_noop_services(count: int) -> list[Any]:
    """``count`` services, each implementing the 7 per-step hooks as ``pass``."""
    from sakura.service import Service

    class NoopService(Service):
        priority = 100

        def __init__(self, name: str) -> None:
            self.name = name

        def on_train_step_begin(self, event: Any) -> None:
            pass

        def on_before_backward(self, event: Any) -> None:
            pass

        def on_after_backward(self, event: Any) -> None:
            pass

        def on_before_optimizer_step(self, event: Any) -> None:
            pass

        def on_optimizer_step(self, event: Any) -> None:
            pass

        def on_before_zero_grad(self, event: Any) -> None:
            pass

        def on_train_step_end(self, event: Any) -> None:
            pass

    return [NoopService(f"noop{i}") for i in range(count)]


def overhead_row(label: str, per_trial_s: list[float], reference_s: list[float]) -> dict[str, Any]:
    """A row of the overhead benchmarks' tables: a variant's time per step over the trials
    (microseconds) and its per-trial ratio to the reference's time in the same trial."""
    from sakura_bench.measure import ratio_summary, summary

    return {
        "label": label,
        "us_per_step": summary(per_trial_s).scaled(1e6),
        "ratio": ratio_summary(per_trial_s, reference_s),
    }


def overhead_row_text(row: dict[str, Any], width: int) -> str:
    """``label  us/step  ratio (IQR, min-max)`` of an :func:`overhead_row`."""
    return (
        f"   {row['label']:<{width}} {row['us_per_step'].median:>9.1f}  "
        f"{row['ratio'].format(4, iqr=True)}"
    )


def run_environment(
    distributions: tuple[str, ...], load_before: tuple[float, float, float] | None
) -> dict[str, Any]:
    """Python, platform, torch and ``distributions``' versions, torch threads, and the machine
    note (CPU model and flags, load average since ``load_before``)."""
    import platform

    import torch

    from sakura_bench.measure import machine_note, versions

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        **{name: v or "not installed" for name, v in versions(distributions).items()},
        "torch_threads": torch.get_num_threads(),
        "machine": machine_note(load_before),
    }


def verdict(ok: bool) -> str:
    return "MET" if ok else "MISSED"
