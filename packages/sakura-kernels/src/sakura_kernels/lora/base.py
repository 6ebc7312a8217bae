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
    forward casts the input to it and hands the output back in the input's dtype; under
    autocast both are ``matmul_dtype`` or else the autocast dtype, as for ``nn.Linear``);
  - ``dequantize_into(out) -> Tensor`` (optional): the weight expanded into ``out`` (a
    ``(out_features, in_features)`` tensor of the wanted dtype), returned.  When a base offers
    it, each product on the CPU expands into one buffer per thread and dtype, reused by every
    layer (the weight is read by one product and not kept), instead of a fresh tensor per
    product whose pages the allocator faults in again every time.

  The layer's own ``forward`` must compute ``x @ dequantize(d).T + bias`` for that ``d``:
  that is what the fused function computes instead of calling it.

A base whose weight (or a plain base's any parameter other than ``bias``) requires a gradient
is not fused: the fused function gives the base weight none.
"""

from __future__ import annotations

import threading
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


class _ExpansionBuffers(threading.local):
    """Per thread, one flat CPU buffer per dtype, grown to the largest weight expanded so far
    (an expansion lives only for the one product that reads it)."""

    def __init__(self) -> None:
        self.flat: dict[torch.dtype, torch.Tensor] = {}

    def take(self, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        numel = shape[0] * shape[1]
        flat = self.flat.get(dtype)
        if flat is None or flat.numel() < numel:
            flat = self.flat[dtype] = torch.empty(numel, dtype=dtype)
        return flat[:numel].view(shape)


_BUFFERS = _ExpansionBuffers()


@dataclass(frozen=True, slots=True)
class DequantizedWeight:
    """A quantized base's weight, expanded for each product: into the thread's buffer when the
    base offers ``dequantize_into`` (CPU, the expansion not kept, no double backward), else by
    ``dequantize(dtype)``.  ``keep``: the forward's expansion is saved for backward instead
    of expanded again (then always a fresh tensor)."""

    layer: Any
    keep: bool = False

    @property
    def keeps_expansion(self) -> bool:
        return self.keep

    def weight(self, dtype: torch.dtype) -> torch.Tensor:
        into = getattr(self.layer, "dequantize_into", None)
        device = getattr(self.layer, "weight", None)
        on_cpu = not isinstance(device, torch.Tensor) or device.device.type == "cpu"
        if callable(into) and not self.keep and on_cpu and not torch.is_grad_enabled():
            shape = (self.layer.out_features, self.layer.in_features)
            expanded: torch.Tensor = into(_BUFFERS.take(shape, dtype))
            return expanded
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


def _trainable_weight(layer: nn.Module) -> bool:
    return any(p.requires_grad for n, p in layer.named_parameters(recurse=False) if n != "bias")


_TRAINABLE = "the base weight is trainable (the fused function gives it no gradient)"


def base_problem(layer: nn.Module) -> str | None:
    """Why ``layer`` cannot be a fused base, or None when it can."""
    bias = getattr(layer, "bias", None)
    if bias is not None and not isinstance(bias, torch.Tensor):
        return f"base layer {type(layer).__name__} has a bias that is not a tensor"
    if not _is_plain_linear(layer) and not _offers_dequantize(layer):
        return (
            f"base layer {type(layer).__name__} is neither a plain nn.Linear nor a quantized "
            "layer with dequantize(dtype)"
        )
    return _TRAINABLE if _trainable_weight(layer) else None


def weight_source_for(
    layer: nn.Module, keep_expanded: bool
) -> LinearWeight | DequantizedWeight | None:
    """The weight source of ``layer``, or None where it is no longer a base the fused function
    can read (checked at every call: a base may be swapped or unfrozen after fusing)."""
    if _trainable_weight(layer):
        return None
    if isinstance(layer, nn.Linear) and _is_plain_linear(layer):
        return LinearWeight(layer)
    if _offers_dequantize(layer):
        return DequantizedWeight(layer, keep_expanded)
    return None


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
    if autocast:  # as nn.Linear under autocast: the output in the dtype the product ran in
        return (matmul_dtype or out_dtype), (matmul_dtype or out_dtype)
    return (matmul_dtype or out_dtype), out_dtype
