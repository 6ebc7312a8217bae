"""sakura-quant's plugin module (entry point ``sakura``): registers the ``quant`` service
lazily, so listing plugins never imports torch, and offers sakura-offload's ``fit`` the
choice ``quantize_base`` (:mod:`sakura_quant.fit_choice`) through sakura-offload's hook
``sakura_register_fit_choices`` (optional: without sakura-offload nothing calls it)."""

from __future__ import annotations

from sakura.hookspecs import Register, hookimpl


@hookimpl
def sakura_register_services(register: Register) -> None:
    register(
        "quant",
        "sakura_quant.service:Quantization",
        description="frozen Linear weights quantized (nf4, int8, fp8, nvfp4) for QLoRA",
    )


@hookimpl(optionalhook=True)
def sakura_register_fit_choices(register: Register) -> None:
    register(
        "quantize_base",
        "sakura_quant.fit_choice:QuantizeBase",
        description="frozen Linear weights quantized (int8 before nf4) when fit needs it",
    )
