"""``Kernels``: the ``kernels`` service, which swaps the fused block kernels (and, on
request, fused LoRA) into the model it is given.

Spec: ``kernels``, ``kernels:true``, ``kernels:false``, ``kernels:auto,fused_lora=true``,
``kernels:true,attention=false``, ``kernels:true,keep_expanded=true``,
``kernels:auto,reuse_heap=true``.

* ``enabled`` (the positional option): ``"auto"`` (default), True or False.  ``"auto"``
  patches only when the frozen weights are quantized (a module shaped like sakura-quant's
  ``QuantizedLinear`` or bitsandbytes' 4/8-bit linears, found by duck typing: sakura-quant
  is never imported), because the fused kernels round once where PyTorch rounds at every
  step: a quantized model is already not bit-exact, while a bf16 / fp32 model stays
  bit-exact unless asked.
* ``fused_lora``: ``"auto"`` (default: on when the base is quantized), True or False;
  runs :func:`sakura_kernels.lora.fuse_lora` on the model.
* ``keep_expanded``: False (default) or True: fused LoRA keeps a quantized base's forward
  expansion for backward instead of expanding again (``fuse_lora(keep_expanded=True)``:
  faster, one full-precision weight per layer held from forward to backward).
* ``fp32_outputs``: ``"eval"`` (default), True or False: fused LoRA layers return fp32
  where they would return bf16/fp16 -- always (True), never (False), or while the model is
  in eval mode (``"eval"``: the trainer's evaluation loop; the training step keeps its
  16-bit outputs).  ``fuse_lora(fp32_outputs=...)`` says why: a bf16 evaluation loses
  the fine-tune's small adapter contribution in the output's rounding.
* ``attention``: ``"auto"`` (default: on when the base is quantized and the model is on the
  CPU), True or False: the Hugging Face model inside (a PEFT wrapper is looked through) runs
  sakura-kernels' fused CPU attention
  (:func:`~sakura_kernels.blocks.attention.register_attention`,
  ``set_attn_implementation("sakura")``; on a GPU or for cases it does not cover, that
  function hands over to SDPA); its previous attention comes back at teardown.
* ``reuse_heap``: False (default) or True: glibc keeps the memory a step frees for the next
  step to reuse (:func:`sakura_torch.heap.reuse_freed_memory`: a process-wide setting, not
  undone at teardown, so it is asked for, not assumed).  On a CPU a step otherwise pays
  page faults for most of its large tensors: 6-7 % of the QLoRA step of
  ``benchmarks/qlora_step.py``.  What it did is kept on ``self.heap``.

``wrap_model`` patches in place (the same module object comes back) with
:func:`~sakura_kernels.patch_model`; the reports are kept on ``self.reports`` /
``self.lora_reports``.  ``teardown`` (the runtime closing) restores every model it patched.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

from torch import nn

from sakura.options import check_bool, check_choice, option_error
from sakura.service import Service
from sakura_kernels.lora.fuse import FP32_OUTPUTS
from sakura_torch.heap import HeapReuse, reuse_freed_memory

__all__ = ["Kernels", "is_quantized"]

_LOG = logging.getLogger("sakura_kernels")
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

    def __init__(
        self,
        enabled: Any = "auto",
        *,
        fused_lora: Any = "auto",
        attention: Any = "auto",
        keep_expanded: Any = False,
        fp32_outputs: Any = "eval",
        reuse_heap: Any = False,
    ) -> None:
        self.enabled: Any = check_choice("kernels", enabled, _CHOICES, owner=_OWNER)
        self.fused_lora: Any = check_choice("fused_lora", fused_lora, _CHOICES, owner=_OWNER)
        self.attention: Any = check_choice("attention", attention, _CHOICES, owner=_OWNER)
        self.keep_expanded = check_bool("keep_expanded", keep_expanded, owner=_OWNER)
        self.fp32_outputs: Any = check_choice(
            "fp32_outputs", fp32_outputs, FP32_OUTPUTS, owner=_OWNER
        )
        self.reuse_heap = check_bool("reuse_heap", reuse_heap, owner=_OWNER)
        self.heap: HeapReuse | None = None
        self._attention: list[tuple[weakref.ref[nn.Module], str]] = []
        self.reports: list[Any] = []
        self.lora_reports: list[Any] = []
        self._patched: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._fused: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    def __repr__(self) -> str:
        return (
            f"Kernels(enabled={self.enabled!r}, fused_lora={self.fused_lora!r}, "
            f"attention={self.attention!r}, keep_expanded={self.keep_expanded!r}, "
            f"fp32_outputs={self.fp32_outputs!r}, reuse_heap={self.reuse_heap!r})"
        )

    def wrap_model(self, model: Any) -> Any:
        if not isinstance(model, nn.Module):
            raise option_error("model", type(model).__name__, "a torch.nn.Module", owner=_OWNER)
        quantized = is_quantized(model)
        if self.reuse_heap and self.heap is None:
            self.heap = reuse_freed_memory()
            _LOG.info("kernels: %s", self.heap.detail)
        if self.enabled is True or (self.enabled == "auto" and quantized):
            from sakura_kernels.blocks.patch import patch_model

            self.reports.append(patch_model(model))
            self._patched.add(model)
        if self.fused_lora is True or (self.fused_lora == "auto" and quantized):
            from sakura_kernels.lora import fuse_lora

            self.lora_reports.append(
                fuse_lora(model, keep_expanded=self.keep_expanded, fp32_outputs=self.fp32_outputs)
            )
            self._fused.add(model)
        on_cpu = all(p.device.type == "cpu" for p in model.parameters())
        if self.attention is True or (self.attention == "auto" and quantized and on_cpu):
            self._use_fused_attention(model)
        return model

    def _use_fused_attention(self, model: nn.Module) -> None:
        from sakura_kernels.blocks.attention import register_attention

        target: Any = next(
            (
                m
                for m in model.modules()
                if callable(getattr(m, "set_attn_implementation", None))
                and isinstance(
                    getattr(getattr(m, "config", None), "_attn_implementation", None), str
                )
            ),
            None,
        )
        if target is None:
            return
        name = register_attention()
        previous: str = target.config._attn_implementation
        if previous != name:
            target.set_attn_implementation(name)
            self._attention.append((weakref.ref(target), previous))

    def teardown(self) -> None:
        from sakura_kernels.blocks.patch import unpatch_model

        for model in list(self._fused):
            from sakura_kernels.lora import unfuse_lora

            unfuse_lora(model)
        for model in list(self._patched):
            unpatch_model(model)
        for ref, previous in reversed(self._attention):
            target: Any = ref()
            if target is not None:
                target.set_attn_implementation(previous)
        self._attention = []
        self._patched = weakref.WeakSet()
        self._fused = weakref.WeakSet()
