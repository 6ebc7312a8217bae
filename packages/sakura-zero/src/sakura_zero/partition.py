"""Which rank owns which parameter: a size-balanced, deterministic partition.

Every rank computes the partition on its own from the parameter sizes alone, so no
communication is needed and all ranks agree.  Ownership is per parameter (never a slice
of one), which keeps any per-parameter optimizer exact: the owner steps a whole tensor
with the optimizer's own code.  The price is some imbalance when a few tensors are large
compared with ``total / world_size``; :attr:`Partition.imbalance` reports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PARTITION_STRATEGIES", "Partition", "balanced_partition", "contiguous_partition"]

PARTITION_STRATEGIES = ("greedy", "contiguous")


@dataclass(frozen=True)
class Partition:
    """The owner of every parameter, by its global index (its position in the optimizer's
    param groups, the numbering ``optimizer.state_dict()`` uses), and the bytes per rank."""

    owners: tuple[int, ...]
    """``owners[i]`` is the rank that owns parameter ``i``."""
    loads: tuple[int, ...]
    """Bytes of parameters owned by each rank."""

    @property
    def world_size(self) -> int:
        return len(self.loads)

    @property
    def total(self) -> int:
        """Bytes of all partitioned parameters."""
        return sum(self.loads)

    @property
    def imbalance(self) -> float:
        """How much the most loaded rank exceeds a perfect split: ``max(loads) / (total /
        world_size) - 1`` (0.0 is perfect; 0.05 means 5 % more than ``total / world_size``)."""
        if self.total == 0:
            return 0.0
        return max(self.loads) * self.world_size / self.total - 1.0

    def owned(self, rank: int) -> list[int]:
        """Global indices of the parameters ``rank`` owns, in increasing order."""
        return [i for i, owner in enumerate(self.owners) if owner == rank]

    def extended(self, sizes: Sequence[int]) -> Partition:
        """This partition plus new parameters of ``sizes`` bytes (indices following the
        current ones), assigned by the same rule without moving existing ones."""
        owners, loads = _greedy(sizes, list(self.loads))
        return Partition(owners=self.owners + owners, loads=loads)


def balanced_partition(sizes: Sequence[int], world_size: int) -> Partition:
    """Assign each parameter (``sizes[i]`` bytes) to a rank, balancing bytes per rank.

    Longest-processing-time greedy: parameters from largest to smallest (ties: lower
    index first) each go to the currently least loaded rank (ties: lower rank).  It is
    deterministic, and its maximum load is at most 4/3 of the optimum.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    for i, size in enumerate(sizes):
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"sizes[{i}] must be an int >= 0 (bytes), got {size!r}")
    owners, loads = _greedy(sizes, [0] * world_size)
    return Partition(owners=owners, loads=loads)


def _greedy(sizes: Sequence[int], loads: list[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    owners = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda j: (-sizes[j], j)):
        rank = min(range(len(loads)), key=lambda r: (loads[r], r))
        owners[i] = rank
        loads[rank] += sizes[i]
    return tuple(owners), tuple(loads)


def contiguous_partition(sizes: Sequence[int], world_size: int) -> Partition:
    """Assign parameters in order, in ``world_size`` consecutive runs of about equal bytes.

    Rank ``r``'s run ends at the parameter boundary nearest to ``(r + 1) / world_size`` of
    the total.  Less even than :func:`balanced_partition` (one large tensor cannot be
    split), but each owner's parameters are neighbours, so their gradients sit together
    in DDP's buckets (which follow the reverse parameter order) and can be reduced to
    their owner in place, without packing.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    for i, size in enumerate(sizes):
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"sizes[{i}] must be an int >= 0 (bytes), got {size!r}")
    total = sum(sizes)
    owners = []
    loads = [0] * world_size
    done = 0
    rank = 0
    for size in sizes:
        # move on to the next rank when this parameter's middle is past the rank's share
        while (
            rank < world_size - 1
            and total
            and (2 * done + size) > 2 * total * (rank + 1) / world_size
        ):
            rank += 1
        owners.append(rank)
        loads[rank] += size
        done += size
    return Partition(owners=tuple(owners), loads=tuple(loads))
