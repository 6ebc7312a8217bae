"""Precision strings: sakura's short names and Lightning's, resolved to one canonical mode.

=====================================  ==========================================================
accepted                               canonical mode: what it does
=====================================  ==========================================================
``"bf16"``, ``"bf16-mixed"``           ``"bf16-mixed"``: bf16 autocast, fp32 weights
``"fp16"``, ``"16-mixed"``, ``16``,    ``"16-mixed"``: fp16 autocast, fp32 weights, dynamic loss
``"16"``                               scaling (GradScaler)
``"bf16-true"``                        ``"bf16-true"``: weights, inputs and new tensors in bf16
``"16-true"``                          ``"16-true"``: the same in fp16 (no loss scaling, as in
                                       Lightning)
``"32-true"``, ``32``, ``"32"``,       ``"32-true"``: fp32 everywhere (the default precision)
``"fp32"``
``"64-true"``, ``64``, ``"64"``        ``"64-true"``: fp64 everywhere
``"fp8"``                              ``"fp8"``: Linear matmuls in float8 (e4m3 forward, e5m2
                                       gradients, dynamic per-tensor scales), the rest under
                                       bf16 autocast
``"auto"``                             resolved when the service is built: on CUDA
                                       ``"bf16-mixed"`` where the GPU supports bf16, else
                                       ``"16-mixed"``; on a CPU with native bf16 instructions
                                       (AVX512-BF16 or AMX) ``"bf16-mixed"``, else ``"32-true"``
=====================================  ==========================================================
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ACCEPTED", "Mode", "cpu_has_native_bf16", "resolve_mode"]


@dataclass(frozen=True)
class Mode:
    """A canonical precision mode."""

    name: str
    """Lightning's spelling: ``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"``, ``"16-true"``,
    ``"32-true"``, ``"64-true"``, or ``"fp8"``."""
    kind: str
    """``"mixed"`` (autocast, fp32 weights), ``"true"`` (weights cast) or ``"fp8"``."""
    dtype: torch.dtype
    """The autocast dtype (mixed, fp8) or the weight dtype (true)."""

    @property
    def loss_scaled(self) -> bool:
        return self.name == "16-mixed"


_MODES = {
    "bf16-mixed": Mode("bf16-mixed", "mixed", torch.bfloat16),
    "16-mixed": Mode("16-mixed", "mixed", torch.float16),
    "bf16-true": Mode("bf16-true", "true", torch.bfloat16),
    "16-true": Mode("16-true", "true", torch.float16),
    "32-true": Mode("32-true", "true", torch.float32),
    "64-true": Mode("64-true", "true", torch.float64),
    "fp8": Mode("fp8", "fp8", torch.bfloat16),
}

_ALIASES: dict[Any, str] = {
    "bf16": "bf16-mixed",
    "bf16-mixed": "bf16-mixed",
    "fp16": "16-mixed",
    "16-mixed": "16-mixed",
    "16": "16-mixed",
    16: "16-mixed",
    "bf16-true": "bf16-true",
    "16-true": "16-true",
    "32-true": "32-true",
    "32": "32-true",
    32: "32-true",
    "fp32": "32-true",
    "64-true": "64-true",
    "64": "64-true",
    64: "64-true",
    "fp8": "fp8",
}

ACCEPTED: tuple[Any, ...] = (*_ALIASES, "auto")
"""Every value ``MixedPrecision(dtype=...)`` accepts."""


@functools.lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """True when this CPU has bf16 dot-product instructions (AVX512-BF16 or AMX-BF16).

    Read from ``/proc/cpuinfo`` (Linux).  Elsewhere False: bf16 emulated in software is
    slower than fp32, so ``"auto"`` keeps fp32 there.
    """
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:
        return False
    return False


def _auto() -> Mode:
    if torch.cuda.is_available():
        return _MODES["bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"]
    return _MODES["bf16-mixed" if cpu_has_native_bf16() else "32-true"]


def resolve_mode(value: Any) -> Mode:
    """The canonical :class:`Mode` for a precision value; ValueError listing what is accepted."""
    if isinstance(value, Mode):
        return value
    if isinstance(value, torch.dtype):
        by_dtype = {torch.bfloat16: "bf16-mixed", torch.float16: "16-mixed"}
        if value in by_dtype:
            return _MODES[by_dtype[value]]
    key = value.strip().lower() if isinstance(value, str) else value
    if key == "auto":
        return _auto()
    if not isinstance(key, bool) and isinstance(key, (str, int)) and key in _ALIASES:
        return _MODES[_ALIASES[key]]
    accepted = ", ".join(repr(a) for a in ACCEPTED)
    raise ValueError(
        f"MixedPrecision: dtype={value!r} is not accepted; accepted: {accepted} "
        f"(or torch.bfloat16 / torch.float16)"
    )
