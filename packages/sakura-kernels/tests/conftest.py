"""Shared fixtures for sakura-kernels' tests: tiny Llama-family causal LMs from configs."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import transformers

FAMILIES = ("llama", "mistral", "qwen2")
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
)


def tiny_model(
    family: str = "llama", dtype: torch.dtype = torch.float32, seed: int = 0
) -> torch.nn.Module:
    configs = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
    }
    config = configs[family](**TINY)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    models = {
        "llama": transformers.LlamaForCausalLM,
        "mistral": transformers.MistralForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
    }
    model = models[family](config).to(dtype)
    # Norm weights away from 1 so that their gradients and products are exercised.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture
def make_model() -> Callable[..., torch.nn.Module]:
    """``make_model(family="llama", dtype=torch.float32, seed=0)``: a tiny causal LM."""
    return tiny_model
