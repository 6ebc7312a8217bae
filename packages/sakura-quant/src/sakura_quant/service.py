"""``QuantizedBase``: the ``quant`` service, so ``rt.prepare`` quantizes the frozen base."""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

from sakura.options import check_bool
from sakura.service import Service
from sakura_quant.loftq import check_error_options
from sakura_quant.options import (
    check_block_size,
    check_double_quant,
    check_format,
    check_keep_precise,
    check_matmul_dtype,
    check_names,
    matmul_dtype_name,
)
from sakura_quant.quantize import DEFAULT_SKIP, quantize_model

__all__ = ["QuantizedBase"]

_OWNER = "QuantizedBase"


class QuantizedBase(Service):
    """Quantizes a model's frozen ``nn.Linear`` weights when the loop prepares the model.

    Spec strings: ``quant:nf4``, ``quant:int8,block_size=128``, ``quant:nf4,double_quant=true``,
    ``quant:nf4,matmul_dtype=bf16`` (the frozen matmuls in bf16 under an fp32 model).
    The arguments are :func:`~sakura_quant.quantize_model`'s; they are checked here, when the
    service is built.  ``wrap_model`` changes the model in place (so it works under the stock
    Hugging Face Trainer with ``HFAdapter`` and under Lightning) and returns it; ``stats`` then
    holds what ``quantize_model`` returned.  Put LoRA on the model before or after: either
    way only the base layers are quantized, never the adapters. With ``error_rank`` (LoftQ),
    adapters already on the model start at the quantization error; adapters added later start
    there with :func:`~sakura_quant.init_lora_from_error`.

    It runs before the other model wrappers (priority 5), so compilation and activation
    checkpointing see the quantized layers.
    """

    name = "quant"
    priority = 5

    def __init__(
        self,
        format: str = "nf4",
        *,
        block_size: int | None = None,
        double_quant: bool = False,
        targets: Any = None,
        skip: Any = DEFAULT_SKIP,
        freeze: bool = False,
        keep_precise: Any = 0,
        error_rank: Any = 0,
        error_iters: Any = 1,
        matmul_dtype: Any = None,
    ) -> None:
        self.format = check_format(format, owner=_OWNER)
        self.matmul_dtype = check_matmul_dtype(matmul_dtype, owner=_OWNER)
        self.block_size = check_block_size(self.format, block_size, owner=_OWNER)
        self.double_quant = check_double_quant(self.format, double_quant, owner=_OWNER)
        self.targets = check_names("targets", targets, owner=_OWNER, allow_none=True)
        self.skip = check_names("skip", skip, owner=_OWNER, allow_none=False) or ()
        self.freeze = check_bool("freeze", freeze, owner=_OWNER)
        self.keep_precise = check_keep_precise(self.format, keep_precise, owner=_OWNER)
        self.error_rank, self.error_iters = check_error_options(
            error_rank, error_iters, owner=_OWNER
        )
        self.stats: dict[str, int] = {}
        self._done: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    def __repr__(self) -> str:
        return (
            f"QuantizedBase(format={self.format!r}, block_size={self.block_size}, "
            f"double_quant={self.double_quant}, "
            f"matmul_dtype={matmul_dtype_name(self.matmul_dtype)!r})"
        )

    def wrap_model(self, model: Any) -> Any:
        if not isinstance(model, nn.Module):
            raise TypeError(f"QuantizedBase needs a torch.nn.Module, got {type(model).__name__}")
        if model in self._done:
            return model  # the same model prepared again: it is already quantized
        self.stats = quantize_model(
            model,
            self.format,
            block_size=self.block_size,
            double_quant=self.double_quant,
            targets=self.targets,
            skip=self.skip,
            freeze=self.freeze,
            keep_precise=self.keep_precise,
            error_rank=self.error_rank,
            error_iters=self.error_iters,
            matmul_dtype=self.matmul_dtype,
        )
        self._done.add(model)
        return model
