"""The frozen-weight formats, one module each, by name."""

from __future__ import annotations

from sakura_quant.formats.base import QuantizedWeight, WeightFormat
from sakura_quant.formats.fp8 import FP8
from sakura_quant.formats.int8 import Int8
from sakura_quant.formats.nf4 import NF4
from sakura_quant.formats.nvfp4 import NVFP4

__all__ = ["FORMATS", "QuantizedWeight", "WeightFormat"]

FORMATS: dict[str, WeightFormat] = {f.name: f for f in (Int8(), NF4(), FP8(), NVFP4())}
"""Format name -> format, in order of precision."""
