"""Have the C allocator keep the memory a training step frees, for the next step to reuse.

torch on a CPU allocates every tensor with ``malloc``.  glibc's defaults hand memory back to
the kernel eagerly: a block of at least ``M_MMAP_THRESHOLD`` bytes (128 KiB to start; the
threshold rises as such blocks are freed) is a fresh ``mmap`` and an ``munmap`` when freed,
and a free top of the heap larger than ``M_TRIM_THRESHOLD`` is given back.  A training step
frees and reallocates the same few hundred buffers every step, so each one is handed back
and faulted in again, a page at a time: measured on this project's machine (2-core Xeon,
SmolLM2-135M QLoRA step, 1 thread), the page faults cost 6-7 % of sakura's step, and
two 512 x 1536 bf16 products took 2.4 ms instead of 0.8 ms when their outputs were kept
alive between calls.

:func:`reuse_freed_memory` sets both thresholds with ``mallopt`` (process-wide, like
``torch.set_num_threads``; nothing undoes it): blocks below ``largest`` bytes come from the
heap and freed memory stays there for reuse.  Setting only one of the two is worse than
neither (it switches off glibc's own rising threshold), so both are set or neither.  The
process's resident memory then stays at its high-water mark instead of falling back between
steps; the peak itself does not grow in the steps measured.  Other C libraries (musl,
macOS) are left alone and say so.
"""

from __future__ import annotations

import ctypes
import os
from typing import NamedTuple

from sakura.options import check_int

__all__ = ["LARGEST", "HeapReuse", "reuse_freed_memory"]

LARGEST = 32 << 20
"""The largest block served from the heap: glibc's own ceiling for the threshold it raises
by itself (``DEFAULT_MMAP_THRESHOLD_MAX`` on a 64-bit system).  Larger blocks stay ``mmap``
s; a 1 GiB threshold made no difference to the QLoRA step of ``benchmarks/qlora_step.py``."""

_SMALLEST = 128 << 10
_CEILING = 1 << 30
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_KEEP_FREED = (1 << 31) - 1  # mallopt takes an int: 2 GiB of free heap top before trimming


class HeapReuse(NamedTuple):
    """What :func:`reuse_freed_memory` did."""

    applied: bool
    detail: str


def _glibc() -> ctypes.CDLL | None:
    """The running glibc, or None when the C library is another one."""
    try:
        version = os.confstr("CS_GNU_LIBC_VERSION")
    except (ValueError, OSError, AttributeError):
        return None
    if not version or not version.startswith("glibc"):
        return None
    libc = ctypes.CDLL(None)
    return libc if hasattr(libc, "mallopt") else None


def reuse_freed_memory(largest: int = LARGEST) -> HeapReuse:
    """Have glibc serve blocks below ``largest`` bytes from its heap and keep freed
    memory there (see the module docstring).  ``largest``: an int from 128 KiB to 1 GiB
    (default :data:`LARGEST`, 32 MiB).  Returns whether it was applied and why not."""
    largest = check_int("largest", largest, minimum=_SMALLEST, maximum=_CEILING)
    libc = _glibc()
    if libc is None:
        return HeapReuse(False, "the C library is not glibc: its allocator is left as it is")
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    if not libc.mallopt(_M_MMAP_THRESHOLD, largest):
        return HeapReuse(False, f"glibc refused M_MMAP_THRESHOLD={largest}")
    if not libc.mallopt(_M_TRIM_THRESHOLD, _KEEP_FREED):
        return HeapReuse(False, "glibc refused M_TRIM_THRESHOLD")
    return HeapReuse(True, f"glibc keeps freed memory for reuse (blocks below {largest >> 20} MiB)")
