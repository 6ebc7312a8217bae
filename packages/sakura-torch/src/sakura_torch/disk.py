"""Tensors in memory-mapped files: :class:`TensorFileStore`, the one disk tier for tensors
that are written once and read many times (frozen weights that host RAM cannot hold).

``store.put(key, tensor)`` writes the tensor's bytes to a file of its own and hands back a
tensor mapped from that file: no copy in anonymous memory, the pages live in the OS's page
cache while RAM has room and are read from the disk again when it does not.  The store
owns a private folder it creates inside the directory it is given; that folder goes away
at :meth:`~TensorFileStore.close`, when the store is garbage-collected, at interpreter exit
(``weakref.finalize``, which runs at ``atexit``) and when a ``with`` block leaves, also on
an exception.

What a file may be trusted for:

* every file is written completely (written, flushed, ``fsync``-ed) under a temporary
  name and renamed into place (:func:`sakura.fileio.atomic_writer`), so a file that
  exists under its final name is whole; a failed write (a full disk, a file-size limit, a
  folder made read-only) removes its temporary file, leaves the store as it was and
  raises :class:`TensorFileError` naming the option, the folder and the OS error;
* before a file is mapped, it is checked against what the store recorded when it wrote
  it (a regular file, exactly ``numel * element_size`` bytes): a file is untrusted input,
  and a mismatch is a :class:`TensorFileError`, never a crash in native code;
* a mapped tensor is a private (copy-on-write) mapping: writing to it never reaches the
  file, so what was stored is what every later :meth:`~TensorFileStore.get` maps.

A tensor's strides survive the round trip: its bytes are written in memory order (for a
transposed weight, the transpose of a contiguous one) and the mapped tensor is a strided
view with the original layout, so kernels see the same tensor geometry as before.

torch is imported when a store is made, never at import.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import stat
import tempfile
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from sakura.errors import add_note
from sakura.fileio import atomic_writer
from sakura.options import option_error

if TYPE_CHECKING:
    import torch

__all__ = ["TensorFileError", "TensorFileStore"]

_ACCEPTED = "a path (str or os.PathLike) of a writable directory, created if missing"


class TensorFileError(OSError):
    """Writing a tensor's file failed (``errno`` is the OS's), or a file no longer matches
    what was written to it."""


@dataclass(frozen=True)
class _Record:
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    numel: int
    nbytes: int


def _cleanup(root: str, made: list[str]) -> None:
    shutil.rmtree(root, ignore_errors=True)
    _remove_empty(made)


def _remove_empty(made: list[str]) -> None:
    for folder in made:  # the directories the store created for itself, if they stayed empty
        with contextlib.suppress(OSError):
            os.rmdir(folder)


def _memory_order(t: torch.Tensor) -> tuple[list[int], tuple[int, ...]]:
    """The dimension order that lists ``t``'s elements as they lie in memory (outermost
    first), and the strides of a dense tensor of ``t``'s shape in that order."""
    order = sorted(range(t.dim()), key=lambda d: (t.stride(d), -d), reverse=True)
    stride = [0] * t.dim()
    step = 1
    for d in reversed(order):
        stride[d] = step
        step *= max(int(t.shape[d]), 1)
    return order, tuple(stride)


class TensorFileStore:
    """Tensors in memory-mapped files under a private folder (see the module docstring).

    Args:
        directory: where the store's folder is created (created too if it does not exist).
        option: the option name errors give for ``directory`` (``"disk_offload"`` when a
            service's ``disk_offload=`` made the store).
        owner: who errors name (``"WeightPaging"``, ``"load_model"``).
        prefix: the start of the private folder's name.

    A store is a context manager: leaving the ``with`` block closes it.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        option: str = "directory",
        owner: str = "TensorFileStore",
        prefix: str = "sakura-tensors-",
    ) -> None:
        self.option = option
        self.owner = owner
        if not isinstance(directory, (str, os.PathLike)):
            raise option_error(option, directory, _ACCEPTED, owner=owner)
        base = Path(directory)
        if str(directory) == "":
            raise option_error(option, directory, _ACCEPTED, owner=owner)
        self.directory = base
        """The directory given; the store's own folder is :attr:`root`, inside it."""
        # The folders created here, deepest first (removed at close if they stay empty).
        made = [str(p) for p in (base, *base.parents) if not p.exists()]
        try:
            if base.exists() and not base.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, "exists and is not a directory")
            base.mkdir(parents=True, exist_ok=True)
            self.root = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
            """The private folder holding the files (removed at close)."""
        except OSError as exc:
            _remove_empty(made)
            raise option_error(
                option, str(directory), f"{_ACCEPTED} ({exc.strerror or exc})", owner=owner
            ) from exc
        self._finalizer = weakref.finalize(self, _cleanup, str(self.root), made)
        try:  # a folder that takes no file is refused now, not at the first tensor
            with atomic_writer(self.root / "probe") as handle:
                handle.write(b"\0")
            (self.root / "probe").unlink()
        except OSError as exc:
            self._finalizer()
            raise option_error(
                option, str(directory), f"{_ACCEPTED} ({exc.strerror or exc})", owner=owner
            ) from exc
        self._lock = threading.Lock()
        self._records: dict[str, _Record] = {}
        self._counter = 0

    # --- writing ------------------------------------------------------------------------

    def put(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """Write ``tensor`` under ``key`` (replacing what ``key`` held) and return it mapped
        from its file: the usual call for "store this as it is read"."""
        self.write(key, tensor)
        return self.get(key)

    def write(self, key: str, tensor: torch.Tensor) -> None:
        """Write ``tensor`` (any device, dtype and layout of a dense strided tensor) to a
        file of its own under ``key``; on failure nothing of it is kept."""
        import torch

        if not isinstance(key, str):
            raise TypeError(f"{self.owner}: a tensor's key must be a str, got {key!r}")
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
            raise TypeError(
                f"{self.owner}: {key!r}: a dense (strided) torch.Tensor is stored, got "
                f"{type(tensor).__name__}"
                + (f" with layout {tensor.layout}" if isinstance(tensor, torch.Tensor) else "")
            )
        self._check_open()
        order, stride = _memory_order(tensor)
        flat = tensor.detach().permute(order).to("cpu").contiguous().reshape(-1)
        nbytes = flat.numel() * flat.element_size()
        with self._lock:
            self._counter += 1
            path = self.root / f"{self._counter}.bin"
        try:
            with atomic_writer(path) as handle:
                if nbytes:  # the tensor's own bytes, no copy (flat stays alive meanwhile)
                    handle.write(memoryview((ctypes.c_char * nbytes).from_address(flat.data_ptr())))
        except OSError as exc:
            error = TensorFileError(
                exc.errno,
                f"{self.owner}: {self.option}={str(self.directory)!r}: writing {key!r} "
                f"({nbytes} bytes) under {str(self.root)!r} failed: {exc.strerror or exc}",
            )
            add_note(error, f"give {self.option}= a folder with room that this process can write")
            raise error from exc
        record = _Record(path, tensor.dtype, tuple(tensor.shape), stride, tensor.numel(), nbytes)
        with self._lock:
            old = self._records.get(key)
            self._records[key] = record
        if old is not None:
            with contextlib.suppress(OSError):
                old.path.unlink()

    # --- reading ------------------------------------------------------------------------

    def get(self, key: str) -> torch.Tensor:
        """The tensor stored under ``key``, mapped from its file (zero-copy, private: a
        write to it never reaches the file); its file is checked first."""
        import torch

        self._check_open()
        with self._lock:
            record = self._records.get(key)
        if record is None:
            raise KeyError(f"{self.owner}: no tensor {key!r} in {str(self.root)!r}")
        try:
            info = os.lstat(record.path)
        except OSError as exc:
            raise TensorFileError(
                exc.errno,
                f"{self.owner}: the file of {key!r} ({record.path}) cannot be read: "
                f"{exc.strerror or exc}",
            ) from exc
        if not stat.S_ISREG(info.st_mode) or info.st_size != record.nbytes:
            raise TensorFileError(
                f"{self.owner}: the file of {key!r} ({record.path}) is not the one written: "
                f"{'a regular file' if stat.S_ISREG(info.st_mode) else 'not a regular file'} "
                f"of {info.st_size} bytes, {record.nbytes} bytes expected "
                f"({record.numel} x {record.dtype})"
            )
        if record.numel == 0:
            return torch.empty(record.shape, dtype=record.dtype)
        flat = torch.from_file(
            str(record.path), shared=False, size=record.numel, dtype=record.dtype
        )
        return flat.as_strided(record.shape, record.stride)

    def __contains__(self, key: object) -> bool:
        return key in self._records

    def __len__(self) -> int:
        return len(self._records)

    def keys(self) -> list[str]:
        """The stored keys, in the order they were first written."""
        return list(self._records)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data in the store's files."""
        return sum(record.nbytes for record in self._records.values())

    def remove(self, key: str) -> None:
        """Forget ``key`` and delete its file (tensors mapped from it stay valid)."""
        with self._lock:
            record = self._records.pop(key, None)
        if record is not None:
            with contextlib.suppress(OSError):
                record.path.unlink()

    # --- closing ------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"{self.owner}: the tensor store {str(self.root)!r} is closed")

    def close(self) -> None:
        """Remove the folder and every file (tensors already mapped stay readable where the
        system allows deleting a mapped file, as POSIX does)."""
        self._finalizer()
        self._records.clear()

    def __enter__(self) -> TensorFileStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{len(self._records)} tensors, {self.nbytes} bytes"
        return f"TensorFileStore({str(self.root)!r}, {state})"
