"""Configuration: which plugins load and which services install.

This module only reads and merges what the arguments, the environment and the files say
(a :class:`SakuraConfig`); :meth:`SakuraRuntime.from_config` and
:meth:`SakuraRuntime.from_loaded_config` build a runtime from it.  The arrow points one way:
the runtime knows the configuration, the configuration knows nothing of runtimes.

Sources, highest precedence first:

1. arguments to :meth:`SakuraRuntime.from_config` / :func:`load_config`, including an
   explicit ``path`` to a config file;
2. the environment: ``SAKURA_PLUGINS``, ``SAKURA_DISABLED_PLUGINS``,
   ``SAKURA_DISABLE_PLUGIN_AUTOLOAD=1``, and ``SAKURA_CONFIG`` (a TOML file used instead
   of the files below);
3. ``sakura.toml`` in the working directory;
4. ``[tool.sakura]`` in ``pyproject.toml`` in the working directory.

Only one file is read: ``path``, else ``$SAKURA_CONFIG``, else ``./sakura.toml``, else
``./pyproject.toml``.  Keys (all optional)::

    plugins = ["my-plugin"]            # load only these plugins
    disabled_plugins = ["other"]       # never load these
    autoload = true                    # load every installed plugin not disabled
    services = ["telemetry:path=run.jsonl", {name = "mixed_precision", dtype = "bf16"}]
    strict = false                     # re-raise handler exceptions
    history = true                     # count events per class
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sakura.env import env_flag, env_list
from sakura.errors import ConfigError, nearest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib  # type: ignore[import-not-found, unused-ignore]

__all__ = ["CONFIG_KEYS", "SakuraConfig", "load_config"]

CONFIG_KEYS = ("plugins", "disabled_plugins", "autoload", "services", "strict", "history")


@dataclass
class SakuraConfig:
    """The merged configuration, with where it came from."""

    plugins: list[str] | None = None
    disabled_plugins: list[str] = field(default_factory=list)
    autoload: bool = True
    services: list[str | dict[str, Any]] = field(default_factory=list)
    strict: bool = False
    history: bool = True
    source: str | None = None
    """The file read, if any."""


def _read_toml(path: Path, *, table: str | None = None) -> dict[str, Any]:
    try:
        with path.open("rb") as handle:
            data = tomllib.load(handle)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    if table is None:
        return dict(data)
    node: Any = data
    for part in table.split("."):
        node = node.get(part, {}) if isinstance(node, dict) else {}
    if not isinstance(node, dict):
        raise ConfigError(f"{path}: [{table}] must be a table")
    return node


def _validate(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key not in CONFIG_KEYS:
            hint = nearest(key, CONFIG_KEYS)
            extra = f"; did you mean {hint!r}?" if hint else ""
            raise ConfigError(
                f"{where}: unknown key {key!r}{extra} (accepted: {', '.join(CONFIG_KEYS)})"
            )
        if key in ("plugins", "disabled_plugins"):
            if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
                raise ConfigError(f"{where}: {key} must be a list of plugin names, got {value!r}")
        elif key in ("autoload", "strict", "history"):
            if not isinstance(value, bool):
                raise ConfigError(f"{where}: {key} must be true or false, got {value!r}")
        elif key == "services":
            if not isinstance(value, list):
                raise ConfigError(f"{where}: services must be a list, got {value!r}")
            for item in value:
                if isinstance(item, str):
                    continue
                if isinstance(item, dict) and isinstance(item.get("name"), str):
                    continue
                raise ConfigError(
                    f"{where}: each service must be a spec string ('mixed_precision:bf16') or a "
                    f"table with a 'name' key ({{name = 'telemetry', path = 'run.jsonl'}}); "
                    f"got {item!r}"
                )
        out[key] = value
    return out


def _find_file(
    path: str | os.PathLike[str] | None, environ: Mapping[str, str], cwd: Path
) -> tuple[Path, str | None] | None:
    if path is not None:
        candidate = Path(path)
        if not candidate.is_file():
            raise ConfigError(f"config file {str(candidate)!r} does not exist")
        return candidate, _table_for(candidate)
    env_path = environ.get("SAKURA_CONFIG")
    if env_path:
        candidate = Path(env_path)
        if not candidate.is_file():
            raise ConfigError(f"SAKURA_CONFIG={env_path!r}: no such file")
        return candidate, _table_for(candidate)
    local = cwd / "sakura.toml"
    if local.is_file():
        return local, None
    pyproject = cwd / "pyproject.toml"
    if pyproject.is_file():
        return pyproject, "tool.sakura"
    return None


def _table_for(path: Path) -> str | None:
    return "tool.sakura" if path.name == "pyproject.toml" else None


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    services: Iterable[Any] | None = None,
    plugins: Iterable[str] | None = None,
    disabled_plugins: Iterable[str] | None = None,
    strict: bool | None = None,
    history: bool | None = None,
    environ: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> SakuraConfig:
    """Merge arguments, environment and files into a :class:`SakuraConfig`."""
    environ = os.environ if environ is None else environ
    workdir = Path(cwd) if cwd is not None else Path.cwd()
    config = SakuraConfig()
    found = _find_file(path, environ, workdir)
    if found is not None:
        file_path, table = found
        where = f"{file_path}" + (f" [{table}]" if table else "")
        data = _validate(_read_toml(file_path, table=table), where)
        config.source = str(file_path)
        for key, value in data.items():
            setattr(config, key, list(value) if isinstance(value, list) else value)
    env_plugins = env_list("SAKURA_PLUGINS", environ=environ)
    if env_plugins is not None:
        config.plugins = env_plugins
    env_disabled = env_list("SAKURA_DISABLED_PLUGINS", environ=environ)
    if env_disabled is not None:
        config.disabled_plugins = env_disabled
    no_autoload = env_flag("SAKURA_DISABLE_PLUGIN_AUTOLOAD", environ=environ)
    if no_autoload is not None:
        config.autoload = not no_autoload
    if plugins is not None:
        config.plugins = _str_list("plugins", plugins)
    if disabled_plugins is not None:
        config.disabled_plugins = _str_list("disabled_plugins", disabled_plugins)
    if services is not None:
        config.services = list(services)
    if strict is not None:
        config.strict = strict
    if history is not None:
        config.history = history
    return config


def _str_list(option: str, values: Iterable[str]) -> list[str]:
    if isinstance(values, str):
        raise ConfigError(f"{option} must be a list of names, not a single string {values!r}")
    out = list(values)
    for value in out:
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{option} must hold non-empty strings, got {value!r}")
    return out
