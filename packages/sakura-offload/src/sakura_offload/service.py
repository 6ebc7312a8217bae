"""The ``offload_adamw`` service: swaps the loop's AdamW for :class:`OffloadAdamW`.

It acts in ``wrap_optimizer``, which ``rt.prepare(model, optimizer)`` calls for raw loops,
Lightning's ``LightningAdapter`` calls on every optimizer of the Trainer, and sakura's
``SakuraTrainer`` calls on the Hugging Face Trainer's optimizer.  The new optimizer shares
the old one's param-group dicts (LR schedulers built on the old one keep driving it), takes
over its hyper-parameters and state (moved to host RAM in ``moment_dtype``) and the old
optimizer's state is released.  The loop must use the optimizer that ``rt.prepare``
returns; the reference quickstart's flow, where the loop keeps its own optimizer object and
never calls ``rt.prepare``, cannot be swapped and raises at ``OnTrainBegin``.
"""

from __future__ import annotations

import warnings
from typing import Any

from sakura import Service
from sakura.options import check_number
from sakura_offload._options import check_optimizer_options

__all__ = ["OffloadAdamWService"]

_OWNER = "OffloadAdamWService"


class OffloadAdamWService(Service):
    """Spec ``offload_adamw[:moment_dtype][,max_grad_norm=..,accumulation_steps=..,eager=..,
    backend=..,seed=..]``, e.g. ``offload_adamw:bf16``.  The options are
    :class:`~sakura_offload.OffloadAdamW`'s."""

    name = "offload_adamw"
    priority: float = 80

    def __init__(
        self,
        moment_dtype: Any = "float32",
        *,
        max_grad_norm: float | None = None,
        accumulation_steps: int = 1,
        eager: bool | None = None,
        backend: str = "auto",
        seed: int = 0,
        priority: float | None = None,
    ) -> None:
        check_optimizer_options(
            moment_dtype=moment_dtype,
            max_grad_norm=max_grad_norm,
            accumulation_steps=accumulation_steps,
            eager=eager,
            backend=backend,
            seed=seed,
            owner=_OWNER,
        )
        self.options: dict[str, Any] = {
            "moment_dtype": moment_dtype,
            "max_grad_norm": max_grad_norm,
            "accumulation_steps": accumulation_steps,
            "eager": eager,
            "backend": backend,
            "seed": seed,
        }
        if priority is not None:
            self.priority = check_number("priority", priority, owner=_OWNER)
        self.optimizers: list[Any] = []

    def wrap_optimizer(self, optimizer: Any) -> Any:
        """``optimizer`` (a torch AdamW, or Adam without weight decay) as an OffloadAdamW."""
        from sakura_offload.optimizer import OffloadAdamW

        offload = OffloadAdamW.from_optimizer(optimizer, **self.options)
        self.optimizers.append(offload)
        return offload

    def on_train_begin(self, event: Any) -> None:
        """Warn when training starts with an optimizer that was never swapped (the loop
        kept its own object instead of the one ``rt.prepare`` returned)."""
        from sakura_offload.optimizer import OffloadAdamW

        optimizer = getattr(event, "optimizer", None)
        while optimizer is not None and not isinstance(optimizer, OffloadAdamW):
            optimizer = getattr(optimizer, "optimizer", None)  # Lightning / HF wrappers
        if optimizer is None and getattr(event, "optimizer", None) is not None:
            warnings.warn(
                "offload_adamw: training started with an optimizer that is not an "
                "OffloadAdamW; pass it through rt.prepare(model, optimizer) and use the "
                "optimizer that returns",
                RuntimeWarning,
                stacklevel=2,
            )

    def teardown(self) -> None:
        for optimizer in self.optimizers:
            optimizer.detach()
        self.optimizers.clear()
