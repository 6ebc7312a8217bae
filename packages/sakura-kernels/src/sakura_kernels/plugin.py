"""sakura-kernels' plugin module (entry point ``sakura``): registers the services lazily,
so listing plugins never imports torch."""

from __future__ import annotations

from sakura.hookspecs import Register, hookimpl


@hookimpl
def sakura_register_services(register: Register) -> None:
    register(
        "kernels",
        "sakura_kernels.service:Kernels",
        description="fused RMSNorm, rotary embedding, gated MLP and LoRA kernels swapped into "
        "Llama-family models where they agree with the modules they replace",
    )
    register(
        "chunked_loss",
        "sakura_kernels.losses.service:ChunkedLoss",
        description="the causal-LM loss from the hidden states a chunk of tokens at a time: "
        "the logits never exist",
    )
