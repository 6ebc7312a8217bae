"""NF4: 4-bit NormalFloat codes with an fp32 absmax per block, bit-identical to bitsandbytes.

The layout bitsandbytes uses, which this module reproduces exactly:

* the 16 code values below (quantiles of a standard normal, QLoRA, Dettmers et al. 2023);
* one fp32 absmax per block of ``block_size`` consecutive values of the flattened weight;
* a value is scaled by *multiplying* with ``1 / absmax`` (not dividing), clamped to [-1, 1],
  and rounded to the nearest code with ties going to the lower code (the code index is the
  number of midpoints that the value is strictly greater than);
* two codes per byte, the even index in the high nibble; an odd count gets a zero pad.
"""

from __future__ import annotations

import functools

import torch

from sakura_quant.formats._blocks import as_blocks, block_absmax, inverse, scale_blocks
from sakura_quant.formats.base import WeightFormat

NF4_CODE = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)


@functools.cache
def _code(device: torch.device) -> torch.Tensor:
    return torch.tensor(NF4_CODE, dtype=torch.float32, device=device)


@functools.cache
def _midpoints(device: torch.device) -> torch.Tensor:
    code = _code(device)
    return (code[:-1] + code[1:]) / 2


@functools.cache
def _pair_table(device: torch.device) -> torch.Tensor:
    """For each byte, the two code values it holds (high nibble first): ``(256, 2)``.

    Expanding a packed weight is then one gather of two floats per byte.
    """
    code = _code(device)
    byte = torch.arange(256, device=device)
    return torch.stack((code[byte >> 4], code[byte & 15]), dim=1).contiguous()


def pack_nibbles_high_first(index: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit indices two per byte, the even index in the high nibble."""
    flat = index.reshape(-1).to(torch.uint8)
    if flat.numel() % 2:
        flat = torch.nn.functional.pad(flat, (0, 1))
    pairs = flat.view(-1, 2)
    return (pairs[:, 0] << 4) | pairs[:, 1]


class NF4(WeightFormat):
    name = "nf4"
    default_block_size = 64
    supports_double_quant = True

    def quantize(self, weight: torch.Tensor, block_size: int) -> dict[str, torch.Tensor]:
        numel = weight.numel()
        blocks = as_blocks(weight, block_size)
        absmax = block_absmax(blocks)
        scaled = (blocks * inverse(absmax).unsqueeze(1)).clamp_(-1.0, 1.0)
        # bucketize (right=False) counts the midpoints strictly below the value: a value
        # exactly on a midpoint goes to the lower code, as in bitsandbytes.
        # An odd count keeps one padding zero: it fills the last low nibble with the zero code.
        kept = scaled.view(-1)[: numel + numel % 2]
        index = torch.bucketize(kept, _midpoints(weight.device), out_int32=True)
        return {"data": pack_nibbles_high_first(index), "scales": absmax}

    def dequantize(
        self, tensors: dict[str, torch.Tensor], numel: int, block_size: int
    ) -> torch.Tensor:
        data = tensors["data"]
        values = _pair_table(data.device)[data.long()].view(-1)
        return scale_blocks(values, tensors["scales"], numel, block_size)
