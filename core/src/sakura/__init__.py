"""sakura: the event bus, service registry and plugin system of the Sakura ecosystem.

``import sakura`` imports pluggy and the standard library only (never torch).
"""

from __future__ import annotations

from sakura import _removed
from sakura.errors import (
    ConfigError,
    InvalidServiceError,
    PluginConflictError,
    SakuraError,
    SpecError,
    UnknownNameError,
)
from sakura.events import *  # noqa: F403 - the event vocabulary is part of the top-level API
from sakura.events import EVENT_TYPES, Event
from sakura.hookspecs import hookimpl, hookspec
from sakura.runtime import HandlerError, SakuraRuntime
from sakura.service import Service
from sakura.specs import Spec, parse_spec
from sakura.step import STEP_SKIPPED, StepSkipped
from sakura.telemetry import Telemetry

__version__ = "0.1.0"

# `import sakura.lightning` (a v0.1.x module) names its replacement instead of failing bare.
_removed.install()

__all__ = [
    "SakuraRuntime",
    "Service",
    "Telemetry",
    "Event",
    "EVENT_TYPES",
    "HandlerError",
    "Spec",
    "parse_spec",
    "STEP_SKIPPED",
    "StepSkipped",
    "hookimpl",
    "hookspec",
    "SakuraError",
    "ConfigError",
    "InvalidServiceError",
    "PluginConflictError",
    "SpecError",
    "UnknownNameError",
    *[cls.__name__ for cls in EVENT_TYPES],
]
