"""Meta-tests: each event's fields live in sakura/events.py only.

The hookspec docstrings are generated from the event classes; docs/events.md and
docs/hooks.md list the fields by hand and are checked here against
``dataclasses.fields``.  The checkers are shown to catch drift on purpose-built drifts
(an event class with an extra field, altered doc text).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar

import pytest

from sakura import hookspecs
from sakura.events import EVENT_TYPES, Event, specific_fields

DOCS = Path(__file__).resolve().parents[2] / "docs"
COMMON = [f.name for f in dataclasses.fields(Event)]


# --- the checkers ---------------------------------------------------------------------------


def _ticked(text: str) -> list[str]:
    return re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", text)


def _drop_parentheses(text: str) -> str:
    previous = None
    while previous != text:
        previous, text = text, re.sub(r"\([^()]*\)", "", text)
    return text


def events_md_drift(text: str, event_types: Iterable[type[Event]]) -> list[str]:
    """Differences between docs/events.md's tables and the event classes."""
    problems = []
    common = re.search(r"Every event carries:\n\n((?:\|.*\n)+)", text)
    documented_common = (
        [_ticked(row.split("|")[1])[0] for row in common.group(1).splitlines()[2:]]
        if common
        else []
    )
    if documented_common != COMMON:
        problems.append(f"events.md: common fields {documented_common} != {COMMON}")
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if (
            len(cells) >= 4
            and re.fullmatch(r"`On[A-Za-z]+`", cells[0])
            and cells[1].startswith("`on_")
        ):
            rows[cells[0].strip("`")] = cells
    for cls in event_types:
        cells = rows.get(cls.__name__)
        if cells is None:
            problems.append(f"events.md: no row for {cls.__name__}")
            continue
        if cells[1] != f"`{cls.hook}`":
            problems.append(f"events.md: {cls.__name__} hook {cells[1]} != `{cls.hook}`")
        documented = _ticked(cells[2])
        if documented != list(specific_fields(cls)):
            problems.append(
                f"events.md: {cls.__name__} fields {documented} != {list(specific_fields(cls))}"
            )
    return problems


def hooks_md_drift(text: str, event_types: Iterable[type[Event]]) -> list[str]:
    """Differences between the ``Fields:`` sentence of each event hook in docs/hooks.md and
    the event classes."""
    problems = []
    for cls in event_types:
        heading = f"### `{cls.hook}(event: {cls.__name__}) -> None`"
        start = text.find(heading)
        if start < 0:
            problems.append(f"hooks.md: no section {heading}")
            continue
        end = text.find("\n#", start + len(heading))
        section = text[start + len(heading) : end if end >= 0 else None]
        found = re.search(r"Fields:(.*?)(?:\.\s|\.$)", _drop_parentheses(section), re.S)
        documented = _ticked(found.group(1)) if found else None
        if documented != list(specific_fields(cls)):
            problems.append(
                f"hooks.md: {cls.hook} fields {documented} != {list(specific_fields(cls))}"
            )
    return problems


def hookspec_drift(event_types: Iterable[type[Event]]) -> list[str]:
    """Event hookspecs that are missing, take another event class, or whose docstring does
    not list the class's fields."""
    problems = []
    for cls in event_types:
        spec = getattr(hookspecs.ServiceHooks, cls.hook, None)
        if spec is None:
            problems.append(f"hookspecs: no hook {cls.hook}")
            continue
        if spec.__annotations__.get("event") not in (cls.__name__, cls):
            problems.append(f"hookspecs: {cls.hook} does not take {cls.__name__}")
        fields = ", ".join(f"``{name}``" for name in specific_fields(cls)) or "none"
        if f"Fields beyond rank/world_size/step/epoch: {fields}." not in (spec.__doc__ or ""):
            problems.append(f"hookspecs: {cls.hook} docstring does not list {fields}")
    return problems


# --- the real tree has no drift --------------------------------------------------------------


def test_events_md_matches_the_event_classes() -> None:
    assert events_md_drift((DOCS / "events.md").read_text(), EVENT_TYPES) == []


def test_hooks_md_matches_the_event_classes() -> None:
    assert hooks_md_drift((DOCS / "hooks.md").read_text(), EVENT_TYPES) == []


def test_hookspec_docstrings_are_generated_from_the_event_classes() -> None:
    assert hookspec_drift(EVENT_TYPES) == []
    for cls in EVENT_TYPES:
        doc = getattr(hookspecs.ServiceHooks, cls.hook).__doc__
        assert doc == hookspecs.event_hook_doc(cls)
    # the two that were stale while they were hand-written
    assert "``trainer``" in hookspecs.ServiceHooks.on_train_begin.__doc__
    assert "``skipped``" in hookspecs.ServiceHooks.on_optimizer_step.__doc__


def test_specific_fields_are_the_dataclass_fields_beyond_the_common_ones() -> None:
    from sakura.events import OnOptimizerStep, OnTrainBegin

    assert specific_fields(OnTrainBegin) == (
        "model",
        "optimizer",
        "train_loader",
        "trainer",
        "accumulation_steps",
        "loop",
    )
    assert specific_fields(OnOptimizerStep) == ("model", "optimizer", "skipped")
    assert specific_fields(Event) == ()


# --- deliberate drift: the checkers catch it -------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class OnTrainBeginWithExtra(Event):
    """A fake OnTrainBegin that grew a field the docs do not know."""

    hook: ClassVar[str] = "on_train_begin"
    model: Any = None
    optimizer: Any = None
    train_loader: Any = None
    trainer: Any = None
    accumulation_steps: int | None = None
    loop: Any = None
    scheduler: Any = None


def test_checkers_report_a_field_added_to_an_event_class() -> None:
    events_text = (
        (DOCS / "events.md").read_text().replace("`OnTrainBegin`", "`OnTrainBeginWithExtra`")
    )
    [problem] = events_md_drift(events_text, [OnTrainBeginWithExtra])
    assert "OnTrainBeginWithExtra fields" in problem and "'scheduler'" in problem

    hooks_text = (
        (DOCS / "hooks.md")
        .read_text()
        .replace("(event: OnTrainBegin)", "(event: OnTrainBeginWithExtra)")
    )
    [problem] = hooks_md_drift(hooks_text, [OnTrainBeginWithExtra])
    assert "on_train_begin fields" in problem and "'scheduler'" in problem

    [problem] = [p for p in hookspec_drift([OnTrainBeginWithExtra]) if "docstring" in p]
    assert "``scheduler``" in problem


def test_checkers_report_a_field_dropped_from_the_docs() -> None:
    events_text = (DOCS / "events.md").read_text()
    drifted = events_text.replace(
        "| `OnOptimizerStep` | `on_optimizer_step` | `model`, `optimizer`, `skipped` |",
        "| `OnOptimizerStep` | `on_optimizer_step` | `model`, `optimizer` |",
    )
    assert drifted != events_text
    assert events_md_drift(drifted, EVENT_TYPES) == [
        "events.md: OnOptimizerStep fields ['model', 'optimizer'] != "
        "['model', 'optimizer', 'skipped']"
    ]

    hooks_text = (DOCS / "hooks.md").read_text()
    drifted = hooks_text.replace(
        "Fields: `model`, `optimizer`, `train_loader`, `trainer`",
        "Fields: `model`, `optimizer`, `train_loader`",
    )
    assert drifted != hooks_text
    assert hooks_md_drift(drifted, EVENT_TYPES) == [
        "hooks.md: on_train_begin fields "
        "['model', 'optimizer', 'train_loader', 'accumulation_steps', 'loop'] != "
        "['model', 'optimizer', 'train_loader', 'trainer', 'accumulation_steps', 'loop']"
    ]


def test_checkers_report_a_missing_row_section_and_common_field() -> None:
    events_text = (DOCS / "events.md").read_text()
    no_row = "\n".join(
        line for line in events_text.splitlines() if not line.startswith("| `OnLog` |")
    )
    assert events_md_drift(no_row, EVENT_TYPES) == ["events.md: no row for OnLog"]
    no_epoch = events_text.replace("| `epoch` | Current epoch, counted from 0. |\n", "")
    assert events_md_drift(no_epoch, EVENT_TYPES) == [
        f"events.md: common fields {COMMON[:-1]} != {COMMON}"
    ]
    hooks_text = (
        (DOCS / "hooks.md").read_text().replace("### `on_log(event: OnLog)", "### `on_log(")
    )
    assert hooks_md_drift(hooks_text, EVENT_TYPES) == [
        "hooks.md: no section ### `on_log(event: OnLog) -> None`"
    ]


def test_hookspec_checker_reports_a_hand_written_stale_docstring(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def on_optimizer_step(self: Any, event: Any) -> None:
        """Receives OnOptimizerStep.

        Fields beyond rank/world_size/step/epoch: ``model``, ``optimizer``.
        """

    on_optimizer_step.__annotations__["event"] = "OnOptimizerStep"
    monkeypatch.setattr(hookspecs.ServiceHooks, "on_optimizer_step", on_optimizer_step)
    from sakura.events import OnOptimizerStep

    assert hookspec_drift([OnOptimizerStep]) == [
        "hookspecs: on_optimizer_step docstring does not list ``model``, ``optimizer``, ``skipped``"
    ]


# --- the sakura.testing signatures in docs/events.md -----------------------------------------

TESTING_FUNCTIONS = (
    "check_hooks_valid",
    "check_state_round_trip",
    "check_exceptions_isolated",
    "check_no_work_on_unhandled_events",
    "run_tiny_loop",
    "expected_event_names",
)


def plain_signature(function: Any) -> str:
    """``name(a, *, b=1)``: the signature as docs/events.md writes it (no annotations)."""
    params = [
        p.replace(annotation=inspect.Parameter.empty)
        for p in inspect.signature(function).parameters.values()
    ]
    return f"{function.__name__}{inspect.Signature(params)}"


def helper_signature_drift(text: str, functions: Iterable[Any]) -> list[str]:
    return [
        f"events.md: `{plain_signature(f)}` not documented"
        for f in functions
        if f"`{plain_signature(f)}`" not in text
    ]


def test_events_md_documents_the_testing_helpers_with_their_signatures() -> None:
    import sakura.testing

    functions = [getattr(sakura.testing, name) for name in TESTING_FUNCTIONS]
    checks = {name for name in sakura.testing.__all__ if name.startswith("check_")}
    assert checks <= set(TESTING_FUNCTIONS)  # a new check_* function must be documented too
    assert helper_signature_drift((DOCS / "events.md").read_text(), functions) == []

    def check_hooks_valid(service: Any, *, deep: bool = False) -> None:
        """A drifted signature: a keyword the docs do not show."""

    assert helper_signature_drift((DOCS / "events.md").read_text(), [check_hooks_valid]) == [
        "events.md: `check_hooks_valid(service, *, deep=False)` not documented"
    ]
