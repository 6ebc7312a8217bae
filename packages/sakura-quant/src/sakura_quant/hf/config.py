"""``SakuraQuantConfig``: sakura-quant's options as a transformers quantization config.

``from_pretrained(path, quantization_config=SakuraQuantConfig("nf4"))`` quantizes the frozen
``nn.Linear`` weights while the checkpoint loads; ``save_pretrained`` writes this config into
``config.json`` (``to_dict``) and ``from_pretrained`` reads it back (``from_dict``). The options
are :func:`~sakura_quant.quantize_model`'s, checked once into the same
:class:`~sakura_quant.options.QuantOptions`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from transformers.utils.quantization_config import QuantizationConfigMixin

from sakura.options import option_error
from sakura_quant.options import DEFAULT_SKIP, QuantOptions

__all__ = ["QUANT_METHOD", "SakuraQuantConfig"]

QUANT_METHOD = "sakura_quant"
"""The ``quant_method`` under which transformers' registry knows sakura-quant."""

_OWNER = "SakuraQuantConfig"


def _option(name: str) -> property:
    """A field of the config: read from ``options`` as JSON; setting it (transformers'
    ``update`` / ``from_dict(..., **kwargs)`` do) builds ``options`` again, checked."""

    def get(self: SakuraQuantConfig) -> Any:
        return self.options.to_kwargs()[name]

    def set_(self: SakuraQuantConfig, value: Any) -> None:
        self.options = QuantOptions.from_kwargs(
            owner=_OWNER, **{**self.options.to_kwargs(), name: value}
        )

    return property(get, set_)


class SakuraQuantConfig(QuantizationConfigMixin):
    """How ``from_pretrained`` quantizes a model's frozen ``nn.Linear`` weights.

    Args:
        format: ``"nf4"``, ``"int8"``, ``"fp8"`` or ``"nvfp4"``.
        block_size: values per scale; ``None`` is the format's default (int8 / nf4: 64).
        double_quant: int8 / nf4 block scales stored in one byte each.
        targets: ``None`` (every ``nn.Linear`` not skipped) or module names / name suffixes.
        skip: module names or last name components left in full precision
            (default ``("lm_head",)``); a module transformers ties to another, and the
            model's ``_keep_in_fp32_modules``, are always left alone.
        keep_precise: nf4 / nvfp4 weights that lose most stored int8 / fp8 within that
            fraction of extra bytes (``"auto"`` / ``True``: 0.05).
        error_rank, error_iters: LoftQ (0: off), as for :func:`~sakura_quant.quantize_model`.
        matmul_dtype: ``None`` (the input's dtype), ``"bf16"``, ``"fp32"``, ``"fp16"``: what
            the quantized layers multiply in (``bnb_4bit_compute_dtype`` of bitsandbytes);
            saved in ``config.json`` and applied again on reload.

    The values are checked once, into ``options`` (a
    :class:`~sakura_quant.options.QuantOptions`, what the quantizer reads), with the errors
    of :func:`~sakura_quant.quantize_model`; the fields above read them back as JSON values.
    """

    format = _option("format")
    block_size = _option("block_size")
    double_quant = _option("double_quant")
    targets = _option("targets")
    skip = _option("skip")
    keep_precise = _option("keep_precise")
    error_rank = _option("error_rank")
    error_iters = _option("error_iters")
    matmul_dtype = _option("matmul_dtype")

    def __init__(
        self,
        format: str = "nf4",
        *,
        block_size: int | None = None,
        double_quant: bool = False,
        targets: Any = None,
        skip: Any = DEFAULT_SKIP,
        keep_precise: Any = 0,
        error_rank: Any = 0,
        error_iters: Any = 1,
        matmul_dtype: Any = None,
        quant_method: str = QUANT_METHOD,
    ) -> None:
        if quant_method != QUANT_METHOD:
            raise option_error("quant_method", quant_method, repr(QUANT_METHOD), owner=_OWNER)
        # Not a member of transformers' QuantizationMethod enum: a registered custom method.
        self.quant_method = QUANT_METHOD  # type: ignore[assignment]
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

    def to_dict(self) -> dict[str, Any]:
        """The options as JSON values (what ``config.json`` carries)."""
        return {"quant_method": self.quant_method, **self.options.to_kwargs()}

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        """``dict(config)``: the JSON values, as :meth:`to_dict`."""
        yield from self.to_dict().items()
