"""Spec strings: how the command line and config files name a configured object.

Grammar::

    spec   := name [":" item ("," item)*]
    item   := value | key "=" value
    name   := letter (letter | digit | "_" | "-" | ".")*

Positional values come before keyword ones.  Values are converted: ``true``/``false``
to bool, ``none``/``null`` to None, integers and floats to numbers, anything else stays a
string.  Examples: ``mixed_precision:bf16``, ``compile:mode=max-autotune``,
``async_eval:thread,every=2``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sakura.errors import SpecError

__all__ = ["Spec", "coerce_value", "parse_spec"]

_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.\-]*\Z")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_GRAMMAR = "name, name:value, or name:key=value,key=value (e.g. 'mixed_precision:bf16')"


@dataclass(frozen=True)
class Spec:
    """A parsed spec string."""

    name: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    text: str = ""

    def __str__(self) -> str:
        if self.text:
            return self.text
        items = [str(a) for a in self.args] + [f"{k}={v}" for k, v in self.kwargs.items()]
        return self.name + (":" + ",".join(items) if items else "")


def coerce_value(text: str) -> Any:
    """Convert one spec value: bools, None, ints and floats; other text stays a string."""
    lowered = text.lower()
    if lowered == "true":
        return True
    if lowered == "false":
        return False
    if lowered in ("none", "null"):
        return None
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        return text


def parse_spec(text: str) -> Spec:
    """Parse ``text`` into a :class:`Spec`; raise :class:`SpecError` naming what is wrong."""
    if not isinstance(text, str):
        raise SpecError(
            f"spec must be a string like {_GRAMMAR}; got {type(text).__name__} {text!r}"
        )
    stripped = text.strip()
    name, sep, rest = stripped.partition(":")
    if not _NAME.match(name):
        raise SpecError(f"invalid spec {text!r}: {name!r} is not a valid name; expected {_GRAMMAR}")
    if sep and not rest.strip():
        raise SpecError(f"invalid spec {text!r}: nothing after ':'; expected {_GRAMMAR}")
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    if rest:
        for raw in rest.split(","):
            item = raw.strip()
            if not item:
                raise SpecError(
                    f"invalid spec {text!r}: empty item between commas; expected {_GRAMMAR}"
                )
            key, eq, value = item.partition("=")
            if eq:
                key = key.strip()
                if not _KEY.match(key):
                    raise SpecError(f"invalid spec {text!r}: {key!r} is not a valid option name")
                if key in kwargs:
                    raise SpecError(f"invalid spec {text!r}: option {key!r} given twice")
                kwargs[key] = coerce_value(value.strip())
            else:
                if kwargs:
                    raise SpecError(
                        f"invalid spec {text!r}: positional value {item!r} after key=value items"
                    )
                args.append(coerce_value(item))
    return Spec(name=name, args=tuple(args), kwargs=kwargs, text=stripped)
