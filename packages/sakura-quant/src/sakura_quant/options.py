"""sakura-quant's options, declared once and checked once (wording from :mod:`sakura.options`).

Two frozen objects hold checked values:

* :class:`WeightSpec`: how one weight is stored (format, block size, double quantization);
* :class:`QuantOptions`: what quantizing a model takes (a :class:`WeightSpec`'s three, which
  modules, ``keep_precise``, LoftQ's ``error_rank`` / ``error_iters``, ``matmul_dtype``).

Every entry point builds one of them from its own arguments, once, with
:meth:`WeightSpec.check` / :meth:`QuantOptions.from_kwargs` (``quantize_weight``,
``quantize_model``, ``load_model``, the ``quant`` service, ``SakuraQuantConfig``), and passes it
down: the functions and layers below take the object, or values read from it, and check
nothing again.  An invalid value raises the same :class:`~sakura.options.OptionError` text from
every entry point, prefixed with the entry point's name (its ``owner``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from sakura.options import check_bool, check_choice, check_int, option_error
from sakura_quant.formats import FORMATS

__all__ = [
    "DEFAULT_SKIP",
    "FORMAT_NAMES",
    "KEEP_PRECISE_AUTO",
    "MATMUL_DTYPES",
    "MAX_BLOCK_SIZE",
    "PRECISE_FORMAT",
    "QuantOptions",
    "WeightSpec",
    "check_block_size",
    "check_matmul_dtype",
    "matmul_dtype_name",
]

FORMAT_NAMES = tuple(FORMATS)
"""``("int8", "nf4", "fp8", "nvfp4")``, in order of precision."""
MAX_BLOCK_SIZE = 2**31
"""The largest block size int8 / nf4 take (the kernels index blocks with 64-bit counts; a
bound keeps every product of sizes far from overflowing)."""
DEFAULT_SKIP = ("lm_head",)
"""Left in full precision by default, as bitsandbytes / transformers do: the output head."""
PRECISE_FORMAT = {"nf4": "int8", "nvfp4": "fp8"}
"""The one-step-more-precise format ``keep_precise`` stores a weight in."""
KEEP_PRECISE_AUTO = 0.05
_KEEP_PRECISE_ACCEPTED = "0, False, None, 'auto', True (= 0.05), or a fraction in (0, 0.5]"

MATMUL_DTYPES: dict[Any, torch.dtype | None] = {
    None: None,
    "float32": torch.float32,
    "fp32": torch.float32,
    torch.float32: torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    torch.bfloat16: torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    torch.float16: torch.float16,
}
"""Accepted ``matmul_dtype`` values -> the dtype (None: the input's own)."""


def check_block_size(fmt: str, value: Any, *, owner: str) -> int:
    """The block size for ``fmt``: ``None`` means the format's default (int8 / nf4: 64);
    int8 and nf4 take any even integer in [2, 2**31]; fp8 and nvfp4 have a fixed block
    (32 / 16).  Also what :func:`~sakura_quant.formats.checks.check_quantized_weight` holds a
    stored (untrusted) weight's block size to."""
    weight_format = FORMATS[fmt]
    if value is None:
        return weight_format.default_block_size
    fixed = weight_format.fixed_block_size
    if fixed is not None:
        if isinstance(value, bool) or value != fixed:
            raise option_error(
                "block_size", value, f"None or {fixed} ({fmt} has a fixed block size)", owner=owner
            )
        return fixed
    check_int("block_size", value, minimum=2, maximum=MAX_BLOCK_SIZE, owner=owner)
    if value % 2:
        raise option_error(
            "block_size",
            value,
            f"an even int in [2, {MAX_BLOCK_SIZE}], or None for {weight_format.default_block_size}",
            owner=owner,
        )
    return int(value)


def _check_double_quant(fmt: str, value: Any, *, owner: str) -> bool:
    """``double_quant``: True or False; True only for the formats with fp32 block scales."""
    flag = check_bool("double_quant", value, owner=owner)
    if flag and not FORMATS[fmt].supports_double_quant:
        supported = " and ".join(repr(n) for n, f in FORMATS.items() if f.supports_double_quant)
        raise option_error(
            "double_quant",
            value,
            f"False with format={fmt!r} (double quantization applies to {supported})",
            owner=owner,
        )
    return flag


def _check_keep_precise(fmt: str, value: Any, *, owner: str) -> float:
    """``keep_precise`` as a fraction of extra bytes (0.0: off); only nf4 / nvfp4 take one."""
    if value is None or value is False or (not isinstance(value, bool) and value == 0):
        return 0.0
    if value is True or value == "auto":
        fraction = KEEP_PRECISE_AUTO
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 0.5:
        fraction = float(value)
    else:
        raise option_error("keep_precise", value, _KEEP_PRECISE_ACCEPTED, owner=owner)
    if fmt not in PRECISE_FORMAT:
        raise option_error(
            "keep_precise",
            value,
            f"0 / False / None with format={fmt!r} (keep_precise applies to 'nf4' and 'nvfp4')",
            owner=owner,
        )
    return fraction


def _check_error_options(error_rank: Any, error_iters: Any, *, owner: str) -> tuple[int, int]:
    """``error_rank``: an int >= 0 (0: off); ``error_iters``: an int >= 1, and 1 when
    ``error_rank`` is 0 (there is nothing to iterate)."""
    rank = int(check_int("error_rank", error_rank, minimum=0, owner=owner))
    iters = int(check_int("error_iters", error_iters, minimum=1, owner=owner))
    if rank == 0 and iters != 1:
        raise option_error(
            "error_iters", error_iters, "1 when error_rank=0 (LoftQ is off)", owner=owner
        )
    return rank, iters


def check_matmul_dtype(value: Any, *, owner: str) -> torch.dtype | None:
    """``matmul_dtype``: the dtype the frozen weight is expanded to and multiplied in
    (bitsandbytes' ``compute_dtype``); None keeps the input's dtype.  ``QuantOptions`` and
    ``QuantizedLinear`` (its own option) check it here."""
    check_choice("matmul_dtype", value, MATMUL_DTYPES, owner=owner)
    return MATMUL_DTYPES[value]


def matmul_dtype_name(dtype: torch.dtype | None) -> str | None:
    """The JSON spelling of a checked ``matmul_dtype`` (``"bfloat16"``, ... or None)."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _check_names(
    option: str, value: Any, *, owner: str, allow_none: bool
) -> tuple[str, ...] | None:
    """A list/tuple of module names (``None`` when allowed)."""
    if value is None and allow_none:
        return None
    accepted = "a list of module names" + (" or None" if allow_none else "")
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise option_error(option, value, accepted, owner=owner)
    names = tuple(value)
    if not all(isinstance(n, str) and n for n in names):
        raise option_error(option, value, accepted, owner=owner)
    return names


@dataclass(frozen=True)
class WeightSpec:
    """How one weight is stored: ``format``, ``block_size`` (resolved: never None) and
    ``double_quant``.  Holds checked values: build it with :meth:`check` (or read it from a
    :class:`QuantOptions` or a stored weight)."""

    format: str
    block_size: int
    double_quant: bool

    @classmethod
    def check(
        cls,
        format: Any,
        block_size: Any = None,
        double_quant: Any = False,
        *,
        owner: str,
        format_option: str = "format",
        also_accepted: tuple[Any, ...] = (),
    ) -> WeightSpec:
        """The spec, each value checked (errors name ``format_option`` for the format and
        list ``also_accepted`` beside the format names: values the caller takes itself, such
        as ``load_model``'s ``quantize=None``, and never passes here)."""
        if not (isinstance(format, str) and format in FORMAT_NAMES):
            accepted = ", ".join(repr(c) for c in (*FORMAT_NAMES, *also_accepted))
            raise option_error(format_option, format, accepted, owner=owner)
        fmt = format
        return cls(
            fmt,
            check_block_size(fmt, block_size, owner=owner),
            _check_double_quant(fmt, double_quant, owner=owner),
        )

    def precise(self) -> WeightSpec:
        """How ``keep_precise`` stores a weight of this spec: one step more precise (nf4 ->
        int8 with the same block size and double quantization, nvfp4 -> fp8)."""
        fmt = PRECISE_FORMAT[self.format]
        target = FORMATS[fmt]
        size = target.fixed_block_size or self.block_size
        return WeightSpec(fmt, size, self.double_quant and target.supports_double_quant)


@dataclass(frozen=True)
class QuantOptions:
    """sakura-quant's options for quantizing a model, checked (see the module docstring).

    ``format``, ``block_size``, ``double_quant``: as :class:`WeightSpec` (``spec``);
    ``targets``: module names / suffixes or None (every ``nn.Linear`` not in ``skip``);
    ``skip``: names left alone; ``keep_precise``: a fraction (0.0: off); ``error_rank`` /
    ``error_iters``: LoftQ (0 / 1: off); ``matmul_dtype``: a torch dtype or None.
    Build it with :meth:`from_kwargs`.
    """

    spec: WeightSpec
    targets: tuple[str, ...] | None = None
    skip: tuple[str, ...] = DEFAULT_SKIP
    keep_precise: float = 0.0
    error_rank: int = 0
    error_iters: int = 1
    matmul_dtype: torch.dtype | None = None

    @property
    def format(self) -> str:
        return self.spec.format

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def double_quant(self) -> bool:
        return self.spec.double_quant

    @classmethod
    def from_kwargs(
        cls,
        *,
        owner: str,
        format_option: str = "format",
        also_accepted: tuple[Any, ...] = (),
        format: Any = "nf4",
        block_size: Any = None,
        double_quant: Any = False,
        targets: Any = None,
        skip: Any = DEFAULT_SKIP,
        keep_precise: Any = 0,
        error_rank: Any = 0,
        error_iters: Any = 1,
        matmul_dtype: Any = None,
    ) -> QuantOptions:
        """The options, each checked once; errors are :class:`~sakura.options.OptionError`
        prefixed with ``owner`` (the entry point), the format called ``format_option``
        (``"quantize"`` for ``quantize_model`` / ``load_model``, as the reference spells it),
        ``also_accepted`` as for :meth:`WeightSpec.check`."""
        spec = WeightSpec.check(
            format,
            block_size,
            double_quant,
            owner=owner,
            format_option=format_option,
            also_accepted=also_accepted,
        )
        wanted = _check_names("targets", targets, owner=owner, allow_none=True)
        skipped = _check_names("skip", skip, owner=owner, allow_none=False) or ()
        precise = _check_keep_precise(spec.format, keep_precise, owner=owner)
        rank, iters = _check_error_options(error_rank, error_iters, owner=owner)
        compute = check_matmul_dtype(matmul_dtype, owner=owner)
        return cls(spec, wanted, skipped, precise, rank, iters, compute)

    def to_kwargs(self) -> dict[str, Any]:
        """The options as the keyword arguments of the entry points, in JSON values
        (``from_kwargs(owner=..., **options.to_kwargs())`` builds the same options)."""
        return {
            "format": self.format,
            "block_size": self.block_size,
            "double_quant": self.double_quant,
            "targets": None if self.targets is None else list(self.targets),
            "skip": list(self.skip),
            "keep_precise": self.keep_precise,
            "error_rank": self.error_rank,
            "error_iters": self.error_iters,
            "matmul_dtype": matmul_dtype_name(self.matmul_dtype),
        }
