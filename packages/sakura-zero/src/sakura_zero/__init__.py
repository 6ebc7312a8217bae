"""sakura-zero: ZeRO optimizer-state (ZeRO1) and gradient (ZeRO2) sharding services for
sakura, on torch.distributed (gloo on CPU, NCCL on GPU).

``ZeRO1()`` / ``ZeRO2()`` are sakura services (spec strings ``zero1`` and ``zero2``); they
shard a ``torch.optim`` optimizer in place, see :class:`OptimizerSharding`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sakura_zero.partition import Partition, balanced_partition, contiguous_partition
    from sakura_zero.service import ZeRO1, ZeRO2
    from sakura_zero.sharding import OptimizerSharding

# Exports load on first use: the plugin module (sakura_zero.plugin) is imported whenever
# sakura lists plugins, and that must not import torch.
_EXPORTS = {
    "OptimizerSharding": "sakura_zero.sharding",
    "Partition": "sakura_zero.partition",
    "ZeRO1": "sakura_zero.service",
    "ZeRO2": "sakura_zero.service",
    "balanced_partition": "sakura_zero.partition",
    "contiguous_partition": "sakura_zero.partition",
}

__all__ = [
    "OptimizerSharding",
    "Partition",
    "ZeRO1",
    "ZeRO2",
    "balanced_partition",
    "contiguous_partition",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sakura_zero' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
