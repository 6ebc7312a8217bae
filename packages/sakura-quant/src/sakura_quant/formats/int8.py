"""int8: symmetric linear codes in [-127, 127] with an fp32 absmax per block.

``code = round(x * (1 / absmax) * 127)`` (round half to even), ``x ≈ code / 127 * absmax``.
"""

from __future__ import annotations

import torch

from sakura_quant.formats._blocks import as_blocks, block_absmax, inverse, scale_blocks
from sakura_quant.formats.base import WeightFormat


class Int8(WeightFormat):
    name = "int8"
    default_block_size = 64
    supports_double_quant = True
    data_dtype = torch.int8

    def quantize(self, weight: torch.Tensor, block_size: int) -> dict[str, torch.Tensor]:
        numel = weight.numel()
        blocks = as_blocks(weight, block_size)
        absmax = block_absmax(blocks)
        scaled = (blocks * inverse(absmax).unsqueeze(1)).clamp_(-1.0, 1.0).mul_(127.0)
        # Cast after cutting the padding: the codes own exactly their storage (a view of the
        # padded block matrix would keep that alive through ``_base`` even once ``.data`` is
        # swapped, as weight paging does: the codes twice in RAM).
        codes = scaled.round_().view(-1)[:numel].to(torch.int8)
        return {"data": codes, "scales": absmax}

    def dequantize(
        self, tensors: dict[str, torch.Tensor], numel: int, block_size: int
    ) -> torch.Tensor:
        values = tensors["data"].float().div_(127.0)
        return scale_blocks(values, tensors["scales"], numel, block_size)
