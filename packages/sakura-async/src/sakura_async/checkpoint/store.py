"""Checkpoint directories on disk: atomic writes, manifests, retention, verified loading.

Layout: one directory per checkpoint under the checkpoint root::

    ckpt/
      step-0000000120-epoch-0002/
        state.pt              (state.safetensors, checkpoint.ckpt; ".zst" when compressed)
        manifest.json         step, epoch, metric, format, sha256 and size of every file
      .tmp-step-...-<pid>-<random>/   a write in progress (or abandoned by a crash)

A write goes to a temporary directory: the state file is written and fsynced, then the
manifest (written and fsynced last), then the directory itself is fsynced, renamed to its
final name, and the root directory fsynced.  A crash at any moment leaves either the
complete checkpoint or an ignored ``.tmp-`` directory, never a partial checkpoint under a
final name.  Retention runs only after the new checkpoint is durable, and deletes only
checkpoints older than it.  Loaders (:func:`load_latest`, :func:`load_best`) check every
file against the manifest's sha256 and skip anything incomplete or corrupt.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import time
from dataclasses import dataclass, field
from typing import Any

from sakura_async.checkpoint.formats import FORMATS, main_file, read_state, write_state
from sakura_async.errors import CheckpointError

__all__ = [
    "MANIFEST",
    "Checkpoint",
    "find_checkpoints",
    "load_best",
    "load_latest",
    "remove_stale_temporaries",
    "verify",
    "write_checkpoint",
]

logger = logging.getLogger("sakura.async")

MANIFEST = "manifest.json"
MANIFEST_VERSION = 1
_TMP_PREFIX = ".tmp-"
_NAME = re.compile(r"step-(\d+)-epoch-(\d+)(?:\.(\d+))?\Z")


@dataclass
class Checkpoint:
    """A complete checkpoint directory (and, once loaded, its state)."""

    path: str
    """The checkpoint directory."""
    file: str
    """The state file (pass it to ``lightning.Trainer.fit(ckpt_path=...)`` for the
    ``lightning`` format)."""
    format: str
    step: int
    epoch: int
    metric: dict[str, Any] | None
    """``{"name": ..., "value": ..., "mode": "min"|"max"}`` or None."""
    manifest: dict[str, Any] = field(repr=False)
    state: Any = field(default=None, repr=False)
    """The loaded state tree (None until loaded)."""

    @property
    def metric_value(self) -> float | None:
        return None if self.metric is None else self.metric.get("value")


# --- writing ------------------------------------------------------------------------------


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _final_name(root: str, step: int, epoch: int) -> str:
    base = f"step-{step:010d}-epoch-{epoch:04d}"
    name, n = base, 0
    while os.path.exists(os.path.join(root, name)):
        n += 1
        name = f"{base}.{n}"
    return name


def write_checkpoint(
    root: str,
    state: Any,
    *,
    format: str = "torch",
    step: int = 0,
    epoch: int = 0,
    metric: dict[str, Any] | None = None,
    keep: int | None = None,
    compress: int | None = None,
    extra: dict[str, Any] | None = None,
) -> str:
    """Write ``state`` as a new checkpoint under ``root`` atomically; apply retention
    (``keep`` newest complete checkpoints) once it is durable.  Returns its directory.

    This is what AsyncCheckpoint runs on its dispatcher; it is usable on its own.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    os.makedirs(root, exist_ok=True)
    name = _final_name(root, step, epoch)
    tmp = os.path.join(root, f"{_TMP_PREFIX}{name}-{os.getpid()}-{secrets.token_hex(4)}")
    os.mkdir(tmp)
    try:
        file_name = main_file(format, compress)
        with open(os.path.join(tmp, file_name), "wb") as f:
            hashing = write_state(state, f, format, compress)
            f.flush()
            os.fsync(f.fileno())
        manifest = {
            "sakura_checkpoint": MANIFEST_VERSION,
            "format": format,
            "step": int(step),
            "epoch": int(epoch),
            "metric": metric,
            "created_unix": time.time(),
            "compression": "zstd" if compress else None,
            "main": file_name,
            "files": {file_name: {"sha256": hashing.sha256.hexdigest(), "bytes": hashing.bytes}},
            "extra": extra or {},
        }
        with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        for _ in range(100):
            final = os.path.join(root, name)
            try:
                os.rename(tmp, final)  # fails if another writer took the name meanwhile
                break
            except OSError:
                if not os.path.exists(final):
                    raise
                name = _final_name(root, step, epoch)
        else:
            raise CheckpointError(f"could not find a free checkpoint name under {root}")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(root)
    if keep is not None:
        _retain(root, keep, newest=final)
    return final


def _retain(root: str, keep: int, *, newest: str) -> None:
    """Delete complete checkpoints older than the ``keep`` newest (the just-written one,
    already durable, counts).  Never deletes anything newer than ``newest``."""
    found = find_checkpoints(root, verify=False)
    names = [c.path for c in found]
    if newest not in names:
        return
    cutoff = names.index(newest) + 1  # nothing after the new one is touched
    older = found[:cutoff]
    for old in older[: max(0, len(older) - keep)]:
        # Rename first so a crash mid-delete never leaves a half-deleted "complete" one.
        doomed = os.path.join(root, f"{_TMP_PREFIX}deleting-{os.path.basename(old.path)}")
        try:
            os.rename(old.path, doomed)
        except OSError:
            continue
        shutil.rmtree(doomed, ignore_errors=True)
    _fsync_dir(root)


def remove_stale_temporaries(root: str) -> list[str]:
    """Remove ``.tmp-`` directories left by writers that are no longer alive."""
    removed: list[str] = []
    if not os.path.isdir(root):
        return removed
    for entry in os.listdir(root):
        if not entry.startswith(_TMP_PREFIX):
            continue
        match = re.search(r"-(\d+)-[0-9a-f]{8}\Z", entry)
        pid = int(match.group(1)) if match else None
        if pid is not None and pid != os.getpid() and _alive(pid):
            continue
        if pid == os.getpid():
            continue
        shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
        removed.append(entry)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --- reading ------------------------------------------------------------------------------


def _read_manifest(path: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("sakura_checkpoint") != MANIFEST_VERSION:
        return None
    if manifest.get("format") not in FORMATS or not isinstance(manifest.get("files"), dict):
        return None
    return manifest


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def verify(checkpoint: Checkpoint) -> str | None:
    """None when every file matches the manifest; else what is wrong."""
    for name, info in checkpoint.manifest["files"].items():
        file = os.path.join(checkpoint.path, name)
        try:
            size = os.path.getsize(file)
        except OSError:
            return f"{name} is missing"
        if size != info.get("bytes"):
            return f"{name} has {size} bytes, the manifest says {info.get('bytes')}"
        if _sha256(file) != info.get("sha256"):
            return f"{name} does not match its sha256 in the manifest"
    return None


def find_checkpoints(root: str, *, verify: bool = False) -> list[Checkpoint]:
    """Complete checkpoints under ``root``, oldest first (by step, then write time).

    With ``verify=True``, those whose files do not match their manifest are left out
    (reading every file).
    """
    found: list[Checkpoint] = []
    if not os.path.isdir(root):
        return found
    for entry in os.listdir(root):
        if entry.startswith(".") or not _NAME.match(entry):
            continue
        path = os.path.join(root, entry)
        manifest = _read_manifest(path)
        if manifest is None:
            continue
        ckpt = Checkpoint(
            path=path,
            file=os.path.join(path, manifest["main"]),
            format=manifest["format"],
            step=int(manifest["step"]),
            epoch=int(manifest["epoch"]),
            metric=manifest.get("metric"),
            manifest=manifest,
        )
        found.append(ckpt)
    found.sort(key=lambda c: (c.step, c.manifest.get("created_unix", 0.0), c.path))
    if verify:
        found = [c for c in found if _verify_quiet(c)]
    return found


def _verify_quiet(ckpt: Checkpoint) -> bool:
    problem = verify(ckpt)
    if problem:
        logger.warning("sakura: skipping checkpoint %s: %s", ckpt.path, problem)
    return problem is None


def _load(ckpt: Checkpoint, map_location: Any, weights_only: bool) -> Checkpoint | None:
    problem = verify(ckpt)
    if problem is not None:
        logger.warning("sakura: skipping checkpoint %s: %s", ckpt.path, problem)
        return None
    try:
        ckpt.state = read_state(
            ckpt.file, ckpt.format, map_location=map_location, weights_only=weights_only
        )
    except FileNotFoundError:
        return None  # removed by retention while we read it
    return ckpt


def load_latest(
    root: str | os.PathLike[str], *, map_location: Any = "cpu", weights_only: bool = True
) -> Checkpoint | None:
    """The newest complete checkpoint under ``root`` with its state loaded, or None.

    Checksums are verified; an incomplete or corrupt checkpoint is skipped (with a
    warning) in favour of the previous one.  ``weights_only=True`` loads without
    unpickling arbitrary objects.
    """
    root = os.fspath(root)
    for ckpt in reversed(find_checkpoints(root)):
        loaded = _load(ckpt, map_location, weights_only)
        if loaded is not None:
            return loaded
    return None


def load_best(
    root: str | os.PathLike[str],
    *,
    metric: str | None = None,
    mode: str | None = None,
    map_location: Any = "cpu",
    weights_only: bool = True,
) -> Checkpoint | None:
    """The complete checkpoint with the best recorded metric, with its state loaded, or
    None when no checkpoint records one.

    ``metric`` restricts to checkpoints that recorded that metric name; ``mode`` ("min" or
    "max") overrides the mode stored in the manifests.
    """
    if mode is not None and mode not in ("min", "max"):
        raise ValueError(f"mode must be 'min', 'max' or None, got {mode!r}")
    root = os.fspath(root)
    scored = []
    for ckpt in find_checkpoints(root):
        m = ckpt.metric
        if not m or m.get("value") is None or (metric is not None and m.get("name") != metric):
            continue
        scored.append(ckpt)
    if not scored:
        return None
    names = {c.metric["name"] for c in scored}  # type: ignore[index]
    if len(names) > 1:
        raise CheckpointError(
            f"checkpoints under {root} record different metrics {sorted(names)}; pass metric="
        )
    chosen_mode = mode or scored[-1].metric.get("mode", "min")  # type: ignore[union-attr]
    sign = 1.0 if chosen_mode == "min" else -1.0
    # Best first; among equals the newest.
    scored.sort(key=lambda c: (sign * float(c.metric["value"]), -c.step))  # type: ignore[index]
    for ckpt in scored:
        loaded = _load(ckpt, map_location, weights_only)
        if loaded is not None:
            return loaded
    return None


def describe_dir(root: str) -> str:
    with contextlib.suppress(OSError):
        return ", ".join(sorted(os.listdir(root))) or "empty"
    return "missing"
