"""Fused decoder-block kernels: RMSNorm, rotary embedding and gated MLP activations
(:mod:`sakura_kernels.blocks.functions`), and :func:`patch_model`, which swaps them into a
Hugging Face Llama-family model where they agree with its own modules
(:mod:`sakura_kernels.blocks.patch`)."""

from __future__ import annotations

from sakura_kernels.blocks.functions import fused_glu, fused_rms_norm, fused_rotary
from sakura_kernels.blocks.patch import PatchReport, patch_model, unpatch_model

__all__ = [
    "PatchReport",
    "fused_glu",
    "fused_rms_norm",
    "fused_rotary",
    "patch_model",
    "unpatch_model",
]
