"""Transformer models from transformers configs (random initialisation, no download).

transformers is imported when a model is built, not when sakura-bench is imported.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from sakura_bench.errors import BenchError

__all__ = [
    "DistilBertClassifier",
    "MultiTaskDistilBert",
    "causal_lm",
    "distilbert_config",
    "require",
]


def require(module: str, extra: str) -> Any:
    """Import ``module`` or raise ImportError saying which extra provides it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(
            f"this workload needs {module!r}, which is not installed: "
            f"pip install 'sakura-bench[{extra}]'"
        ) from exc


def distilbert_config(settings: Mapping[str, Any], num_labels: int) -> Any:
    transformers = require("transformers", "hf")
    return transformers.DistilBertConfig(
        vocab_size=settings["vocab_size"],
        dim=settings["dim"],
        n_layers=settings["layers"],
        n_heads=settings["heads"],
        hidden_dim=settings["hidden_dim"],
        max_position_embeddings=max(512, settings["max_length"]),
        num_labels=num_labels,
    )


class DistilBertClassifier(nn.Module):
    """DistilBERT for sequence classification behind a plain interface:
    ``forward(input_ids, attention_mask) -> logits`` (for loops that compute their loss)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        transformers = require("transformers", "hf")
        self.net = transformers.DistilBertForSequenceClassification(config)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.net(input_ids=input_ids, attention_mask=attention_mask).logits  # type: ignore[no-any-return]


class MultiTaskDistilBert(nn.Module):
    """One DistilBERT encoder shared by several classification heads (one per task), each
    shaped as ``DistilBertForSequenceClassification``'s: pre-classifier, ReLU, dropout,
    classifier over the first token."""

    def __init__(self, config: Any, labels_per_task: Sequence[int]) -> None:
        super().__init__()
        transformers = require("transformers", "hf")
        self.encoder = transformers.DistilBertModel(config)
        dim = config.dim
        self.heads = nn.ModuleList(
            nn.Sequential(
                nn.Linear(dim, dim),
                nn.ReLU(),
                nn.Dropout(config.seq_classif_dropout),
                nn.Linear(dim, labels),
            )
            for labels in labels_per_task
        )

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, task: int
    ) -> torch.Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask)[0]
        return self.heads[task](hidden[:, 0])  # type: ignore[no-any-return]


def causal_lm(kind: str, settings: Mapping[str, Any]) -> nn.Module:
    """A ``LlamaForCausalLM`` or ``MistralForCausalLM`` from its config, randomly
    initialised."""
    transformers = require("transformers", "hf")
    common = {
        "vocab_size": settings["vocab_size"],
        "hidden_size": settings["hidden"],
        "intermediate_size": settings["intermediate"],
        "num_hidden_layers": settings["layers"],
        "num_attention_heads": settings["heads"],
        "num_key_value_heads": settings["kv_heads"],
        "max_position_embeddings": max(settings["max_length"], settings.get("max_positions", 0)),
        "tie_word_embeddings": settings.get("tie_word_embeddings", False),
    }
    if kind == "llama":
        config = transformers.LlamaConfig(**common, rope_theta=settings.get("rope_theta", 5e5))
        cls = transformers.LlamaForCausalLM
    elif kind == "mistral":
        config = transformers.MistralConfig(
            **common, sliding_window=settings.get("sliding_window", 4096)
        )
        cls = transformers.MistralForCausalLM
    else:
        raise BenchError(f"unknown causal LM kind {kind!r}; accepted: llama, mistral")
    config._attn_implementation = "sdpa"
    return cls(config)  # type: ignore[no-any-return]
