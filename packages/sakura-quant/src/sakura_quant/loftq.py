"""LoftQ: quantize a weight together with a low-rank fit of what quantization loses.

The base stores ``Q(W - B A)`` and the pair ``(A, B)`` is kept beside it, so that a LoRA
adapter started at ``(A, B)`` (:func:`init_lora_from_error`) makes ``base + adapter`` close to
the original ``W`` from the first step, instead of starting at the quantized ``W``.  The rounds
follow the LoftQ paper and PEFT's ``loftq_init``: quantize the residual, take the rank-``r``
SVD of ``W`` minus its expansion, and quantize ``W`` minus that fit in the next round.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sakura.options import option_error
from sakura_quant.codec import dequantize_weight, encode
from sakura_quant.formats import QuantizedWeight
from sakura_quant.options import WeightSpec

__all__ = [
    "check_error_rank",
    "fit_error",
    "init_lora_from_error",
    "quantize_with_error_fit",
]


def check_error_rank(rank: int, shape: tuple[int, ...], *, name: str, owner: str) -> None:
    """``error_rank`` for the weight ``name`` of ``shape`` ``(out, in)``: 0 (off) or at most
    ``min(out, in)``, the largest rank a fit of that weight has; a larger one is an error
    (it used to be cut down silently, and the adapters then had fewer fitted columns than
    asked for)."""
    limit = min(shape) if shape else 0
    if rank > limit:
        raise option_error(
            "error_rank",
            rank,
            f"an int in [0, {limit}] for {name} (its weight is {tuple(shape)}: a low-rank fit "
            f"has rank at most min(out, in) = {limit})",
            owner=owner,
        )


def _low_rank(residual: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A, B)`` with ``B @ A`` the best rank-``rank`` fit of ``residual`` (the singular
    values split evenly between the two factors by their square roots, as PEFT does)."""
    u, s, vh = torch.linalg.svd(residual, full_matrices=False)
    root = s[:rank].sqrt()
    return root[:, None] * vh[:rank], u[:, :rank] * root[None, :]


def quantize_with_error_fit(
    weight: torch.Tensor,
    format: str,
    *,
    block_size: int | None,
    double_quant: bool,
    rank: int,
    iters: int,
    name: str = "weight",
    owner: str = "quantize_with_error_fit",
) -> tuple[QuantizedWeight, torch.Tensor, torch.Tensor]:
    """``(Q(W - B A), A, B)`` after ``iters`` LoftQ rounds; ``A`` is ``(rank, in)`` and ``B``
    ``(out, rank)`` in fp32.  ``format`` / ``block_size`` / ``double_quant`` are checked as
    :func:`~sakura_quant.quantize_weight` checks them; ``rank`` must be in
    ``[1, min(out, in)]`` (a larger fit does not exist: :func:`check_error_rank`);
    ``name`` / ``owner`` are what errors cite."""
    spec = WeightSpec.check(format, block_size, double_quant, owner=owner)
    return fit_error(weight, spec, rank, iters, name=name, owner=owner)


def fit_error(
    weight: torch.Tensor,
    spec: WeightSpec,
    rank: int,
    iters: int,
    *,
    name: str = "weight",
    owner: str = "quantize_with_error_fit",
) -> tuple[QuantizedWeight, torch.Tensor, torch.Tensor]:
    """:func:`quantize_with_error_fit` for a ``spec`` already checked (the model-level
    paths): each round quantizes with :func:`~sakura_quant.codec.encode`, checking nothing
    again but the rank against this weight's shape."""
    if weight.dim() != 2:
        raise ValueError(f"LoftQ needs a 2-D weight, got shape {tuple(weight.shape)}")
    check_error_rank(rank, tuple(weight.shape), name=name, owner=owner)
    w = weight.detach().float()
    residual = w
    for i in range(iters):
        qweight = encode(residual.to(weight.dtype), spec, name=name)
        a, b = _low_rank(w - dequantize_weight(qweight, torch.float32), rank)
        if i + 1 < iters:
            residual = w - b @ a
    return qweight, a.contiguous(), b.contiguous()


def _lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """PEFT LoRA layers (by what they hold, so PEFT is not imported here)."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(getattr(m, "base_layer", None), nn.Module)
        and isinstance(getattr(m, "lora_A", None), nn.ModuleDict)
        and isinstance(getattr(m, "lora_B", None), nn.ModuleDict)
    ]


@torch.no_grad()
def init_lora_from_error(model: nn.Module, adapter_name: str | None = None) -> int:
    """Start every PEFT LoRA adapter whose base is a quantized layer carrying LoftQ factors
    at that layer's quantization error; returns how many adapters it set.

    For an adapter of rank ``r`` and scaling ``s``: ``lora_A = A[:k]``, ``lora_B[:, :k] =
    B[:, :k] / s`` and the other columns of ``lora_B`` zero (``k = min(r, error_rank)``), so
    ``s * lora_B @ lora_A`` is the rank-``k`` fit.  ``adapter_name``: only that adapter
    (default: every adapter of each layer).  DoRA adapters are refused.
    """
    from sakura_quant.linear import QuantizedLinear

    count = 0
    for name, layer in _lora_layers(model):
        base = layer.base_layer
        if not isinstance(base, QuantizedLinear) or base.error_factors is None:
            continue
        factor_a, factor_b = base.error_factors
        lora_a: Any = layer.lora_A
        lora_b: Any = layer.lora_B
        scaling: dict[str, float] = getattr(layer, "scaling", {})
        for adapter in list(lora_a.keys()):
            if adapter_name is not None and adapter != adapter_name:
                continue
            if getattr(layer, "use_dora", {}).get(adapter, False):
                raise ValueError(
                    f"init_lora_from_error: {name} adapter {adapter!r} uses DoRA; LoftQ "
                    "starts plain LoRA adapters only"
                )
            a = lora_a[adapter].weight
            b = lora_b[adapter].weight
            k = min(a.shape[0], factor_a.shape[0])
            scale = float(scaling.get(adapter, 1.0))
            a[:k].copy_(factor_a[:k].to(a.dtype))
            b.zero_()
            b[:, :k].copy_((factor_b[:, :k] / scale).to(b.dtype))
            count += 1
    return count
