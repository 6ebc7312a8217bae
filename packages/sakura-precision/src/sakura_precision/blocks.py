"""Finding the repeated block stack of a model: ``ActivationCheckpoint`` checkpoints these
blocks and ``Compile(target="blocks")`` compiles them one by one.

The selection itself is sakura-torch's :mod:`sakura_torch.blocks` (one implementation for
every package, so ``blocks=`` means the same everywhere); this module re-exports it, with the
type of a selector.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from sakura_torch.blocks import describe_selector, find_blocks, validate_selector

__all__ = ["BlockSelector", "describe_selector", "find_blocks", "validate_selector"]

BlockSelector = None | str | type | tuple[type, ...] | Callable[[str, nn.Module], bool]
"""What ``blocks=`` accepts."""
