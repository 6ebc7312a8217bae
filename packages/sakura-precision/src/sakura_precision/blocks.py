"""Finding the repeated block stack of a model (transformer layers, residual stages).

``ActivationCheckpoint`` checkpoints these blocks and ``Compile(target="blocks")`` compiles
them one by one.  ``blocks`` selects them:

* ``None``: auto-detect.  A *stack* is a ``ModuleList`` or ``Sequential`` holding at least
  two modules of one class that has submodules of its own (a ``LlamaDecoderLayer``, a
  ``BertLayer``; not a bare ``Linear``).  The stack with the most parameters wins; its
  modules of that class are the blocks.
* a class, a tuple of classes, or a class name (``"LlamaDecoderLayer"``, as in spec
  strings): every module of that class.
* a callable ``(qualified_name, module) -> bool``: every module it accepts.

With a class or a callable, modules inside an already selected module are not selected
again (the outermost match wins).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["BlockSelector", "describe_selector", "find_blocks", "validate_selector"]

BlockSelector = None | str | type | tuple[type, ...] | Callable[[str, nn.Module], bool]
"""What ``blocks=`` accepts."""


def validate_selector(owner: str, blocks: Any) -> Any:
    """Check a ``blocks=`` value; returns it unchanged."""
    if blocks is None or isinstance(blocks, str):
        if isinstance(blocks, str) and not blocks.strip():
            raise ValueError(f"{owner}: blocks must not be an empty string")
        return blocks
    if isinstance(blocks, type):
        if not issubclass(blocks, nn.Module):
            raise ValueError(
                f"{owner}: blocks={blocks.__name__} is not a torch.nn.Module subclass; accepted: "
                f"None (auto-detect), an nn.Module class, a tuple of classes, a class name, or "
                f"a callable (name, module) -> bool"
            )
        return blocks
    if isinstance(blocks, tuple) and blocks:
        for item in blocks:
            if not (isinstance(item, type) and issubclass(item, nn.Module)):
                raise ValueError(
                    f"{owner}: a blocks tuple must hold nn.Module classes, got {item!r}"
                )
        return blocks
    if callable(blocks):
        return blocks
    raise ValueError(
        f"{owner}: blocks={blocks!r} is not accepted; accepted: None (auto-detect), an "
        f"nn.Module class, a tuple of classes, a class name, or a callable (name, module) -> bool"
    )


def describe_selector(blocks: Any) -> str:
    if blocks is None:
        return "auto-detected"
    if isinstance(blocks, type):
        return blocks.__name__
    if isinstance(blocks, tuple):
        return "(" + ", ".join(t.__name__ for t in blocks) + ")"
    if isinstance(blocks, str):
        return blocks
    return getattr(blocks, "__name__", repr(blocks))


def _auto_detect(model: nn.Module) -> list[tuple[str, nn.Module]]:
    best: list[tuple[str, nn.Module]] = []
    best_params = -1
    for name, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        by_class: dict[type, list[tuple[str, nn.Module]]] = {}
        for child_name, child in container.named_children():
            by_class.setdefault(type(child), []).append(
                (f"{name}.{child_name}" if name else child_name, child)
            )
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


def find_blocks(
    model: nn.Module, blocks: Any = None, *, owner: str = "sakura"
) -> list[tuple[str, nn.Module]]:
    """The selected blocks of ``model`` as ``(qualified_name, module)`` in model order.

    Raises ValueError naming the model's class and the selector when nothing matches.
    """
    if blocks is None:
        found = _auto_detect(model)
    else:
        match = _matcher(blocks)
        found = []
        taken: list[str] = []
        for name, module in model.named_modules():
            if module is model:
                if match(name, module):
                    raise ValueError(
                        f"{owner}: blocks={describe_selector(blocks)} selects the whole model "
                        f"({type(model).__name__}); select its repeated sub-blocks instead"
                    )
                continue
            if any(name.startswith(prefix + ".") for prefix in taken):
                continue
            if match(name, module):
                found.append((name, module))
                taken.append(name)
    if not found:
        if blocks is None:
            raise ValueError(
                f"{owner}: found no repeated block stack in {type(model).__name__} (a ModuleList "
                f"or Sequential holding two or more modules of one class with submodules); pass "
                f"blocks= a block class, its name, or a callable (name, module) -> bool"
            )
        raise ValueError(
            f"{owner}: blocks={describe_selector(blocks)} matched no module of "
            f"{type(model).__name__}"
        )
    return found
