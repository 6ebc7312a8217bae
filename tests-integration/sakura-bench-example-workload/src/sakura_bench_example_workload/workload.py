"""``example-xor``: a noisy XOR learned by a two-layer MLP."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from sakura_bench.workload import Split, Workload, classification_sums


class XorWorkload(Workload):
    """Two inputs near 0 or 1 (Gaussian noise), label = their XOR."""

    description = "noisy XOR, MLP 2-32-2, AdamW"
    default_epochs = 3
    configs: ClassVar[Mapping[str, Mapping[str, Any]]] = {
        "tiny": {"batch_size": 16, "train": 128, "eval": 64},
        "full": {"batch_size": 64, "train": 8192, "eval": 2048},
    }

    def _split(self, n: int, split: int) -> Split:
        g = torch.Generator().manual_seed(self.seed * 1000 + split)
        bits = torch.randint(0, 2, (n, 2), generator=g)
        x = bits.float() + 0.1 * torch.randn((n, 2), generator=g)
        return {"x": x, "y": bits[:, 0] ^ bits[:, 1]}

    def train_split(self) -> Split:
        return self._split(int(self.config["train"]), 0)

    def eval_split(self) -> Split:
        return self._split(int(self.config["eval"]), 1)

    def make_model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 2))

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=0.01)

    def loss(self, model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
        return nn.functional.cross_entropy(model(batch["x"]), batch["y"])

    def eval_batch(self, model: nn.Module, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        return classification_sums(model(batch["x"]), batch["y"])
