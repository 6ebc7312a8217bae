"""Giving the C heap's free pages back to the OS while ``fit`` holds a host budget:
:func:`trim_heap`, :class:`HeapTrim`.

On a CPU device the streamed blocks, the activations and the bandwidth probes are all
host RAM.  glibc's malloc keeps the pages of chunks it freed inside its heap until the
free space reaches the top of the heap (``M_TRIM_THRESHOLD``); what a step freed below a
chunk still in use stays resident.  Measured on ``benchmarks/fit.py``'s model (fp32 blocks
streamed from disk, ``mallinfo2``): 25-45 MiB of free heap held resident after each step
and after ``wrap`` (the bandwidth probes), on top of the 47 MiB the process used.
``malloc_trim(0)`` releases every whole free page of every arena (``madvise``, glibc >=
2.8), in about a millisecond here.  ``fit`` calls it once its parts are applied and after
each optimizer step, only when its plan moved something off the device (a plan that keeps
everything resident is left alone).  Linux with glibc only: elsewhere (musl, macOS,
Windows) :func:`trim_heap` does nothing and says so by returning ``None``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any

__all__ = ["HeapTrim", "trim_heap"]


@functools.cache
def _malloc_trim() -> Any:
    """glibc's ``malloc_trim``, or None where the C library has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim.argtypes = [ctypes.c_size_t]
        trim.restype = ctypes.c_int
    return trim


def trim_heap() -> bool | None:
    """Return the C heap's free pages to the OS; whether any were (``None``: not glibc,
    nothing done)."""
    trim = _malloc_trim()
    if trim is None:
        return None
    return bool(trim(0))


class HeapTrim:
    """Trims the heap after every step of ``optimizer`` (a step post-hook) until
    :meth:`remove`; ``trims`` counts the calls."""

    def __init__(self, optimizer: Any) -> None:
        self.trims = 0
        self._handle = None
        if _malloc_trim() is not None and hasattr(optimizer, "register_step_post_hook"):
            self._handle = optimizer.register_step_post_hook(self._after_step)

    def _after_step(self, *_: Any) -> None:
        trim_heap()
        self.trims += 1

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
