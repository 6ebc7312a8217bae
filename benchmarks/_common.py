"""Helpers shared by the benchmarks (the overhead ones' services and summaries; the memory
ones' ``/proc/self/status`` reader); ``nox -s bench`` skips ``_``-prefixed files, so this
one only runs through them."""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["make_noop_services", "require_status_kib", "status_kib", "summary", "verdict"]


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


def summary(label: str, per_trial: list[float], ratios: list[float]) -> dict[str, Any]:
    q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
    return {
        "label": label,
        "median_us_per_step": statistics.median(per_trial) * 1e6,
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "ratio_q1": q[0],
        "ratio_q3": q[2],
        "per_trial_us": [t * 1e6 for t in per_trial],
        "per_trial_ratio": ratios,
    }


def verdict(ok: bool) -> str:
    return "MET" if ok else "MISSED"
