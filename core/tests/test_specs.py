from __future__ import annotations

from typing import Any

import pytest

from sakura import Spec, SpecError, parse_spec


@pytest.mark.parametrize(
    ("text", "name", "args", "kwargs"),
    [
        ("compile", "compile", (), {}),
        ("mixed_precision:bf16", "mixed_precision", ("bf16",), {}),
        ("compile:mode=max-autotune", "compile", (), {"mode": "max-autotune"}),
        (
            "async_eval:thread,every=2,strict=true",
            "async_eval",
            ("thread",),
            {"every": 2, "strict": True},
        ),
        (
            "x:lr=1e-3,off=False,none=null,ratio=0.5",
            "x",
            (),
            {"lr": 1e-3, "off": False, "none": None, "ratio": 0.5},
        ),
        ("telemetry:path=/tmp/a b.jsonl", "telemetry", (), {"path": "/tmp/a b.jsonl"}),
        ("  zero1  ", "zero1", (), {}),
        ("my-plugin.svc:16", "my-plugin.svc", (16,), {}),
    ],
)
def test_parse_valid_specs(
    text: str, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    spec = parse_spec(text)
    assert (spec.name, spec.args, dict(spec.kwargs)) == (name, args, kwargs)
    assert str(spec) == text.strip()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "is not a valid name"),
        (":bf16", "is not a valid name"),
        ("1abc", "is not a valid name"),
        ("name:", "nothing after ':'"),
        ("name:a,,b", "empty item between commas"),
        ("name:a=1,a=2", "option 'a' given twice"),
        ("name:k=1,positional", "positional value 'positional' after key=value"),
        ("name:bad key=1", "'bad key' is not a valid option name"),
    ],
)
def test_malformed_specs_name_the_problem(text: str, message: str) -> None:
    with pytest.raises(SpecError, match=message) as info:
        parse_spec(text)
    assert repr(text) in str(info.value)


def test_spec_must_be_a_string_and_str_round_trips() -> None:
    with pytest.raises(SpecError, match="spec must be a string"):
        parse_spec(3)  # type: ignore[arg-type]
    assert str(Spec("a", (1,), {"k": "v"})) == "a:1,k=v"
    assert isinstance(SpecError("x"), ValueError)
