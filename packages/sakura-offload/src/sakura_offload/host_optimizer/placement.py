"""Where OffloadAdamW's state lives, decided from the host RAM: the moment format of
``moment_dtype="auto"``, whether the state is page-locked (``pin_moments``), and whether
updates start during backward (``eager=None``).

Each decision is a pure function of the figures it is given (bytes the state would take,
host RAM, whether CUDA is present), so tests force every branch with injected figures;
:func:`sakura_torch.host_memory.host_ram` measures the machine, as for the planner.
A decision is a :class:`Decision`: the value and a sentence saying why, which
``OffloadAdamW.stats()`` reports.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from sakura_torch.host_memory import host_ram

__all__ = [
    "MOMENT_BYTES",
    "PIN_FRACTION",
    "Decision",
    "Placement",
    "choose_eager",
    "choose_moment_dtype",
    "choose_pinning",
    "default_moment_budget",
    "distributed",
    "moment_bytes",
    "place",
    "ram_floor",
    "state_bytes",
]

PIN_FRACTION = 0.4
"""``pin_moments=None`` pins unless the state would lock more than this share of RAM."""

MOMENT_BYTES = {"float32": 8.0, "bfloat16": 4.0, "int8": 2.0 + 8.0 / 256}
"""Host bytes of both moments per parameter, by format (int8: one byte per value plus an
fp32 absmax per 256 values, for each moment)."""

_ORDER = ("float32", "bfloat16", "int8")


@dataclass(frozen=True)
class Decision:
    """A chosen value and why it was chosen."""

    value: Any
    reason: str

    def astuple(self) -> tuple[Any, str]:
        return (self.value, self.reason)


@dataclass(frozen=True)
class Placement:
    """The three decisions for one optimizer, and the budget the first was made against."""

    moment_dtype: Decision
    pin: Decision
    eager: Decision
    host_budget: int


def distributed() -> bool:
    """True inside a process group of more than one rank."""
    dist = torch.distributed
    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def ram_floor(total: int) -> int:
    """RAM always left free: 10 % of physical RAM, at least 4 GiB (the planner's margin)."""
    return max(total // 10, 4 * 2**30)


def default_moment_budget(available: int, total: int) -> int:
    """Host RAM the optimizer's state may take by default: what is available less the
    floor (:func:`ram_floor`)."""
    return max(0, available - ram_floor(total))


def moment_bytes(dtype: str, numel: int) -> int:
    """Host bytes of both moments of ``numel`` parameters in format ``dtype``."""
    return int(MOMENT_BYTES[dtype] * numel)


def _gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB"


def choose_moment_dtype(numel: int, master_bytes: int, budget: int) -> Decision:
    """``moment_dtype="auto"``: float32 unless the moments (plus ``master_bytes`` of master
    weights, which every format needs) would not fit in ``budget`` bytes, then bfloat16,
    then int8 (chosen also when even int8 does not fit: the smallest there is)."""
    for dtype in _ORDER:
        need = moment_bytes(dtype, numel) + master_bytes
        if need <= budget:
            skipped = "" if dtype == "float32" else ", the larger formats do not"
            return Decision(
                dtype,
                f"{dtype} moments and masters ({_gib(need)}) fit in the host budget "
                f"({_gib(budget)}){skipped}",
            )
    need = moment_bytes("int8", numel) + master_bytes
    return Decision(
        "int8",
        f"no format fits in the host budget ({_gib(budget)}); int8, the smallest, needs "
        f"{_gib(need)}",
    )


def choose_pinning(pin_moments: bool | None, state_bytes: int, total: int, cuda: bool) -> Decision:
    """Whether to page-lock ``state_bytes`` of moments and masters.  Pinning needs CUDA
    (page-locked memory is allocated through its driver): without it ``None`` means not
    pinned and ``True`` raises.  ``None`` pins unless that would lock more than
    :data:`PIN_FRACTION` of the ``total`` RAM."""
    from sakura.options import option_error

    if pin_moments is False:
        return Decision(False, "pin_moments=False")
    if not cuda:
        if pin_moments is True:
            raise option_error(
                "pin_moments",
                True,
                "None or False on a machine without CUDA (page-locked host memory is "
                "allocated through the CUDA driver, which torch cannot reach here)",
                owner="OffloadAdamW",
            )
        return Decision(False, "no CUDA: page-locked memory needs the CUDA driver")
    if pin_moments is True:
        return Decision(True, "pin_moments=True")
    limit = int(total * PIN_FRACTION)
    if state_bytes > limit:
        return Decision(
            False,
            f"the state ({_gib(state_bytes)}) would lock more than 40 % of RAM ({_gib(limit)})",
        )
    return Decision(True, f"the state ({_gib(state_bytes)}) is within 40 % of RAM")


def choose_eager(eager: bool | None, *, max_grad_norm: float | None, distributed: bool) -> Decision:
    """``eager=None``: on unless the optimizer clips (``max_grad_norm``: the norm needs
    every gradient first) or gradients are averaged across ranks after backward (a
    process group of more than one rank: the hook would see this rank's gradient only).
    ``True`` with ``max_grad_norm`` is rejected by the option checks."""
    if eager is not None:
        return Decision(bool(eager), f"eager={eager}")
    if max_grad_norm is not None:
        return Decision(False, "max_grad_norm is set: clipping needs every gradient first")
    if distributed:
        return Decision(
            False, "a process group of several ranks averages the gradients after backward"
        )
    return Decision(True, "no clipping: each tensor is updated as its last gradient lands")


def place(
    numel: int,
    master_bytes: int,
    *,
    moment_dtype: str,
    host_budget: int | None,
    pin_moments: bool | None,
    eager: bool | None,
    max_grad_norm: float | None,
    distributed: bool,
) -> Placement:
    """Every decision for an optimizer of ``numel`` parameters with ``master_bytes`` of
    master weights, on this machine's RAM (:func:`host_ram`) and CUDA."""
    available, total = host_ram()
    budget = default_moment_budget(available, total) if host_budget is None else host_budget
    if moment_dtype == "auto":
        dtype = choose_moment_dtype(numel, master_bytes, budget)
    else:
        dtype = Decision(moment_dtype, f"moment_dtype={moment_dtype!r}")
    need = moment_bytes(dtype.value, numel) + master_bytes
    return Placement(
        moment_dtype=dtype,
        pin=choose_pinning(pin_moments, need, total, torch.cuda.is_available()),
        eager=choose_eager(eager, max_grad_norm=max_grad_norm, distributed=distributed),
        host_budget=budget,
    )


def state_bytes(
    states: Iterable[Mapping[str, Any]], buffers: Iterable[torch.Tensor]
) -> tuple[int, int, int]:
    """(moment bytes, master bytes, page-locked bytes) of optimizer states and gradient
    staging ``buffers`` (page-locked bytes only where CUDA can pin)."""
    cuda = torch.cuda.is_available()
    moments = masters = pinned = 0
    for state in states:
        for key, value in state.items():
            if key == "step" or not isinstance(value, torch.Tensor):
                continue
            size = value.numel() * value.element_size()
            if key == "master":
                masters += size
            else:
                moments += size
            if cuda and value.is_pinned():
                pinned += size
    if cuda:
        pinned += sum(b.numel() * b.element_size() for b in buffers if b.is_pinned())
    return moments, masters, pinned
