"""A multi-layer perceptron over flattened images."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


def mlp(in_features: int, hidden: Sequence[int], classes: int) -> nn.Sequential:
    """``Flatten -> (Linear -> ReLU) per hidden width -> Linear``."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = in_features
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)
