"""sakura-zero: ZeRO optimizer-state (ZeRO1) and gradient (ZeRO2) sharding services for
sakura, on torch.distributed (gloo on CPU, NCCL on GPU).

``ZeRO1()`` / ``ZeRO2()`` are sakura services (spec strings ``zero1`` and ``zero2``); they
shard a ``torch.optim`` optimizer in place, see :class:`OptimizerSharding`.
"""

from __future__ import annotations

from sakura_zero.partition import Partition, balanced_partition, contiguous_partition
from sakura_zero.service import ZeRO1, ZeRO2
from sakura_zero.sharding import OptimizerSharding

__all__ = [
    "OptimizerSharding",
    "Partition",
    "ZeRO1",
    "ZeRO2",
    "balanced_partition",
    "contiguous_partition",
]
__version__ = "0.1.0"
