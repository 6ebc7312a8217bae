"""``SakuraQuantConfig``: sakura-quant's options as a transformers quantization config.

``from_pretrained(path, quantization_config=SakuraQuantConfig("nf4"))`` quantizes the frozen
``nn.Linear`` weights while the checkpoint loads; ``save_pretrained`` writes this config into
``config.json`` (``to_dict``) and ``from_pretrained`` reads it back (``from_dict``). The options
are :func:`~sakura_quant.quantize_model`'s, checked by the same validators.
"""

from __future__ import annotations

from typing import Any

from transformers.utils.quantization_config import QuantizationConfigMixin

from sakura.options import option_error
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
from sakura_quant.quantize import DEFAULT_SKIP

__all__ = ["QUANT_METHOD", "SakuraQuantConfig"]

QUANT_METHOD = "sakura_quant"
"""The ``quant_method`` under which transformers' registry knows sakura-quant."""

_OWNER = "SakuraQuantConfig"


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

    Every value is checked here, with the errors of :func:`~sakura_quant.quantize_model`.
    """

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
        self.format = check_format(format, owner=_OWNER)
        self.block_size = check_block_size(self.format, block_size, owner=_OWNER)
        self.double_quant = check_double_quant(self.format, double_quant, owner=_OWNER)
        wanted = check_names("targets", targets, owner=_OWNER, allow_none=True)
        self.targets = None if wanted is None else list(wanted)
        self.skip = list(check_names("skip", skip, owner=_OWNER, allow_none=False) or ())
        self.keep_precise = check_keep_precise(self.format, keep_precise, owner=_OWNER)
        self.error_rank, self.error_iters = check_error_options(
            error_rank, error_iters, owner=_OWNER
        )
        self.matmul_dtype = matmul_dtype_name(check_matmul_dtype(matmul_dtype, owner=_OWNER))

    def to_dict(self) -> dict[str, Any]:
        """The options as JSON values (what ``config.json`` carries)."""
        return {
            "quant_method": self.quant_method,
            "format": self.format,
            "block_size": self.block_size,
            "double_quant": self.double_quant,
            "targets": None if self.targets is None else list(self.targets),
            "skip": list(self.skip),
            "keep_precise": self.keep_precise,
            "error_rank": self.error_rank,
            "error_iters": self.error_iters,
            "matmul_dtype": self.matmul_dtype,
        }
