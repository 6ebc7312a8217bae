"""The repeated block stack of a model (transformer layers, residual stages): the unit that
services checkpoint, compile, page or plan one by one.

sakura-precision's ``ActivationCheckpoint`` and ``Compile(target="blocks")``, and
sakura-offload's ``WeightPaging`` and memory planner, all select blocks with this one
function, so ``blocks=`` means the same thing everywhere (and a third-party service gets the
same behaviour).  ``blocks`` selects them:

* ``None``: auto-detect.  A *stack* is a ``ModuleList`` or ``Sequential`` holding at least
  two modules of one class that has submodules of its own (a ``LlamaDecoderLayer``, a
  ``BertLayer``; not a bare ``Linear``).  The stack with the most parameters wins; its
  modules of that class are the blocks.
* a class, a tuple of classes, or a class name (``"LlamaDecoderLayer"``, as in spec
  strings): every module of that class.
* a callable ``(qualified_name, module) -> bool``: every module it accepts.

With a class or a callable, modules inside an already selected module are not selected
again (the outermost match wins).

torch is imported when a selector is checked or blocks are found, never at import: a plugin
module that validates ``blocks=`` in its spec parser stays torch-free.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sakura.options import option_error

if TYPE_CHECKING:
    from torch import nn

__all__ = ["ACCEPTED", "describe_selector", "find_blocks", "validate_selector"]

ACCEPTED = (
    "None (auto-detect), an nn.Module class, a tuple of classes, a class name, "
    "or a callable (name, module) -> bool"
)
"""What ``blocks=`` accepts, as error messages say it."""


def validate_selector(blocks: Any, *, owner: str | None = None) -> Any:
    """Check a ``blocks=`` value; returns it unchanged, or raises
    :class:`~sakura.options.OptionError` naming ``blocks`` and what is accepted."""
    from torch import nn

    if blocks is None or (callable(blocks) and not isinstance(blocks, type)):
        return blocks
    if isinstance(blocks, str) and blocks.strip():
        return blocks
    classes = blocks if isinstance(blocks, tuple) and blocks else (blocks,)
    if all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
        return blocks
    raise option_error("blocks", blocks, ACCEPTED, owner=owner)


def describe_selector(blocks: Any) -> str:
    """A short text for a selector, for reprs and messages (``LlamaDecoderLayer``)."""
    if blocks is None:
        return "auto-detected"
    if isinstance(blocks, type):
        return blocks.__name__
    if isinstance(blocks, tuple):
        return "(" + ", ".join(t.__name__ for t in blocks) + ")"
    if isinstance(blocks, str):
        return blocks
    return str(getattr(blocks, "__name__", repr(blocks)))


def _auto_detect(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from torch import nn

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


def find_blocks(
    model: nn.Module, blocks: Any = None, *, owner: str = "sakura"
) -> list[tuple[str, nn.Module]]:
    """The selected blocks of ``model`` as ``(qualified_name, module)`` in model order.

    Raises :class:`~sakura.options.OptionError` (a ValueError) naming the model's class and
    the selector when nothing matches, or when the selector matches the whole model.
    """
    validate_selector(blocks, owner=owner)
    if blocks is None:
        found = _auto_detect(model)
    else:
        match = _matcher(blocks)
        found = []
        for name, module in model.named_modules():
            if module is model:
                if match(name, module):
                    raise option_error(
                        "blocks",
                        blocks,
                        f"a selector of the repeated sub-blocks of {type(model).__name__}; "
                        f"{describe_selector(blocks)} selects the whole model",
                        owner=owner,
                    )
                continue
            if any(name.startswith(f"{done}.") for done, _ in found):
                continue
            if match(name, module):
                found.append((name, module))
    if not found:
        if blocks is None:
            raise option_error(
                "blocks",
                blocks,
                f"a block class, its name, or a callable (name, module) -> bool: found no "
                f"repeated block stack in {type(model).__name__} (a ModuleList or Sequential "
                f"holding two or more modules of one class with submodules)",
                owner=owner,
            )
        raise option_error(
            "blocks",
            blocks,
            f"{ACCEPTED} that selects modules of {type(model).__name__}: "
            f"{describe_selector(blocks)} matched no module of {type(model).__name__}",
            owner=owner,
        )
    return found
