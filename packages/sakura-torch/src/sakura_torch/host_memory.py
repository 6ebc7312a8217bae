"""How much host RAM there is: one reading for every package that plans memory.

The memory planner, the host optimizer's ``moment_dtype="auto"`` and ``load_model``'s
``quantize="auto"`` all size their choices against the same figure, so it is read one way:
``MemAvailable`` and ``MemTotal`` from ``/proc/meminfo`` (what the kernel estimates can be
allocated without swapping, page cache included), falling back to ``sysconf``'s free and
physical pages where there is no ``/proc`` (macOS, some containers).  Pure Python: nothing
here imports torch.
"""

from __future__ import annotations

import os
from typing import NamedTuple

__all__ = ["HostRam", "host_ram"]


class HostRam(NamedTuple):
    """Bytes of host RAM."""

    available: int
    """What can be allocated now without swapping (``MemAvailable``)."""
    total: int
    """Physical RAM (``MemTotal``)."""


def host_ram() -> HostRam:
    """The machine's available and total host RAM, in bytes, read now."""
    try:
        fields: dict[str, int] = {}
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                name, _, rest = line.partition(":")
                if name in ("MemAvailable", "MemTotal"):
                    fields[name] = int(rest.split()[0]) * 1024
        return HostRam(fields["MemAvailable"], fields["MemTotal"])
    except (OSError, KeyError, ValueError, IndexError):
        page = os.sysconf("SC_PAGE_SIZE")
        return HostRam(
            int(os.sysconf("SC_AVPHYS_PAGES") * page), int(os.sysconf("SC_PHYS_PAGES") * page)
        )
