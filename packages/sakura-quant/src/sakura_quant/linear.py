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

``matmul_dtype`` (bitsandbytes calls it ``compute_dtype``) is the dtype both products run
in: None (the default) multiplies in the input's dtype; ``torch.bfloat16`` under an fp32
model expands the weight straight to bf16 and casts the input, which on a CPU with
AVX512-BF16 or AMX (and on any recent GPU) runs the matmuls about twice as fast, at the
cost of bf16 rounding of the input and the product -- small beside NF4's own error.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from sakura_quant.codec import dequantize_weight, encode, quantize_weight
from sakura_quant.formats import QuantizedWeight
from sakura_quant.formats.checks import check_quantized_weight
from sakura_quant.loftq import fit_error
from sakura_quant.options import QuantOptions, WeightSpec, check_matmul_dtype, matmul_dtype_name

__all__ = ["QuantizedLinear"]

_DATA = "weight"


def _buffer_name(tensor_name: str) -> str:
    return _DATA if tensor_name == "data" else f"weight_{tensor_name}"


def _describe(tensor: Any) -> str:
    if isinstance(tensor, torch.Tensor):
        return f"{tuple(tensor.shape)} {tensor.dtype}"
    return type(tensor).__name__


class _DequantizedMatmul(torch.autograd.Function):
    """``x @ W.T`` with ``W`` expanded from its codes in forward and again in backward, both
    products in the layer's ``matmul_dtype`` (the input's dtype when it has none); the
    result and the input's gradient are handed back in the input's dtype."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, layer: QuantizedLinear) -> torch.Tensor:
        ctx.layer = layer
        ctx.input_dtype = x.dtype
        dtype = layer.matmul_dtype or x.dtype
        out = F.linear(x.to(dtype), layer.dequantize(dtype))
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None
        dtype = ctx.layer.matmul_dtype or grad_out.dtype
        weight = ctx.layer.dequantize(dtype)
        return grad_out.to(dtype).matmul(weight).to(ctx.input_dtype), None


class QuantizedLinear(nn.Linear):
    """A linear layer with a frozen quantized weight (see the module docstring).

    Build it with :meth:`from_linear` (or :func:`sakura_quant.quantize_model`).  The state
    dict holds the stored tensors: ``weight`` (codes), ``weight_scales`` and, depending on
    the format, ``weight_scales_scale``, ``weight_scales_offset``, ``weight_global_scale``.
    Loading a full-precision ``weight`` (2-D, ``(out_features, in_features)``) quantizes it
    again; keys a state dict does not give are left as they are.

    ``matmul_dtype``: see the module docstring (None: the input's dtype).

    ``error_factors``: LoftQ's ``(A, B)`` (``(r, in)``, ``(out, r)``), the low-rank fit of
    what quantizing lost, kept as the buffers ``error_a`` / ``error_b`` for
    :func:`sakura_quant.init_lora_from_error`; ``error_iters`` is how many rounds made them
    (used again when a full-precision weight is loaded).
    """

    def __init__(
        self,
        qweight: QuantizedWeight,
        bias: torch.Tensor | None = None,
        *,
        error_factors: tuple[torch.Tensor, torch.Tensor] | None = None,
        error_iters: int = 1,
        matmul_dtype: Any = None,
    ) -> None:
        nn.Module.__init__(self)
        self._matmul_dtype: torch.dtype | None = None
        if matmul_dtype is not None:
            self.matmul_dtype = matmul_dtype
        check_quantized_weight(qweight, name="QuantizedLinear")
        if len(qweight.shape) != 2:
            raise ValueError(f"QuantizedLinear needs a 2-D weight, got shape {qweight.shape}")
        self.out_features, self.in_features = qweight.shape
        self.format = qweight.format
        self.block_size = qweight.block_size
        self.compute_dtype = qweight.dtype
        self._tensor_names = tuple(qweight.tensors)
        for name, tensor in qweight.tensors.items():
            self.register_buffer(_buffer_name(name), tensor)
        self.error_iters = error_iters
        if error_factors is not None:
            factor_a, factor_b = error_factors
            if (
                not all(
                    isinstance(f, torch.Tensor) and f.is_floating_point() for f in error_factors
                )
                or factor_a.dim() != 2
                or factor_b.dim() != 2
                or factor_a.shape[1] != self.in_features
                or factor_b.shape[0] != self.out_features
                or factor_a.shape[0] != factor_b.shape[1]
            ):
                raise ValueError(
                    f"error_factors must be floating (r, {self.in_features}) and "
                    f"({self.out_features}, r) tensors for a ({self.out_features}, "
                    f"{self.in_features}) weight; got {_describe(factor_a)}, {_describe(factor_b)}"
                )
            self.register_buffer("error_a", factor_a)
            self.register_buffer("error_b", factor_b)
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
        matmul_dtype: Any = None,
    ) -> QuantizedLinear:
        """A quantized copy of ``linear`` (its bias kept as it is)."""
        qweight = quantize_weight(
            linear.weight.detach(), format, block_size=block_size, double_quant=double_quant
        )
        return cls(qweight, linear.bias, matmul_dtype=matmul_dtype)

    @classmethod
    def from_options(
        cls,
        qweight: QuantizedWeight,
        options: QuantOptions,
        *,
        bias: torch.Tensor | None = None,
        error_factors: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> QuantizedLinear:
        """The layer the model-level paths build (``quantize_model``, ``load_model``, the
        ``quant`` service, ``from_pretrained``): ``error_iters`` and ``matmul_dtype`` come
        from ``options``, checked once by the entry point, and are not checked again."""
        layer = cls(qweight, bias, error_factors=error_factors, error_iters=options.error_iters)
        layer.use_options(options)
        return layer

    def use_options(self, options: QuantOptions) -> None:
        """Take ``options``' ``matmul_dtype`` (checked by whoever built ``options``), as
        ``from_pretrained`` does for the layers it reloads quantized."""
        self._matmul_dtype = options.matmul_dtype

    @property
    def matmul_dtype(self) -> torch.dtype | None:
        """The dtype both matmuls run in (None: the input's); setting it checks the value
        as the constructor does (``"bf16"``, ``torch.bfloat16``, ... or None)."""
        return self._matmul_dtype

    @matmul_dtype.setter
    def matmul_dtype(self, value: Any) -> None:
        self._matmul_dtype = check_matmul_dtype(value, owner="QuantizedLinear")

    @property
    def error_factors(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """LoftQ's ``(A, B)`` when the weight was quantized with ``error_rank``, else None."""
        a, b = getattr(self, "error_a", None), getattr(self, "error_b", None)
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            return a, b
        return None

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
            + (
                f", matmul_dtype={matmul_dtype_name(self.matmul_dtype)}"
                if self.matmul_dtype
                else ""
            )
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
            # A full-precision weight: quantize it the way this layer stores its own (with a
            # fresh LoftQ fit when it has one), then load the stored tensors it gives.
            # The layer's own spec, checked when it was built: nothing to check again.
            spec = WeightSpec(self.format, self.block_size, "scales_offset" in self._tensor_names)
            weight = incoming.to(self.compute_dtype)
            factors = self.error_factors
            state_dict = {k: v for k, v in state_dict.items() if k != key}
            if factors is not None:
                fresh, state_dict[prefix + "error_a"], state_dict[prefix + "error_b"] = fit_error(
                    weight, spec, factors[0].shape[0], self.error_iters
                )
            else:
                fresh = encode(weight, spec, name=prefix + _DATA)
            for name, tensor in fresh.tensors.items():
                state_dict[prefix + _buffer_name(name)] = tensor
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        try:  # a state dict is untrusted: what it loaded (assign=True swaps dtypes) is checked
            check_quantized_weight(self.quantized_weight(), name=prefix.rstrip(".") or "weight")
        except ValueError as exc:
            error_msgs.append(str(exc))
