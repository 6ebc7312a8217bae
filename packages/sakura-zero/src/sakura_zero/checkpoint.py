"""Optimizer state on disk and across ranks: consolidation and sharded files.

Consolidated state is exactly what the unsharded optimizer's ``state_dict()`` returns
(``{"state": {index: {...}}, "param_groups": [...]}``, indices over the flattened param
groups), so a plain ``torch.optim`` optimizer loads it, and so does a sharded one on any
world size.  Sharded files hold one rank's entries of that same dict plus a small header;
any complete set of them, written on any world size, loads on any other.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from sakura.fileio import atomic_writer

__all__ = ["SHARD_FORMAT", "atomic_save", "find_shards", "shard_path", "to_cpu"]

SHARD_FORMAT = "sakura-zero-shard/1"
_SHARD_NAME = re.compile(r"(?P<name>.+)\.rank(?P<rank>\d+)-of-(?P<world>\d+)\.pt\Z")


def to_cpu(value: Any) -> Any:
    """``value`` with every tensor moved to the CPU (containers rebuilt, not mutated)."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, Mapping):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    return value


def shard_path(directory: str | os.PathLike[str], name: str, rank: int, world_size: int) -> Path:
    return Path(directory) / f"{name}.rank{rank:05d}-of-{world_size:05d}.pt"


def atomic_save(obj: Any, path: Path) -> None:
    """Write ``obj`` with ``torch.save`` atomically and durably
    (:func:`sakura.fileio.atomic_writer`): a crash never leaves a truncated file where the
    previous one was."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_writer(path) as f:  # fsyncs the file and the directory
        torch.save(obj, f)


def find_shards(directory: str | os.PathLike[str], name: str) -> list[Path]:
    """The complete set of shard files of ``name`` in ``directory``, ordered by rank.

    Raises FileNotFoundError when there are none, ValueError when they come from more
    than one world size or a rank is missing.
    """
    root = Path(directory)
    found: dict[int, dict[int, Path]] = {}
    if root.is_dir():
        for path in root.iterdir():
            match = _SHARD_NAME.match(path.name)
            if match and match["name"] == name:
                world = int(match["world"])
                found.setdefault(world, {})[int(match["rank"])] = path
    if not found:
        raise FileNotFoundError(
            f"no sharded optimizer files named {name!r} in {str(root)!r} "
            f"(expected {name}.rankNNNNN-of-NNNNN.pt, written by save_sharded)"
        )
    if len(found) > 1:
        raise ValueError(
            f"{str(root)!r} holds shards of {name!r} from several world sizes "
            f"({sorted(found)}); keep one complete set per directory"
        )
    world, ranks = next(iter(found.items()))
    missing = sorted(set(range(world)) - set(ranks))
    if missing:
        raise ValueError(
            f"incomplete sharded checkpoint {name!r} in {str(root)!r}: world size {world}, "
            f"missing rank(s) {missing}"
        )
    return [ranks[r] for r in range(world)]
