"""``Quantization``: the ``quant`` service, so ``rt.prepare`` quantizes the frozen base."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from sakura.options import check_bool
from sakura.service import Service
from sakura_quant.fsdp import check_sharded, is_fsdp_sharded, shardable
from sakura_quant.linear import QuantizedLinear
from sakura_quant.options import DEFAULT_SKIP, QuantOptions, matmul_dtype_name
from sakura_quant.quantize import quantize_with_options

__all__ = ["Quantization"]

_OWNER = "Quantization"


class Quantization(Service):
    """Quantizes a model's frozen ``nn.Linear`` weights when the loop prepares the model.

    Spec strings: ``quant:nf4``, ``quant:int8,block_size=128``, ``quant:nf4,double_quant=true``,
    ``quant:nf4,matmul_dtype=bf16`` (the frozen matmuls in bf16 under an fp32 model),
    ``quant:nf4,fsdp=true`` (the model will be sharded by FSDP2's ``fully_shard``).
    The arguments are :func:`~sakura_quant.quantize_model`'s (the format is ``format``
    here); they are checked once, when the service is built, into ``options`` (a
    :class:`~sakura_quant.options.QuantOptions`) that ``wrap_model`` passes down as it is.
    ``wrap_model`` changes the model in place (so it works under the stock
    Hugging Face Trainer with ``HFAdapter`` and under Lightning) and returns it; ``stats`` then
    holds what ``quantize_model`` returned.  Put LoRA on the model before or after: either
    way only the base layers are quantized, never the adapters. With ``error_rank`` (LoftQ),
    adapters already on the model start at the quantization error; adapters added later start
    there with :func:`~sakura_quant.init_lora_from_error`.

    ``fsdp=True``: after quantizing, ``wrap_model`` makes the quantized layers shardable
    (:func:`sakura_quant.fsdp.shardable`), so that a later ``fully_shard`` shards the
    quantized base (each rank holds about ``1/N`` of it) instead of replicating it; call
    ``rt.prepare`` before ``fully_shard`` then.  A model that ``fully_shard`` already wrapped
    is not quantized (its weights are sharded): ``wrap_model`` checks its quantized layers
    with :func:`sakura_quant.fsdp.check_sharded` and refuses unsharded ones.

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
        fsdp: bool = False,
    ) -> None:
        self.options = QuantOptions.from_kwargs(
            owner=_OWNER,
            format=format,
            block_size=block_size,
            double_quant=double_quant,
            targets=targets,
            skip=skip,
            keep_precise=keep_precise,
            error_rank=error_rank,
            error_iters=error_iters,
            matmul_dtype=matmul_dtype,
        )
        self.freeze = check_bool("freeze", freeze, owner=_OWNER)
        self.fsdp = check_bool("fsdp", fsdp, owner=_OWNER)
        self.stats: dict[str, int] = {}
        self._done: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    # The checked options, read-only, under the constructor's names.

    @property
    def format(self) -> str:
        return self.options.format

    @property
    def block_size(self) -> int:
        return self.options.block_size

    @property
    def double_quant(self) -> bool:
        return self.options.double_quant

    @property
    def targets(self) -> tuple[str, ...] | None:
        return self.options.targets

    @property
    def skip(self) -> tuple[str, ...]:
        return self.options.skip

    @property
    def keep_precise(self) -> float:
        return self.options.keep_precise

    @property
    def error_rank(self) -> int:
        return self.options.error_rank

    @property
    def error_iters(self) -> int:
        return self.options.error_iters

    @property
    def matmul_dtype(self) -> torch.dtype | None:
        return self.options.matmul_dtype

    def __repr__(self) -> str:
        return (
            f"Quantization(format={self.format!r}, block_size={self.block_size}, "
            f"double_quant={self.double_quant}, "
            f"matmul_dtype={matmul_dtype_name(self.matmul_dtype)!r}, fsdp={self.fsdp})"
        )

    def wrap_model(self, model: Any) -> Any:
        if not isinstance(model, nn.Module):
            raise TypeError(f"Quantization needs a torch.nn.Module, got {type(model).__name__}")
        if is_fsdp_sharded(model) and (
            model in self._done or any(isinstance(m, QuantizedLinear) for m in model.modules())
        ):
            check_sharded(model)  # quantized before fully_shard: refuse an unsharded base
            return model
        if model in self._done:
            return model  # the same model prepared again: it is already quantized
        self.stats = quantize_with_options(model, self.options, freeze=self.freeze)
        if self.fsdp:
            shardable(model)
        self._done.add(model)
        return model
