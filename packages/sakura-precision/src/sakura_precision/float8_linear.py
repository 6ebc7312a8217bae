"""Float8 matmuls for ``nn.Linear``: the engine of ``MixedPrecision("fp8")``.

Recipe (per-tensor dynamic scaling, as torchao's "tensorwise" float8 training): every
forward quantizes the input and the weight to ``float8_e4m3fn`` with a scale of
``448 / amax``; the backward quantizes the incoming gradient to ``float8_e5m2`` (more range,
less precision).  The three matmuls (output, input gradient, weight gradient) run on those
fp8 operands with fp32 accumulation; the weight itself stays in its own dtype (the fp32
master copy the optimizer updates).  The fp8 input and weight are what backward keeps, so
a Linear's saved activations take half the bytes of bf16.

Hardware: fp8 matrix multiply needs an NVIDIA GPU of compute capability 8.9 or newer (Ada
Lovelace, Hopper, Blackwell); there ``torch._scaled_mm`` runs the matmuls.  Elsewhere the
layers raise, unless built with ``emulate=True``: then the fp8 operands are dequantized and
multiplied in fp32, giving the numerics of the recipe (for tests) at fp32 speed or worse.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["FP8_REQUIREMENT", "Float8Linear", "check_fp8_hardware", "convert_to_float8"]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
_MAX = {E4M3: float(torch.finfo(E4M3).max), E5M2: float(torch.finfo(E5M2).max)}
_EPS = 1e-12
_ALIGN = 16  # torch._scaled_mm on CUDA: inner and output dims must be multiples of 16

FP8_REQUIREMENT = (
    "float8 matrix multiply needs an NVIDIA GPU with compute capability >= 8.9 (Ada Lovelace, "
    "Hopper or newer) and a CUDA build of torch"
)
_checked: set[tuple[str, int | None]] = set()


def check_fp8_hardware(device: torch.device) -> None:
    """Raise RuntimeError unless ``device`` can run fp8 matmuls in hardware."""
    key = (device.type, device.index)
    if key in _checked:
        return
    if device.type != "cuda":
        raise RuntimeError(
            f"MixedPrecision('fp8'): {FP8_REQUIREMENT}; the model runs on {device.type}. Use "
            f"'bf16' here, or MixedPrecision('fp8', emulate=True) to emulate the fp8 numerics "
            f"in fp32 (slow; for testing)"
        )
    if getattr(torch.version, "hip", None):
        raise RuntimeError(
            f"MixedPrecision('fp8'): {FP8_REQUIREMENT}; ROCm devices are not supported"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        name = torch.cuda.get_device_name(device)
        raise RuntimeError(
            f"MixedPrecision('fp8'): {FP8_REQUIREMENT}; {name} has compute capability "
            f"{capability[0]}.{capability[1]}. Use 'bf16' (or 'fp16' before Ampere) instead"
        )
    _checked.add(key)


def _quantize(t: torch.Tensor, fp8_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` in ``fp8_dtype`` with a per-tensor scale, and the fp32 dequantization scale."""
    fp8_max = _MAX[fp8_dtype]
    amax = t.detach().abs().amax().float().clamp(min=_EPS)
    scale = fp8_max / amax
    q = (t.float() * scale).clamp(-fp8_max, fp8_max).to(fp8_dtype)
    return q, scale.reciprocal()


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    extra = (-t.shape[0]) % _ALIGN
    if extra == 0:
        return t
    return torch.cat([t, t.new_zeros(extra, t.shape[1])])


def _pad_cols(t: torch.Tensor) -> torch.Tensor:
    extra = (-t.shape[1]) % _ALIGN
    if extra == 0:
        return t
    return torch.cat([t, t.new_zeros(t.shape[0], extra)], dim=1)


def fp8_matmul(
    a: torch.Tensor,
    a_inv: torch.Tensor,
    b: torch.Tensor,
    b_inv: torch.Tensor,
    out_dtype: torch.dtype,
    *,
    emulate: bool,
) -> torch.Tensor:
    """``(a * a_inv) @ (b * b_inv)`` in ``out_dtype`` for fp8 ``a`` [M, K] and ``b`` [K, N].

    Hardware path: ``torch._scaled_mm`` with ``a`` row-major and ``b`` column-major, as
    cuBLASLt requires; K is zero-padded to a multiple of 16 (zeros add nothing to the
    products).  Emulated path: dequantize and multiply in fp32.
    """
    if emulate:
        return ((a.float() * a_inv) @ (b.float() * b_inv)).to(out_dtype)
    k = a.shape[1]
    if k % _ALIGN:
        a = _pad_cols(a.float()).to(a.dtype)
        b = _pad_rows(b.float()).to(b.dtype)
    a = a.contiguous()
    b = b.t().contiguous().t()
    return torch._scaled_mm(a, b, scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype)


class _Float8Matmul(torch.autograd.Function):
    """``x @ weight.T`` with fp8 operands in forward and backward (see the module docstring)."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype, emulate: bool
    ) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            x_q, x_inv = _quantize(x, E4M3)
            w_q, w_inv = _quantize(weight, E4M3)
            out = fp8_matmul(x_q, x_inv, w_q.t(), w_inv, out_dtype, emulate=emulate)
        ctx.save_for_backward(x_q, x_inv, w_q, w_inv)
        ctx.emulate = emulate
        ctx.x_dtype = x.dtype
        ctx.w_dtype = weight.dtype
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        x_q, x_inv, w_q, w_inv = ctx.saved_tensors
        emulate = ctx.emulate
        grad_x = grad_w = None
        with torch.autocast(grad_out.device.type, enabled=False):
            g_q, g_inv = _quantize(grad_out, E5M2)
            if ctx.needs_input_grad[0]:
                grad_x = fp8_matmul(g_q, g_inv, w_q, w_inv, ctx.x_dtype, emulate=emulate)
            if ctx.needs_input_grad[1]:
                grad_w = fp8_matmul(g_q.t(), g_inv, x_q, x_inv, torch.float32, emulate=emulate).to(
                    ctx.w_dtype
                )
        return grad_x, grad_w, None, None


class Float8Linear(nn.Linear):
    """An ``nn.Linear`` whose matmuls run in float8.

    :func:`convert_to_float8` turns ``nn.Linear`` modules into this class in place (the
    instance's class changes; parameters, hooks and ``state_dict`` keys stay as they are).
    The output dtype is the autocast dtype when autocast is on, else the input's.
    """

    fp8_emulate: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device_type = x.device.type
        if not self.fp8_emulate:
            check_fp8_hardware(x.device)
        if torch.is_autocast_enabled(device_type):
            out_dtype = torch.get_autocast_dtype(device_type)
        else:
            out_dtype = x.dtype
        lead = x.shape[:-1]
        out = _Float8Matmul.apply(  # type: ignore[no-untyped-call]
            x.reshape(-1, self.in_features), self.weight, out_dtype, self.fp8_emulate
        )
        out = out.reshape(*lead, self.out_features)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out  # type: ignore[no-any-return]


def convert_to_float8(model: nn.Module, *, emulate: bool, module_filter: Any = None) -> list[str]:
    """Turn every exact ``nn.Linear`` of ``model`` whose in/out features are multiples of 16
    (and that ``module_filter(name, module)`` accepts, when given) into a
    :class:`Float8Linear`, in place.  Returns the converted modules' names."""
    converted = []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear:
            continue
        if module.in_features % _ALIGN or module.out_features % _ALIGN:
            continue
        if module_filter is not None and not module_filter(name, module):
            continue
        module.__class__ = Float8Linear
        module.__dict__["fp8_emulate"] = emulate
        converted.append(name)
    return converted
