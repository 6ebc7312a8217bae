"""sakura-quant in transformers' quantizer registry (``quant_method="sakura_quant"``).

Importing this module imports transformers and registers :class:`SakuraQuantConfig` and
:class:`SakuraHfQuantizer`; ``import sakura_quant`` arranges for that to happen as soon as
transformers' registry itself is imported, and not before (:mod:`sakura_quant._hf_hook`).
"""

from __future__ import annotations

import transformers

if int(transformers.__version__.split(".", 1)[0]) < 5:
    raise ImportError(
        "SakuraQuantConfig plugs into the weight loading of transformers 5 (tested with 5.24); "
        f"transformers {transformers.__version__} is installed: pip install 'transformers>=5'"
    )

from sakura_quant.hf.config import QUANT_METHOD, SakuraQuantConfig
from sakura_quant.hf.quantizer import SakuraHfQuantizer

__all__ = ["QUANT_METHOD", "SakuraHfQuantizer", "SakuraQuantConfig", "register"]


def register() -> None:
    """Add sakura-quant to transformers' registries (a second call does nothing)."""
    from transformers.quantizers import auto

    if QUANT_METHOD not in auto.AUTO_QUANTIZATION_CONFIG_MAPPING:
        auto.register_quantization_config(QUANT_METHOD)(SakuraQuantConfig)
    if QUANT_METHOD not in auto.AUTO_QUANTIZER_MAPPING:
        auto.register_quantizer(QUANT_METHOD)(SakuraHfQuantizer)


register()
