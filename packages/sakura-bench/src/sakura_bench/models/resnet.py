"""ResNet with bottleneck blocks (He et al. 2016), written out as torchvision defines it.

``resnet(layers=(3, 4, 6, 3), width=64)`` is ResNet-50 (25.6 M parameters with 1000
classes, 23.5 M with 10).  ``cifar_stem=True`` replaces the 7x7/2 convolution and the
max-pool by one 3x3/1 convolution, the usual adaptation to 32x32 inputs; ``resize`` makes
the model first upsample its input (CIFAR-10 at 224x224, as the reference benchmark ran).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["Bottleneck", "ResNet", "resnet"]


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, in_ch: int, width: int, stride: int) -> None:
        super().__init__()
        out_ch = width * self.expansion
        self.conv1 = nn.Conv2d(in_ch, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), nn.BatchNorm2d(out_ch)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        activated: torch.Tensor = self.relu(out + identity)
        return activated


class ResNet(nn.Module):
    def __init__(
        self,
        layers: Sequence[int],
        *,
        width: int = 64,
        classes: int = 10,
        cifar_stem: bool = False,
        resize: int | None = None,
    ) -> None:
        super().__init__()
        self.resize = resize
        if cifar_stem:
            self.stem = nn.Sequential(
                nn.Conv2d(3, width, 3, padding=1, bias=False),
                nn.BatchNorm2d(width),
                nn.ReLU(inplace=True),
            )
        else:
            self.stem = nn.Sequential(
                nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False),
                nn.BatchNorm2d(width),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(3, stride=2, padding=1),
            )
        blocks: list[nn.Module] = []
        in_ch = width
        for stage, count in enumerate(layers):
            stage_width = width * 2**stage
            for i in range(count):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(Bottleneck(in_ch, stage_width, stride))
                in_ch = stage_width * Bottleneck.expansion
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_ch, classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        for m in self.modules():  # zero-init the last BN of each block, as torchvision can
            if isinstance(m, Bottleneck):
                nn.init.zeros_(m.bn3.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.resize is not None and x.shape[-1] != self.resize:
            x = nn.functional.interpolate(
                x, size=(self.resize, self.resize), mode="bilinear", align_corners=False
            )
        x = self.blocks(self.stem(x))
        logits: torch.Tensor = self.fc(torch.flatten(self.pool(x), 1))
        return logits


def resnet(layers: Sequence[int] = (3, 4, 6, 3), **kwargs: object) -> ResNet:
    return ResNet(layers, **kwargs)  # type: ignore[arg-type]
