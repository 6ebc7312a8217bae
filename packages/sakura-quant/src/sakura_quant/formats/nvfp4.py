"""NVFP4: e2m1 values, an e4m3 scale per block of 16 and one fp32 scale per tensor.

The recipe NVIDIA's Blackwell tensor cores read:

* ``global_scale = 448 * 6 / amax(weight)`` (1 for an all-zero weight), kept in fp32;
* each block's scale ``fp8_e4m3(absmax(block) / 6 * global_scale)``; the block's decoding
  scale is ``scale / global_scale``;
* each value ``x * (1 / decoding scale)`` rounded to the nearest e2m1 value
  (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives; ties to the even mantissa) and stored as a
  4-bit code (sign in bit 3), two per byte with the first value in the low nibble, as in
  ``torch.float4_e2m1fn_x2``.
"""

from __future__ import annotations

import functools

import torch

from sakura_quant.formats._blocks import as_blocks, block_absmax, inverse, scale_blocks
from sakura_quant.formats.base import WeightFormat
from sakura_quant.formats.fp8 import E4M3_MAX

E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring magnitudes; on a tie the value goes to the one with the even
# mantissa: down at 0.25, 1.25, 2.5 and 5, up at 0.75, 1.75 and 3.5.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIES_UP = (0.75, 1.75, 3.5)


@functools.cache
def _midpoints(device: torch.device) -> torch.Tensor:
    return torch.tensor(_MIDPOINTS, dtype=torch.float32, device=device)


@functools.cache
def _pair_table(device: torch.device) -> torch.Tensor:
    """For each byte, the two e2m1 values it holds (low nibble first): ``(256, 2)``."""
    magnitudes = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    code = torch.cat((magnitudes, -magnitudes))
    byte = torch.arange(256, device=device)
    return torch.stack((code[byte & 15], code[byte >> 4]), dim=1).contiguous()


def e2m1_codes(scaled: torch.Tensor) -> torch.Tensor:
    """4-bit e2m1 codes (uint8, sign in bit 3) of values already in [-6, 6]."""
    magnitude = scaled.abs()
    index = torch.bucketize(magnitude, _midpoints(scaled.device), out_int32=True)
    for tie in _TIES_UP:
        index += magnitude == tie
    sign = (scaled < 0).to(torch.int32) << 3
    return (index | sign).to(torch.uint8)


class NVFP4(WeightFormat):
    name = "nvfp4"
    default_block_size = 16
    fixed_block_size = 16
    data_dtype = torch.uint8
    values_per_code = 2
    scale_dtype = torch.float8_e4m3fn
    scalar_tensors = ("global_scale",)

    def quantize(self, weight: torch.Tensor, block_size: int) -> dict[str, torch.Tensor]:
        numel = weight.numel()
        blocks = as_blocks(weight, block_size)
        absmax = block_absmax(blocks)
        amax = absmax.amax() if absmax.numel() else absmax.new_zeros(())
        global_scale = torch.where(
            amax > 0, (E4M3_MAX * E2M1_MAX) / amax, torch.ones_like(amax)
        ).to(torch.float32)
        block_scale = (absmax / E2M1_MAX * global_scale).to(torch.float8_e4m3fn)
        decode = block_scale.float() / global_scale
        scaled = (blocks * inverse(decode).unsqueeze(1)).clamp_(-E2M1_MAX, E2M1_MAX)
        codes = e2m1_codes(scaled.view(-1)[:numel])
        if codes.numel() % 2:
            codes = torch.nn.functional.pad(codes, (0, 1))
        pairs = codes.view(-1, 2)
        packed = pairs[:, 0] | (pairs[:, 1] << 4)
        return {"data": packed, "scales": block_scale, "global_scale": global_scale}

    def dequantize(
        self, tensors: dict[str, torch.Tensor], numel: int, block_size: int
    ) -> torch.Tensor:
        data = tensors["data"]
        values = _pair_table(data.device)[data.long()].view(-1)
        decode = tensors["scales"].float() / tensors["global_scale"]
        return scale_blocks(values, decode, numel, block_size)
