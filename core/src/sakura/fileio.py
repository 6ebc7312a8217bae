"""Atomic, durable writes: a crash at any moment leaves the old file (or directory) or the
new one, never a truncated mix.

The recipe, in one place for every package: write to a temporary name in the same
directory, flush and ``fsync`` the file, ``os.replace`` it over the final name, then
``fsync`` the directory so the rename itself survives a power cut.  Errors are the
``OSError`` the system gave, with a note naming the path being written.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from sakura.errors import add_note

__all__ = ["atomic_directory", "atomic_write_bytes", "atomic_writer", "fsync_dir"]


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """``fsync`` a directory (its entries: creations, renames).  A no-op where the platform
    cannot open directories (Windows)."""
    try:
        fd = os.open(os.fspath(path), os.O_RDONLY)
    except (PermissionError, IsADirectoryError):  # Windows cannot open a directory
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _annotate(error: OSError, what: str) -> OSError:
    add_note(error, what)
    return error


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike[str], mode: str = "wb") -> Iterator[IO[Any]]:
    """Open a temporary file beside ``path`` for writing; on a clean exit it is flushed,
    fsynced and renamed over ``path`` and the directory fsynced.  On an exception the
    temporary file is removed and ``path`` is untouched.

    ``mode`` is ``"wb"`` (default) or ``"w"`` (text, UTF-8)::

        with atomic_writer(target) as f:
            torch.save(state, f)
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_writer: mode={mode!r} is not accepted; accepted: 'wb', 'w'")
    target = Path(path)
    directory = target.parent
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=directory)
    except OSError as exc:
        raise _annotate(exc, f"while creating a temporary file in {str(directory)!r}") from None
    try:
        kwargs: dict[str, Any] = {"encoding": "utf-8"} if mode == "w" else {}
        with os.fdopen(fd, mode, **kwargs) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            add_note(exc, f"while writing {str(target)!r}")
        raise
    fsync_dir(directory)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` atomically and durably (see :func:`atomic_writer`)."""
    with atomic_writer(path, "wb") as handle:
        handle.write(data)


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Build a directory under a temporary name beside ``path``; on a clean exit every file
    in it (top level) is fsynced, the directory fsynced, renamed to ``path`` and the parent
    fsynced.  ``path`` must not exist (a directory is never replaced half-way); on an
    exception the temporary directory is removed."""
    target = Path(path)
    if target.exists():
        raise FileExistsError(f"atomic_directory: {str(target)!r} already exists")
    parent = target.parent
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=parent))
    except OSError as exc:
        raise _annotate(exc, f"while creating a temporary directory in {str(parent)!r}") from None
    try:
        yield tmp
        for entry in tmp.iterdir():
            if entry.is_file():
                with entry.open("rb") as handle:
                    os.fsync(handle.fileno())
        fsync_dir(tmp)
        os.rename(tmp, target)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError):
            add_note(exc, f"while writing the directory {str(target)!r}")
        raise
    fsync_dir(parent)
