"""Environment variables, parsed one way everywhere.

``SAKURA_DISABLE_PLUGIN_AUTOLOAD=on`` must mean the same to the plugin loader, the config
reader and any third-party package: these functions are the only parsers.  A value that is
not understood is a :class:`~sakura.errors.ConfigError` naming the variable, the value and
what is accepted, never silently "false".
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from sakura.errors import ConfigError

__all__ = [
    "FALSE_WORDS",
    "TRUE_WORDS",
    "cache_dir",
    "env_choice",
    "env_flag",
    "env_int",
    "env_list",
]

TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off", ""})


def env_flag(
    name: str, default: bool | None = None, *, environ: Mapping[str, str] | None = None
) -> bool | None:
    """The boolean in ``name``: 1/true/yes/on or 0/false/no/off (any case; empty is false);
    ``default`` when the variable is unset."""
    env = os.environ if environ is None else environ
    if name not in env:
        return default
    raw = env[name].strip().lower()
    if raw in TRUE_WORDS:
        return True
    if raw in FALSE_WORDS:
        return False
    raise ConfigError(
        f"{name}={env[name]!r} is not accepted; accepted: 1/0, true/false, yes/no, on/off"
    )


def env_list(name: str, *, environ: Mapping[str, str] | None = None) -> list[str] | None:
    """The comma-separated names in ``name`` (stripped, empty items dropped); ``None`` when
    the variable is unset."""
    env = os.environ if environ is None else environ
    if name not in env:
        return None
    return [item.strip() for item in env[name].split(",") if item.strip()]


def env_int(
    name: str,
    default: int | None = None,
    *,
    minimum: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> int | None:
    """The integer in ``name`` (at least ``minimum``); ``default`` when unset or empty."""
    env = os.environ if environ is None else environ
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or (minimum is not None and value < minimum):
        accepted = "an integer" + (f" >= {minimum}" if minimum is not None else "")
        raise ConfigError(f"{name}={env[name]!r} is not accepted; accepted: {accepted}")
    return value


def env_choice(
    name: str,
    choices: Sequence[str],
    default: str | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> str | None:
    """One of ``choices`` in ``name`` (stripped, any case: the choice as spelt in
    ``choices`` is returned); ``default`` when unset or empty."""
    env = os.environ if environ is None else environ
    raw = env.get(name, "").strip()
    if not raw:
        return default
    for choice in choices:
        if raw.lower() == choice.lower():
            return choice
    accepted = ", ".join(repr(c) for c in choices)
    raise ConfigError(f"{name}={env[name]!r} is not accepted; accepted: {accepted}")


def cache_dir(
    *parts: str, override: str | None = None, environ: Mapping[str, str] | None = None
) -> Path:
    """A persistent per-user cache folder: ``$override`` when that variable is set and not
    empty, else ``$XDG_CACHE_HOME/<parts...>``, else ``~/.cache/<parts...>``.  Not created.

    ``cache_dir("sakura-offload", override="SAKURA_OFFLOAD_CACHE")``."""
    env = os.environ if environ is None else environ
    if override is not None and env.get(override):
        return Path(env[override])
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).joinpath(*parts)
