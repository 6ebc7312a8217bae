"""Activation paging: the tensors autograd saves for backward go to host RAM or to files on
disk while the forward pass runs, and come back when backward needs them
(:class:`ActivationPaging`, a context manager of saved-tensor hooks).

What is paged and what is kept, and how: ``docs/offload.md``, "Activation paging: design".
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from sakura.errors import add_note
from sakura.options import check_choice, check_int, option_error

__all__ = ["ActivationPaging", "PagingStats", "is_broadcast", "is_dense"]

_OWNER = "ActivationPaging"
TIERS = ("host", "disk")


def is_broadcast(t: torch.Tensor) -> bool:
    """True for a view that repeats memory: a stride of 0 over a dimension larger than 1."""
    return any(stride == 0 and size > 1 for size, stride in zip(t.shape, t.stride(), strict=True))


def is_dense(t: torch.Tensor) -> bool:
    """True when the elements fill exactly ``numel`` consecutive slots in some order of the
    dimensions (contiguous, or a permutation of contiguous such as a transpose)."""
    dims = sorted(
        ((stride, size) for size, stride in zip(t.shape, t.stride(), strict=True) if size != 1),
        reverse=True,
    )
    expected = 1
    for stride, size in reversed(dims):
        if stride != expected:
            return False
        expected *= size
    return True


@dataclass
class PagingStats:
    """What one :class:`ActivationPaging` did (cumulative)."""

    paged: int = 0
    paged_bytes: int = 0
    kept: int = 0
    kept_broadcast: int = 0
    restored: int = 0
    files_removed: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)


class _DiskPage:
    """One saved tensor in a file; the file goes when this object does."""

    __slots__ = ("__weakref__", "device", "dtype", "nbytes", "path", "shape", "stride")

    def __init__(self, path: Path, t: torch.Tensor) -> None:
        self.path = path
        self.shape = t.shape
        self.stride = t.stride()
        self.dtype = t.dtype
        self.device = t.device
        self.nbytes = t.numel() * t.element_size()


class _HostPage:
    __slots__ = ("device", "host")

    def __init__(self, host: torch.Tensor, device: torch.device) -> None:
        self.host = host
        self.device = device


def _remove(path: str, stats: PagingStats, lock: threading.Lock) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return
    with lock:
        stats.files_removed += 1


class ActivationPaging:
    """Context manager that pages the tensors autograd saves (see the module docstring).

    Args:
        tier: ``"host"`` (accelerator tensors to page-locked host RAM) or ``"disk"``
            (memory-mapped files).
        directory: for ``"disk"``: where the private directory of files is created
            (default: the system's temporary directory).  It must exist and be writable.
        min_bytes: smaller tensors are kept as they are (default 64 KiB).
    """

    def __init__(
        self,
        tier: str = "host",
        *,
        directory: str | os.PathLike[str] | None = None,
        min_bytes: int = 1 << 16,
    ) -> None:
        self.tier = check_choice("tier", tier, TIERS, owner=_OWNER)
        self.min_bytes: int = check_int("min_bytes", min_bytes, minimum=0, owner=_OWNER)
        self.stats = PagingStats()
        self._lock = threading.Lock()
        self._counter = 0
        self._hooks: Any = None
        self.root: Path | None = None
        if tier == "disk":
            base = Path(directory) if directory is not None else Path(tempfile.gettempdir())
            if not base.is_dir():
                raise option_error("directory", str(base), "an existing directory", owner=_OWNER)
            try:
                self.root = Path(tempfile.mkdtemp(prefix="sakura-paging-", dir=base))
                probe = self.root / "probe"
                probe.write_bytes(b"\0")
                probe.unlink()
            except OSError as exc:
                raise option_error(
                    "directory",
                    str(base),
                    f"a writable directory ({exc.strerror or exc})",
                    owner=_OWNER,
                ) from exc
            weakref.finalize(self, shutil.rmtree, str(self.root), True)
        elif directory is not None:
            raise option_error("directory", directory, "None unless tier='disk'", owner=_OWNER)

    # --- context ----------------------------------------------------------------------

    def __enter__(self) -> ActivationPaging:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        hooks, self._hooks = self._hooks, None
        hooks.__exit__(exc_type, exc, tb)

    # --- hooks ------------------------------------------------------------------------

    def _keep(self, t: torch.Tensor, reason: str) -> torch.Tensor:
        with self._lock:
            self.stats.kept += 1
            self.stats.by_reason[reason] = self.stats.by_reason.get(reason, 0) + 1
            if reason == "broadcast":
                self.stats.kept_broadcast += 1
        return t

    def _pack(self, t: torch.Tensor) -> Any:
        nbytes = t.numel() * t.element_size()
        if nbytes < self.min_bytes or t.numel() == 0:
            return self._keep(t, "small")
        if t.requires_grad and t.is_leaf:
            return self._keep(t, "parameter")
        if is_broadcast(t):
            return self._keep(t, "broadcast")
        if not is_dense(t) or t.is_sparse or t.layout != torch.strided:
            return self._keep(t, "layout")
        if self.tier == "host":
            if t.device.type == "cpu":
                return self._keep(t, "on host")
            host = torch.empty_strided(
                t.shape, t.stride(), dtype=t.dtype, device="cpu", pin_memory=True
            )
            host.copy_(t, non_blocking=True)
            page: Any = _HostPage(host, t.device)
        else:
            page = self._write(t)
        with self._lock:
            self.stats.paged += 1
            self.stats.paged_bytes += nbytes
        return page

    def _open_for_write(self, path: Path) -> Any:
        return open(path, "xb")

    def _write(self, t: torch.Tensor) -> _DiskPage:
        if self.root is None:  # only tier="disk" pages to files
            raise RuntimeError("ActivationPaging: no disk directory (tier is not 'disk')")
        with self._lock:
            self._counter += 1
            path = self.root / f"{self._counter}.bin"
        # The bytes in memory order: for a transposed tensor, the transpose of a contiguous one.
        order = sorted(range(t.dim()), key=lambda d: t.stride(d), reverse=True)
        flat = t.detach().permute(order).contiguous().view(-1).view(torch.uint8)
        data = flat.cpu().numpy()
        try:
            with self._open_for_write(path) as out:
                out.write(data.data)  # the array's buffer, no copy
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(path)
            error = RuntimeError(
                f"ActivationPaging: writing a saved tensor ({data.nbytes} bytes) to {path} "
                f"failed: {exc.strerror or exc}"
            )
            add_note(error, "use another directory= (with free space) or tier='host'")
            raise error from exc
        page = _DiskPage(path, t)
        weakref.finalize(page, _remove, str(path), self.stats, self._lock)
        return page

    def _unpack(self, page: Any) -> torch.Tensor:
        if isinstance(page, torch.Tensor):
            return page
        with self._lock:
            self.stats.restored += 1
        if isinstance(page, _HostPage):
            return page.host.to(page.device, non_blocking=True)
        raw = torch.from_file(str(page.path), shared=False, size=page.nbytes, dtype=torch.uint8)
        restored = torch.empty_strided(page.shape, page.stride, dtype=page.dtype)
        order = sorted(range(restored.dim()), key=lambda d: restored.stride(d), reverse=True)
        restored.permute(order).view(-1).view(torch.uint8).copy_(raw)
        return restored.to(page.device) if page.device.type != "cpu" else restored
