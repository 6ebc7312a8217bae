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

Under ``torch.autocast`` the layer behaves as ``nn.Linear`` does there: with no
``matmul_dtype`` of its own both products run in the autocast dtype, and the output comes back
in the dtype the products ran in.  A bf16 model (``model.to(torch.bfloat16)`` before
quantizing, or bf16 activations under autocast) with ``matmul_dtype="bf16"`` therefore runs the
frozen path in bf16 end to end: the codes expand straight to bf16, the product accumulates in
fp32 inside the GEMM (oneDNN / AMX on the CPU), and neither the output nor the input's
gradient is copied to another dtype.

On the CPU the expansion goes into a buffer reused by every layer of the thread (one per
dtype, the size of the largest weight, about 1.7 MiB in bf16 for SmolLM2-135M) rather than a
fresh tensor per product: the weight is never kept expanded, and the allocator does not
page-fault a new multi-megabyte block for each of the two products of every layer.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from sakura_quant.codec import dequantize_into, dequantize_weight, encode, quantize_weight
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


class _ExpansionBuffers(threading.local):
    """Per thread, one flat CPU buffer per dtype, grown to the largest weight expanded so
    far: an expansion lives only for the one product that reads it (the products return
    fresh tensors and save nothing), so every layer can expand into the same memory."""

    def __init__(self) -> None:
        self.flat: dict[torch.dtype, torch.Tensor] = {}

    def take(self, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        numel = shape[0] * shape[1]
        flat = self.flat.get(dtype)
        if flat is None or flat.numel() < numel:
            flat = self.flat[dtype] = torch.empty(numel, dtype=dtype)
        return flat[:numel].view(shape)


_BUFFERS = _ExpansionBuffers()


def _expanded(layer: QuantizedLinear, dtype: torch.dtype, reuse: bool) -> torch.Tensor:
    """The layer's weight in ``dtype``: into the thread's reusable buffer on the CPU when
    ``reuse`` (the caller reads it once and keeps nothing that aliases it), else fresh."""
    qweight = layer.quantized_weight()
    if reuse and qweight.tensors["data"].device.type == "cpu":
        shape = (layer.out_features, layer.in_features)
        return layer.dequantize_into(_BUFFERS.take(shape, dtype))
    return dequantize_weight(qweight, dtype)


class _DequantizedMatmul(torch.autograd.Function):
    """``x @ W.T`` with ``W`` expanded from its codes in forward and again in backward, both
    products in ``matmul_dtype``; the result is handed back in ``out_dtype`` and the input's
    gradient in the input's dtype (no copy when they already match)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        layer: QuantizedLinear,
        matmul_dtype: torch.dtype,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        ctx.layer = layer
        ctx.input_dtype = x.dtype
        ctx.matmul_dtype = matmul_dtype
        out = F.linear(x.to(matmul_dtype), _expanded(layer, matmul_dtype, reuse=True))
        return out.to(out_dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        # A double backward (create_graph) would save the weight: never the shared buffer then.
        weight = _expanded(ctx.layer, ctx.matmul_dtype, reuse=not torch.is_grad_enabled())
        grad_x = grad_out.to(ctx.matmul_dtype).matmul(weight).to(ctx.input_dtype)
        return grad_x, None, None, None


def _product_dtypes(layer: QuantizedLinear, x: torch.Tensor) -> tuple[torch.dtype, torch.dtype]:
    """(the dtype the products run in, the output's dtype): the layer's ``matmul_dtype``, else
    the autocast dtype where autocast is on (whose output is then the products' dtype, as for
    ``nn.Linear`` under autocast), else the input's."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = layer.matmul_dtype or torch.get_autocast_dtype(device_type)
        return dtype, dtype
    return layer.matmul_dtype or x.dtype, x.dtype


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

    def dequantize_into(self, out: torch.Tensor) -> torch.Tensor:
        """The weight expanded into ``out`` (``(out_features, in_features)``, the wanted dtype),
        returned: the product paths (this layer's and sakura-kernels' fused LoRA) expand into a
        reused buffer this way instead of a fresh tensor per product."""
        return dequantize_into(self.quantized_weight(), out)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        matmul_dtype, out_dtype = _product_dtypes(self, input)
        out: torch.Tensor = _DequantizedMatmul.apply(  # type: ignore[no-untyped-call]
            input, self, matmul_dtype, out_dtype
        )
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
