"""Telemetry: a JSON-lines sink with one line per event.

Per event it stores a small tuple in memory: the event name, rank, step, epoch, wall time
and the event's *scalar* fields (numbers, strings, one-element tensors, and mappings of
those such as ``metrics``).  Objects (models, batches, optimizers) are never kept.

One-element tensors (a loss) are kept detached and only turned into Python numbers when
the buffer is written, at epoch end, at exit, or when ``max_buffer`` lines accumulate:
reading ``loss.item()`` per step would force a host-device sync on the training path.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import fields
from pathlib import Path
from typing import IO, Any

from sakura.events import EVENT_TYPES, Event, OnEpochEnd, OnError, event_type
from sakura.service import Service

__all__ = ["Telemetry", "summarize"]

_SKIP = frozenset(
    {
        "rank",
        "world_size",
        "step",
        "epoch",
        "model",
        "optimizer",
        "batch",
        "train_loader",
        "trainer",
        "loop",
        "outputs",
        "checkpoint",
    }
)
_SCALARS = (bool, int, float, str, type(None))
# One encoder for every line: json.dumps(..., default=str) builds a new one per call.
_ENCODE = json.JSONEncoder(default=str).encode


_RENAMED = {"event": "failed_event"}  # OnError.event would clash with the line's "event" key


def _plan(cls: type[Event]) -> tuple[tuple[str, str], ...]:
    """(attribute, JSON key) of the fields of ``cls`` that telemetry may write."""
    return tuple((f.name, _RENAMED.get(f.name, f.name)) for f in fields(cls) if f.name not in _SKIP)


_PLANS: dict[type[Event], tuple[tuple[str, str], ...]] = {cls: _plan(cls) for cls in EVENT_TYPES}


def _capture(value: Any) -> Any:
    """What to keep of a field now (cheap, no device sync); ``_MISSING`` to drop it."""
    if isinstance(value, _SCALARS):
        return value
    numel = getattr(value, "numel", None)  # tensors first: the common case on the step path
    if numel is not None and callable(numel):
        try:
            if numel() == 1:
                return value.detach()
        except Exception:  # noqa: S110 - not a tensor after all
            pass
        return _MISSING
    if isinstance(value, Mapping):
        kept = {}
        for key, item in value.items():
            captured = _capture(item)
            if captured is not _MISSING and not isinstance(captured, dict):
                kept[str(key)] = captured
        return kept
    if isinstance(value, BaseException):
        return f"{type(value).__name__}: {value}"
    if isinstance(value, Event):
        return type(value).__name__
    if hasattr(value, "item") and getattr(value, "shape", None) == ():  # numpy scalar
        return value.item()
    return _MISSING


_MISSING: Any = object()


def _materialise(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _materialise(v) for k, v in value.items()}
    if isinstance(value, _SCALARS):
        if isinstance(value, float) and not math.isfinite(value):
            return str(value)
        return value
    item = value.item()  # detached one-element tensor: the sync happens here, once per flush
    if isinstance(item, float) and not math.isfinite(item):
        return str(item)
    return item


class Telemetry(Service):
    """Write every event (or the ``events`` chosen) to a JSON-lines file.

    Args:
        path: output file.  ``{rank}`` in it is replaced by the process's rank; in a
            multi-process run without ``{rank}`` the rank is appended to the file name
            so processes never write one file.
        events: event classes or names to record (default: all).
        max_buffer: write out once this many lines are buffered (bounds memory).
        append: append to an existing file instead of replacing it.
    """

    name = "telemetry"
    priority = 1000  # run after the services whose effects it records

    def __init__(
        self,
        path: str | os.PathLike[str] = "sakura-telemetry.jsonl",
        *,
        events: Collection[type[Event] | str] | None = None,
        max_buffer: int = 10_000,
        append: bool = False,
    ) -> None:
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise ValueError(f"path must be a non-empty file path, got {path!r}")
        if isinstance(max_buffer, bool) or not isinstance(max_buffer, int) or max_buffer < 1:
            raise ValueError(f"max_buffer must be a positive int, got {max_buffer!r}")
        if not isinstance(append, bool):
            raise ValueError(f"append must be a bool, got {append!r}")
        self.path_template = str(path)
        self.max_buffer = max_buffer
        self.append = append
        self.event_types: frozenset[type[Event]] | None = None
        if events is not None:
            if isinstance(events, str):
                events = [events]
            resolved = set()
            for item in events:
                if isinstance(item, str):
                    try:
                        resolved.add(event_type(item))
                    except KeyError as exc:
                        raise ValueError(f"events: {exc.args[0]}") from None
                elif isinstance(item, type) and issubclass(item, Event):
                    resolved.add(item)
                else:
                    raise ValueError(f"events must hold event classes or names, got {item!r}")
            if OnEpochEnd not in resolved:
                resolved.add(OnEpochEnd)  # needed to flush at epoch end; not written unless asked
                self._drop_epoch_end = True
            else:
                self._drop_epoch_end = False
            self.event_types = frozenset(resolved)
        else:
            self._drop_epoch_end = False
        self.path: Path | None = None
        self.counts: Counter[str] = Counter()
        self._buffer: list[tuple[str, int, int, int, float, dict[str, Any]]] = []
        self._file: IO[str] | None = None
        self._start = 0.0
        self._last: dict[str, Any] = {}

    # --- lifecycle ----------------------------------------------------------------------

    def setup(self, runtime: Any) -> None:
        template = self.path_template
        if "{rank}" in template:
            path = Path(template.format(rank=runtime.rank))
        elif runtime.world_size > 1:
            base = Path(template)
            path = base.with_name(f"{base.stem}.rank{runtime.rank}{base.suffix}")
        else:
            path = Path(template)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("a" if self.append else "w", encoding="utf-8")
        self._start = time.time()

    def drain(self) -> None:
        self.flush()

    def teardown(self) -> None:
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None

    # --- recording ------------------------------------------------------------------------

    def on_event(self, event: Event) -> None:
        cls = type(event)
        if cls is OnEpochEnd and self._drop_epoch_end:
            self.flush()
            return
        data = {}
        for attribute, key in _PLANS[cls]:
            captured = _capture(getattr(event, attribute))
            if captured is not _MISSING:
                data[key] = captured
        self._buffer.append((cls.__name__, event.rank, event.step, event.epoch, time.time(), data))
        if cls is OnEpochEnd or cls is OnError or len(self._buffer) >= self.max_buffer:
            self.flush()

    def flush(self) -> None:
        """Write the buffered lines and flush the file."""
        if not self._buffer:
            return
        if self._file is None:
            raise RuntimeError(
                "Telemetry has buffered events but no open file: install it on a runtime that "
                "is running (use `with SakuraRuntime() as rt:`)"
            )
        buffer, self._buffer = self._buffer, []
        lines = []
        for name, rank, step, epoch, wall, data in buffer:
            record = {"event": name, "rank": rank, "step": step, "epoch": epoch, "time": wall}
            values = {k: _materialise(v) for k, v in data.items()}
            record.update(values)
            self.counts[name] += 1
            if "loss" in values:
                self._last["loss"] = values["loss"]
            if values.get("metrics"):
                self._last.setdefault("metrics", {}).update(values["metrics"])
            lines.append(_ENCODE(record))
        self._file.write("\n".join(lines) + "\n")
        self._file.flush()

    def summary(self) -> dict[str, Any]:
        """Counts per event written so far, elapsed time, and the last loss and metrics."""
        return {
            "path": str(self.path) if self.path else None,
            "events": dict(self.counts),
            "total_events": sum(self.counts.values()),
            "elapsed_s": (time.time() - self._start) if self._start else 0.0,
            **self._last,
        }


def summarize(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Summarise a telemetry file: events per name, epochs, wall time, last loss/metrics."""
    counts: Counter[str] = Counter()
    first = last = None
    summary: dict[str, Any] = {}
    epochs: set[int] = set()
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not a JSON line ({exc})") from None
            counts[record["event"]] += 1
            first = record["time"] if first is None else first
            last = record["time"]
            epochs.add(record.get("epoch", 0))
            if "loss" in record:
                summary["last_loss"] = record["loss"]
            if record.get("metrics"):
                summary.setdefault("last_metrics", {}).update(record["metrics"])
    summary.update(
        events=dict(counts),
        total_events=sum(counts.values()),
        epochs=len(epochs),
        wall_s=(last - first) if first is not None and last is not None else 0.0,
    )
    return summary
