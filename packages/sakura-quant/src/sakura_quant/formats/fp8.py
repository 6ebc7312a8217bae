"""FP8: e4m3 values (``torch.float8_e4m3fn``) with an fp32 absmax per block of 32.

A block is scaled so that its absmax lands on 448, e4m3's largest finite value, and cast
(round to nearest even): ``code = fp8(x * (1 / absmax) * 448)``, ``x ≈ code / 448 * absmax``.
"""

from __future__ import annotations

import torch

from sakura_quant.formats._blocks import as_blocks, block_absmax, inverse, scale_blocks
from sakura_quant.formats.base import WeightFormat

E4M3_MAX = 448.0


class FP8(WeightFormat):
    name = "fp8"
    default_block_size = 32
    fixed_block_size = 32
    data_dtype = torch.float8_e4m3fn

    def quantize(self, weight: torch.Tensor, block_size: int) -> dict[str, torch.Tensor]:
        numel = weight.numel()
        blocks = as_blocks(weight, block_size)
        absmax = block_absmax(blocks)
        scaled = (blocks * inverse(absmax).unsqueeze(1)).clamp_(-1.0, 1.0).mul_(E4M3_MAX)
        codes = scaled.view(-1)[:numel].to(torch.float8_e4m3fn)  # not a view (see int8)
        return {"data": codes, "scales": absmax}

    def dequantize(
        self, tensors: dict[str, torch.Tensor], numel: int, block_size: int
    ) -> torch.Tensor:
        values = tensors["data"].float().div_(E4M3_MAX)
        return scale_blocks(values, tensors["scales"], numel, block_size)
