"""sakura-precision's plugin module (entry point ``sakura``): registers the services lazily,
so listing plugins never imports torch."""

from __future__ import annotations

from sakura.hookspecs import Register, hookimpl


@hookimpl
def sakura_register_services(register: Register) -> None:
    register(
        "mixed_precision",
        "sakura_precision.mixed_precision:MixedPrecision",
        description="bf16/fp16/fp8 and Lightning's precision strings; fp16 loss scaling",
    )
    register(
        "compile",
        "sakura_precision.compile:Compile",
        description="torch.compile in place, with an on-disk cache",
    )
    register(
        "activation_checkpoint",
        "sakura_precision.activation_checkpoint:ActivationCheckpoint",
        description="selective activation checkpointing of the repeated block stack",
    )
