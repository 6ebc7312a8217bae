"""Metrics handed to a framework's logging from outside its loop (``LoopContext.report_metrics``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["numeric_metrics"]


def numeric_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The metrics that loggers accept: numbers and one-element tensors, as floats."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if isinstance(value, (bool, int, float)):
            out[key] = float(value)
        elif hasattr(value, "numel") and value.numel() == 1:
            out[key] = float(value.item())
    return out
