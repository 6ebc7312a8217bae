"""Causal language models, HF-shaped: ``llama3-1b-finetune`` (every weight trains) and
``mistral-7b-lora`` (LoRA adapters on a frozen base, through ``peft``).

Models are built from ``LlamaConfig``/``MistralConfig`` with the published shapes of
Llama-3.2-1B and Mistral-7B at ``full`` scale (randomly initialised: no weights are
downloaded); ``small`` and ``tiny`` shrink width and depth for CPUs and tests.  Data:
sequences from a random Markov chain by default; ``--data DIR`` reads ``train.txt`` and
``valid.txt`` (or ``validation.txt``/``test.txt``), tokenized with sakura-bench's
word-level tokenizer and packed into blocks of ``max_length`` tokens.  Metrics:
``val_loss`` (mean token cross-entropy) and ``val_ppl``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from sakura_bench.workload import Split, Workload

__all__ = ["CausalLMWorkload", "Llama3Finetune", "Mistral7BLoRA"]

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def with_lora(peft: Any, base: nn.Module, r: int, *, dropout: float, seed: int) -> nn.Module:
    """``base`` with PEFT LoRA of rank ``r`` (alpha 2r) on every projection; the adapters
    are initialised from ``seed + 1``."""
    config = peft.LoraConfig(
        r=r,
        lora_alpha=2 * r,
        lora_dropout=dropout,
        target_modules=list(LORA_TARGETS),
        task_type="CAUSAL_LM",
    )
    torch.manual_seed(seed + 1)
    return peft.get_peft_model(base, config)  # type: ignore[no-any-return]


class CausalLMObjective(Workload):
    """What every causal-LM workload shares: AdamW over the trainable parameters, the
    model's own loss, held-out loss sums (labels shifted by one, ``-100`` ignored) and the
    perplexity computed from them."""

    eval_inputs: ClassVar[tuple[str, ...]] = ("input_ids", "attention_mask")
    """The batch entries the evaluation forward takes (packed rows use position_ids)."""

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        params = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=float(self.config["lr"]), weight_decay=0.0)

    def loss(self, model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
        return model(**batch).loss  # type: ignore[no-any-return]

    def eval_batch(self, model: nn.Module, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        logits = model(**{name: batch[name] for name in self.eval_inputs}).logits
        labels = batch["labels"][:, 1:]
        shifted = logits[:, :-1].float()
        loss_sum = nn.functional.cross_entropy(
            shifted.reshape(-1, shifted.shape[-1]),
            labels.reshape(-1),
            ignore_index=-100,
            reduction="sum",
        )
        return {"loss_sum": loss_sum, "count": (labels != -100).sum()}

    def complete_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        if "val_loss" in metrics:
            metrics["val_ppl"] = math.exp(min(metrics["val_loss"], 700.0))
        return metrics


class AdapterEvalState:
    """For workloads that train adapters only: the evaluation snapshot is the trainable
    tensors, loaded into the evaluator's model with ``strict=False``."""

    def eval_state(self, model: nn.Module) -> dict[str, torch.Tensor]:
        trainable = {name for name, p in model.named_parameters() if p.requires_grad}
        return {k: v for k, v in model.state_dict().items() if k in trainable}

    def load_eval_state(self, model: nn.Module, state: Mapping[str, torch.Tensor]) -> nn.Module:
        result = model.load_state_dict(state, strict=False)
        if result.unexpected_keys:
            raise KeyError(f"LoRA state has unexpected keys: {result.unexpected_keys[:5]}")
        return model


class CausalLMWorkload(CausalLMObjective):
    """Shared data, loss and evaluation of the causal-LM workloads."""

    hf_shaped = True
    kind: ClassVar[str] = "llama"
    grad_clip = 1.0
    _cache: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None

    def _splits(self) -> tuple[Split, Split]:
        if self._cache is not None:
            return self._cache
        c = self.config
        if self.data_dir is None:
            from sakura_bench.data.text import synthetic_lm

            common = {"seq_len": c["max_length"], "vocab_size": c["vocab_size"], "seed": self.seed}
            train = synthetic_lm(c["train"], split=0, **common)
            dev = synthetic_lm(c["eval"], split=1, **common)
        else:
            from sakura_bench.data.text import pack_lm, read_lm_corpus
            from sakura_bench.data.tokenizer import WordTokenizer

            train_text, eval_text = read_lm_corpus(self.data_dir)
            tokenizer = WordTokenizer.build([train_text], c["vocab_size"])
            train = pack_lm(tokenizer, train_text, c["max_length"], c["train"])
            dev = pack_lm(tokenizer, eval_text, c["max_length"], c["eval"])
        self._cache = (train, dev)
        return self._cache

    def train_split(self) -> Split:
        return self._splits()[0]

    def eval_split(self) -> Split:
        return self._splits()[1]

    def _base_model(self) -> nn.Module:
        from sakura_bench.models.transformer import causal_lm

        torch.manual_seed(self.seed)
        device = getattr(self, "device", torch.device("cpu"))
        dtype = torch.bfloat16 if self.config.get("base_bf16") and device.type == "cuda" else None
        if device.type == "cuda" and self.scale == "full":
            with torch.device(device):  # 1-7 B parameters: initialise them where they train
                model = causal_lm(self.kind, self.config)
        else:
            model = causal_lm(self.kind, self.config)
        return model.to(dtype) if dtype is not None else model


class Llama3Finetune(CausalLMWorkload):
    """Full fine-tune of a Llama-3.2-1B-shaped model (1.24 B parameters at full scale)."""

    description = "full fine-tune of a Llama-3.2-1B-shaped causal LM, AdamW, clip 1.0"
    kind = "llama"
    configs: ClassVar[Mapping[str, Mapping[str, Any]]] = {
        "tiny": {
            "vocab_size": 512,
            "hidden": 64,
            "intermediate": 128,
            "layers": 2,
            "heads": 4,
            "kv_heads": 2,
            "max_length": 32,
            "batch_size": 4,
            "train": 16,
            "eval": 8,
            "lr": 1e-3,
            "tie_word_embeddings": True,
        },
        "small": {
            "vocab_size": 32000,
            "hidden": 512,
            "intermediate": 2048,
            "layers": 4,
            "heads": 8,
            "kv_heads": 2,
            "max_length": 128,
            "batch_size": 4,
            "train": 64,
            "eval": 16,
            "lr": 3e-4,
            "tie_word_embeddings": True,
        },
        "full": {
            "vocab_size": 128256,
            "hidden": 2048,
            "intermediate": 8192,
            "layers": 16,
            "heads": 32,
            "kv_heads": 8,
            "max_length": 512,
            "batch_size": 8,
            "eval_batch_size": 4,
            "train": 512,
            "eval": 64,
            "lr": 2e-5,
            "tie_word_embeddings": True,
            "rope_theta": 500000.0,
        },
    }
    gpu_scales: ClassVar[Mapping[str, str]] = {
        "full": "1.24 B parameters: about 20 GB for fp32 weights, gradients and AdamW state",
    }

    def make_model(self) -> nn.Module:
        return self._base_model()


class Mistral7BLoRA(AdapterEvalState, CausalLMWorkload):
    """LoRA on a Mistral-7B-shaped model: adapters of rank ``lora_r`` on every attention
    and MLP projection (``peft``), the base frozen (bf16 on a GPU at full scale)."""

    description = "LoRA r=16 on every projection of a Mistral-7B-shaped causal LM (peft)"
    kind = "mistral"
    configs: ClassVar[Mapping[str, Mapping[str, Any]]] = {
        "tiny": {
            "vocab_size": 512,
            "hidden": 64,
            "intermediate": 128,
            "layers": 2,
            "heads": 4,
            "kv_heads": 2,
            "max_length": 32,
            "batch_size": 4,
            "train": 16,
            "eval": 8,
            "lr": 1e-3,
            "lora_r": 4,
        },
        "small": {
            "vocab_size": 32000,
            "hidden": 512,
            "intermediate": 1792,
            "layers": 4,
            "heads": 8,
            "kv_heads": 2,
            "max_length": 128,
            "batch_size": 4,
            "train": 64,
            "eval": 16,
            "lr": 2e-4,
            "lora_r": 16,
        },
        "full": {
            "vocab_size": 32000,
            "hidden": 4096,
            "intermediate": 14336,
            "layers": 32,
            "heads": 32,
            "kv_heads": 8,
            "max_length": 512,
            "batch_size": 4,
            "eval_batch_size": 4,
            "train": 256,
            "eval": 32,
            "lr": 2e-4,
            "lora_r": 16,
            "base_bf16": True,
        },
    }
    gpu_scales: ClassVar[Mapping[str, str]] = {
        "full": "7.2 B parameters: 14.5 GB for the bf16 base alone",
    }

    def make_model(self) -> nn.Module:
        from sakura_bench.models.transformer import require

        peft = require("peft", "hf")
        base = self._base_model()
        return with_lora(peft, base, int(self.config["lora_r"]), dropout=0.05, seed=self.seed)
