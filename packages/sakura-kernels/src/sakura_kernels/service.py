"""``Kernels``: the ``kernels`` service, which swaps the fused block kernels (and, on
request, fused LoRA) into the model it is given.

Spec: ``kernels``, ``kernels:true``, ``kernels:false``, ``kernels:auto,fused_lora=true``.

* ``enabled`` (the positional option): ``"auto"`` (default), True or False.  ``"auto"``
  patches only when the frozen weights are quantized (a module shaped like sakura-quant's
  ``QuantizedLinear`` or bitsandbytes' 4/8-bit linears, found by duck typing: sakura-quant
  is never imported), because the fused kernels round once where PyTorch rounds at every
  step: a quantized model is already not bit-exact, while a bf16 / fp32 model stays
  bit-exact unless asked.
* ``fused_lora``: ``"auto"`` (default: on when the base is quantized), True or False;
  runs :func:`sakura_kernels.lora.fuse_lora` on the model.

``wrap_model`` patches in place (the same module object comes back) with
:func:`~sakura_kernels.patch_model`; the reports are kept on ``self.reports`` /
``self.lora_reports``.  ``teardown`` (the runtime closing) restores every model it patched.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

from sakura.options import check_choice, option_error
from sakura.service import Service

__all__ = ["Kernels", "is_quantized"]

_OWNER = "kernels"
_CHOICES = ("auto", True, False)
_QUANTIZED_CLASSES = ("QuantizedLinear", "Linear4bit", "Linear8bitLt")


def is_quantized(model: nn.Module) -> bool:
    """Whether ``model`` holds a quantized linear layer (by duck typing: a class named
    ``QuantizedLinear`` / ``Linear4bit`` / ``Linear8bitLt``, or a ``quantized_weight``
    attribute)."""
    return any(
        type(m).__name__ in _QUANTIZED_CLASSES or hasattr(m, "quantized_weight")
        for m in model.modules()
    )


class Kernels(Service):
    """The ``kernels`` service (see the module docstring).

    Args:
        enabled: ``"auto"``, True or False: the fused RMSNorm, rotary and gated-MLP kernels.
        fused_lora: ``"auto"``, True or False: fused LoRA (:mod:`sakura_kernels.lora`).
    """

    name = "kernels"
    priority = 15  # after quantization (5), before the chunked loss (20) and compilation

    def __init__(self, enabled: Any = "auto", *, fused_lora: Any = "auto") -> None:
        self.enabled: Any = check_choice("kernels", enabled, _CHOICES, owner=_OWNER)
        self.fused_lora: Any = check_choice("fused_lora", fused_lora, _CHOICES, owner=_OWNER)
        self.reports: list[Any] = []
        self.lora_reports: list[Any] = []
        self._patched: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._fused: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    def __repr__(self) -> str:
        return f"Kernels(enabled={self.enabled!r}, fused_lora={self.fused_lora!r})"

    def wrap_model(self, model: Any) -> Any:
        if not isinstance(model, nn.Module):
            raise option_error("model", type(model).__name__, "a torch.nn.Module", owner=_OWNER)
        quantized = is_quantized(model)
        if self.enabled is True or (self.enabled == "auto" and quantized):
            from sakura_kernels.blocks.patch import patch_model

            self.reports.append(patch_model(model))
            self._patched.add(model)
        if self.fused_lora is True or (self.fused_lora == "auto" and quantized):
            from sakura_kernels.lora import fuse_lora

            self.lora_reports.append(fuse_lora(model))
            self._fused.add(model)
        return model

    def teardown(self) -> None:
        from sakura_kernels.blocks.patch import unpatch_model

        for model in list(self._fused):
            from sakura_kernels.lora import unfuse_lora

            unfuse_lora(model)
        for model in list(self._patched):
            unpatch_model(model)
        self._patched = weakref.WeakSet()
        self._fused = weakref.WeakSet()
