"""What ``fit`` logs while training: where the state lives and the bytes moved, as metrics
named ``sakura_*``, handed to the loop's own logging.

Names mirror the reference's ``ts_*`` log metrics with Sakura's prefix (``ts_`` is the
reference product's name, not a format other tools read), in exact bytes rather than GB:

=============================== =================================================
``sakura_h2d_bytes_per_step``   the host optimizer's host→device copies, last step
                                (``ts_h2d_gb`` is the same over a logging interval)
``sakura_d2h_bytes_per_step``   device→host copies, last step (``ts_d2h_gb``)
``sakura_pinned_bytes``         page-locked host state (``ts_pinned_gb``)
``sakura_host_state_bytes``     host-RAM state: moments, masters, streamed frozen
                                weights (``ts_host_state_gb``)
``sakura_host_optimizer_bytes`` of which the optimizer's moments and masters
``sakura_host_frozen_bytes``    of which streamed frozen weights held in RAM
``sakura_disk_bytes``           frozen weights on the disk tier
``sakura_device_bytes``         model, gradients and optimizer state on the device
``sakura_weight_blocks_materialised`` streamed blocks brought to the device so far
=============================== =================================================

Once, at the first report, the plan's summary: ``sakura_plan_device_bytes``,
``sakura_plan_host_bytes``, ``sakura_plan_disk_bytes``, ``sakura_plan_streamed_blocks`` and
``sakura_plan`` (the summary text; loggers that take numbers only drop it).

Every value is :func:`~sakura_offload.fit.report.memory_report`'s and
:meth:`~sakura_offload.OffloadAdamW.stats`'s at the moment of the report.  Reading them waits
for the optimizer's queued updates, so :class:`FitMetrics` reads them every ``log_every``
optimizer steps only, and not at all when nothing receives them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from sakura.options import check_int

__all__ = ["FitMetrics", "fit_metrics", "plan_metrics"]

_LOG = logging.getLogger("sakura_offload.fit")
Reporter = Callable[[Mapping[str, Any], int, int], None]


def _host_optimizer(optimizer: Any) -> Any:
    from sakura_offload.host_optimizer.optimizer import OffloadAdamW

    while optimizer is not None and not isinstance(optimizer, OffloadAdamW):
        optimizer = getattr(optimizer, "optimizer", None)
    return optimizer


def fit_metrics(model: Any) -> dict[str, int]:
    """The ``sakura_*`` metrics (module docstring) of a model ``wrap`` / ``fit`` prepared."""
    from sakura_offload.fit.report import memory_report

    report = memory_report(model)
    moved = report["moved"]
    host = report["host"]
    optimizer = _host_optimizer(model.sakura_fit.optimizer)
    pinned = 0 if optimizer is None else int(optimizer.stats()["pinned_bytes"])
    device = report["device"]
    return {
        "sakura_h2d_bytes_per_step": int(moved.get("h2d_bytes_per_step", 0)),
        "sakura_d2h_bytes_per_step": int(moved.get("d2h_bytes_per_step", 0)),
        "sakura_pinned_bytes": pinned,
        "sakura_host_state_bytes": int(host["optimizer"]) + int(host["frozen"]),
        "sakura_host_optimizer_bytes": int(host["optimizer"]),
        "sakura_host_frozen_bytes": int(host["frozen"]),
        "sakura_disk_bytes": int(report["disk"]["frozen"]),
        "sakura_device_bytes": sum(
            int(device[k]) for k in ("trainable", "gradients", "frozen", "optimizer")
        ),
        "sakura_weight_blocks_materialised": int(moved.get("weight_blocks_materialised", 0)),
    }


def plan_metrics(model: Any) -> dict[str, Any]:
    """The plan's summary as metrics (module docstring)."""
    plan = model.sakura_fit.plan
    return {
        "sakura_plan_device_bytes": int(plan.device_bytes),
        "sakura_plan_host_bytes": int(plan.host_bytes),
        "sakura_plan_disk_bytes": int(plan.disk_bytes),
        "sakura_plan_streamed_blocks": sum(t != "device" for t in plan.block_tiers),
        "sakura_plan": plan.summary(),
    }


class FitMetrics:
    """Reports :func:`fit_metrics` every ``log_every`` optimizer steps (0: never) to
    ``report(metrics, epoch, step)`` (the loop's ``LoopContext.report_metrics``), else to
    ``emit(metrics, epoch, step)`` (the ``fit`` service emits them as an ``OnLog`` event,
    which a raw loop's ``Telemetry`` records), and as a DEBUG line of the logger
    ``sakura_offload.fit``.  The per-step cost is one counter increment."""

    def __init__(self, log_every: Any = 50, *, owner: str = "Fit") -> None:
        self.log_every = check_int("log_every", log_every, minimum=0, owner=owner)
        self._steps = 0
        self._planned = False
        self.model: Any = None
        """The model ``fit`` wrapped (set by the service)."""
        self._report: Reporter | None = None
        self.last: dict[str, Any] | None = None
        """The metrics last reported."""

    def begin(self, report: Reporter | None) -> None:
        """Training starts; ``report``: the loop's reporter (None: the emitter given to
        :meth:`step`)."""
        self._report = report
        self._steps = 0

    def step(self, epoch: int, step: int, emit: Reporter | None) -> None:
        """An optimizer step happened; report when the interval is due."""
        self._steps += 1
        if self.log_every == 0 or self._steps % self.log_every or self.model is None:
            return
        sink = self._report if self._report is not None else emit
        debug = _LOG.isEnabledFor(logging.DEBUG)
        if sink is None and not debug:
            return
        metrics: dict[str, Any] = {}
        if not self._planned:
            metrics.update(plan_metrics(self.model))
            self._planned = True
        metrics.update(fit_metrics(self.model))
        self.last = metrics
        if sink is not None:
            sink(metrics, epoch, step)
        if debug:
            _LOG.debug("fit: step %d: %s", step, metrics)
