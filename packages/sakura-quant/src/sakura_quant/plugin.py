"""sakura-quant's plugin module (entry point ``sakura``): registers the ``quant`` service
lazily, so listing plugins never imports torch."""

from __future__ import annotations

from sakura.hookspecs import Register, hookimpl


@hookimpl
def sakura_register_services(register: Register) -> None:
    register(
        "quant",
        "sakura_quant.service:Quantization",
        description="frozen Linear weights quantized (nf4, int8, fp8, nvfp4) for QLoRA",
    )
