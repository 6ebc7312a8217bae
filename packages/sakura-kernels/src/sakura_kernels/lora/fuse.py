"""``fuse_lora`` / ``unfuse_lora``: patch a stock PEFT model so that each eligible LoRA linear
layer runs base and adapter as one autograd function (:mod:`sakura_kernels.lora.function`).

A layer is eligible when it is PEFT's ``lora.Linear`` with exactly one active adapter that is
plain LoRA: dropout off (``lora_dropout=0``), no DoRA or other PEFT variant, no adapter bias
(``lora_bias=False``), not merged, no ``fan_in_fan_out``, and a base that
:mod:`sakura_kernels.lora.base` accepts (plain ``nn.Linear`` or a quantized layer offering
``dequantize(dtype)``), frozen.  Anything else is left to PEFT and reported with the reason.

Patching sets an instance ``forward`` (a :class:`FusedForward`) on the layer (the class is untouched, so ``isinstance``,
``repr``, the state dict and PEFT's own methods see the stock layer); ``unfuse_lora`` removes
it.  At every call the patched forward checks that the layer is still as it was fused -- the
adapters enabled (PEFT's ``disable_adapter()`` context, ``disable_adapter_layers()``), not
merged (``merge_adapter()``), the same single active adapter (``set_adapter``), no per-call
``adapter_names`` or other arguments, a frozen base it can read -- and otherwise runs PEFT's
own forward, so every PEFT feature still works, unfused, for that call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from sakura.options import check_bool, check_choice, option_error
from sakura_kernels.lora.base import base_dtypes, base_problem, weight_source_for
from sakura_kernels.lora.function import fused_lora_linear

__all__ = ["FP32_OUTPUTS", "FuseReport", "FusedForward", "fuse_lora", "is_fused", "unfuse_lora"]

FP32_OUTPUTS = (False, True, "eval")
"""The values :func:`fuse_lora`'s ``fp32_outputs`` accepts."""

_HALF = (torch.bfloat16, torch.float16)


@dataclass
class FuseReport:
    """What :func:`fuse_lora` did: ``fused`` (module names, in model order) and ``skipped``
    (``(name, why)`` of each LoRA layer left to PEFT)."""

    fused: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"fused LoRA: {len(self.fused)} layers fused, {len(self.skipped)} skipped"]
        lines += [f"  skipped {name}: {why}" for name, why in self.skipped]
        return "\n".join(lines)


def _lora_linear_class() -> type[nn.Module] | None:
    try:
        from peft.tuners.lora import Linear
    except ImportError:  # no PEFT installed: no PEFT layer can be in the model
        return None
    cls: type[nn.Module] = Linear
    return cls


def _dropout_off(dropout: nn.Module) -> bool:
    if isinstance(dropout, nn.Identity):
        return True
    return isinstance(dropout, nn.Dropout) and dropout.p == 0


def _layer_problem(layer: Any) -> str | None:
    """Why this ``lora.Linear`` cannot be fused, or None."""
    active = list(layer.active_adapters)
    if len(active) != 1:
        return f"{len(active)} active adapters {active} (fused LoRA takes exactly one)"
    adapter = active[0]
    if adapter not in layer.lora_A:
        return f"active adapter {adapter!r} has no LoRA weights in this layer"
    if getattr(layer, "merged", False):
        return "adapter merged into the base weight"
    if getattr(layer, "fan_in_fan_out", False):
        return "fan_in_fan_out=True (Conv1D-style weight)"
    if layer.use_dora.get(adapter, False):
        return "DoRA adapter (use_dora=True)"
    if adapter in getattr(layer, "lora_variant", {}):
        return f"PEFT LoRA variant {type(layer.lora_variant[adapter]).__name__}"
    dropout = layer.lora_dropout[adapter]
    if not _dropout_off(dropout):
        p = getattr(dropout, "p", None)
        return f"lora_dropout={p} (fused LoRA needs dropout off)"
    lora_a, lora_b = layer.lora_A[adapter], layer.lora_B[adapter]
    if type(lora_a) is not nn.Linear or type(lora_b) is not nn.Linear:
        return "adapter matrices are not plain nn.Linear"
    if getattr(lora_a, "bias", None) is not None or getattr(lora_b, "bias", None) is not None:
        return "adapter bias (lora_bias=True)"
    scaling = layer.scaling.get(adapter)
    if not isinstance(scaling, (int, float)):
        return f"scaling {scaling!r} is not a number"
    return base_problem(layer.base_layer)


class FusedForward:
    """The ``forward`` a fused layer gets (an instance attribute): the fused function when the
    layer is as it was fused, else PEFT's own forward.  A plain object, not a bound method, so
    that a fused model deep-copies and pickles (the copy's forward is bound to the copy)."""

    def __init__(
        self, layer: nn.Module, adapter: str, keep_expanded: bool, fp32_outputs: Any = False
    ) -> None:
        self.layer = layer
        self.adapter = adapter
        self.keep_expanded = keep_expanded
        self.fp32_outputs = fp32_outputs

    def ready(self, x: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether this call can take the fused path."""
        layer: Any = self.layer
        return (
            not args
            and not kwargs
            and isinstance(x, torch.Tensor)
            and not layer.disable_adapters
            and not layer.merged
            and list(layer.active_adapters) == [self.adapter]
            and self.adapter in layer.lora_A
            and self.adapter not in layer.lora_variant
        )

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        layer: Any = self.layer
        stock = type(layer).forward
        if not self.ready(x, args, kwargs):
            result: torch.Tensor = stock(layer, x, *args, **kwargs)
            return result
        base = layer.base_layer
        dtypes = base_dtypes(base, x)
        source = weight_source_for(base, self.keep_expanded)
        if dtypes is None or source is None:
            result = stock(layer, x)
            return result
        wide = self.fp32_outputs is True or (self.fp32_outputs == "eval" and not layer.training)
        if wide and dtypes[1] in _HALF and torch.is_autocast_enabled(x.device.type):
            dtypes = (dtypes[0], torch.float32)
        return fused_lora_linear(
            x,
            layer.lora_A[self.adapter].weight,
            layer.lora_B[self.adapter].weight,
            base.bias,
            source,
            float(layer.scaling[self.adapter]),
            *dtypes,
        )


def is_fused(layer: nn.Module) -> bool:
    """Whether ``layer`` is a LoRA layer patched by :func:`fuse_lora`."""
    return isinstance(layer.__dict__.get("forward"), FusedForward)


def fuse_lora(
    model: nn.Module, *, keep_expanded: bool = False, fp32_outputs: bool | str = False
) -> FuseReport:
    """Patch, in place, every eligible PEFT ``lora.Linear`` of ``model`` (a stock
    ``get_peft_model`` result, or any module holding such layers) to run base and adapter as
    one autograd function; returns the :class:`FuseReport`.  Calling it again fuses what is
    newly eligible and sets the options below on the layers already fused.

    ``keep_expanded``: for quantized bases, keep the forward's expanded weight until backward
    instead of expanding it again there (one full-precision weight per layer held between
    forward and backward: what quantizing saved, given back for a faster backward).  Default
    False.  Plain ``nn.Linear`` bases are not affected.

    ``fp32_outputs``: under autocast, where the layer would return bf16 or fp16, return fp32
    instead (without autocast a half-precision model's next layers expect half-precision
    inputs, so its outputs are left as they are): the base product still runs in its dtype, the adapter
    product is computed and added in fp32, and nothing is rounded to 16 bits afterwards, so
    what follows the layer (the residual stream, the next norm) sees the fine-tune's small
    adapter contribution whole.  On SmolLM2 after a QLoRA fine-tune this takes a bf16
    evaluation from +0.6 % perplexity against the fp32 path to within 0.1 % (see
    ``benchmarks/quant_quality.py``); it costs fp32 activations after every adapted layer,
    so it is meant for evaluation and serving, not the training step: ``"eval"`` turns it on
    only while the layer is in eval mode (``model.eval()``: a trainer's evaluation loop).
    False (default), True or ``"eval"``.
    """
    if not isinstance(model, nn.Module):
        raise option_error("model", model, "a torch.nn.Module", owner="fuse_lora")
    keep = check_bool("keep_expanded", keep_expanded, owner="fuse_lora")
    wide = check_choice("fp32_outputs", fp32_outputs, FP32_OUTPUTS, owner="fuse_lora")
    report = FuseReport()
    lora_linear = _lora_linear_class()
    if lora_linear is None:
        return report
    for name, module in model.named_modules():
        if not isinstance(module, lora_linear):
            continue
        layer: Any = module
        if is_fused(module):
            fused: Any = module.__dict__["forward"]
            fused.keep_expanded, fused.fp32_outputs = keep, wide
            report.fused.append(name)
            continue
        why = _layer_problem(module)
        if why is not None:
            report.skipped.append((name, why))
            continue
        (adapter,) = layer.active_adapters
        layer.forward = FusedForward(layer, adapter, keep, wide)
        report.fused.append(name)
    return report


def unfuse_lora(model: nn.Module) -> list[str]:
    """Undo :func:`fuse_lora` on ``model`` (the layers run PEFT's own forward again, nothing
    else changed); returns the names of the layers restored."""
    if not isinstance(model, nn.Module):
        raise option_error("model", model, "a torch.nn.Module", owner="unfuse_lora")
    restored = []
    for name, module in model.named_modules():
        if is_fused(module):
            del module.__dict__["forward"]
            restored.append(name)
    return restored
