"""Unknown hook names get the hook the author meant: another framework's name first
(Lightning, the Hugging Face Trainer), spelling second.  The name tables in
sakura.suggest are checked against docs/events.md and against the installed frameworks."""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping
from pathlib import Path

import pytest

from sakura import SakuraRuntime, Service
from sakura.errors import InvalidServiceError, nearest
from sakura.events import event_type
from sakura.service import EVENT_HOOKS, SERVICE_HOOKS
from sakura.suggest import HF_TRAINER_EVENTS, LIGHTNING_HOOKS, hook_hint, suggest_hook

DOCS = Path(__file__).resolve().parents[2] / "docs"


def _service_with(method_name: str) -> Service:
    def handler(self: Service, event: object) -> None:
        return None

    cls = type("Misnamed", (Service,), {"name": "misnamed", method_name: handler})
    return cls()  # type: ignore[no-any-return]


def _install_error(method_name: str) -> str:
    with pytest.raises(InvalidServiceError) as info, SakuraRuntime() as rt:
        rt.install(_service_with(method_name))
    return str(info.value)


@pytest.mark.parametrize(
    ("written", "meant"),
    [
        ("on_train_start", "on_train_begin"),  # Lightning; spelling says on_train_step_end
        ("on_fit_start", "on_fit_begin"),  # Lightning; spelling says on_fit_end (the opposite)
        ("on_validation_start", "on_validation_begin"),  # spelling: on_validation_end
        ("on_train_epoch_start", "on_epoch_begin"),  # spelling: on_train_end
        ("on_step_begin", "on_train_step_begin"),  # HF; spelling: on_test_begin
        ("on_exception", "on_error"),  # Lightning; spelling: on_save_checkpoint
    ],
)
def test_framework_names_suggest_the_hook_for_the_same_moment(written: str, meant: str) -> None:
    assert suggest_hook(written) == meant
    assert nearest(written, SERVICE_HOOKS) == meant
    assert f"did you mean {meant!r}?" in _install_error(written)


def test_typos_still_get_the_nearest_spelling() -> None:
    assert suggest_hook("on_trian_begin") == "on_train_begin"
    assert suggest_hook("wrap_optimiser") == "wrap_optimizer"
    assert suggest_hook("on_completely_unrelated_thing") is None
    assert "did you mean 'on_epoch_end'?" in _install_error("on_epoch_ends")


def test_the_hint_says_which_framework_the_name_comes_from() -> None:
    assert hook_hint("on_train_start") == (
        "; did you mean 'on_train_begin'? (Lightning's Callback.on_train_start is sakura's "
        "on_train_begin)"
    )
    assert "transformers.TrainerCallback.on_evaluate" in hook_hint("on_evaluate")
    assert hook_hint("on_trian_begin") == "; did you mean 'on_train_begin'?"
    # a framework name whose hook is not among the candidates falls back to spelling
    assert suggest_hook("on_train_start", ["on_train_end"]) == "on_train_end"


DOC_EXAMPLE = re.compile(r"`(\w+)`\s*(?:→|->|:)\s*did you mean `(\w+)`\?")


@pytest.mark.parametrize("doc", ["hooks.md", "writing-a-plugin.md"])
def test_the_docs_examples_are_what_install_says(doc: str) -> None:
    examples = DOC_EXAMPLE.findall((DOCS / doc).read_text())
    assert examples, f"no 'did you mean' example found in docs/{doc}"
    for written, meant in examples:
        assert f"did you mean {meant!r}?" in _install_error(written), (doc, written)


def _doc_table(heading: str) -> dict[str, list[str]]:
    """The first table under ``heading`` in docs/events.md: framework hook -> the sakura
    hooks named in its event column."""
    text = (DOCS / "events.md").read_text()
    section = text[text.index(heading) :]
    rows: dict[str, list[str]] = {}
    started = False
    for line in section.splitlines():
        if not line.startswith("|"):
            if started:
                break
            continue
        started = True
        cells = [c.strip() for c in line.strip("|").split("|")]
        hook = re.fullmatch(r"`(\w+)`", cells[0])
        if hook is None:
            continue  # the header and separator rows
        events = re.findall(r"`(On\w+)[`(]", cells[1])
        rows[hook.group(1)] = [event_type(e).hook for e in events]
    return rows


def table_drift(table: Mapping[str, str | None], documented: Mapping[str, list[str]]) -> list[str]:
    """How a name table and the documented mapping disagree (empty: they agree)."""
    problems = [f"{h}: documented, not in the table" for h in documented if h not in table]
    problems += [f"{h}: in the table, not documented" for h in table if h not in documented]
    for hook, target in table.items():
        events = documented.get(hook)
        if events is None:
            continue
        if target is None and events:
            problems.append(f"{hook}: the table has no event, the docs say {events}")
        elif target is not None and target not in events:
            problems.append(f"{hook}: the table says {target}, the docs say {events}")
    return problems


@pytest.mark.parametrize(
    ("table", "heading"),
    [(LIGHTNING_HOOKS, "### Lightning"), (HF_TRAINER_EVENTS, "### Hugging Face")],
)
def test_name_tables_agree_with_the_documented_mapping(
    table: Mapping[str, str | None], heading: str
) -> None:
    documented = _doc_table(heading)
    assert len(documented) >= 15
    assert table_drift(table, documented) == []
    assert all(target is None or target in EVENT_HOOKS for target in table.values())


def test_a_drifted_table_is_caught() -> None:
    documented = _doc_table("### Lightning")
    drifted = dict(LIGHTNING_HOOKS, on_train_start="on_train_step_end")
    del drifted["on_exception"]
    assert table_drift(drifted, documented) == [
        "on_exception: documented, not in the table",
        "on_train_start: the table says on_train_step_end, the docs say ['on_train_begin']",
    ]


def test_lightning_table_covers_every_callback_hook() -> None:
    callback = pytest.importorskip("lightning.pytorch").Callback
    hooks = {
        name
        for name, value in inspect.getmembers(callback, inspect.isfunction)
        if not name.startswith("_")
    }
    assert hooks == set(LIGHTNING_HOOKS)


def test_hf_table_covers_every_trainer_callback_event() -> None:
    callback = pytest.importorskip("transformers").TrainerCallback
    events = {name for name in vars(callback) if name.startswith("on_")}
    assert events == set(HF_TRAINER_EVENTS)
