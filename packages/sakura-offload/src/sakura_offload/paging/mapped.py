"""Block copies in memory of their own on a CPU device: :func:`mapped_empty_like`.

On a CPU "device" (a simulated one, or the CPU training for real), every streamed block is
copied into fresh memory each time it runs, forward and backward, and freed after.  From
the C allocator (glibc's malloc) those multi-megabyte copies come from the heap once its
dynamic mmap threshold has risen (it rises to the size of the largest chunk freed, up to
32 MiB), and activations of the same step are carved out of the holes they leave; the
next copy no longer fits the hole, the heap grows, and its free chunks stay resident: the
process's anonymous RSS ended up 30-45 MiB above what it used on ``benchmarks/fit.py``'s
model (measured with ``mallinfo2``: in use 57 MiB, resident 94 MiB).  A copy mapped on
its own (an anonymous ``mmap``) is returned to the OS when its last tensor dies, and
never splits the heap.  Portable: Python's :mod:`mmap` (anonymous maps exist on Linux,
macOS; elsewhere the allocator is used); small tensors keep the allocator (a page each
would waste more).
"""

from __future__ import annotations

import mmap

import torch

__all__ = ["MAPPED_MIN_BYTES", "mapped_empty_like"]

MAPPED_MIN_BYTES = 128 * 1024
"""Tensors this large or larger get a map of their own (glibc's initial mmap threshold)."""

_PRIVATE = (
    mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS")
    else None
)
"""Private anonymous pages (counted in ``RssAnon`` as the heap's are; a shared map would be
``RssShmem``); ``None`` where :mod:`mmap` has no such flags (Windows): the allocator."""


def mapped_empty_like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised CPU tensor with ``t``'s shape, dtype and strides, in an anonymous
    memory map of its own when ``t`` is a dense tensor of at least
    :data:`MAPPED_MIN_BYTES` (else ``torch.empty_like``).  The map is unmapped when the
    tensor's storage is freed (the storage holds the buffer's only export)."""
    nbytes = t.numel() * t.element_size()
    if _PRIVATE is None or nbytes < MAPPED_MIN_BYTES or not t.is_contiguous() or t.is_quantized:
        return torch.empty_like(t, device="cpu")
    region = mmap.mmap(-1, nbytes, flags=_PRIVATE)
    flat = torch.frombuffer(region, dtype=torch.uint8, count=nbytes)
    del region  # the tensor's storage keeps the map alive, and only it
    return flat.view(t.dtype).view(t.shape)
