"""Resuming services' state when the installed services changed since the checkpoint.

Adding a monitoring service to a resumed run, or dropping one, is normal.  So
``rt.load_state_dict(state)`` is lenient by default:

* an installed stateful service with no entry in the checkpoint starts fresh, with a
  :class:`ServiceStateWarning` naming it;
* an entry for a service that is not installed (or cannot load state) is not lost: the
  runtime keeps it in ``rt.orphaned_state``, writes it again in the next
  ``rt.state_dict()`` (so a later run that installs the service again gets it back), and
  reports it with a :class:`ServiceStateWarning`.

``rt.load_state_dict(state, strict=True)`` raises one :class:`ServiceStateError` listing
both kinds instead, before any service is loaded.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from sakura.errors import SakuraError

__all__ = ["ResumePlan", "ServiceStateError", "ServiceStateWarning", "plan_resume"]


class ServiceStateWarning(UserWarning):
    """A checkpoint's service state and the installed services do not match (a service
    starts fresh, or state is kept for a service that is not installed)."""


class ServiceStateError(SakuraError, KeyError):
    """``rt.load_state_dict(state, strict=True)`` found state and services that do not
    match.  ``missing``: installed stateful services without state; ``orphaned``: state
    entries for services that are not installed or cannot load state."""

    def __init__(self, message: str, *, missing: list[str], orphaned: list[str]) -> None:
        super().__init__(message)
        self.missing = missing
        self.orphaned = orphaned

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class ResumePlan:
    """How one checkpoint's service state meets the installed services."""

    load: dict[str, Any]
    """Service name -> state, for the installed services that can load it."""
    missing: list[str]
    """Installed stateful services the checkpoint has no state for (sorted)."""
    orphaned: dict[str, Any]
    """State entries no installed service can load, kept as they are."""

    def missing_message(self) -> str:
        return (
            f"checkpoint has no state for installed service(s) {self.missing}; they start "
            f"fresh (pass strict=True to make this an error)"
        )

    def orphaned_message(self) -> str:
        return (
            f"checkpoint has state for service(s) {sorted(self.orphaned)} that are not installed "
            f"or cannot load state; it is kept in rt.orphaned_state and saved again with the "
            f"next rt.state_dict() (install the service(s) to use it)"
        )

    def error(self, loaders: Collection[str]) -> ServiceStateError:
        problems = []
        if self.orphaned:
            problems.append(
                f"state for service(s) {sorted(self.orphaned)} that are not installed or cannot "
                f"load state (installed services that load state: {sorted(loaders) or 'none'})"
            )
        if self.missing:
            problems.append(f"no state for installed service(s) {self.missing}")
        return ServiceStateError(
            "checkpoint does not match the installed services: "
            + "; ".join(problems)
            + ". Install or remove services to match, or pass strict=False to start new "
            "services fresh and keep state of absent ones",
            missing=list(self.missing),
            orphaned=sorted(self.orphaned),
        )


def plan_resume(
    state: Mapping[str, Any], *, loaders: Collection[str], stateful: Collection[str]
) -> ResumePlan:
    """Match ``state`` (service name -> state, from ``rt.state_dict()``) against the
    services that implement ``load_state_dict`` (``loaders``) and ``state_dict``
    (``stateful``)."""
    if not isinstance(state, Mapping):
        raise TypeError(
            f"state must be a mapping of service name -> state, got {type(state).__name__}"
        )
    load = {name: value for name, value in state.items() if name in loaders}
    orphaned = {name: value for name, value in state.items() if name not in loaders}
    missing = sorted(name for name in stateful if name in loaders and name not in state)
    return ResumePlan(load=load, missing=missing, orphaned=orphaned)
