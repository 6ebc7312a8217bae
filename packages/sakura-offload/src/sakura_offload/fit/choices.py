"""Fit choices: ways to make a model's frozen weights smaller that plugins offer to ``fit``.

sakura-offload decides where state lives; it does not know how to shrink a frozen base.
Packages that can (sakura-quant: "quantize the frozen base") offer a *choice* through the
plugin hook :func:`sakura_register_fit_choices`, which this module adds to sakura's plugin
manager (``sakura_add_hookspecs``, as sakura-bench adds its workload hooks).  A plugin
implements it like any sakura hook::

    from sakura import hookimpl


    @hookimpl(optionalhook=True)  # optional: the plugin still loads without sakura-offload
    def sakura_register_fit_choices(register):
        register("my_choice", "my_package.fit:MyChoice", description="...")

``target`` is a :class:`FitChoice` subclass, or a lazy ``"module:Name"`` string imported
only when ``fit`` plans.  :func:`fit_choices` returns them by name, through
the core's registry (name matching, duplicate-name errors, failure reporting).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sakura.hookspecs import hookspec

__all__ = [
    "HOOK",
    "FitChoice",
    "FitChoiceError",
    "FitOption",
    "add_to",
    "fit_choices",
    "sakura_register_fit_choices",
]

Register = Callable[..., None]

HOOK = "sakura_register_fit_choices"


class FitChoiceError(LookupError):
    """An unknown fit choice, or one that failed to load."""


@dataclass(frozen=True)
class FitOption:
    """One way a choice can apply to a model, with what it saves.

    ``saved``: bytes of frozen tensors saved, by the qualified name of the module that holds
    them (``fit`` adds them up per block, so a streamed block's working set shrinks too);
    ``frozen_bytes_after``: the model's frozen bytes once applied; ``cost``: how much the
    option costs (quality and time), used to rank every option of every choice: the
    cheapest option that makes the model fit is taken (sakura-quant's int8 costs 1.0, nf4
    2.0); ``detail``: what the choice needs to apply it (its own data)."""

    choice: str
    name: str
    cost: float
    saved: Mapping[str, int]
    frozen_bytes_after: int
    description: str = ""
    detail: Mapping[str, Any] = field(default_factory=dict)

    @property
    def bytes_saved(self) -> int:
        return sum(self.saved.values())

    @property
    def label(self) -> str:
        return f"{self.choice}:{self.name}"


class FitChoice:
    """A way to shrink a model's frozen weights (subclass it, or give an object these
    methods: a package that must not depend on sakura-offload does; see the module
    docstring).

    ``name`` is set from the registration when the class leaves it empty.  ``reversible``:
    whether :meth:`undo` gives the original weights back (``unwrap`` calls it)."""

    name: str = ""
    description: str = ""
    reversible: bool = False

    def applies(self, model: Any) -> bool:
        """Whether this choice can do anything for ``model``."""
        raise NotImplementedError(f"{type(self).__name__}.applies")

    def estimate(self, model: Any, **context: Any) -> list[FitOption]:
        """The options for ``model``, exactly sized, without changing it.  ``context``:
        ``blocks`` (the block names ``fit`` found) and ``device`` (where the model is)."""
        raise NotImplementedError(f"{type(self).__name__}.estimate")

    def apply(self, model: Any, option: FitOption) -> None:
        """Apply ``option`` (one :meth:`estimate` returned) to ``model`` in place."""
        raise NotImplementedError(f"{type(self).__name__}.apply")

    def undo(self, model: Any) -> None:
        """Undo :meth:`apply` (only when ``reversible``)."""
        raise NotImplementedError(f"{type(self).__name__} cannot be undone")


def add_to(pluginmanager: Any) -> None:
    """Declare :func:`sakura_register_fit_choices` on ``pluginmanager`` unless a package
    declared it first."""
    hook = getattr(pluginmanager.hook, HOOK, None)
    if getattr(hook, "spec", None) is None:
        pluginmanager.add_hookspecs(
            type("SakuraOffloadFitHooks", (), {HOOK: sakura_register_fit_choices})
        )


@hookspec
def sakura_register_fit_choices(register: Register) -> None:
    """Offer ways to shrink a model's frozen weights to ``fit`` (sakura-offload).  Call
    ``register(name, target, *, description="")`` once per choice: ``name`` is what
    ``fit``'s ``choices=`` option takes; ``target`` a
    :class:`~sakura_offload.fit.FitChoice` subclass or a ``"module:Name"`` string."""


def fit_choices(names: Any = None, manager: Any = None) -> dict[str, FitChoice]:
    """The registered fit choices called ``names`` (``None``: all), by name, instantiated
    (``manager``: sakura's shared plugin manager by default).  An unknown name, or a choice
    whose target fails to load, is a :class:`FitChoiceError` naming it (and the known
    names)."""
    from sakura.plugins import get_plugin_manager

    manager = manager or get_plugin_manager()
    manager.load()
    add_to(manager.pm)
    registry = manager.collect("fit choice", HOOK, error=FitChoiceError)
    found: dict[str, FitChoice] = {}
    wanted = registry.names() if names is None else list(names)
    for wanted_name in wanted:
        entry = registry.find(wanted_name)
        if entry is None:
            known = ", ".join(registry.names()) or "none registered"
            raise FitChoiceError(f"unknown fit choice {wanted_name!r}; known: {known}")
        name = entry.name
        try:
            target = entry.load()
        except Exception as exc:
            raise FitChoiceError(f"fit choice {name!r} failed to load: {exc}") from exc
        choice = target() if isinstance(target, type) else target
        missing = [
            m for m in ("applies", "estimate", "apply") if not callable(getattr(choice, m, None))
        ]
        if missing:
            raise FitChoiceError(
                f"fit choice {name!r} ({type(choice).__name__}) lacks {', '.join(missing)}: "
                "subclass sakura_offload.fit.FitChoice"
            )
        if not getattr(choice, "name", ""):
            choice.name = name
        found[name] = choice
    return found
