"""sakura-quant: quantized frozen bases for QLoRA.

Frozen ``nn.Linear`` weights stored as NF4 (bit-identical to bitsandbytes), int8, FP8 or
NVFP4, with optional double quantization of the block scales; layers that stock PEFT LoRA
adapts; the ``quant`` service (``quant:nf4``) for ``rt.prepare``; ``SakuraQuantConfig`` for
transformers' ``from_pretrained(..., quantization_config=...)``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from sakura_quant import _hf_hook

if TYPE_CHECKING:
    from sakura_quant.codec import dequantize_weight, quantize_weight
    from sakura_quant.formats import QuantizedWeight
    from sakura_quant.fsdp import shardable
    from sakura_quant.hf import SakuraQuantConfig
    from sakura_quant.linear import QuantizedLinear
    from sakura_quant.loading import load_model
    from sakura_quant.loftq import init_lora_from_error
    from sakura_quant.options import QuantOptions
    from sakura_quant.quantize import quantize_model
    from sakura_quant.service import Quantization

# Exports load on first use: the plugin module (sakura_quant.plugin) is imported whenever
# sakura lists plugins, and that must not import torch.
_EXPORTS = {
    "QuantOptions": "sakura_quant.options",
    "Quantization": "sakura_quant.service",
    "QuantizedLinear": "sakura_quant.linear",
    "QuantizedWeight": "sakura_quant.formats",
    "SakuraQuantConfig": "sakura_quant.hf",
    "init_lora_from_error": "sakura_quant.loftq",
    "load_model": "sakura_quant.loading",
    "shardable": "sakura_quant.fsdp",
    "quantize_model": "sakura_quant.quantize",
    "dequantize_weight": "sakura_quant.codec",
    "quantize_weight": "sakura_quant.codec",
}

__all__ = [
    "QuantOptions",
    "Quantization",
    "QuantizedLinear",
    "QuantizedWeight",
    "SakuraQuantConfig",
    "dequantize_weight",
    "init_lora_from_error",
    "load_model",
    "quantize_model",
    "quantize_weight",
    "shardable",
]
__version__ = "0.1.0"

# transformers' quantizer registry learns quant_method "sakura_quant" when it is imported
# (at once if it already is); transformers itself is not imported here.
_hf_hook.install()


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sakura_quant' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
