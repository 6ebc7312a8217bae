"""What every weight format provides, and the quantized weight it produces."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["QuantizedWeight", "WeightFormat"]


@dataclass
class QuantizedWeight:
    """One quantized weight: its codes, its scales and what is needed to expand it.

    ``tensors`` always holds ``"data"`` (the codes) and ``"scales"`` (one per block, fp32, or
    uint8 codes under double quantization, which adds ``"scales_scale"`` and
    ``"scales_offset"``); NVFP4 adds ``"global_scale"``.
    """

    format: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    block_size: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of every stored tensor together."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class WeightFormat:
    """A frozen-weight format (one subclass per module in :mod:`sakura_quant.formats`).

    ``fixed_block_size`` is set by the formats whose block size is part of the format
    (FP8: 32, NVFP4: 16); the others take any even block size of at least 2.

    The stored layout, which :func:`sakura_quant.formats.checks.check_quantized_weight`
    holds every weight to before a kernel reads it: ``"data"`` holds one ``data_dtype``
    element per ``values_per_code`` values, ``"scales"`` one ``scale_dtype`` per block, and
    each name in ``scalar_tensors`` one fp32 value.
    """

    name: str = ""
    default_block_size: int = 64
    fixed_block_size: int | None = None
    supports_double_quant: bool = False
    data_dtype: torch.dtype = torch.uint8
    values_per_code: int = 1
    scale_dtype: torch.dtype = torch.float32
    scalar_tensors: tuple[str, ...] = ()

    def quantize(self, weight: torch.Tensor, block_size: int) -> dict[str, torch.Tensor]:
        """The stored tensors of ``weight`` (``"data"``, ``"scales"``, ...)."""
        raise NotImplementedError

    def dequantize(
        self, tensors: dict[str, torch.Tensor], numel: int, block_size: int
    ) -> torch.Tensor:
        """The flat fp32 values of a weight; ``tensors["scales"]`` is already decoded to fp32
        when double quantization stored it as codes."""
        raise NotImplementedError

    def dequantize_to(
        self, tensors: dict[str, torch.Tensor], numel: int, block_size: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """:meth:`dequantize` rounded to ``dtype`` (a format may do both in one pass)."""
        return self.dequantize(tensors, numel, block_size).to(dtype)
