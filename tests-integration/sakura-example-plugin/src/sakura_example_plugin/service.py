"""EventLog: record the order of training events into a JSON file, and count optimizer steps."""

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sakura import (
    Event,
    OnEpochBegin,
    OnEpochEnd,
    OnError,
    OnOptimizerStep,
    OnTrainBegin,
    OnTrainEnd,
    OnValidationEnd,
    SakuraRuntime,
    Service,
)


class EventLog(Service):
    """Record the training events it receives, in order, and write them to a JSON file when
    the runtime stops.

    Args:
        path: the JSON file to write.  ``{rank}`` in it is replaced by the process's rank.

    The number of optimizer steps is checkpointed (``state_dict``), so a resumed run keeps
    counting where the saved one stopped.
    """

    name = "event_log"
    priority = 900  # after the services that change training, so it sees their effects

    def __init__(self, path: str | os.PathLike[str] = "sakura-events.json") -> None:
        if not isinstance(path, (str, os.PathLike)) or not str(path):
            raise ValueError(f"path must be a non-empty file path, got {path!r}")
        self.path_template = str(path)
        self.path: Path | None = None
        self.rank = 0
        self.optimizer_steps = 0
        self.events: list[dict[str, Any]] = []

    # --- lifecycle: acquire nothing in __init__, write the file once at the end ----------

    def setup(self, runtime: SakuraRuntime) -> None:
        self.rank = runtime.rank
        self.path = Path(self.path_template.replace("{rank}", str(runtime.rank)))
        self.events = []

    def teardown(self) -> None:
        if self.path is None:
            return
        record = {
            "service": self.name,
            "rank": self.rank,
            "optimizer_steps": self.optimizer_steps,
            "events": self.events,
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        os.replace(partial, self.path)  # atomic: a reader never sees half a file

    # --- event hooks: keep them cheap, they run on the training path ---------------------

    def _record(self, event: Event, **extra: Any) -> None:
        self.events.append(
            {"event": type(event).__name__, "step": event.step, "epoch": event.epoch, **extra}
        )

    def on_train_begin(self, event: OnTrainBegin) -> None:
        self._record(event)

    def on_epoch_begin(self, event: OnEpochBegin) -> None:
        self._record(event)

    def on_optimizer_step(self, event: OnOptimizerStep) -> None:
        self.optimizer_steps += 1
        self._record(event)

    def on_validation_end(self, event: OnValidationEnd) -> None:
        self._record(event)

    def on_epoch_end(self, event: OnEpochEnd) -> None:
        self._record(event)

    def on_train_end(self, event: OnTrainEnd) -> None:
        self._record(event)

    def on_error(self, event: OnError) -> None:
        self._record(event, source=event.source, error=repr(event.exception))

    # --- checkpointed state ----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer_steps": self.optimizer_steps}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        steps = state.get("optimizer_steps")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(
                f"event_log state must hold 'optimizer_steps' as an int >= 0, got {dict(state)!r}"
            )
        self.optimizer_steps = steps
