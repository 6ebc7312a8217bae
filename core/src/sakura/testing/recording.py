"""A service that records every event it receives, for tests."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from typing import Any

from sakura.events import Event

__all__ = ["RecordingService"]


class RecordingService:
    """Records each event (``events``) and the names in order (``names``).

    ``event_types`` limits what it subscribes to; ``fail_on`` names events (class names)
    on which it raises RuntimeError, to exercise failure isolation.
    """

    def __init__(
        self,
        name: str = "recorder",
        priority: float = 100,
        *,
        event_types: Collection[type[Event]] | None = None,
        fail_on: Collection[str] = (),
    ) -> None:
        self.name = name
        self.priority = priority
        self.event_types = event_types
        self.fail_on = frozenset(fail_on)
        self.events: list[Event] = []

    @property
    def names(self) -> list[str]:
        return [type(e).__name__ for e in self.events]

    def counts(self) -> Counter[str]:
        return Counter(self.names)

    def of(self, event_type: type[Event]) -> list[Any]:
        return [e for e in self.events if type(e) is event_type]

    def on_event(self, event: Event) -> None:
        self.events.append(event)
        if type(event).__name__ in self.fail_on:
            raise RuntimeError(f"{self.name} was told to fail on {type(event).__name__}")

    def __repr__(self) -> str:
        return f"<RecordingService {self.name!r}: {len(self.events)} events>"
