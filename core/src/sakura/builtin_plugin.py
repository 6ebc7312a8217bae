"""sakura-core's own plugin: what the core provides, registered the way any plugin is."""

from __future__ import annotations

from sakura.hookspecs import Register, hookimpl
from sakura.telemetry import Telemetry


@hookimpl
def sakura_register_services(register: Register) -> None:
    register("telemetry", Telemetry, description="JSON-lines event sink, one line per event")
