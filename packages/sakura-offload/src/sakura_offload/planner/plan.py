"""What the memory planner decides, as data: the choices a block's saved activations can
take, :class:`BlockDecision` (one block's measurements and choice), :class:`MemoryPlan` (a
decision per block, with its text table), :class:`MemoryBudgetError`, and
:func:`parse_bytes` (sizes such as ``"2GB"``).  See ``docs/offload.md``, "The memory
planner"."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from sakura.options import option_error

__all__ = [
    "CHOICES",
    "BlockDecision",
    "MemoryBudgetError",
    "MemoryPlan",
    "RamSwitch",
    "parse_bytes",
]

_OWNER = "MemoryPlanner"

CHOICES = ("keep", "page_host", "page_disk", "recompute")
"""What a block's saved activations can become."""

_LABELS = {
    "keep": "keep",
    "page_host": "page (host)",
    "page_disk": "page (disk)",
    "recompute": "recompute",
}
_COLUMN = len("+ms page (host)")

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*\Z")
_SIZE_ACCEPTED = (
    "a number of bytes: an int, or a string such as '2GB' or '512MiB' "
    "(KB, MB, GB, TB: powers of 1000; KiB, MiB, GiB, TiB: powers of 1024)"
)


def parse_bytes(
    option: str,
    value: Any,
    *,
    minimum: int = 0,
    allow_none: bool = False,
    owner: str | None = _OWNER,
) -> int | None:
    """``value`` (an int, an integral float, or a size string like ``"2GB"``) in bytes;
    an :class:`~sakura.options.OptionError` naming ``option`` otherwise."""
    accepted = _SIZE_ACCEPTED + (f", >= {minimum}" if minimum else "")
    if allow_none:
        accepted = "None or " + accepted
    if value is None and allow_none:
        return None
    result: int | None = None
    if isinstance(value, bool):
        result = None
    elif isinstance(value, int):
        result = value
    elif isinstance(value, float) and math.isfinite(value) and value.is_integer():
        result = int(value)
    elif isinstance(value, str):
        match = _SIZE.match(value)
        if match and match.group(2).lower() in _UNITS:
            result = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if result is None or result < minimum:
        raise option_error(option, value, accepted, owner=owner)
    return result


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


class MemoryBudgetError(ValueError):
    """The budget is below the least peak any plan reaches (``minimum``, in bytes)."""

    def __init__(self, message: str, *, budget: int, minimum: int) -> None:
        super().__init__(message)
        self.budget = budget
        self.minimum = minimum


@dataclass(frozen=True)
class BlockDecision:
    """What the planner measured for one block and what it chose."""

    name: str
    activation_bytes: int
    """Bytes of the storages autograd saved in the block's forward."""
    pageable_bytes: int
    """Of those, the bytes paging moves off the device."""
    copy_bytes: int
    """Bytes paging copies out (and back in backward): each pageable saved tensor once,
    also when several share a storage."""
    input_bytes: int
    """Bytes of the block's tensor inputs (recomputation keeps them)."""
    recompute_bytes: int
    """The most bytes the block's forward had live at once of the storages it created
    (recomputation creates them again in backward)."""
    parameter_bytes: int
    forward_seconds: float
    choice: str
    """One of :data:`CHOICES`."""
    cost_seconds: float
    """Extra time per step of this choice (measured, or estimated: see ``costs_measured``)."""
    costs: tuple[tuple[str, float], ...] = ()
    """Extra seconds per step of each choice the planner could make, as it weighed them."""
    costs_measured: bool = False
    """Whether those costs were timed on the block (else estimated from copy bandwidth and
    forward time)."""

    @property
    def resident_bytes(self) -> int:
        """Saved bytes this block leaves on the device until its backward."""
        return _resident(self, self.choice)

    @property
    def label(self) -> str:
        return _LABELS[self.choice]


def _resident(d: BlockDecision, choice: str) -> int:
    if choice == "keep":
        return d.activation_bytes
    if choice == "recompute":
        return d.input_bytes
    return d.activation_bytes - d.pageable_bytes


@dataclass(frozen=True)
class RamSwitch:
    """Blocks switched at run time from paging to host RAM to recomputation because the
    RAM available fell under the floor (``MemoryPlanner(ram_floor=...)``)."""

    forward: int
    """The forward pass (counted from the plan's application, from 1) it took effect in."""
    blocks: tuple[str, ...]
    available: int
    """Bytes of host RAM available when it was read."""
    floor: int

    def describe(self) -> str:
        return (
            f"memory plan: host RAM available {_mb(self.available)} is under the floor "
            f"{_mb(self.floor)} (ram_floor); from forward {self.forward} blocks "
            f"{', '.join(self.blocks)} recompute instead of paging to host RAM"
        )


@dataclass(frozen=True)
class MemoryPlan:
    """A decision per block (``decisions``), with the estimates it was made from."""

    decisions: tuple[BlockDecision, ...]
    budget: int | None
    """The budget planned for (None: choices given, not planned)."""
    estimated_peak: int
    keep_peak: int
    """The estimated peak with every block kept."""
    least_peak: int
    """The least estimated peak of any plan (the lowest budget that can be met)."""
    outside_bytes: int
    """Saved bytes outside the blocks (embeddings, head, loss)."""
    host_bandwidth: float
    """Round-trip bytes/s of host paging: given, probed, or (when its costs were measured)
    the effective figure, copy bytes over the measured extra time."""
    disk_bandwidth: float
    device: str
    cost_trials: int = 0
    """Timed rounds per choice the costs were measured with (0: estimated)."""
    ram_switches: tuple[RamSwitch, ...] = ()
    """Switches made at run time to hold the host-RAM floor, in order (``decisions``
    shows the choices after them; the estimates are those of the plan as made)."""

    @property
    def choices(self) -> dict[str, str]:
        return {d.name: d.choice for d in self.decisions}

    @property
    def estimated_cost_seconds(self) -> float:
        return sum(d.cost_seconds for d in self.decisions)

    def table(self) -> str:
        """The decision as a text table."""
        budget = "choices given" if self.budget is None else f"budget {_mb(self.budget)}"
        lines = [
            f"memory plan ({self.device}): {budget}, estimated peak of saved activations "
            f"{_mb(self.estimated_peak)} (everything kept: {_mb(self.keep_peak)}, least "
            f"reachable: {_mb(self.least_peak)}; outside the blocks: {_mb(self.outside_bytes)})",
            (
                f"costs measured ({self.cost_trials} timed forward + backward per choice and "
                "block shape); effective copy round trip"
                if any(d.costs_measured for d in self.decisions)
                else "costs estimated; copy round trip"
            )
            + f": host {self.host_bandwidth / 1e9:.2f} GB/s, disk "
            + (f"{self.disk_bandwidth / 1e9:.2f} GB/s" if self.disk_bandwidth else "not used")
            + "; extra time per step "
            f"{self.estimated_cost_seconds * 1e3:.2f} ms",
        ]
        width = max(len("block"), *(len(d.name) for d in self.decisions))
        options = [c for c, _ in self.decisions[0].costs if c != "keep"] if self.decisions else []
        header = (
            f"{'block':<{width}}  {'activation MB':>13}  {'params MB':>9}  {'forward ms':>10}"
            + "".join(f"  {'+ms ' + _LABELS[c]:>{_COLUMN}}" for c in options)
            + f"  {'choice':<11}  {'+ms chosen':>10}"
        )
        lines += [header, "-" * len(header)]
        for d in self.decisions:
            costs = dict(d.costs)
            lines.append(
                f"{d.name:<{width}}  {d.activation_bytes / 1e6:>13.2f}  "
                f"{d.parameter_bytes / 1e6:>9.2f}  {d.forward_seconds * 1e3:>10.2f}"
                + "".join(f"  {costs.get(c, math.nan) * 1e3:>{_COLUMN}.2f}" for c in options)
                + f"  {d.label:<11}  {d.cost_seconds * 1e3:>10.2f}"
            )
        lines += [s.describe() for s in self.ram_switches]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()
