"""``SakuraPrecision``: the Lightning precision plugin that routes the step through a runtime.

Lightning's own extension point for autocast, loss scaling, unscaling before clipping, the
optimizer step and model/optimizer wrapping is the ``Precision`` plugin API; this plugin
wraps the one the Trainer configured and adds the runtime's calls (the table is in
:mod:`sakura_adapters.lightning`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning_utilities.core.apply_func import apply_to_collection

from sakura import events as ev
from sakura.proxies import register_optimizer_proxy
from sakura.runtime import SakuraRuntime

__all__ = ["SakuraPrecision", "check_runtime"]

# Lightning hands training_step a LightningOptimizer around the real optimizer: services
# see through it with sakura.proxies.unwrap_optimizer.
register_optimizer_proxy(LightningOptimizer, "_optimizer")


def _floating_dtype(module: torch.nn.Module) -> torch.dtype | None:
    """The one floating dtype of ``module``'s parameters, else None."""
    dtypes = {p.dtype for p in module.parameters() if p.is_floating_point()}
    return dtypes.pop() if len(dtypes) == 1 else None


def check_runtime(rt: Any) -> SakuraRuntime:
    if not isinstance(rt, SakuraRuntime):
        raise TypeError(f"rt must be a sakura.SakuraRuntime, got {type(rt).__name__}")
    return rt


class SakuraPrecision(Precision):
    """A Lightning precision plugin that routes the step through a SakuraRuntime.

    ``inner`` is the precision plugin it wraps (the Trainer's own, e.g. for
    ``precision="bf16-true"``); everything sakura's services do not take over is delegated
    to it.  Normally installed by :class:`LightningAdapter`; pass it yourself with
    ``Trainer(plugins=[SakuraPrecision(rt)])`` to use the runtime without the callback.
    """

    inner: Precision
    """The precision plugin this one wraps and delegates to."""

    def __init__(self, rt: SakuraRuntime, inner: Precision | None = None) -> None:
        super().__init__()
        self.rt = check_runtime(rt)
        if inner is not None and not isinstance(inner, Precision):
            raise TypeError(
                f"inner must be a lightning Precision plugin, got {type(inner).__name__}"
            )
        if isinstance(inner, SakuraPrecision):
            inner = inner.inner
        self.inner = inner if inner is not None else Precision()
        self.precision = self.inner.precision
        self._input_dtype: torch.dtype | None = None
        """The dtype a service cast the module's weights to in ``convert_module``
        (``MixedPrecision("bf16-true")``, say): batches are cast to it, as Lightning's own
        ``-true`` plugins do in ``convert_input``; None when no service changed it."""

    # --- setup ------------------------------------------------------------------------

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        module = self.inner.convert_module(module)
        before = _floating_dtype(module)
        wrapped = self.rt.wrap_model(module)
        if isinstance(module, pl.LightningModule) and wrapped is not module:
            raise TypeError(
                f"under Lightning, wrap_model must modify the LightningModule in place and return "
                f"it (services {list(self.rt.implements('wrap_model'))} returned a "
                f"{type(wrapped).__name__}); Lightning drives the module it was given"
            )
        # Lightning hands the batch to training_step, not to forward, so a service's forward
        # pre-hook casting the inputs does not see it: when a service cast the weights to
        # one dtype, the batch follows them here (Lightning's convert_input moment).
        after = _floating_dtype(wrapped) if isinstance(wrapped, torch.nn.Module) else None
        self._input_dtype = after if after is not None and after != before else None
        return wrapped  # type: ignore[no-any-return]

    def connect(
        self, model: torch.nn.Module, optimizers: list[Any], lr_schedulers: list[Any]
    ) -> tuple[torch.nn.Module, list[Any], list[Any]]:
        model, optimizers, lr_schedulers = self.inner.connect(model, optimizers, lr_schedulers)
        return model, [self.rt.wrap_optimizer(opt) for opt in optimizers], lr_schedulers

    # --- contexts ---------------------------------------------------------------------

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        if not self.rt.implements("autocast"):
            return self.inner.forward_context()  # nothing to add: no extra generator frame
        return self._stacked_forward_context()

    @contextlib.contextmanager
    def _stacked_forward_context(self) -> Generator[None, None, None]:
        with self.inner.forward_context(), self.rt.autocast():
            yield

    def tensor_init_context(self) -> contextlib.AbstractContextManager[Any]:
        return self.inner.tensor_init_context()

    def module_init_context(self) -> contextlib.AbstractContextManager[Any]:
        return self.inner.module_init_context()

    def convert_input(self, data: Any) -> Any:
        data = self.inner.convert_input(data)
        dtype = self._input_dtype
        if dtype is None:
            return data
        return apply_to_collection(
            data,
            torch.Tensor,
            lambda t: t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t,
        )

    def convert_output(self, data: Any) -> Any:
        return self.inner.convert_output(data)

    # --- backward and step ---------------------------------------------------------------

    def pre_backward(self, tensor: torch.Tensor, module: pl.LightningModule) -> torch.Tensor:  # type: ignore[override]
        tensor = self.inner.pre_backward(tensor, module)
        return self.rt.scale_loss(tensor)  # type: ignore[no-any-return]

    def backward(  # type: ignore[override]
        self,
        tensor: torch.Tensor,
        model: pl.LightningModule,
        optimizer: Any,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        self.inner.backward(tensor, model, optimizer, *args, **kwargs)

    def post_backward(self, tensor: torch.Tensor, module: pl.LightningModule) -> torch.Tensor:  # type: ignore[override]
        return self.inner.post_backward(tensor, module)

    def clip_gradients(
        self, optimizer: Any, clip_val: float = 0.0, gradient_clip_algorithm: Any = None
    ) -> None:
        if clip_val is None or clip_val <= 0:
            return
        # Manual optimization hands clip_gradients a LightningOptimizer while optimizer_step
        # gets the torch optimizer: services keyed by the optimizer must see the same object.
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        self.rt.unscale_gradients(optimizer)
        if gradient_clip_algorithm is None:
            self.inner.clip_gradients(optimizer, clip_val)
        else:
            self.inner.clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Any,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        if not self.rt.implements("optimizer_step"):
            result = self.inner.optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        else:
            if isinstance(optimizer, torch.optim.LBFGS):
                raise TypeError(
                    f"sakura services {list(self.rt.implements('optimizer_step'))} own the optimizer "
                    f"step, which cannot re-evaluate an LBFGS closure; use another optimizer"
                )
            result = closure()
            skipped = result is None and getattr(model, "automatic_optimization", True)
            if not skipped:
                self.rt.unscale_gradients(optimizer)
            self._after_closure(model, optimizer)
            if skipped:
                return result
            if not self.rt.optimizer_step(optimizer):
                optimizer.step(**kwargs)
        trainer = getattr(model, "_trainer", None)
        if trainer is not None and self.rt.handles(ev.OnOptimizerStep):
            self.rt.emit(
                ev.OnOptimizerStep,
                step=trainer.global_step + 1,
                epoch=trainer.current_epoch,
                model=model,
                optimizer=optimizer,
                skipped=self.rt.last_step_skipped,
            )
        return result

    # --- state --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)

    def teardown(self) -> None:
        self.inner.teardown()
