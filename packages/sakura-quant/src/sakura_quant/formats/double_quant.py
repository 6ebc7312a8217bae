"""Double quantization: block scales stored as one byte each, in bitsandbytes' layout.

The fp32 absmax of each block is replaced by (bitsandbytes' ``compress_statistics``):

* ``offset`` — the mean of all the block scales (fp32);
* ``scales`` — ``scale - offset`` as 8-bit codes of the signed *dynamic* map (a
  logarithmic 256-value code, Dettmers 2015), blockwise with one fp32 absmax per 256 scales
  (``scales_scale``).  Each value is divided by its block's absmax and goes to the nearest
  code (distances compared in fp32, a tie to the lower code).

The offset, the 256-blocks, their absmax and the map are bitsandbytes'; the codes are too,
except for values almost exactly between two codes, where bitsandbytes' CPU binary search
(and its CUDA kernel, by another rule) sometimes returns the farther one.

Decoding: ``code[q] * scales_scale + offset``. That is 8 + 32/256 bits per block instead of
32: with blocks of 64, about 0.37 bits less per weight.
"""

from __future__ import annotations

import functools

import torch

from sakura_quant.formats._blocks import as_blocks, block_absmax, scale_blocks

SCALE_BLOCK_SIZE = 256


def dynamic_map() -> torch.Tensor:
    """The signed 8-bit dynamic code (256 sorted fp32 values in [-1, 1]).

    Seven decades of exponent, 10^-6 ... 10^0; decade ``i`` holds ``2**i`` values, the
    midpoints of ``2**i + 1`` points spread evenly over [0.1, 1], with both signs; then 0
    and 1.
    """
    values: list[float] = []
    for i in range(7):
        points = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
        mids = (points[:-1] + points[1:]) / 2.0
        decade = 10.0 ** (i - 6)
        values += (decade * mids).tolist()
        values += (-decade * mids).tolist()
    values += [0.0, 1.0]
    return torch.tensor(sorted(values), dtype=torch.float32)


@functools.cache
def _code(device: torch.device) -> torch.Tensor:
    return dynamic_map().to(device)


def nearest_code(values: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """Index of the nearest entry of the sorted ``code`` (fp32 distances, a tie to the lower)."""
    last = code.numel() - 1
    lower = (torch.bucketize(values, code, right=True) - 1).clamp_(0, last - 1)
    upper = lower + 1
    closer_up = (values - code[upper]).abs() < (values - code[lower]).abs()
    return torch.where(closer_up, upper, lower)


def compress_scales(scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """``scales`` (fp32, one per block, finite) as one-byte codes, their absmax and the
    offset.

    Scales near fp32's largest value stay finite: their mean is taken in float64 where the
    fp32 sum would overflow (elsewhere it is bitsandbytes' fp32 mean, bit for bit), and a
    code whose decoded scale (``code * absmax + offset`` in fp32) would round past fp32's
    largest value is replaced by the next lower one.
    """
    offset = scales.mean()
    if not bool(torch.isfinite(offset)):
        offset = scales.double().mean().float()
    centred = scales - offset
    blocks = as_blocks(centred, SCALE_BLOCK_SIZE)
    absmax = block_absmax(blocks)
    scaled = (blocks / absmax.unsqueeze(1)).clamp_(-1.0, 1.0).nan_to_num_(0.0)
    code = _code(scales.device)
    index = nearest_code(scaled.view(-1)[: scales.numel()], code)
    for _ in range(2):  # one step down is enough; a second guards the rounding of the product
        decoded = scale_blocks(code[index], absmax, index.numel(), SCALE_BLOCK_SIZE) + offset
        overflow = ~torch.isfinite(decoded)
        if not bool(overflow.any()):
            break
        index = torch.where(overflow, (index - 1).clamp_(min=0), index)
    return {
        "scales": index.to(torch.uint8),
        "scales_scale": absmax,
        "scales_offset": offset,  # 0-dim already (a mean): no view of it
    }


def decompress_scales(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The fp32 block scales back from :func:`compress_scales`' tensors."""
    codes = tensors["scales"]
    values = _code(codes.device)[codes.long()]
    return (
        scale_blocks(values, tensors["scales_scale"], codes.numel(), SCALE_BLOCK_SIZE)
        + (tensors["scales_offset"])
    )
