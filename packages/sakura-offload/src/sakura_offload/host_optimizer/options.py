"""Validation of OffloadAdamW's options (one wording, through :mod:`sakura.options`)."""

from __future__ import annotations

from typing import Any

import torch

from sakura.options import check_choice, check_int, check_number, option_error

__all__ = [
    "BACKENDS",
    "MOMENT_DTYPES",
    "check_betas",
    "check_group",
    "check_moment_dtype",
    "check_optimizer_options",
]

OWNER = "OffloadAdamW"

MOMENT_DTYPES: dict[Any, str] = {
    "float32": "float32",
    "fp32": "float32",
    torch.float32: "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    torch.bfloat16: "bfloat16",
    "int8": "int8",
    "8bit": "int8",
    "auto": "auto",
}
"""Accepted ``moment_dtype`` values -> the format's canonical name (``"auto"``: chosen from
the host RAM when the optimizer is built, see :mod:`.placement`)."""

BACKENDS = ("auto", "cpp", "torch", "cuda")


def check_moment_dtype(value: Any, *, owner: str = OWNER) -> str:
    """The canonical format name (``"float32"``, ``"bfloat16"``, ``"int8"``, ``"auto"``) of
    ``value``."""
    check_choice("moment_dtype", value, MOMENT_DTYPES, owner=owner)
    return MOMENT_DTYPES[value]


def check_betas(value: Any, *, owner: str = OWNER) -> tuple[float, float]:
    accepted = "a pair (beta1, beta2) of numbers, each >= 0 and < 1"
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise option_error("betas", value, accepted, owner=owner)
    try:
        b1 = check_number("betas[0]", value[0], minimum=0.0, maximum=1.0, max_inclusive=False)
        b2 = check_number("betas[1]", value[1], minimum=0.0, maximum=1.0, max_inclusive=False)
    except ValueError:
        raise option_error("betas", value, accepted, owner=owner) from None
    return (b1, b2)


def check_group(group: dict[str, Any], *, owner: str = OWNER) -> None:
    """Validate (and normalise) a param group's hyper-parameters in place."""
    group["lr"] = check_number("lr", group["lr"], minimum=0.0, owner=owner)
    group["betas"] = check_betas(group["betas"], owner=owner)
    group["eps"] = check_number("eps", group["eps"], minimum=0.0, owner=owner)
    group["weight_decay"] = check_number(
        "weight_decay", group["weight_decay"], minimum=0.0, owner=owner
    )
    for flag in ("amsgrad", "maximize"):
        if group.get(flag, False) is not False:
            raise option_error(flag, group[flag], "False (not supported)", owner=owner)


def check_optimizer_options(
    *,
    moment_dtype: Any,
    max_grad_norm: Any,
    accumulation_steps: Any,
    eager: Any,
    backend: Any,
    seed: Any,
    pin_moments: Any = None,
    host_budget: Any = None,
    owner: str = OWNER,
) -> dict[str, Any]:
    """The validated optimizer-wide options (``eager`` and ``pin_moments`` still None when
    given so: the optimizer decides them; ``host_budget`` in bytes or None)."""
    from sakura_offload.planner.plan import parse_bytes

    dtype = check_moment_dtype(moment_dtype, owner=owner)
    norm = check_number(
        "max_grad_norm",
        max_grad_norm,
        minimum=0.0,
        min_inclusive=False,
        allow_none=True,
        owner=owner,
    )
    steps = check_int("accumulation_steps", accumulation_steps, minimum=1, owner=owner)
    check_choice("eager", eager, (None, True, False), owner=owner)
    if eager is True and norm is not None:
        raise option_error(
            "eager",
            eager,
            "None or False when max_grad_norm is set (clipping needs every gradient first)",
            owner=owner,
        )
    check_choice("backend", backend, BACKENDS, owner=owner)
    check_int("seed", seed, minimum=0, maximum=2**32 - 1, owner=owner)
    check_choice("pin_moments", pin_moments, (None, True, False), owner=owner)
    budget = parse_bytes("host_budget", host_budget, allow_none=True, owner=owner)
    return {
        "moment_dtype": dtype,
        "max_grad_norm": norm,
        "accumulation_steps": steps,
        "eager": eager,
        "backend": backend,
        "seed": seed,
        "pin_moments": pin_moments,
        "host_budget": budget,
    }
