"""The checks a quantized weight passes before any kernel reads it, and a weight before it
is quantized.

A quantized weight read from a model file is untrusted: its format, shape, block size and
the sizes and dtypes of its tensors are all declared by the file.  The kernels index the
codes and the scales with those numbers, so :func:`check_quantized_weight` holds every
stored tensor to the exact size and dtype that the format, the shape and the block size
imply; a mismatch is a ``ValueError`` that names the weight and the sizes.
"""

from __future__ import annotations

import torch

from sakura_quant.formats import FORMATS, QuantizedWeight
from sakura_quant.formats.double_quant import SCALE_BLOCK_SIZE
from sakura_quant.options import check_block_size

__all__ = ["check_finite", "check_quantized_weight", "stored_layout"]

COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
"""The dtypes a quantized weight may be expanded back to (the dtype it was quantized from)."""


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def stored_layout(
    fmt: str, numel: int, block_size: int, double_quant: bool
) -> dict[str, tuple[torch.dtype, int]]:
    """``{tensor name: (dtype, element count)}`` of a weight of ``numel`` values stored in
    ``fmt`` with blocks of ``block_size`` (and one-byte block scales with ``double_quant``)."""
    spec = FORMATS[fmt]
    blocks = _ceil_div(numel, block_size)
    layout = {"data": (spec.data_dtype, _ceil_div(numel, spec.values_per_code))}
    if double_quant:
        layout["scales"] = (torch.uint8, blocks)
        layout["scales_scale"] = (torch.float32, _ceil_div(blocks, SCALE_BLOCK_SIZE))
        layout["scales_offset"] = (torch.float32, 1)
    else:
        layout["scales"] = (spec.scale_dtype, blocks)
    for name in spec.scalar_tensors:
        layout[name] = (torch.float32, 1)
    return layout


def check_quantized_weight(qweight: QuantizedWeight, *, name: str) -> None:
    """Raise ``ValueError`` (naming ``name`` and the sizes) unless ``qweight``'s metadata
    and tensors agree: a known format, a shape of non-negative ints, a floating dtype, a
    block size the format takes, and exactly the tensors of :func:`stored_layout`, each of
    its dtype and element count, all on one device."""
    if not isinstance(qweight, QuantizedWeight):
        raise TypeError(f"{name}: expected a QuantizedWeight, got {type(qweight).__name__}")
    fmt = qweight.format
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise ValueError(f"{name}: format {fmt!r} is not one of {sorted(FORMATS)}")
    shape = qweight.shape
    if not isinstance(shape, tuple) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise ValueError(f"{name}: shape {shape!r} is not a tuple of ints >= 0")
    if qweight.dtype not in COMPUTE_DTYPES:
        raise ValueError(
            f"{name}: dtype {qweight.dtype!r} is not one the weight can be expanded to "
            f"({', '.join(str(d) for d in COMPUTE_DTYPES)})"
        )
    size = qweight.block_size
    if not isinstance(size, int) or isinstance(size, bool):
        raise ValueError(f"{name}: block_size {size!r} is not an int")
    check_block_size(fmt, size, owner=name)
    tensors = qweight.tensors
    if not isinstance(tensors, dict) or not all(
        isinstance(k, str) and isinstance(t, torch.Tensor) for k, t in tensors.items()
    ):
        raise ValueError(f"{name}: tensors must be a dict of str to torch.Tensor")
    double_quant = "scales_offset" in tensors and FORMATS[fmt].supports_double_quant
    expected = stored_layout(fmt, qweight.numel, size, double_quant)
    if set(tensors) != set(expected):
        raise ValueError(
            f"{name}: a {fmt} weight stores the tensors {sorted(expected)}, got {sorted(tensors)}"
        )
    for key, (dtype, count) in expected.items():
        tensor = tensors[key]
        if tensor.dtype != dtype or tensor.numel() != count:
            raise ValueError(
                f"{name}: {key} of a {fmt} weight of shape {shape} with block_size {size} "
                f"holds {count} {dtype} values; got {tensor.numel()} {tensor.dtype} "
                f"(shape {tuple(tensor.shape)})"
            )
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        raise ValueError(
            f"{name}: the stored tensors are on several devices {sorted(map(str, devices))}"
        )


def check_finite(weight: torch.Tensor, *, name: str) -> None:
    """Raise ``ValueError`` when ``weight`` holds NaN or ±Inf (naming ``name`` and the count).

    No format can store them: a block's values are scaled by its absmax (an Inf makes every
    other value of the block 0 or NaN, under double quantization a whole group of 256 blocks
    too; nvfp4's per-tensor scale spreads it over the weight), and a NaN has no code.
    """
    bad = int(torch.count_nonzero(~torch.isfinite(weight.detach())))
    if bad:
        raise ValueError(
            f"cannot quantize {name}: it holds {bad} non-finite value{'s' if bad > 1 else ''} "
            f"(NaN or ±Inf) among {weight.numel()}; quantized formats cannot store them "
            "(replace them, e.g. with torch.nan_to_num, or leave the layer out with skip=)"
        )
