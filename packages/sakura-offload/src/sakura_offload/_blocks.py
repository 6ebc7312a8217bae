"""The repeated block stack of a model, found the way sakura-precision's
``ActivationCheckpoint`` finds it (``sakura_precision.blocks``; sakura-offload does not
depend on sakura-precision, and a test checks that both select the same blocks).

``blocks`` selects them:

* ``None``: auto-detect.  A *stack* is a ``ModuleList`` or ``Sequential`` holding at least
  two modules of one class that has submodules of its own (a ``LlamaDecoderLayer``); the
  stack with the most parameters wins and its modules of that class are the blocks;
* a class, a tuple of classes, or a class name: every module of that class;
* a callable ``(qualified_name, module) -> bool``: every module it accepts.

With a class or a callable, modules inside an already selected module are not selected
again (the outermost match wins).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from sakura.options import option_error

__all__ = ["find_blocks", "validate_selector"]

_ACCEPTED = (
    "None (auto-detect), an nn.Module class, a tuple of classes, a class name, "
    "or a callable (name, module) -> bool"
)


def validate_selector(blocks: Any, *, owner: str) -> Any:
    """Check a ``blocks=`` value; returns it unchanged."""
    if blocks is None or (callable(blocks) and not isinstance(blocks, type)):
        return blocks
    if isinstance(blocks, str) and blocks.strip():
        return blocks
    classes = blocks if isinstance(blocks, tuple) and blocks else (blocks,)
    if all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        return blocks
    raise option_error("blocks", blocks, _ACCEPTED, owner=owner)


def _auto_detect(model: nn.Module) -> list[tuple[str, nn.Module]]:
    best: list[tuple[str, nn.Module]] = []
    best_params = -1
    for name, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        by_class: dict[type, list[tuple[str, nn.Module]]] = {}
        for child_name, child in container.named_children():
            qualified = f"{name}.{child_name}" if name else child_name
            by_class.setdefault(type(child), []).append((qualified, child))
        for members in by_class.values():
            if len(members) < 2 or next(members[0][1].children(), None) is None:
                continue
            params = sum(p.numel() for _, m in members for p in m.parameters())
            if params > best_params or (params == best_params and len(members) > len(best)):
                best, best_params = members, params
    return best


def _matcher(blocks: Any) -> Callable[[str, nn.Module], bool]:
    if isinstance(blocks, str):
        return lambda _name, module: type(module).__name__ == blocks
    if isinstance(blocks, (type, tuple)):
        return lambda _name, module: isinstance(module, blocks)
    return blocks  # type: ignore[no-any-return]


def find_blocks(model: nn.Module, blocks: Any, *, owner: str) -> list[tuple[str, nn.Module]]:
    """The selected blocks of ``model`` as ``(qualified_name, module)`` in model order."""
    if blocks is None:
        found = _auto_detect(model)
    else:
        match = _matcher(blocks)
        found = []
        for name, module in model.named_modules():
            if module is model or any(name.startswith(f"{done}.") for done, _ in found):
                continue
            if match(name, module):
                found.append((name, module))
    if not found:
        what = "no repeated block stack" if blocks is None else f"no module for blocks={blocks!r}"
        raise option_error(
            "blocks",
            blocks,
            f"{_ACCEPTED} that selects modules of {type(model).__name__} (found {what})",
            owner=owner,
        )
    return found
