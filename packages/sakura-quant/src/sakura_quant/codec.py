"""The codec of one weight tensor: quantize it to a format and expand it again.

``quantize_weight`` is the public entry (it checks its options into a
:class:`~sakura_quant.options.WeightSpec`); ``encode`` is what the model-level code calls with
a spec already checked.  ``dequantize_into`` expands into a buffer the caller owns, which the
quantized layers reuse for every product (no fresh allocation, no page faults per call).
"""

from __future__ import annotations

import torch

from sakura_quant import _kernel
from sakura_quant.formats import FORMATS, QuantizedWeight, nf4
from sakura_quant.formats.checks import check_finite
from sakura_quant.formats.double_quant import compress_scales, decompress_scales
from sakura_quant.options import WeightSpec

__all__ = ["dequantize_into", "dequantize_weight", "encode", "quantize_weight"]


def quantize_weight(
    weight: torch.Tensor,
    format: str = "nf4",
    *,
    block_size: int | None = None,
    double_quant: bool = False,
    name: str = "weight",
) -> QuantizedWeight:
    """Quantize ``weight`` (any shape, any floating dtype) to ``format``.

    ``block_size``: values per scale (``None``: 64 for int8 / nf4; fp8 and nvfp4 use their
    fixed 32 / 16). ``double_quant``: store the block scales of int8 / nf4 in one byte each.
    ``name``: what errors call the weight (the loaders pass the layer's name).

    A weight holding NaN or ±Inf is refused with a ``ValueError`` that names it and counts
    them, in every format and on every path (no format can store them; see
    :func:`~sakura_quant.formats.checks.check_finite`).
    """
    spec = WeightSpec.check(format, block_size, double_quant, owner="quantize_weight")
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        raise TypeError(
            f"quantize_weight: weight must be a floating-point tensor, got {weight!r:.80}"
        )
    return encode(weight, spec, name=name)


def encode(weight: torch.Tensor, spec: WeightSpec, *, name: str = "weight") -> QuantizedWeight:
    """``weight`` (a floating tensor) stored as ``spec`` says, ``spec`` already checked; a
    weight holding NaN or ±Inf is refused here, on every path."""
    check_finite(weight, name=name)
    tensors = FORMATS[spec.format].quantize(weight, spec.block_size)
    if spec.double_quant:
        tensors.update(compress_scales(tensors["scales"]))
    return QuantizedWeight(
        format=spec.format,
        shape=tuple(weight.shape),
        dtype=weight.dtype,
        block_size=spec.block_size,
        tensors=tensors,
    )


def dequantize_weight(qweight: QuantizedWeight, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The weight back, in ``dtype`` (default: the dtype it was quantized from)."""
    tensors = qweight.tensors
    if qweight.format == "nf4":  # on a CUDA device, one kernel also decodes the scales
        fused = nf4.dequantize_cuda(
            tensors, qweight.numel, qweight.block_size, dtype or qweight.dtype
        )
        if fused is not None:
            return fused.view(qweight.shape)
    if "scales_offset" in tensors:
        tensors = dict(tensors, scales=decompress_scales(tensors))
    flat = FORMATS[qweight.format].dequantize_to(
        tensors, qweight.numel, qweight.block_size, dtype or qweight.dtype
    )
    return flat.view(qweight.shape)


def dequantize_into(qweight: QuantizedWeight, out: torch.Tensor) -> torch.Tensor:
    """The weight expanded into ``out`` (its shape, any floating dtype), and ``out`` returned.

    NF4 with fp32 scales on the CPU into a contiguous fp32 / bf16 ``out`` is expanded in
    place by the C++ kernel (the same bits as :func:`dequantize_weight`); int8 with whole
    blocks in place too (through a fixed 512 KiB fp32 chunk for a non-fp32 ``out``: no
    weight-sized temporary, whose heap holes would grow the resident set); every other case
    expands as :func:`dequantize_weight` does and copies.
    """
    if tuple(out.shape) != tuple(qweight.shape) or not out.is_floating_point():
        raise ValueError(
            f"dequantize_into: out must be a floating tensor of shape {tuple(qweight.shape)}, "
            f"got {tuple(out.shape)} {out.dtype}"
        )
    tensors = qweight.tensors
    if (
        qweight.format == "nf4"
        and out.is_contiguous()
        and _nf4_into_cpu(tensors, qweight.numel, qweight.block_size, out)
    ):
        return out
    if qweight.format == "int8" and _int8_into(tensors, qweight.numel, qweight.block_size, out):
        return out
    return out.copy_(dequantize_weight(qweight, out.dtype))


INT8_CHUNK = 1 << 17
"""Elements per fp32 temporary when int8 expands into a non-fp32 ``out`` (512 KiB; a smaller
weight's temporary is the weight's size)."""


def _int8_into(
    tensors: dict[str, torch.Tensor], numel: int, block_size: int, out: torch.Tensor
) -> bool:
    """int8 expanded into ``out`` with no weight-sized temporary, the same bits as
    :func:`dequantize_weight` (``codes.float() / 127 * scale`` in fp32, rounded once to
    ``out``'s dtype): in place for an fp32 ``out``, through a fixed fp32 chunk otherwise.
    False where it does not apply (a partial last block, non-contiguous ``out``, fp32 scales
    missing)."""
    scales = tensors["scales"]
    if (
        numel % block_size
        or not out.is_contiguous()
        or scales.dtype != torch.float32
        or "scales_offset" in tensors
    ):
        return False
    codes = tensors["data"].reshape(-1, block_size)
    blocks = out.view(-1, block_size)
    per_scale = scales.view(-1, 1)
    if out.dtype == torch.float32:
        blocks.copy_(codes).div_(127.0).mul_(per_scale)
        return True
    rows = min(blocks.shape[0], max(1, INT8_CHUNK // block_size))  # never over the weight
    tmp = torch.empty(rows, block_size, dtype=torch.float32, device=out.device)
    for start in range(0, blocks.shape[0], rows):
        stop = min(start + rows, blocks.shape[0])
        part = tmp[: stop - start]
        part.copy_(codes[start:stop]).div_(127.0).mul_(per_scale[start:stop])
        blocks[start:stop].copy_(part)
    return True


def _nf4_into_cpu(
    tensors: dict[str, torch.Tensor], numel: int, block_size: int, out: torch.Tensor
) -> bool:
    """Run the C++ NF4 expansion into ``out``; False where it does not apply (another
    device or dtype, double-quantized scales, no kernel)."""
    data, scales = tensors["data"], tensors["scales"]
    suffix = nf4._KERNEL_DTYPES.get(out.dtype)
    if (
        suffix is None
        or out.device.type != "cpu"
        or data.device.type != "cpu"
        or data.dtype != torch.uint8
        or scales.device.type != "cpu"
        or scales.dtype != torch.float32
    ):
        return False
    lib = _kernel.LIBRARY.load()
    if lib is None:
        return False
    data, scales = data.contiguous(), scales.contiguous()
    code = nf4._code(torch.device("cpu"))
    status = getattr(lib, f"sakura_nf4_dequantize_{suffix}")(
        data.data_ptr(),
        data.numel(),
        scales.data_ptr(),
        scales.numel(),
        numel,
        block_size,
        code.data_ptr(),
        out.data_ptr(),
        out.numel(),
        nf4._threads(),
    )
    if status:
        raise nf4._sizes_error(
            "C++ NF4 dequantize kernel", numel, block_size, data=data.numel(), scales=scales.numel()
        )
    return True
