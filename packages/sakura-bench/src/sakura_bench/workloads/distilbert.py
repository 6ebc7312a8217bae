"""DistilBERT on SST-2: ``distilbert-sst2`` (a plain ``logits = model(ids, mask)``
interface for raw and Lightning loops) and ``distilbert-sst2-hf`` (HF-shaped: the model is
``DistilBertForSequenceClassification`` called as ``model(**batch).loss``; it also runs
under ``transformers.Trainer``).

Synthetic sentences by default; ``--data DIR`` reads GLUE's ``SST-2/train.tsv`` and
``dev.tsv`` (``DIR`` is the GLUE folder or the SST-2 folder), tokenized with sakura-bench's
word-level tokenizer (:mod:`sakura_bench.data.tokenizer`: DistilBERT's WordPiece
vocabulary cannot be downloaded here).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from sakura_bench.workload import Split, Workload, classification_sums

__all__ = ["DISTILBERT_SCALES", "DistilBertSST2", "DistilBertSST2HF"]

_TINY = {"vocab_size": 512, "dim": 32, "layers": 2, "heads": 2, "hidden_dim": 64}
_BASE = {"vocab_size": 30522, "dim": 768, "layers": 6, "heads": 12, "hidden_dim": 3072}

DISTILBERT_SCALES: Mapping[str, Mapping[str, Any]] = {
    "tiny": {**_TINY, "max_length": 16, "batch_size": 8, "train": 32, "eval": 16, "lr": 5e-4},
    "small": {
        **_BASE,
        "max_length": 64,
        "batch_size": 16,
        "eval_batch_size": 64,
        "train": 128,
        "eval": 64,
        "lr": 5e-5,
    },
    "full": {
        **_BASE,
        "max_length": 128,
        "batch_size": 64,
        "eval_batch_size": 128,
        "train": 4096,
        "eval": 872,
        "lr": 5e-5,
    },
}
DISTILBERT_GPU = {
    "full": "DistilBERT (66 M parameters) at 128 tokens over 4,096 sentences is about "
    "200 TFLOP per epoch",
}


class DistilBertSST2(Workload):
    """DistilBERT (randomly initialised from its config) classifying SST-2 sentences."""

    description = "DistilBERT sequence classification on SST-2, AdamW"
    default_epochs = 2
    configs = DISTILBERT_SCALES
    gpu_scales: ClassVar[Mapping[str, str]] = DISTILBERT_GPU

    _cache: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None

    def _splits(self) -> tuple[Split, Split]:
        if self._cache is not None:
            return self._cache
        c = self.config
        if self.data_dir is None:
            from sakura_bench.data.text import synthetic_classification

            common = {"seq_len": c["max_length"], "vocab_size": c["vocab_size"], "num_labels": 2}
            train = synthetic_classification(c["train"], seed=self.seed, split=0, **common)
            dev = synthetic_classification(c["eval"], seed=self.seed, split=1, **common)
        else:
            from sakura_bench.data.text import GLUE_TASKS, read_glue_task
            from sakura_bench.data.tokenizer import WordTokenizer

            train_ex, dev_ex = read_glue_task(self.data_dir, GLUE_TASKS["sst2"])
            first = train_ex.first[: c["train"]]
            tokenizer = WordTokenizer.build(first, c["vocab_size"])
            ids, mask = tokenizer.encode_pairs(first, None, c["max_length"])
            train = {
                "input_ids": ids,
                "attention_mask": mask,
                "labels": train_ex.labels[: c["train"]],
            }
            ids, mask = tokenizer.encode_pairs(dev_ex.first[: c["eval"]], None, c["max_length"])
            dev = {"input_ids": ids, "attention_mask": mask, "labels": dev_ex.labels[: c["eval"]]}
        self._cache = (train, dev)
        return self._cache

    def train_split(self) -> Split:
        return self._splits()[0]

    def eval_split(self) -> Split:
        return self._splits()[1]

    def make_model(self) -> nn.Module:
        from sakura_bench.models.transformer import DistilBertClassifier, distilbert_config

        torch.manual_seed(self.seed)
        return DistilBertClassifier(distilbert_config(self.config, num_labels=2))

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=float(self.config["lr"]), weight_decay=0.01)

    def loss(self, model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
        logits = model(batch["input_ids"], batch["attention_mask"])
        return nn.functional.cross_entropy(logits, batch["labels"])

    def eval_batch(self, model: nn.Module, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        return classification_sums(
            model(batch["input_ids"], batch["attention_mask"]), batch["labels"]
        )


class DistilBertSST2HF(DistilBertSST2):
    """The HF-shaped SST-2 workload: ``DistilBertForSequenceClassification`` itself, dict
    batches with ``labels``, the loss from the model's output."""

    description = "DistilBERT on SST-2, HF-shaped (runs under transformers.Trainer too)"
    hf_shaped = True

    def make_model(self) -> nn.Module:
        from sakura_bench.models.transformer import distilbert_config, require

        transformers = require("transformers", "hf")
        torch.manual_seed(self.seed)
        return transformers.DistilBertForSequenceClassification(  # type: ignore[no-any-return]
            distilbert_config(self.config, num_labels=2)
        )

    def loss(self, model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
        return model(**batch).loss  # type: ignore[no-any-return]

    def eval_batch(self, model: nn.Module, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        return classification_sums(model(**batch).logits, batch["labels"])

    def hf_metrics(self, predictions: Any, labels: Any) -> dict[str, float] | None:
        predictions = torch.as_tensor(predictions)
        labels = torch.as_tensor(labels)
        return {"acc": float((predictions == labels).float().mean())}
