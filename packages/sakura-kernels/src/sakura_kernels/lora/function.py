"""The fused LoRA product: base and adapter of one adapted linear layer as one autograd
function.

Forward, for ``x`` of shape ``(N, in)`` (the caller flattens leading dimensions)::

    out = x @ W.T(+bias)  # the base product
    h = x @ A.T  # (N, r)
    out += scaling * (h @ B.T)  # accumulated into the base output (addmm_)

Backward, for ``g = d loss / d out``::

    gB = g @ B  # (N, r)
    grad_x = g @ W
    grad_x += scaling * (gB @ A)  # accumulated (addmm_)
    grad_A = scaling * gB.T @ x
    grad_B = scaling * g.T @ h

What is kept for backward: the input the base read (``x`` itself, no copy: a copy only exists
where autocast casts it, and then the one cast serves both products), ``h`` (``N x r``), and
the adapters as the products read them (cast once per step, in the forward: fp32 masters
with bf16 products give two small bf16 copies, shared by forward and backward).  PEFT instead casts the input to the adapters' dtype (an fp32 copy
of a bf16 input when the adapters are fp32, as ``get_peft_model`` makes them by default) and
keeps that copy for ``A``'s gradient.

The adapter products run in the output's dtype (the autocast dtype under autocast, else the
input's): a bf16 model with fp32 adapters multiplies them in bf16 (the adapters are cast,
``r x in`` and ``out x r`` values, not the input) and returns their gradients in fp32.

The base weight comes from a :class:`WeightSource`: a plain ``nn.Linear``'s weight, or a
quantized layer's expansion (``dequantize(dtype)``), expanded again in backward unless the
source keeps it (see :mod:`sakura_kernels.lora.base`).  The base weight gets no gradient: the
fused layers are frozen bases.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch.autograd.function import once_differentiable

__all__ = ["FusedLoraFunction", "WeightSource", "fused_lora_linear"]


class WeightSource(Protocol):
    """Where the fused function gets the base weight ``(out, in)`` from."""

    def weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in ``dtype`` (may be a fresh expansion; the caller keeps no alias
        beyond the product unless ``keeps_expansion``)."""
        ...

    @property
    def keeps_expansion(self) -> bool:
        """Whether the forward's weight is saved for backward instead of asked for again."""
        ...


class FusedLoraFunction(torch.autograd.Function):
    """See the module docstring.  Arguments: ``x`` (N, in), ``lora_a`` (r, in), ``lora_b``
    (out, r), ``bias`` or None, the :class:`WeightSource`, ``scaling``, the dtype of the base
    product and the dtype of the output (also the adapter products')."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        lora_a: torch.Tensor,
        lora_b: torch.Tensor,
        bias: torch.Tensor | None,
        source: WeightSource,
        scaling: float,
        base_dtype: torch.dtype,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        # The dtypes are decided by the caller: autocast must not re-cast the products.
        with torch.autocast(x.device.type, enabled=False):
            return _forward(ctx, x, lora_a, lora_b, bias, source, scaling, base_dtype, out_dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        with torch.autocast(grad_out.device.type, enabled=False):
            return _backward(ctx, grad_out)


def _product(
    lhs: torch.Tensor, rhs: torch.Tensor, compute: torch.dtype, out: torch.dtype
) -> torch.Tensor:
    """``lhs @ rhs`` with the product in ``compute`` (``rhs`` already is) and the result in
    ``out``: the one matmul-and-cast sequence of the base product and its input gradient
    (a cast only where the dtypes differ)."""
    result = torch.mm(lhs if lhs.dtype == compute else lhs.to(compute), rhs)
    return result if result.dtype == out else result.to(out)


def _forward(
    ctx: Any,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    bias: torch.Tensor | None,
    source: WeightSource,
    scaling: float,
    base_dtype: torch.dtype,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    xo = x.to(out_dtype)  # the input as the adapters read it (no copy in the usual case)
    weight = source.weight(base_dtype)
    if bias is not None and base_dtype == out_dtype:
        out = torch.addmm(bias.to(out_dtype), xo, weight.t())  # as nn.Linear: one rounding
    else:
        out = _product(xo if base_dtype == out_dtype else x, weight.t(), base_dtype, out_dtype)
        if bias is not None:
            out.add_(bias.to(out_dtype))
    # The adapters in the products' dtype, cast once here and kept for backward (r x in and
    # out x r values: a bf16 copy of fp32 masters costs nothing to keep).
    a = lora_a.to(out_dtype)
    b = lora_b.to(out_dtype)
    h = torch.mm(xo, a.t())
    out.addmm_(h, b.t(), alpha=scaling)

    kept = weight if source.keeps_expansion else None
    ctx.save_for_backward(xo, h, a, b, kept)
    ctx.source = source
    ctx.scaling = scaling
    ctx.base_dtype = base_dtype
    ctx.out_dtype = out_dtype
    ctx.x_dtype = x.dtype
    ctx.adapter_dtypes = (lora_a.dtype, lora_b.dtype)
    ctx.has_bias = bias is not None
    ctx.bias_dtype = bias.dtype if bias is not None else None
    return out


def _backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
    xo, h, a, b, kept = ctx.saved_tensors
    scaling: float = ctx.scaling
    base_dtype: torch.dtype = ctx.base_dtype
    a_dtype, b_dtype = ctx.adapter_dtypes
    need_x, need_a, need_b, need_bias = ctx.needs_input_grad[:4]
    g = grad_out.to(ctx.out_dtype)
    grad_x = grad_a = grad_b = grad_bias = None
    gb = torch.mm(g, b) if (need_x or need_a) else g.new_empty(0)  # (N, r)
    if need_x:
        weight = kept if kept is not None else ctx.source.weight(base_dtype)
        gx = _product(g, weight, base_dtype, ctx.out_dtype)
        gx.addmm_(gb, a, alpha=scaling)
        grad_x = gx.to(ctx.x_dtype)
    if need_a:
        grad_a = torch.mm(gb.t(), xo).mul_(scaling).to(a_dtype)
    if need_b:
        grad_b = torch.mm(g.t(), h).mul_(scaling).to(b_dtype)
    if need_bias and ctx.has_bias:
        grad_bias = g.sum(0).to(ctx.bias_dtype)
    return grad_x, grad_a, grad_b, grad_bias, None, None, None, None


def fused_lora_linear(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    bias: torch.Tensor | None,
    source: WeightSource,
    scaling: float,
    base_dtype: torch.dtype,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``x @ W.T + bias + scaling * (x @ A.T) @ B.T`` over any leading dimensions of ``x``,
    through :class:`FusedLoraFunction`."""
    lead = x.shape[:-1]
    out: torch.Tensor = FusedLoraFunction.apply(  # type: ignore[no-untyped-call]
        x.reshape(-1, x.shape[-1]),
        lora_a,
        lora_b,
        bias,
        source,
        scaling,
        base_dtype,
        out_dtype,
    )
    return out.reshape(*lead, out.shape[-1])
