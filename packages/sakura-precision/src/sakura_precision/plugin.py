"""sakura-precision's plugin module (entry point ``sakura``): registers the services lazily,
so listing plugins never imports torch."""

from __future__ import annotations

from sakura.hookspecs import Register, hookimpl


@hookimpl
def sakura_register_services(register: Register) -> None:
    register(
        "mixed_precision",
        "sakura_precision.mixed_precision:MixedPrecision",
        description="bf16/fp16/fp8 autocast, fp16 dynamic loss scaling, Lightning's precision "
        "strings (mixed_precision:bf16, mixed_precision:fp16, mixed_precision:bf16-true)",
    )
    register(
        "compile",
        "sakura_precision.compile:Compile",
        description="torch.compile in place with an on-disk cache "
        "(compile, compile:mode=max-autotune, compile:target=blocks)",
    )
    register(
        "activation_checkpoint",
        "sakura_precision.checkpointing:ActivationCheckpoint",
        description="selective non-reentrant activation checkpointing of the block stack "
        "(activation_checkpoint, activation_checkpoint:policy=save_matmuls,every=2)",
    )
