"""``QuantizedLinear``: a frozen ``nn.Linear`` whose weight is stored quantized.

It *is* an ``nn.Linear`` (a subclass that skips ``nn.Linear.__init__``), so code that looks
for linear layers by type finds it: stock PEFT's ``get_peft_model`` wraps it in its own
``lora.Linear`` with no extra step, and calls its ``forward`` for the base output.  What PEFT
reads from a base layer is there: ``in_features`` / ``out_features``, ``weight`` (here the
packed codes, a buffer: PEFT takes the device from it and, since it is not floating point,
does not cast the adapters to its dtype) and ``compute_dtype`` (the dtype the weight was
quantized from, which PEFT gives the adapters, as for bitsandbytes' ``Linear4bit``).

The forward pass expands the weight and multiplies (``F.linear``); the backward pass expands
it again instead of keeping the expansion, and returns a gradient for the input only: the
quantized weight is frozen.  The bias, when there is one, stays an ordinary parameter.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from sakura_quant.formats import QuantizedWeight
from sakura_quant.weights import dequantize_weight, quantize_weight

__all__ = ["QuantizedLinear"]

_DATA = "weight"


def _buffer_name(tensor_name: str) -> str:
    return _DATA if tensor_name == "data" else f"weight_{tensor_name}"


class _DequantizedMatmul(torch.autograd.Function):
    """``x @ W.T`` with ``W`` expanded from its codes in forward and again in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layer: QuantizedLinear) -> torch.Tensor:
        ctx.layer = layer
        ctx.input_dtype = x.dtype
        return F.linear(x, layer.dequantize(x.dtype))

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None
        weight = ctx.layer.dequantize(grad_out.dtype)
        return grad_out.matmul(weight).to(ctx.input_dtype), None


class QuantizedLinear(nn.Linear):
    """A linear layer with a frozen quantized weight (see the module docstring).

    Build it with :meth:`from_linear` (or :func:`sakura_quant.quantize_model`).  The state
    dict holds the stored tensors: ``weight`` (codes), ``weight_scales`` and, depending on
    the format, ``weight_scales_scale``, ``weight_scales_offset``, ``weight_global_scale``.
    Loading a full-precision ``weight`` (2-D, ``(out_features, in_features)``) quantizes it
    again; keys a state dict does not give are left as they are.
    """

    def __init__(self, qweight: QuantizedWeight, bias: torch.Tensor | None = None) -> None:
        nn.Module.__init__(self)
        if len(qweight.shape) != 2:
            raise ValueError(f"QuantizedLinear needs a 2-D weight, got shape {qweight.shape}")
        self.out_features, self.in_features = qweight.shape
        self.format = qweight.format
        self.block_size = qweight.block_size
        self.compute_dtype = qweight.dtype
        self._tensor_names = tuple(qweight.tensors)
        for name, tensor in qweight.tensors.items():
            self.register_buffer(_buffer_name(name), tensor)
        if bias is not None:
            self.bias = nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        format: str = "nf4",
        *,
        block_size: int | None = None,
        double_quant: bool = False,
    ) -> QuantizedLinear:
        """A quantized copy of ``linear`` (its bias kept as it is)."""
        qweight = quantize_weight(
            linear.weight.detach(), format, block_size=block_size, double_quant=double_quant
        )
        return cls(qweight, linear.bias)

    def quantized_weight(self) -> QuantizedWeight:
        """The stored weight (its tensors are this layer's buffers, not copies)."""
        return QuantizedWeight(
            format=self.format,
            shape=(self.out_features, self.in_features),
            dtype=self.compute_dtype,
            block_size=self.block_size,
            tensors={name: getattr(self, _buffer_name(name)) for name in self._tensor_names},
        )

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight expanded to ``dtype`` (default: the dtype it was quantized from)."""
        return dequantize_weight(self.quantized_weight(), dtype)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = _DequantizedMatmul.apply(input, self)  # type: ignore[no-untyped-call]
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, format={self.format!r}, block_size={self.block_size}"
        )

    @property
    def quantized_nbytes(self) -> int:
        """Bytes of the stored weight tensors."""
        return self.quantized_weight().nbytes

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        key = prefix + _DATA
        incoming = state_dict.get(key)
        shape = (self.out_features, self.in_features)
        if isinstance(incoming, torch.Tensor) and tuple(incoming.shape) == shape:
            # A full-precision weight: quantize it the way this layer stores its own, then
            # load the stored tensors it gives (the scales too, which the dict cannot hold).
            fresh = quantize_weight(
                incoming.to(self.compute_dtype),
                self.format,
                block_size=self.block_size,
                double_quant="scales_offset" in self._tensor_names,
            )
            state_dict = {k: v for k, v in state_dict.items() if k != key}
            for name, tensor in fresh.tensors.items():
                state_dict[prefix + _buffer_name(name)] = tensor
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
