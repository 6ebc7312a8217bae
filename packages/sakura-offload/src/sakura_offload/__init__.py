"""sakura-offload: AdamW with its moments and fp32 master weights in host RAM, updated by a
vectorised, multi-threaded C++ kernel (built on first use, cached) or a pure-torch path.

``OffloadAdamW`` is a ``torch.optim.Optimizer``; ``OffloadAdamWService`` (spec string
``offload_adamw``) swaps a loop's AdamW for it through ``rt.prepare`` / ``wrap_optimizer``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sakura_offload.loss import causal_lm_loss, chunked_causal_lm_loss
    from sakura_offload.memory_planner import (
        MemoryBudgetError,
        MemoryPlan,
        MemoryPlanner,
        MemoryPlanService,
        plan_memory,
    )
    from sakura_offload.optimizer import OffloadAdamW
    from sakura_offload.service import OffloadAdamWService
    from sakura_offload.weights import WeightPaging, WeightPagingStats, frozen_block_bytes

# Exports load on first use: the plugin module (sakura_offload.plugin) is imported whenever
# sakura lists plugins, and that must not import torch.
_EXPORTS = {
    "OffloadAdamW": "sakura_offload.optimizer",
    "OffloadAdamWService": "sakura_offload.service",
    "causal_lm_loss": "sakura_offload.loss",
    "chunked_causal_lm_loss": "sakura_offload.loss",
    "WeightPaging": "sakura_offload.weights",
    "WeightPagingStats": "sakura_offload.weights",
    "frozen_block_bytes": "sakura_offload.weights",
    "MemoryBudgetError": "sakura_offload.memory_planner",
    "MemoryPlan": "sakura_offload.memory_planner",
    "MemoryPlanner": "sakura_offload.memory_planner",
    "MemoryPlanService": "sakura_offload.memory_planner",
    "plan_memory": "sakura_offload.memory_planner",
}

__all__ = [
    "MemoryBudgetError",
    "MemoryPlan",
    "MemoryPlanService",
    "MemoryPlanner",
    "OffloadAdamW",
    "OffloadAdamWService",
    "WeightPaging",
    "WeightPagingStats",
    "causal_lm_loss",
    "chunked_causal_lm_loss",
    "frozen_block_bytes",
    "plan_memory",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sakura_offload' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
