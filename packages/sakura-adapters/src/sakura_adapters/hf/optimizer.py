"""SakuraTrainer's optimizer step proxy, and the helpers that see through it.

Accelerate wraps the Trainer's optimizer in an ``AcceleratedOptimizer``; SakuraTrainer puts
:class:`_RuntimeStepOptimizer` between the two so that ``step()`` goes through the runtime.
Services must always receive the optimizer ``rt.wrap_optimizer`` returned, never a wrapper:
:func:`service_optimizer` peels both layers off.  Both proxy types are registered with
:func:`sakura.proxies.register_optimizer_proxy` when this module is imported, so a service
handed either one sees through it with :func:`sakura.proxies.unwrap_optimizer`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# accelerate ships no type information (no py.typed).
from accelerate.optimizer import AcceleratedOptimizer  # type: ignore[import-untyped]

from sakura.proxies import register_optimizer_proxy
from sakura.runtime import SakuraRuntime

__all__ = ["mark_step_skipped", "service_optimizer"]


class _RuntimeStepOptimizer(torch.optim.Optimizer):
    """A thin proxy that sends ``step()`` through the runtime.

    It is what :class:`~sakura_adapters.hf.SakuraTrainer` gives accelerate to wrap
    (accelerate only wraps ``torch.optim.Optimizer`` instances, hence the base class, whose
    ``__init__`` is deliberately not called).  ``param_groups``, ``state``, ``defaults``,
    ``state_dict``, ``load_state_dict``, ``zero_grad`` and every other attribute are the
    wrapped optimizer's, so LR schedulers and the Trainer's checkpointing see the real
    thing.  ``step()`` brings the gradients back to scale (``rt.unscale_gradients``,
    idempotent per step) and offers the step to ``rt.optimizer_step``; the wrapped optimizer
    steps itself only when no service owned the step.

    Registered as an optimizer proxy (``sakura.proxies``), as accelerate's wrapper is.
    """

    def __init__(self, optimizer: Any, rt: SakuraRuntime) -> None:
        self.__dict__["optimizer"] = optimizer
        self.__dict__["rt"] = rt

    optimizer: Any
    rt: SakuraRuntime

    @property
    def param_groups(self) -> Any:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: Any) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> Any:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: Any) -> None:
        self.optimizer.defaults = value

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        optimizer, rt = self.optimizer, self.rt
        if closure is None:
            rt.unscale_gradients(optimizer)
            if not rt.optimizer_step(optimizer):
                optimizer.step()
            return None
        if not (rt.implements("optimizer_step") or rt.implements("unscale_gradients")):
            return optimizer.step(closure)
        with torch.enable_grad():
            loss = closure()
        rt.unscale_gradients(optimizer)
        if not rt.optimizer_step(optimizer):
            optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()  # type: ignore[no-any-return]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def __getattr__(self, name: str) -> Any:
        try:
            inner = self.__dict__["optimizer"]
        except KeyError:
            raise AttributeError(name) from None
        return getattr(inner, name)

    def __getstate__(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"


register_optimizer_proxy(AcceleratedOptimizer, "optimizer")
register_optimizer_proxy(_RuntimeStepOptimizer, "optimizer")


def is_wrapper(optimizer: Any) -> bool:
    """Whether ``optimizer`` is accelerate's wrapper or sakura's step proxy."""
    return isinstance(optimizer, (AcceleratedOptimizer, _RuntimeStepOptimizer))


def service_optimizer(optimizer: Any) -> Any:
    """The optimizer the services know: without accelerate's wrapper and sakura's step proxy."""
    while is_wrapper(optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def mark_step_skipped(optimizer: Any, skipped: bool) -> bool:
    """Tell the Trainer that a service skipped the step, the way accelerate's own loss
    scaler does, so that it leaves the LR scheduler alone.

    Right after ``optimizer.step()`` the Trainer steps the scheduler only
    ``if not accelerator.optimizer_step_was_skipped``, which reads each
    ``AcceleratedOptimizer.step_was_skipped`` -- its ``_is_overflow``, set by accelerate's
    GradScaler path alone.  Our services' optimizer sits under that wrapper (SakuraTrainer's
    step proxy), and accelerate has no scaler then, so the flag is ours to keep: set on a
    skipped step, cleared on the next one.  Returns whether the flag could be set.
    """
    if (
        isinstance(optimizer, AcceleratedOptimizer)
        and isinstance(optimizer.optimizer, _RuntimeStepOptimizer)
        and getattr(optimizer, "scaler", None) is None
        and hasattr(optimizer, "_is_overflow")
    ):
        optimizer._is_overflow = skipped
        return True
    return False
