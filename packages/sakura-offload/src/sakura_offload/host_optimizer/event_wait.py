"""How a host thread waits for the GPU: checks an event for a while, then sleeps between checks.

The host optimizer waits for each gradient's copy off the GPU, hundreds of times a step.
CUDA's own ways are both poor for that: a spinning wait keeps a core at 100 % per waiting
thread, and a blocking wait (the thread sleeps until the driver wakes it) makes the wake-up
late and, on some laptops, lets the GPU clock down.  The default here is the middle way:
query the event for ``spin_us`` microseconds, then sleep ``sleep_us`` between queries.

``EventWait.from_env()`` reads the policy from the environment:

* ``SAKURA_OFFLOAD_EVENT_WAIT``: ``poll`` (default), ``spin`` (query without sleeping) or
  ``block`` (``event.synchronize()``: the driver's blocking wait);
* ``SAKURA_OFFLOAD_EVENT_SPIN_US`` (default 50) and ``SAKURA_OFFLOAD_EVENT_SLEEP_US``
  (default 100), for ``poll``.

Every wait but ``block`` is bounded by ``timeout_s`` (a GPU that has not finished one copy
in that long is hung, not slow): it raises :class:`TimeoutError` naming what it waited for.
An event is anything with ``query() -> bool`` and ``synchronize()``, as ``torch.cuda.Event``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from sakura.env import env_choice, env_int
from sakura.options import check_choice, check_int, check_number

__all__ = ["MODES", "Event", "EventWait"]

MODES = ("poll", "spin", "block")
MODE_ENV = "SAKURA_OFFLOAD_EVENT_WAIT"
SPIN_ENV = "SAKURA_OFFLOAD_EVENT_SPIN_US"
SLEEP_ENV = "SAKURA_OFFLOAD_EVENT_SLEEP_US"
_OWNER = "EventWait"


class Event(Protocol):
    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


@dataclass(frozen=True)
class EventWait:
    """A waiting policy (see the module docstring); ``wait(event)`` applies it."""

    mode: str = "poll"
    spin_us: int = 50
    sleep_us: int = 100
    timeout_s: float = 600.0

    def __post_init__(self) -> None:
        check_choice("mode", self.mode, MODES, owner=_OWNER)
        check_int("spin_us", self.spin_us, minimum=0, owner=_OWNER)
        check_int("sleep_us", self.sleep_us, minimum=1, owner=_OWNER)
        check_number("timeout_s", self.timeout_s, minimum=0.0, min_inclusive=False, owner=_OWNER)

    @classmethod
    def from_env(
        cls, *, environ: Mapping[str, str] | None = None, timeout_s: float = 600.0
    ) -> EventWait:
        """The policy the ``SAKURA_OFFLOAD_EVENT_*`` variables set (defaults when unset)."""
        return cls(
            mode=env_choice(MODE_ENV, MODES, "poll", environ=environ) or "poll",
            spin_us=env_int(SPIN_ENV, 50, minimum=0, environ=environ) or 0,
            sleep_us=env_int(SLEEP_ENV, 100, minimum=1, environ=environ) or 100,
            timeout_s=timeout_s,
        )

    def wait(self, event: Event, what: str = "a GPU event") -> int:
        """Return once ``event`` has completed; the number of sleeps it took (0 when it was
        done within the spin, or for ``spin`` / ``block``)."""
        if self.mode == "block":
            event.synchronize()
            return 0
        start = time.perf_counter()
        spin_until = start + self.spin_us * 1e-6
        deadline = start + self.timeout_s
        sleeps = 0
        while not event.query():
            now = time.perf_counter()
            if now > deadline:
                raise TimeoutError(
                    f"sakura-offload: {what} did not complete within {self.timeout_s:g} s "
                    f"({MODE_ENV}={self.mode}); the device looks hung"
                )
            if self.mode == "poll" and now >= spin_until:
                time.sleep(self.sleep_us * 1e-6)
                sleeps += 1
        return sleeps
