"""Shared-memory segments for tensors handed to a local worker.

A segment is an anonymous ``memfd`` (Linux; an unlinked temporary file elsewhere) mapped
in both processes.  Its file descriptor crosses the Unix socket once (``SCM_RIGHTS``), so
no name ever exists in ``/dev/shm`` to leak when a process is killed: the memory is freed
when the last process holding it exits.
"""

from __future__ import annotations

import itertools
import mmap
import os
import tempfile
from typing import Any

__all__ = ["Segment"]

_ids = itertools.count(1)
PAGE = mmap.PAGESIZE


def _anonymous_fd(size: int) -> int:
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("sakura-shm", os.MFD_CLOEXEC)
    else:  # pragma: no cover - non-Linux
        f = tempfile.TemporaryFile()  # noqa: SIM115 - the fd outlives the file object
        fd = os.dup(f.fileno())
        f.close()
    os.ftruncate(fd, size)
    return fd


class Segment:
    """A shared-memory segment: its fd, its mapping and a uint8 tensor over all of it."""

    def __init__(self, size: int) -> None:
        import torch

        self.id = next(_ids)
        self.size = max(PAGE, -(-size // PAGE) * PAGE)
        self.fd = _anonymous_fd(self.size)
        self.mmap = mmap.mmap(self.fd, self.size)
        self.tensor: Any = torch.frombuffer(self.mmap, dtype=torch.uint8)
        self.base: int = self.tensor.data_ptr()
        self.used = 0

    def close(self) -> None:
        """Close the fd; the mapping goes when the last tensor viewing it is gone."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.tensor = None

    def __repr__(self) -> str:
        return f"<Segment #{self.id} {self.size} bytes>"
