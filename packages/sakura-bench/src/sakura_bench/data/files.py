"""Finding dataset files in a ``--data DIR``: the file itself, gzipped, or in the
sub-folder that the usual archives unpack to."""

from __future__ import annotations

import gzip
from collections.abc import Sequence
from pathlib import Path

from sakura_bench.errors import BenchError

__all__ = ["find_file", "read_bytes"]


def find_file(data_dir: str | Path, names: Sequence[str], subdirs: Sequence[str] = ()) -> Path:
    """The first of ``names`` (or ``name.gz``) found in ``data_dir`` or one of its
    ``subdirs``; BenchError listing where it looked."""
    root = Path(data_dir)
    if not root.is_dir():
        raise BenchError(f"--data {str(data_dir)!r} is not a directory")
    tried = []
    for folder in [root, *(root / s for s in subdirs)]:
        for name in names:
            for candidate in (folder / name, folder / f"{name}.gz"):
                tried.append(candidate)
                if candidate.is_file():
                    return candidate
    raise BenchError(
        f"--data {str(data_dir)!r}: none of {', '.join(names)} found (looked for "
        f"{', '.join(str(p.relative_to(root)) for p in tried)})"
    )


def read_bytes(path: Path) -> bytes:
    """The file's bytes, decompressed when it ends in ``.gz``."""
    if path.suffix == ".gz":
        with gzip.open(path, "rb") as f:
            return f.read()
    return path.read_bytes()
