"""Validation of sakura-quant's public options, one place for quantize_model, load_model and
the ``quant`` service (wording from :mod:`sakura.options`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from sakura.options import check_bool, check_choice, check_int, option_error

FORMAT_NAMES = ("int8", "nf4", "fp8", "nvfp4")
_DEFAULT_BLOCK = {"int8": 64, "nf4": 64, "fp8": 32, "nvfp4": 16}
_FIXED_BLOCK = {"fp8": 32, "nvfp4": 16}
_DOUBLE_QUANT = ("int8", "nf4")
MAX_BLOCK_SIZE = 2**31
"""The largest block size int8 / nf4 take (the kernels index blocks with 64-bit counts; a
bound keeps every product of sizes far from overflowing)."""


def check_format(value: Any, *, owner: str, option: str = "format") -> str:
    """A format name: ``"int8"``, ``"nf4"``, ``"fp8"`` or ``"nvfp4"``."""
    return str(check_choice(option, value, FORMAT_NAMES, owner=owner))


def check_block_size(fmt: str, value: Any, *, owner: str) -> int:
    """The block size for ``fmt``: ``None`` means the format's default (int8 / nf4: 64);
    int8 and nf4 take any even integer in [2, 2**31]; fp8 and nvfp4 have a fixed block
    (32 / 16)."""
    if value is None:
        return _DEFAULT_BLOCK[fmt]
    fixed = _FIXED_BLOCK.get(fmt)
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
            f"an even int in [2, {MAX_BLOCK_SIZE}], or None for 64",
            owner=owner,
        )
    return int(value)


def check_double_quant(fmt: str, value: Any, *, owner: str) -> bool:
    """``double_quant``: True or False; True only for the formats with fp32 block scales."""
    flag = check_bool("double_quant", value, owner=owner)
    if flag and fmt not in _DOUBLE_QUANT:
        raise option_error(
            "double_quant",
            value,
            f"False with format={fmt!r} (double quantization applies to 'int8' and 'nf4')",
            owner=owner,
        )
    return flag


PRECISE_FORMAT = {"nf4": "int8", "nvfp4": "fp8"}
"""The one-step-more-precise format ``keep_precise`` stores a weight in."""
KEEP_PRECISE_AUTO = 0.05
_KEEP_PRECISE_ACCEPTED = "0, False, None, 'auto', True (= 0.05), or a fraction in (0, 0.5]"


def check_keep_precise(fmt: str, value: Any, *, owner: str) -> float:
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


def check_matmul_dtype(value: Any, *, owner: str) -> torch.dtype | None:
    """``matmul_dtype``: the dtype the frozen weight is expanded to and multiplied in
    (bitsandbytes' ``compute_dtype``); None keeps the input's dtype."""
    check_choice("matmul_dtype", value, MATMUL_DTYPES, owner=owner)
    return MATMUL_DTYPES[value]


def matmul_dtype_name(dtype: torch.dtype | None) -> str | None:
    """The JSON spelling of a checked ``matmul_dtype`` (``"bfloat16"``, ... or None)."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


def check_names(option: str, value: Any, *, owner: str, allow_none: bool) -> tuple[str, ...] | None:
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
