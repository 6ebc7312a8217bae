"""sakura-kernels: fused kernels for training Llama-family decoders faster.

One sub-package per feature (the guide: ``docs/kernels.md``):

* :mod:`sakura_kernels.blocks`: fused RMSNorm (forward and backward, the weight gradient
  summed in a fixed order), rotary embedding and gated MLP activations (SwiGLU / GeGLU), in
  C++ (AVX-512 / AVX2) and CUDA with a torch fallback; :func:`patch_model` swaps them into a
  Hugging Face model only where a check against the module's own forward agrees;
* :mod:`sakura_kernels.lora`: fused LoRA, base + adapter as one autograd function, over
  plain ``nn.Linear`` and sakura-quant ``QuantizedLinear`` bases of a stock PEFT model;
* :mod:`sakura_kernels.losses`: losses from hidden states, so the logits never exist: the
  chunked causal-LM cross-entropy, ``sequence_logprobs``, ``dpo_loss`` (TRL's argument
  order) and ``reference_logprobs``; the ``chunked_loss`` service;
* :mod:`sakura_kernels.service`: the ``kernels`` service (spec ``kernels``).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Exports load on first use: the plugin module (sakura_kernels.plugin) is imported whenever
# sakura lists plugins, and that must not import torch.
_EXPORTS = {
    "patch_model": "sakura_kernels.blocks.patch",
    "unpatch_model": "sakura_kernels.blocks.patch",
    "PatchReport": "sakura_kernels.blocks.patch",
    "register_attention": "sakura_kernels.blocks.attention",
    "FuseReport": "sakura_kernels.lora",
    "fuse_lora": "sakura_kernels.lora",
    "unfuse_lora": "sakura_kernels.lora",
    "causal_lm_loss": "sakura_kernels.losses.chunked",
    "chunked_causal_lm_loss": "sakura_kernels.losses.chunked",
    "shift_causal_labels": "sakura_kernels.losses.chunked",
    "sequence_logprobs": "sakura_kernels.losses.preference",
    "dpo_loss": "sakura_kernels.losses.preference",
    "reference_logprobs": "sakura_kernels.losses.reference",
    "ChunkedLoss": "sakura_kernels.losses.service",
    "Kernels": "sakura_kernels.service",
}

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sakura_kernels' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
