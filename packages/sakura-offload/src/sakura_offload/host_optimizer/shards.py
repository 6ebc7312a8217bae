"""OffloadAdamW over FSDP2 shards: a parameter that is a ``DTensor`` (``fully_shard``) is
updated through its local shard, so each rank keeps only its shard's moments and master in
host RAM; its exported state is a ``DTensor`` laid out like the parameter (what
``torch.optim.AdamW`` gives under FSDP2, so DCP saves and reshards it)."""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["as_like", "is_sharded", "local"]


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
