"""sakura-offload: fit bigger models by moving training state off the device.

One sub-package per feature (the guide: ``docs/offload.md``):

* :mod:`sakura_offload.host_optimizer`: ``OffloadAdamW``, AdamW with its moments and fp32
  master weights in host RAM, updated by a vectorised, multi-threaded C++ kernel (built on
  first use, cached), a CUDA kernel or a pure-torch path; ``OffloadAdamWService`` (spec
  ``offload_adamw``) swaps a loop's AdamW for it;
* :mod:`sakura_offload.paging`: ``ActivationPaging`` (saved activations to host RAM or
  disk) and ``WeightPaging`` (frozen weights streamed from host RAM per block);
* :mod:`sakura_offload.planner`: ``MemoryPlanner``, keep / page / recompute per block to
  fit a budget; ``MemoryPlannerService`` (spec ``memory_plan``);
* :mod:`sakura_offload.fit`: ``wrap`` / ``unwrap`` / ``memory_report`` and the ``fit``
  service (spec ``fit``): decide from the budgets where the optimizer, the frozen weights
  and the activations live, and whether a plugin's fit choice (a quantized base) is needed.

The chunked causal-LM loss lives in sakura-kernels (``sakura_kernels.chunked_causal_lm_loss``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sakura_offload.fit import (
        Fit,
        FitChoice,
        FitError,
        FitOption,
        memory_report,
        unwrap,
        wrap,
    )
    from sakura_offload.host_optimizer.optimizer import OffloadAdamW
    from sakura_offload.host_optimizer.service import OffloadAdamWService
    from sakura_offload.paging.activations import ActivationPaging, PagingStats
    from sakura_offload.paging.weights import WeightPaging, WeightPagingStats, frozen_block_bytes
    from sakura_offload.planner import MemoryBudgetError, MemoryPlan, MemoryPlanner, plan_memory
    from sakura_offload.planner.service import MemoryPlannerService

# Exports load on first use: the plugin module (sakura_offload.plugin) is imported whenever
# sakura lists plugins, and that must not import torch.
_EXPORTS = {
    "FitChoice": "sakura_offload.fit.choices",
    "FitError": "sakura_offload.fit.decide",
    "FitOption": "sakura_offload.fit.choices",
    "Fit": "sakura_offload.fit.service",
    "memory_report": "sakura_offload.fit.report",
    "unwrap": "sakura_offload.fit.wrap",
    "wrap": "sakura_offload.fit.wrap",
    "OffloadAdamW": "sakura_offload.host_optimizer.optimizer",
    "OffloadAdamWService": "sakura_offload.host_optimizer.service",
    "ActivationPaging": "sakura_offload.paging.activations",
    "PagingStats": "sakura_offload.paging.activations",
    "WeightPaging": "sakura_offload.paging.weights",
    "WeightPagingStats": "sakura_offload.paging.weights",
    "frozen_block_bytes": "sakura_offload.paging.weights",
    "MemoryBudgetError": "sakura_offload.planner",
    "MemoryPlan": "sakura_offload.planner",
    "MemoryPlanner": "sakura_offload.planner",
    "MemoryPlannerService": "sakura_offload.planner.service",
    "plan_memory": "sakura_offload.planner",
}

__all__ = [
    "ActivationPaging",
    "Fit",
    "FitChoice",
    "FitError",
    "FitOption",
    "MemoryBudgetError",
    "MemoryPlan",
    "MemoryPlanner",
    "MemoryPlannerService",
    "OffloadAdamW",
    "OffloadAdamWService",
    "PagingStats",
    "WeightPaging",
    "WeightPagingStats",
    "frozen_block_bytes",
    "memory_report",
    "plan_memory",
    "unwrap",
    "wrap",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sakura_offload' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
