"""Fused LoRA: base and adapter of a PEFT LoRA linear layer as one autograd function.

:func:`fuse_lora` patches a stock PEFT model in place and returns a :class:`FuseReport`
(``fused`` names, ``skipped`` ``(name, why)``); :func:`unfuse_lora` restores it.  The
function itself is :class:`FusedLoraFunction` (:mod:`sakura_kernels.lora.function`); the bases
it reads, plain ``nn.Linear`` and quantized layers offering ``dequantize(dtype)``, are
described in :mod:`sakura_kernels.lora.base`.
"""

from __future__ import annotations

from sakura_kernels.lora.function import FusedLoraFunction, fused_lora_linear
from sakura_kernels.lora.fuse import FuseReport, fuse_lora, is_fused, unfuse_lora

__all__ = [
    "FuseReport",
    "FusedLoraFunction",
    "fuse_lora",
    "fused_lora_linear",
    "is_fused",
    "unfuse_lora",
]
