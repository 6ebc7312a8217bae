"""MLPs on MNIST: ``mnist-mlp`` (the smoke workload) and ``mnist-mlp-multi`` (several
epochs, evaluation about as costly as a training epoch: the regime where evaluating off
the training thread pays off)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from sakura_bench.models.mlp import mlp
from sakura_bench.workload import Split, Workload, classification_sums

__all__ = ["MnistMLP", "MnistMLPMulti"]

# ((train images, train labels), (test images, test labels)) as read from the IDX files.
_MnistFiles = tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class MnistMLP(Workload):
    """An MLP classifying 28x28 digits; synthetic digits with MNIST's shapes by default,
    ``--data DIR`` reads the four MNIST IDX files."""

    description = "MLP 784-512-256-10 on MNIST, AdamW"
    default_epochs = 3
    configs: ClassVar[Mapping[str, Mapping[str, Any]]] = {
        "tiny": {
            "batch_size": 32,
            "eval_batch_size": 64,
            "train": 256,
            "eval": 128,
            "hidden": (64, 32),
        },
        "small": {
            "batch_size": 128,
            "eval_batch_size": 512,
            "train": 8192,
            "eval": 2048,
            "hidden": (512, 256),
        },
        "full": {
            "batch_size": 128,
            "eval_batch_size": 1024,
            "train": 60000,
            "eval": 10000,
            "hidden": (512, 256),
        },
    }

    _files: _MnistFiles | None = None

    def _real(self) -> _MnistFiles:
        from sakura_bench.data.mnist import load_mnist

        if self._files is None:
            if self.data_dir is None:
                raise RuntimeError("MNIST files are read only when a data directory is given")
            self._files = load_mnist(self.data_dir)
        return self._files

    def train_split(self) -> Split:
        from sakura_bench.data.mnist import synthetic_digits

        n = int(self.config["train"])
        if self.data_dir is None:
            x, y = synthetic_digits(n, self.seed, 0)
        else:
            (x, y), _ = self._real()
            x, y = x[:n], y[:n]
        return {"x": x, "y": y}

    def eval_split(self) -> Split:
        from sakura_bench.data.mnist import synthetic_digits

        n = int(self.config["eval"])
        if self.data_dir is None:
            x, y = synthetic_digits(n, self.seed, 1)
        else:
            _, (x, y) = self._real()
            x, y = x[:n], y[:n]
        return {"x": x, "y": y}

    def make_model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return mlp(28 * 28, self.config["hidden"], 10)

    def loss(self, model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
        return nn.functional.cross_entropy(model(batch["x"]), batch["y"])

    def eval_batch(self, model: nn.Module, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        return classification_sums(model(batch["x"]), batch["y"])


class MnistMLPMulti(MnistMLP):
    """Several epochs of a wider MLP with an evaluation set three times the size of the
    epoch's training samples: a training step (forward, backward, AdamW) costs about three
    forward passes, so evaluating an epoch costs about as much as training it.

    With ``--data DIR`` the first ``train`` MNIST training images train; the evaluation
    set is the 10,000 test images followed by the unused training images, up to ``eval``.
    """

    description = "MLP 784-1024-1024-10, 5 epochs, eval set 3x the epoch: eval ≈ train"
    default_epochs = 5
    configs: ClassVar[Mapping[str, Mapping[str, Any]]] = {
        "tiny": {
            "batch_size": 32,
            "eval_batch_size": 96,
            "train": 256,
            "eval": 768,
            "hidden": (64, 64),
        },
        "small": {
            "batch_size": 128,
            "eval_batch_size": 384,
            "train": 2048,
            "eval": 6144,
            "hidden": (1024, 1024),
        },
        "full": {
            "batch_size": 128,
            "eval_batch_size": 384,
            "train": 4096,
            "eval": 12288,
            "hidden": (1024, 1024),
        },
    }

    def eval_split(self) -> Split:
        if self.data_dir is None:
            return super().eval_split()
        n, used = int(self.config["eval"]), int(self.config["train"])
        (train_x, train_y), (test_x, test_y) = self._real()
        x = torch.cat([test_x, train_x[used:]])[:n]
        y = torch.cat([test_y, train_y[used:]])[:n]
        return {"x": x, "y": y}
