"""Which base layers the fused LoRA function can read, and how it reads their weight.

Two kinds of base qualify:

* a plain ``nn.Linear`` (its class exactly, or a subclass that keeps ``nn.Linear.forward``):
  its ``weight`` is read as it is (cast only under autocast, as ``F.linear`` would);
* a **quantized base**: any ``nn.Module`` that offers the protocol below.  sakura-quant's
  ``QuantizedLinear`` does; sakura-kernels does not import sakura-quant, it only calls
  these public members:

  - ``in_features`` / ``out_features`` (ints) and ``bias`` (a tensor of ``out_features`` or
    None);
  - ``dequantize(dtype) -> Tensor``: the weight, ``(out_features, in_features)``, expanded to
    ``dtype`` as a fresh tensor;
  - ``matmul_dtype`` (optional): None, or the dtype the layer's own products run in (its
    forward casts the input to it and hands the output back in the input's dtype, or in the
    autocast dtype under autocast).

  The layer's own ``forward`` must compute ``x @ dequantize(d).T + bias`` for that ``d``:
  that is what the fused function computes instead of calling it.

A base whose weight (or a plain base's any parameter other than ``bias``) requires a gradient
is not fused: the fused function gives the base weight none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["DequantizedWeight", "LinearWeight", "base_dtypes", "base_problem", "weight_source_for"]


@dataclass(frozen=True, slots=True)
class LinearWeight:
    """A plain ``nn.Linear``'s weight (cast to the product dtype only when it differs)."""

    layer: nn.Linear

    @property
    def keeps_expansion(self) -> bool:
        return False

    def weight(self, dtype: torch.dtype) -> torch.Tensor:
        return self.layer.weight.to(dtype)


@dataclass(frozen=True, slots=True)
class DequantizedWeight:
    """A quantized base's weight, expanded by its ``dequantize(dtype)`` for each product
    (``keep``: the forward's expansion is saved for backward instead of expanded again)."""

    layer: Any
    keep: bool = False

    @property
    def keeps_expansion(self) -> bool:
        return self.keep

    def weight(self, dtype: torch.dtype) -> torch.Tensor:
        weight: torch.Tensor = self.layer.dequantize(dtype)
        return weight


def _is_plain_linear(layer: nn.Module) -> bool:
    return isinstance(layer, nn.Linear) and type(layer).forward is nn.Linear.forward


def _offers_dequantize(layer: nn.Module) -> bool:
    return (
        callable(getattr(layer, "dequantize", None))
        and isinstance(getattr(layer, "in_features", None), int)
        and isinstance(getattr(layer, "out_features", None), int)
    )


def base_problem(layer: nn.Module) -> str | None:
    """Why ``layer`` cannot be a fused base, or None when it can."""
    bias = getattr(layer, "bias", None)
    if bias is not None and not isinstance(bias, torch.Tensor):
        return f"base layer {type(layer).__name__} has a bias that is not a tensor"
    if _is_plain_linear(layer):
        if layer.weight.requires_grad:
            return "the base weight is trainable (the fused function gives it no gradient)"
        return None
    if _offers_dequantize(layer):
        trainable = [name for name, p in layer.named_parameters(recurse=False) if p.requires_grad]
        if any(name != "bias" for name in trainable):
            return "the base weight is trainable (the fused function gives it no gradient)"
        return None
    return (
        f"base layer {type(layer).__name__} is neither a plain nn.Linear nor a quantized "
        "layer with dequantize(dtype)"
    )


def weight_source_for(layer: nn.Module, keep_expanded: bool) -> LinearWeight | DequantizedWeight:
    """The weight source of an eligible base (``base_problem(layer)`` is None)."""
    if isinstance(layer, nn.Linear) and _is_plain_linear(layer):
        return LinearWeight(layer)
    return DequantizedWeight(layer, keep_expanded)


def base_dtypes(layer: nn.Module, x: torch.Tensor) -> tuple[torch.dtype, torch.dtype] | None:
    """``(dtype of the base product, dtype of the output)`` that ``layer``'s own forward
    would use for ``x``, or None where it would not run (a plain layer given an input of
    another dtype outside autocast: its own forward then raises, so the caller lets it)."""
    device_type = x.device.type
    autocast = torch.is_autocast_enabled(device_type)
    out_dtype = torch.get_autocast_dtype(device_type) if autocast else x.dtype
    if _is_plain_linear(layer):
        if not autocast and layer.weight.dtype != x.dtype:
            return None
        return out_dtype, out_dtype
    matmul_dtype = getattr(layer, "matmul_dtype", None)
    if matmul_dtype is not None and not isinstance(matmul_dtype, torch.dtype):
        return None
    return (matmul_dtype or out_dtype), out_dtype
