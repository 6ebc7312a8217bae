"""``bf16_base``: every frozen ``nn.Linear`` (weight and bias frozen) stored in bfloat16;
its input is cast to bfloat16 and its output back to the input's dtype."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sakura_offload.fit import FitChoice, FitOption


def _targets(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear)
        and name
        and m.weight.dtype == torch.float32
        and not any(p.requires_grad for p in m.parameters())
    ]


def _pre(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    module._bf16_input_dtype = args[0].dtype
    return (args[0].to(torch.bfloat16), *args[1:])


def _post(module: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
    return output.to(module._bf16_input_dtype)  # type: ignore[arg-type]


class BF16Base(FitChoice):
    """The choice (see the module docstring); cost 0.5: before sakura-quant's int8."""

    name = "bf16_base"
    description = "frozen Linear layers stored in bfloat16"

    def applies(self, model: Any) -> bool:
        return bool(_targets(model))

    def estimate(self, model: Any, **context: Any) -> list[FitOption]:
        saved = {
            name: sum(p.numel() * p.element_size() // 2 for p in m.parameters())
            for name, m in _targets(model)
        }
        frozen = sum(
            t.numel() * t.element_size()
            for t in [*model.parameters(), *model.buffers()]
            if not t.requires_grad
        )
        return [
            FitOption(
                choice=self.name,
                name="bf16",
                cost=0.5,
                saved=saved,
                frozen_bytes_after=frozen - sum(saved.values()),
                description=f"{len(saved)} frozen Linear layers in bfloat16",
            )
        ]

    def apply(self, model: Any, option: FitOption) -> None:
        for name, m in _targets(model):
            if name in option.saved:
                m.to(torch.bfloat16)
                m.register_forward_pre_hook(_pre)
                m.register_forward_hook(_post)
