"""Batches from in-memory column tensors, as an expert loop makes them.

The data of a benchmark lives in host memory as a few column tensors (``{"x": ..., "y":
...}``).  :class:`Batches` yields dict batches by indexing those columns with a slice of a
seeded permutation: no per-sample ``__getitem__`` and no collation, so the loop, not the
data path, is what gets measured.  Each ``iter()`` is one epoch with its own permutation
(``seed`` and the epoch number), so every runner and framework sees the same batches.
Under ``torch.distributed`` each rank takes every ``world_size``-th sample of the
permutation (the same number on every rank).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = ["Batches", "DictDataset", "check_columns"]


def check_columns(columns: Mapping[str, torch.Tensor], what: str) -> int:
    """The common length of ``columns``; ValueError if they disagree or are empty."""
    if not columns:
        raise ValueError(f"{what} has no columns")
    lengths = {name: int(t.shape[0]) for name, t in columns.items()}
    if len(set(lengths.values())) != 1:
        raise ValueError(f"{what} columns have different lengths: {lengths}")
    n = next(iter(lengths.values()))
    if n == 0:
        raise ValueError(f"{what} is empty")
    return n


class Batches:
    """A re-iterable of dict batches over column tensors (one epoch per ``iter()``).

    Args:
        columns: name -> tensor, equal first dimension.
        batch_size: samples per batch (the last batch may be smaller).
        shuffle: a fresh seeded permutation each epoch, else in order.
        seed: base seed of the permutations.
        rank, world_size: this process's shard.
        extra: constant entries added to every batch (e.g. a task index).
    """

    def __init__(
        self,
        columns: Mapping[str, torch.Tensor],
        batch_size: int,
        *,
        shuffle: bool,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        self.columns = dict(columns)
        self.n = check_columns(self.columns, "batches")
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.extra = dict(extra or {})
        self.epoch = 0
        per_rank = self.n // world_size if world_size > 1 else self.n
        if per_rank == 0:
            raise ValueError(f"{self.n} samples cannot be shared by {world_size} ranks")
        self.samples_per_rank = per_rank

    def __len__(self) -> int:
        return -(-self.samples_per_rank // self.batch_size)

    def indices(self, epoch: int) -> torch.Tensor:
        """The sample indices of this rank in ``epoch``, in order of use."""
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = torch.randperm(self.n, generator=generator)
        else:
            order = torch.arange(self.n)
        if self.world_size > 1:
            order = order[: self.samples_per_rank * self.world_size][self.rank :: self.world_size]
        return order

    def __iter__(self) -> Iterator[dict[str, Any]]:
        order = self.indices(self.epoch)
        self.epoch += 1
        for chunk in order.split(self.batch_size):
            batch: dict[str, Any] = {name: t[chunk] for name, t in self.columns.items()}
            batch.update(self.extra)
            yield batch


class DictDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """A map-style dataset of dict samples over column tensors (for ``transformers.Trainer``,
    which batches with its own sampler and collator)."""

    def __init__(self, columns: Mapping[str, torch.Tensor]) -> None:
        self.columns = dict(columns)
        self.n = check_columns(self.columns, "dataset")

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {name: t[index] for name, t in self.columns.items()}
