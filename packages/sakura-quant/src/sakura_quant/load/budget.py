"""``quantize="auto"``: the bytes a model would take unquantized, in int8 and in NF4, and
the first of those that fits a host-RAM budget.

The sizes are computed from shapes (the model's, on the meta device) and the checkpoint's
stored dtypes, never from the weights: a quantized weight's bytes follow from its element
count and its :class:`~sakura_quant.options.WeightSpec` alone (codes, one scale per block,
and under double quantization one byte per scale plus an fp32 absmax per 256 scales and an
fp32 offset), which :func:`quantized_nbytes` computes and a test holds equal to the bytes of
real quantized weights.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

from sakura_quant.formats.double_quant import SCALE_BLOCK_SIZE
from sakura_quant.options import WeightSpec
from sakura_torch.host_memory import host_ram

__all__ = [
    "AUTO_ORDER",
    "LoadChoice",
    "available_ram",
    "choose",
    "quantized_nbytes",
    "release_freed_heap",
]

LOG = logging.getLogger("sakura_quant")
AUTO_ORDER = ("none", "int8", "nf4")
"""What ``quantize="auto"`` tries, in order: the first that fits the budget is taken."""


def quantized_nbytes(numel: int, spec: WeightSpec) -> int:
    """Bytes of a weight of ``numel`` elements stored int8 / nf4 as ``spec`` says."""
    if spec.format not in ("int8", "nf4"):
        raise ValueError(f"quantized_nbytes covers int8 and nf4, not {spec.format!r}")
    blocks = math.ceil(numel / spec.block_size)
    data = numel if spec.format == "int8" else (numel + 1) // 2
    if spec.double_quant:
        scales = blocks + 4 * math.ceil(blocks / SCALE_BLOCK_SIZE) + 4
    else:
        scales = 4 * blocks
    return data + scales


def available_ram() -> int:
    """Bytes of host RAM available now (:func:`sakura_torch.host_memory.host_ram`, the
    reading sakura-offload's planner and host optimizer use too)."""
    return host_ram().available


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
    except OSError:  # pragma: no cover - no C library to load
        return None
    trim = getattr(libc, "malloc_trim", None)  # glibc only
    return None if trim is None else trim


def release_freed_heap() -> None:
    """Hand the heap's free pages back to the OS (glibc's ``malloc_trim(0)``, which also
    releases whole free pages inside the heap; nothing elsewhere).

    ``load_model`` calls it after each quantized weight: glibc raises its mmap threshold
    each time a large block is freed, so the next weight's temporaries come from the heap,
    between the codes kept, and without this the heap only grows (measured: 3.6x the bound
    for an int8 load in one run of two, ``benchmarks/quant_load_peak.py``)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@dataclass(frozen=True)
class LoadChoice:
    """What ``load_model`` chose: ``quantize`` (``"none"``, ``"int8"``, ``"nf4"``), the
    ``budget`` it chose against (bytes) and the estimated ``sizes`` of each candidate
    (bytes, keyed as ``AUTO_ORDER``).  Recorded on the model as ``model.sakura_quant_load``
    (for an explicit ``quantize`` too, with the sizes left empty)."""

    quantize: str
    budget: int | None
    sizes: dict[str, int]

    def describe(self) -> str:
        sizes = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in self.sizes.items())
        return (
            f"load_model: quantize='auto' chose {self.quantize!r} "
            f"(host budget {(self.budget or 0) / 2**20:.1f} MiB; estimated {sizes})"
        )


def choose(sizes: dict[str, int], budget: int) -> LoadChoice:
    """The first of ``AUTO_ORDER`` whose size fits ``budget``; a ``MemoryError`` naming the
    smallest budget that would work when none does.  Logged once."""
    for name in AUTO_ORDER:
        if sizes[name] <= budget:
            choice = LoadChoice(name, budget, dict(sizes))
            LOG.info(choice.describe())
            return choice
    smallest = min(sizes.values())
    raise MemoryError(
        f"load_model: quantize='auto' cannot fit this model in host_budget={budget} bytes "
        f"({budget / 2**20:.1f} MiB): it takes about {sizes['none']} bytes unquantized, "
        f"{sizes['int8']} in int8 and {sizes['nf4']} in nf4, the smallest; a budget of at "
        f"least {smallest} bytes ({smallest / 2**20:.1f} MiB) would work (pass host_budget=, "
        "raise ram_fraction=, or free RAM)"
    )
