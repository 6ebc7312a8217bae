"""Paging: what autograd saves (:mod:`.activations`, ``ActivationPaging``) and frozen
weights (:mod:`.weights`, ``WeightPaging``) live in host RAM (or on disk) and come to the
device only when needed.  The design: ``docs/offload.md``, "Activation paging: design"
and "Weight paging: design"."""

from sakura_offload.paging.activations import ActivationPaging, PagingStats, is_broadcast, is_dense
from sakura_offload.paging.weights import WeightPaging, WeightPagingStats, frozen_block_bytes

__all__ = [
    "ActivationPaging",
    "PagingStats",
    "WeightPaging",
    "WeightPagingStats",
    "frozen_block_bytes",
    "is_broadcast",
    "is_dense",
]
