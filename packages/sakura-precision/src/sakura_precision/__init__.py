"""sakura-precision: mixed precision, torch.compile with an on-disk cache, and activation
checkpointing, as sakura services.

::

    from sakura_precision import ActivationCheckpoint, Compile, MixedPrecision

or through the core facade, ``from sakura.services import MixedPrecision``, or by spec
string: ``mixed_precision:bf16``, ``mixed_precision:fp16``, ``compile``,
``compile:mode=max-autotune``, ``activation_checkpoint``.  Under FSDP2,
``fully_shard(module, mp_policy=fsdp_mp_policy("bf16-mixed"))`` (see
:mod:`sakura_precision.fsdp`).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "MixedPrecision": "sakura_precision.mixed_precision",
    "AutocastPrecision": "sakura_precision.mixed_precision",
    "LossScaledPrecision": "sakura_precision.mixed_precision",
    "TruePrecision": "sakura_precision.mixed_precision",
    "FP8Precision": "sakura_precision.mixed_precision",
    "Compile": "sakura_precision.compile",
    "ActivationCheckpoint": "sakura_precision.activation_checkpoint",
    "Float8Linear": "sakura_precision.float8_linear",
    "find_blocks": "sakura_torch.blocks",
    "fsdp_mp_policy": "sakura_precision.fsdp",
    "resolve_mode": "sakura_precision.modes",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sakura_precision' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
