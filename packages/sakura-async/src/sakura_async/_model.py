"""Helpers to reach the module whose weights a service snapshots."""

from __future__ import annotations

from typing import Any

__all__ = ["unwrap_model"]


def unwrap_model(model: Any) -> Any:
    """The module under DDP/DataParallel/``torch.compile`` wrappers, whose ``state_dict``
    keys match a freshly built model's."""
    seen = 0
    while seen < 8:
        seen += 1
        inner = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
        if inner is not None:
            model = inner
            continue
        name = type(model).__name__
        if name in ("DistributedDataParallel", "DataParallel", "FullyShardedDataParallel"):
            model = model.module
            continue
        break
    return model
