"""OffloadAdamW over FSDP2 shards: a parameter that is a ``DTensor`` (``fully_shard``) is
updated through its local shard, so each rank keeps only its shard's moments and master in
host RAM; its exported state is a ``DTensor`` laid out like the parameter (what
``torch.optim.AdamW`` gives under FSDP2, so DCP saves and reshards it)."""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["as_like", "is_sharded", "local", "total_norm"]


@functools.cache  # (asked per parameter per step)
def _dtensor_type() -> Any:
    if not torch.distributed.is_available():
        return None
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.5
        from torch.distributed._tensor import DTensor  # type: ignore[attr-defined]
    return DTensor


def is_sharded(t: Any) -> bool:
    """Whether ``t`` is a ``DTensor``."""
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(t, dtensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """``t``'s local shard (sharing its storage) when it is a ``DTensor``, else ``t``."""
    return t.to_local() if is_sharded(t) else t  # type: ignore[attr-defined]


def as_like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``value`` (shaped like ``param``'s local shard) as a ``DTensor`` laid out like
    ``param`` when that is one; else ``value``."""
    if not is_sharded(param):
        return value
    dtensor = _dtensor_type()
    return dtensor.from_local(  # type: ignore[no-any-return]
        value,
        param.device_mesh,  # type: ignore[attr-defined]
        param.placements,  # type: ignore[attr-defined]
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


def _placement_types() -> tuple[Any, Any, Any]:
    try:
        from torch.distributed.tensor import Partial, Replicate, Shard
    except ImportError:  # torch < 2.5
        from torch.distributed._tensor import (  # type: ignore[attr-defined]
            Partial,
            Replicate,
            Shard,
        )
    return Partial, Replicate, Shard


def _square(t: torch.Tensor) -> torch.Tensor:
    """``t``'s squared 2-norm, 0-d, computed in fp32 at least (on ``t``'s device)."""
    wide = torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else None
    norm: torch.Tensor = torch.linalg.vector_norm(t, 2.0, dtype=wide).to(torch.float32)
    return norm * norm


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all ``grads`` together (``clip_grad_norm_``'s total norm), a 0-d fp32
    tensor on the first gradient's device, the same on every rank.

    A plain tensor counts once (replicated on every rank, or no process group).  A
    ``DTensor`` gradient (FSDP2) holds one shard per rank: the squares of the local shards
    are summed on each rank and then across the mesh dimensions the gradient is sharded on
    (one all-reduce per mesh and layout, whatever the number of tensors), never across the
    dimensions it is replicated on (HSDP).  A layout other than ``Shard``/``Replicate``
    (a gradient still pending reduction) goes through DTensor's own norm.  Nothing is read
    back to the host here."""
    partial, replicate, shard = _placement_types()
    squares: list[torch.Tensor] = []
    groups: dict[tuple[Any, tuple[bool, ...]], list[torch.Tensor]] = {}
    for g in grads:
        if not is_sharded(g):
            squares.append(_square(g))
            continue
        placements = g.placements  # type: ignore[attr-defined]
        if all(isinstance(p, (shard, replicate)) for p in placements):
            key = (g.device_mesh, tuple(isinstance(p, shard) for p in placements))  # type: ignore[attr-defined]
            groups.setdefault(key, []).append(g.to_local())  # type: ignore[attr-defined]
        else:
            squares.append(_square(g).full_tensor())  # type: ignore[attr-defined]
    dtensor = _dtensor_type()
    for (mesh, sharded), shards in groups.items():
        local_sum = torch.stack([_square(t) for t in shards]).sum()
        placements = [partial("sum") if s else replicate() for s in sharded]
        squares.append(
            dtensor.from_local(local_sum, mesh, placements, run_check=False).full_tensor()
        )
    device = squares[0].device
    return torch.stack([s.to(device) for s in squares]).sum().sqrt()
