"""Checkpoint directories on disk: atomic writes, manifests, retention, verified loading.

Layout: one directory per checkpoint under the checkpoint root::

    ckpt/
      step-0000000120-epoch-0002/
        state.pt              (state.safetensors, checkpoint.ckpt; ".zst" when compressed)
        manifest.json         step, epoch, metric, format, sha256 and size of every file,
                              and the sha256 of the manifest itself
      .step-...-epoch-....<random>.tmp/   a write in progress (or abandoned by a crash)

A write builds the directory under a temporary name with
:func:`sakura.fileio.atomic_directory`: the state file is written, the manifest (written
last), every file and the directory fsynced, the directory renamed to its final name and
the root fsynced.  A crash at any moment leaves either the complete checkpoint or an
ignored temporary directory, never a partial checkpoint under a final name; the writer
holds a lock on its temporary directory until after the rename, so the next start removes
the temporaries of dead writers (:func:`remove_stale_temporaries`).  Retention runs only
after the new checkpoint is durable, counts only checkpoints whose files verify, and
deletes only checkpoints older than the oldest one it keeps.

The manifest protects itself: ``manifest_sha256`` is the SHA-256 of its canonical JSON
(sorted keys, no spaces) without that key.  A checkpoint is complete only when its
manifest is intact, lists the state file, and names the same step and epoch as the
directory.  Loaders (:func:`load_latest`, :func:`load_best`) also check every file against
its size and SHA-256, and skip anything incomplete or corrupt with a warning; a state file
that matches its checksums but does not decode (a forged checkpoint) is skipped the same way.

Long file: one on-disk protocol (write, writer lock, retention, scan, verify, load) whose
crash-safety invariants interlock: retention counts what the scan verifies, the cleaner
trusts the writer's lock, loaders re-scan what retention removes. Kept together so one
crash case can be checked in one place.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import math
import os
import re
import shutil
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from sakura.errors import add_note
from sakura.fileio import atomic_directory, fsync_dir
from sakura.options import check_choice
from sakura_async.checkpoint.encoding import FORMATS, main_file, read_state, write_state
from sakura_async.errors import CheckpointError

__all__ = [
    "MANIFEST",
    "Checkpoint",
    "find_checkpoints",
    "load_best",
    "load_latest",
    "manifest_digest",
    "remove_stale_temporaries",
    "verify",
    "write_checkpoint",
]

logger = logging.getLogger("sakura.async")

MANIFEST = "manifest.json"
MANIFEST_VERSION = 2
_DIGEST_KEY = "manifest_sha256"
_WRITER = ".sakura-writer"
"""Inside a directory being written: a file its writer holds an exclusive ``flock`` on from
the start of the write until after the rename (the OS releases it when the writer dies),
holding the writer's pid for people reading the directory."""
_DOOMED = ".deleting-"
_NAME = re.compile(r"step-(\d+)-epoch-(\d+)(?:\.(\d+))?\Z")
_TEMPORARY = re.compile(r"\.step-\d+-epoch-\d+(?:\.\d+)?\..*\.tmp\Z")
_WARNED: dict[str, str] = {}
_WARNED_LOCK = threading.Lock()
_RESCANS = 1000
"""How many times a loader lists the directory again when the checkpoints it picked were
removed by retention while it read them (each removal means a newer one exists)."""


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


# --- the manifest -------------------------------------------------------------------------


def manifest_digest(manifest: dict[str, Any]) -> str:
    """SHA-256 of the manifest's canonical JSON, without its own ``manifest_sha256``."""
    body = {k: v for k, v in manifest.items() if k != _DIGEST_KEY}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def _plain_name(name: Any) -> bool:
    return (
        isinstance(name, str)
        and name not in ("", ".", "..", MANIFEST)
        and os.path.basename(name) == name
        and "/" not in name
        and "\\" not in name
    )


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_manifest(manifest: Any, dirname: str) -> str | None:
    """None when ``manifest`` is a complete, intact manifest for directory ``dirname``;
    else what is wrong."""
    if not isinstance(manifest, dict):
        return "manifest.json does not hold an object"
    version = manifest.get("sakura_checkpoint")
    if version != MANIFEST_VERSION:
        return (
            f"manifest version {version!r} is not supported (this version reads {MANIFEST_VERSION})"
        )
    if manifest.get(_DIGEST_KEY) != manifest_digest(manifest):
        return "manifest.json does not match its own sha256 (changed or corrupt)"
    if manifest.get("format") not in FORMATS:
        return f"unknown format {manifest.get('format')!r}"
    files, main = manifest.get("files"), manifest.get("main")
    if not isinstance(files, dict) or not files:
        return "the manifest lists no files"
    if not _plain_name(main) or main not in files:
        return f"the state file {main!r} is not listed in the manifest"
    for name, info in files.items():
        if not _plain_name(name):
            return f"the manifest lists a file outside the checkpoint: {name!r}"
        if (
            not isinstance(info, dict)
            or not isinstance(info.get("sha256"), str)
            or isinstance(info.get("bytes"), bool)
            or not isinstance(info.get("bytes"), int)
        ):
            return f"the manifest entry of {name!r} has no sha256 and size"
    metric, created = manifest.get("metric"), manifest.get("created_unix", 0.0)
    if metric is not None and not isinstance(metric, dict):
        return f"the manifest's metric {metric!r} is not an object"
    if not _number(created):
        return f"the manifest's created_unix {created!r} is not a number"
    step, epoch = manifest.get("step"), manifest.get("epoch")
    match = _NAME.match(dirname)
    if (
        match is None
        or not _integer(step)
        or not _integer(epoch)
        or int(match.group(1)) != step
        or int(match.group(2)) != epoch
    ):
        return f"the directory name does not match the manifest's step {step!r} and epoch {epoch!r}"
    return None


# --- writing ------------------------------------------------------------------------------


def _final_name(root: str, step: int, epoch: int) -> str:
    base = f"step-{step:010d}-epoch-{epoch:04d}"
    name, n = base, 0
    while os.path.lexists(os.path.join(root, name)):
        n += 1
        name = f"{base}.{n}"
    return name


def _name_taken(error: OSError, final: str) -> bool:
    """A rename onto a directory another writer created meanwhile."""
    taken = isinstance(error, FileExistsError) or error.errno in (errno.EEXIST, errno.ENOTEMPTY)
    return taken and os.path.isdir(final)


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

    This is what AsyncCheckpoint runs on its dispatcher; it is usable on its own.  An
    ``OSError`` (a full disk, a directory that cannot be written) carries a note naming
    ``dir`` and the checkpoint; nothing older is touched when a write fails.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    try:
        os.makedirs(root, exist_ok=True)
        final = _write_new(root, state, format, step, epoch, metric, compress, extra)
    except OSError as exc:
        add_note(
            exc,
            f"AsyncCheckpoint: dir={root!r}: writing the checkpoint of step {step} failed "
            f"({exc.strerror or exc}); the checkpoints already there are untouched",
        )
        raise
    fsync_dir(root)
    if keep is not None:
        _retain(root, keep, newest=final)
    return final


def _write_new(
    root: str,
    state: Any,
    format: str,
    step: int,
    epoch: int,
    metric: dict[str, Any] | None,
    compress: int | None,
    extra: dict[str, Any] | None,
) -> str:
    for _ in range(100):
        final = os.path.join(root, _final_name(root, step, epoch))
        lock = -1
        try:
            with atomic_directory(final) as tmp:
                lock = _lock_new(str(tmp))
                file_name = main_file(format, compress)
                with open(os.path.join(tmp, file_name), "wb") as f:
                    hashing = write_state(state, f, format, compress)
                manifest: dict[str, Any] = {
                    "sakura_checkpoint": MANIFEST_VERSION,
                    "format": format,
                    "step": int(step),
                    "epoch": int(epoch),
                    "metric": metric,
                    "created_unix": time.time(),
                    "compression": "zstd" if compress else None,
                    "main": file_name,
                    "files": {
                        file_name: {"sha256": hashing.sha256.hexdigest(), "bytes": hashing.bytes}
                    },
                    "extra": extra or {},
                }
                manifest[_DIGEST_KEY] = manifest_digest(manifest)
                with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:
                    json.dump(manifest, f, indent=1, sort_keys=True)
                # atomic_directory fsyncs the files, renames, fsyncs root: still locked.
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(final, _WRITER))  # a leftover one is harmless
            return final
        except _Claimed:
            continue  # a cleaner took the fresh temporary before we locked it: start again
        except OSError as exc:
            if not _name_taken(exc, final):
                raise
            # Another writer took the name between our choice and our rename: next name.
        finally:
            if lock >= 0:
                os.close(lock)  # releases the lock, after the rename
    raise CheckpointError(f"could not find a free checkpoint name under {root}")


def _retain(root: str, keep: int, *, newest: str) -> None:
    """Keep the ``keep`` newest *verified* checkpoints up to ``newest`` (the just-written
    one counts once it verifies) and delete the complete checkpoints older than the oldest
    of them.  A checkpoint whose files fail verification is never counted: it stays while
    it is newer than the oldest kept one (loaders skip it) and goes with the others once it
    is older.  With fewer than ``keep`` verified checkpoints nothing is deleted, so the
    newest verified one always survives.  Never touches anything newer than ``newest``."""
    found = find_checkpoints(root, verify=False)
    names = [c.path for c in found]
    if newest not in names:
        return
    older = found[: names.index(newest) + 1]  # nothing after the new one is touched
    verified = 0
    for cut in range(len(older) - 1, -1, -1):
        verified += _intact(older[cut])
        if verified == keep:
            break
    else:
        return
    for old in older[:cut]:
        # Rename first so a crash mid-delete never leaves a half-deleted "complete" one.
        doomed = os.path.join(root, f"{_DOOMED}{os.path.basename(old.path)}-{os.getpid()}")
        try:
            os.rename(old.path, doomed)
        except OSError:
            continue
        shutil.rmtree(doomed, ignore_errors=True)
    fsync_dir(root)


def _intact(ckpt: Checkpoint) -> bool:
    """Whether every file of ``ckpt`` matches its manifest (a corrupt one is warned about;
    one that another writer's retention removed meanwhile is just not intact)."""
    try:
        problem = _problem(ckpt)
    except _Vanished:
        return False
    if problem is not None:
        _warn_skipped(ckpt.path, problem)
    return problem is None


class _Claimed(Exception):
    """A cleaner claimed a writer's fresh temporary directory before the writer locked it."""


def _same_file(fd: int, path: str) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except OSError:
        return False


def _lock_new(tmp: str) -> int:
    """Create the writer marker in the fresh temporary directory ``tmp`` and lock it; the
    returned descriptor holds the lock until it is closed (after the rename) or the process
    dies.  Raises :class:`_Claimed` when a cleaner got to ``tmp`` first."""
    marker = os.path.join(tmp, _WRITER)
    try:
        fd = os.open(marker, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    except (FileExistsError, FileNotFoundError) as exc:
        raise _Claimed(tmp) from exc
    try:
        # Only a cleaner that found the marker before we locked it can hold the lock.
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, str(os.getpid()).encode("ascii"))
    except BlockingIOError as exc:
        os.close(fd)
        raise _Claimed(tmp) from exc
    except BaseException:
        os.close(fd)
        raise
    return fd


def remove_stale_temporaries(root: str) -> list[str]:
    """Remove what interrupted writers left under ``root``: directories being built by a
    writer that is no longer alive, and checkpoints that retention was deleting.

    A writer holds a lock (``flock``) on the directory it builds from its first step until
    after the rename, and the OS releases it when the writer dies, so a temporary directory
    whose lock is free belongs to a dead writer, whatever step it died at.  One that has no
    marker yet (its writer died right after creating it, or is just starting) is claimed by
    creating the marker: a writer that finds its marker taken starts a fresh directory.
    A live writer's directory is never removed.
    """
    removed: list[str] = []
    if not os.path.isdir(root):
        return removed
    for entry in os.listdir(root):
        path = os.path.join(root, entry)
        if entry.startswith(_DOOMED):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(entry)
        elif _TEMPORARY.match(entry):
            lock = _lock_abandoned(path)
            if lock is None:
                continue
            try:  # removed while we hold the lock: a writer starting on it sees _Claimed
                shutil.rmtree(path, ignore_errors=True)
            finally:
                os.close(lock)
            removed.append(entry)
    return removed


def _lock_abandoned(path: str) -> int | None:
    """A descriptor holding the lock of temporary directory ``path`` when its writer is
    dead; None when a writer holds it (or the directory was renamed or removed)."""
    marker = os.path.join(path, _WRITER)
    try:
        fd = os.open(marker, os.O_RDWR)
    except FileNotFoundError:
        try:  # no marker: claim the directory (a writer creating it now gets EEXIST)
            fd = os.open(marker, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError:  # the writer created it just now, or the directory is gone
            return None
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None  # its writer is alive
    except BaseException:
        os.close(fd)
        raise
    try:
        pid = int(os.pread(fd, 32, 0).strip() or -1)
    except (OSError, ValueError):
        pid = -1
    # Still this directory's marker (not renamed to a checkpoint meanwhile), and not a
    # writer of this process (where flock is per process, as on NFS, its lock is ours).
    if not _same_file(fd, marker) or pid == os.getpid():
        os.close(fd)
        return None
    return fd


# --- reading ------------------------------------------------------------------------------


def _warn_skipped(path: str, problem: str) -> None:
    """Warn that a checkpoint is skipped, once per checkpoint and problem (retention lists
    the directory at every write; a damaged checkpoint would otherwise warn each time)."""
    with _WARNED_LOCK:
        if _WARNED.get(path) == problem:
            return
        if len(_WARNED) >= 4096:
            _WARNED.clear()
        _WARNED[path] = problem
    logger.warning("sakura: skipping checkpoint %s: %s", path, problem)


class _Vanished(Exception):
    """A checkpoint was removed (by retention) while it was being read."""


def _read_manifest(path: str) -> dict[str, Any]:
    """The checked manifest of checkpoint directory ``path``.  Raises :class:`_Vanished`
    when the directory is gone, ``ValueError`` saying what is wrong otherwise."""
    try:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        if not os.path.isdir(path):
            raise _Vanished(path) from exc
        if isinstance(exc, FileNotFoundError):
            raise ValueError("it has no manifest.json") from exc
        raise ValueError(f"its manifest.json cannot be read ({exc})") from exc
    try:
        manifest = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"its manifest.json is not valid JSON ({exc})") from exc
    problem = _check_manifest(manifest, os.path.basename(path))
    if problem is not None:
        raise ValueError(problem)
    return manifest  # type: ignore[no-any-return]


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _problem(checkpoint: Checkpoint) -> str | None:
    """:func:`verify`, raising :class:`_Vanished` when the directory itself is gone."""
    for name, info in checkpoint.manifest["files"].items():
        file = os.path.join(checkpoint.path, name)
        try:
            size = os.path.getsize(file)
            if size != info.get("bytes"):
                return f"{name} has {size} bytes, the manifest says {info.get('bytes')}"
            if _sha256(file) != info.get("sha256"):
                return f"{name} does not match its sha256 in the manifest"
        except OSError as exc:
            if not os.path.isdir(checkpoint.path):
                raise _Vanished(checkpoint.path) from exc
            return f"{name} is missing or unreadable ({exc})"
    return None


def verify(checkpoint: Checkpoint) -> str | None:
    """None when every file matches the manifest; else what is wrong."""
    try:
        return _problem(checkpoint)
    except _Vanished:
        return f"{checkpoint.path} was removed"


def _scan(root: str) -> tuple[list[Checkpoint], bool]:
    """Complete checkpoints under ``root`` oldest first, and whether one vanished while
    listing.  Incomplete ones are skipped with a warning."""
    found: list[Checkpoint] = []
    vanished = False
    try:
        entries = os.listdir(root)
    except FileNotFoundError:
        return found, False
    for entry in entries:
        if entry.startswith(".") or not _NAME.match(entry):
            continue
        path = os.path.join(root, entry)
        try:
            manifest = _read_manifest(path)
        except _Vanished:
            vanished = True
            continue
        except ValueError as exc:
            _warn_skipped(path, str(exc))
            continue
        found.append(
            Checkpoint(
                path=path,
                file=os.path.join(path, manifest["main"]),
                format=manifest["format"],
                step=manifest["step"],
                epoch=manifest["epoch"],
                metric=manifest.get("metric"),
                manifest=manifest,
            )
        )
    found.sort(key=lambda c: (c.step, c.manifest.get("created_unix", 0.0), c.path))
    return found, vanished


def find_checkpoints(root: str | os.PathLike[str], *, verify: bool = False) -> list[Checkpoint]:
    """Complete checkpoints under ``root``, oldest first (by step, then write time).

    A directory whose manifest is missing, unreadable, changed, or does not match the
    directory is left out with a warning.  With ``verify=True``, those whose files do not
    match their manifest are left out too (reading every file).
    """
    found, _ = _scan(os.fspath(root))
    if verify:
        found = [c for c in found if _verify_quiet(c)]
    return found


def _verify_quiet(ckpt: Checkpoint) -> bool:
    problem = verify(ckpt)
    if problem:
        _warn_skipped(ckpt.path, problem)
    return problem is None


def _load(ckpt: Checkpoint, map_location: Any, weights_only: bool) -> Checkpoint | None:
    """``ckpt`` with its state loaded; None when it is corrupt (warned).  Raises
    :class:`_Vanished` when retention removed it meanwhile."""
    problem = _problem(ckpt)
    if problem is not None:
        _warn_skipped(ckpt.path, problem)
        return None
    try:
        ckpt.state = read_state(
            ckpt.file, ckpt.format, map_location=map_location, weights_only=weights_only
        )
    except FileNotFoundError as exc:
        raise _Vanished(ckpt.path) from exc
    except CheckpointError as exc:  # checksums match, content does not decode: forged
        if not os.path.isdir(ckpt.path):
            raise _Vanished(ckpt.path) from exc
        _warn_skipped(ckpt.path, f"its state does not decode: {exc}")
        return None
    return ckpt


def _load_first(
    root: str,
    order: Any,
    map_location: Any,
    weights_only: bool,
) -> Checkpoint | None:
    """Load the first loadable checkpoint of ``order(found)``.  When one the loader picked
    was removed meanwhile (retention, after a newer one became durable), the directory is
    listed again, so a reader never misses the checkpoint that replaced it."""
    for _ in range(_RESCANS):
        found, vanished = _scan(root)
        try:
            for ckpt in order(found):
                loaded = _load(ckpt, map_location, weights_only)
                if loaded is not None:
                    return loaded
        except _Vanished:
            continue
        if not vanished:
            return None
    raise CheckpointError(
        f"checkpoints under {root} kept being replaced while they were read "
        f"({_RESCANS} attempts); is a writer with a very short interval running?"
    )


def load_latest(
    root: str | os.PathLike[str], *, map_location: Any = "cpu", weights_only: bool = True
) -> Checkpoint | None:
    """The newest complete checkpoint under ``root`` with its state loaded, or None.

    Checksums are verified; an incomplete or corrupt checkpoint is skipped (with a
    warning) in favour of the previous one.  Safe while a writer adds checkpoints and
    retention removes old ones.  ``weights_only=True`` loads without unpickling arbitrary
    objects.
    """
    return _load_first(os.fspath(root), lambda found: reversed(found), map_location, weights_only)


def _metric_number(ckpt: Checkpoint) -> float | None:
    value = ckpt.metric_value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return None  # NaN never ranks: it compares false with everything
    return float(value)


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
    "max") overrides the mode stored in the manifests.  Checkpoints whose metric is NaN
    (or not a number) are never chosen.
    """
    if mode is not None:
        check_choice("mode", mode, ("min", "max"), owner="load_best")

    def order(found: list[Checkpoint]) -> list[Checkpoint]:
        scored = [
            c
            for c in found
            if _metric_number(c) is not None
            and isinstance(c.metric, dict)
            and (metric is None or c.metric.get("name") == metric)
        ]
        if not scored:
            return []
        names = {str(c.metric["name"]) for c in scored if c.metric is not None}
        if len(names) > 1:
            raise CheckpointError(
                f"checkpoints under {os.fspath(root)} record different metrics {sorted(names)}; "
                f"pass metric="
            )
        last = scored[-1].metric or {}
        sign = 1.0 if (mode or last.get("mode", "min")) == "min" else -1.0
        # Best first; among equals the newest.
        return sorted(scored, key=lambda c: (sign * (_metric_number(c) or 0.0), -c.step))

    return _load_first(os.fspath(root), order, map_location, weights_only)


def describe_dir(root: str) -> str:
    with contextlib.suppress(OSError):
        return ", ".join(sorted(os.listdir(root))) or "empty"
    return "missing"
