"""The framework interface: a training loop that runs a workload, as a baseline or through
sakura, and reports its timings to the harness.

A framework is a class registered through the ``sakura_register_frameworks`` hook.  The
harness builds the :class:`TrialContext` (workload, data, device, the sakura runtime for
the ``sakura`` runner, the recorder) and calls :meth:`Framework.run`.  ``run`` must

* build the model (``workload.make_model()``) and optimizer
  (``workload.make_optimizer(model)``) the way the framework does;
* train ``ctx.epochs`` epochs, calling ``ctx.recorder`` at the documented points
  (:class:`~sakura_bench.measure.Recorder`);
* evaluate at every epoch end unless ``ctx.eval_services`` is non-empty: then an installed
  service evaluates (off the training thread) and the loop must not evaluate too;
* with a runtime (``ctx.runtime``), attach the framework's sakura adapter and honour the
  runtime's coordinated calls; without one, be the framework's vanilla loop.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

if TYPE_CHECKING:
    from sakura import SakuraRuntime
    from sakura_bench.measure import Recorder
    from sakura_bench.workload import Split, Workload

__all__ = ["Framework", "TrialContext", "unwrap"]


def unwrap(model: Any) -> Any:
    """The workload's own model inside framework wrappers (DDP, the Lightning module)."""
    while True:
        inner = getattr(model, "bench_model", None)
        if isinstance(inner, nn.Module):
            model = inner
            continue
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
            continue
        return model


@dataclass
class TrialContext:
    """Everything a framework needs for one trial."""

    workload: Workload
    runtime: SakuraRuntime | None
    """The running sakura runtime (``sakura`` runner), or None (``baseline``)."""
    epochs: int
    device: torch.device
    recorder: Recorder
    train_split: Split
    eval_services: list[Any] = field(default_factory=list)
    """Installed services that evaluate the model themselves (asynchronous evaluation)."""
    rank: int = 0
    world_size: int = 1
    workdir: Path = field(default_factory=lambda: Path(tempfile.gettempdir()))
    output_dir: Path | None = None
    """The trial's output directory (``--output``), which the framework's loop publishes to
    services (``OnTrainBegin.loop.output_dir``): ``AsyncCheckpoint`` writes under it."""
    model: Any = None
    """Set by the framework: the trained model (for parameter counts)."""
    _eval_split: Split | None = None

    @property
    def eval_split(self) -> Split:
        """The evaluation data, built on first use: a loop that leaves evaluation to a
        service (in another process) never holds it."""
        if self._eval_split is None:
            self._eval_split = self.workload.eval_split()
        return self._eval_split

    @property
    def loop_evaluates(self) -> bool:
        """Whether the loop itself evaluates each epoch."""
        return not self.eval_services


class Framework:
    """Base class of frameworks."""

    description: ClassVar[str] = ""

    def incompatibility(self, workload: type[Workload]) -> str | None:
        """Why this framework cannot run ``workload`` (None: it can)."""
        return None

    def run(self, ctx: TrialContext) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement run(ctx)")
