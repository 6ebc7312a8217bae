"""ResNet-50 on CIFAR-10."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import nn

from sakura_bench.workload import Split, Workload, classification_sums

__all__ = ["Cifar10ResNet50"]


class Cifar10ResNet50(Workload):
    """ResNet-50 classifying CIFAR-10.  ``full`` is the reference GPU benchmark: images
    upsampled to 224x224 on the device, batch 128, 4,096 training and 1,024 validation
    images, 3 epochs.  ``small`` keeps ResNet-50 at CIFAR's native 32x32 (CPU stem);
    ``tiny`` is a one-block-per-stage, 8-wide ResNet for tests.  SGD with momentum."""

    description = "ResNet-50 (bottleneck 3-4-6-3) on CIFAR-10, SGD momentum"
    default_epochs = 3
    configs: ClassVar[Mapping[str, Mapping[str, Any]]] = {
        "tiny": {
            "batch_size": 8,
            "train": 16,
            "eval": 16,
            "layers": (1, 1, 1, 1),
            "width": 8,
            "image": 32,
        },
        "small": {
            "batch_size": 32,
            "eval_batch_size": 128,
            "train": 512,
            "eval": 256,
            "layers": (3, 4, 6, 3),
            "width": 64,
            "image": 32,
        },
        "full": {
            "batch_size": 128,
            "eval_batch_size": 256,
            "train": 4096,
            "eval": 1024,
            "layers": (3, 4, 6, 3),
            "width": 64,
            "image": 224,
        },
    }
    gpu_scales: ClassVar[Mapping[str, str]] = {
        "full": "ResNet-50 at 224x224 is about 12 GFLOP per training image; 12,288 images "
        "would take hours on a CPU",
    }

    _files: Any = None

    def _split(self, which: int) -> Split:
        n = int(self.config["train" if which == 0 else "eval"])
        if self.data_dir is None:
            from sakura_bench.data.cifar import synthetic_cifar

            x, y = synthetic_cifar(n, self.seed, which)
        else:
            from sakura_bench.data.cifar import load_cifar10

            if self._files is None:
                self._files = load_cifar10(self.data_dir)
            x, y = self._files[which]
            x, y = x[:n], y[:n]
        return {"x": x, "y": y}

    def train_split(self) -> Split:
        return self._split(0)

    def eval_split(self) -> Split:
        return self._split(1)

    def make_model(self) -> nn.Module:
        from sakura_bench.models.resnet import resnet

        torch.manual_seed(self.seed)
        image = int(self.config["image"])
        return resnet(
            self.config["layers"],
            width=int(self.config["width"]),
            classes=10,
            cifar_stem=image == 32,
            resize=image if image != 32 else None,
        )

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(
            model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4, nesterov=True
        )

    def loss(self, model: nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
        return nn.functional.cross_entropy(model(batch["x"]), batch["y"])

    def eval_batch(self, model: nn.Module, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        return classification_sums(model(batch["x"]), batch["y"])
