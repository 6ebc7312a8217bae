"""sakura-quant's fit choice, ``quantize_base``: the frozen ``nn.Linear`` weights quantized
(int8, then nf4), offered to sakura-offload's ``fit`` through its plugin hook
``sakura_register_fit_choices`` (:mod:`sakura_quant.plugin`).

sakura-offload never imports sakura-quant: it loads this class by name when it plans, so
this module imports sakura-offload only inside :meth:`QuantizeBase.estimate` (run by
``fit``, which is sakura-offload).  The byte counts are exact: each format's stored layout
(:func:`sakura_quant.formats.checks.stored_layout`) at its default block size, without
double quantization.  Quantizing is not undone by ``unwrap`` (the original weights are
gone): ``reversible`` is False.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from sakura_quant.formats.checks import stored_layout
from sakura_quant.linear import QuantizedLinear
from sakura_quant.options import DEFAULT_SKIP, check_block_size
from sakura_quant.quantize import quantize_model

__all__ = ["FORMAT_COSTS", "QuantizeBase"]

FORMAT_COSTS = {"int8": 1.0, "nf4": 2.0}
"""The formats offered, with their cost rank (int8 loses less than nf4: tried first)."""


def _targets(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The frozen ``nn.Linear`` layers ``quantize_model`` would take (not ``lm_head``, not
    already quantized)."""
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear)
        and not isinstance(m, QuantizedLinear)
        and name
        and name.rsplit(".", 1)[-1] not in DEFAULT_SKIP
        and name not in DEFAULT_SKIP
        and not m.weight.requires_grad
    ]


def _stored_bytes(fmt: str, numel: int) -> int:
    import torch

    block_size = check_block_size(fmt, None, owner="quantize_base")
    layout = stored_layout(fmt, numel, block_size, False)
    return sum(
        torch.empty((), dtype=dtype).element_size() * count for dtype, count in layout.values()
    )


class QuantizeBase:
    """The fit choice ``quantize_base`` (see the module docstring)."""

    name = "quantize_base"
    description = "frozen Linear weights quantized (int8 before nf4)"
    reversible = False

    def applies(self, model: Any) -> bool:
        return isinstance(model, nn.Module) and bool(_targets(model))

    def estimate(self, model: Any, **context: Any) -> list[Any]:
        """An option per format: the bytes each frozen Linear weight saves."""
        from sakura_offload.fit.choices import FitOption

        targets = _targets(model)
        frozen = sum(
            t.numel() * t.element_size()
            for t in [*model.parameters(), *model.buffers()]
            if not t.requires_grad
        )
        options = []
        for fmt, cost in FORMAT_COSTS.items():
            saved = {
                name: m.weight.numel() * m.weight.element_size()
                - _stored_bytes(fmt, m.weight.numel())
                for name, m in targets
            }
            options.append(
                FitOption(
                    choice=self.name,
                    name=fmt,
                    cost=cost,
                    saved=saved,
                    frozen_bytes_after=frozen - sum(saved.values()),
                    description=f"{len(targets)} frozen Linear weights as {fmt}",
                    detail={"targets": tuple(name for name, _ in targets)},
                )
            )
        return options

    def apply(self, model: Any, option: Any) -> None:
        """Quantize the option's layers to its format (``quantize_model``)."""
        quantize_model(model, option.name, targets=tuple(option.detail["targets"]))

    def undo(self, model: Any) -> None:
        raise NotImplementedError("quantize_base cannot be undone: the original weights are gone")
