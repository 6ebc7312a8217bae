"""KNOWN_PROVIDERS (the first-party provider table) against what the first-party plugins
register.  A package's rows are verified where it is installed (the dev environment has
them all); where none is installed the check skips."""

from __future__ import annotations

import re
from collections.abc import Mapping
from importlib import metadata

import pytest

from sakura.plugins import ENTRY_POINT_GROUP, KINDS, KNOWN_PROVIDERS, PluginManager
from sakura.registry import normalize_name


def _installed_first_party() -> list[str]:
    with_plugin = {
        normalize_name(ep.dist.name)
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)
        if ep.dist is not None
    }
    return sorted(
        dist for dist in set(KNOWN_PROVIDERS.values()) if normalize_name(dist) in with_plugin
    )


def _registered_names(distribution: str) -> set[str]:
    """Spec names and facade class names the distribution's plugin registers (its plugin
    alone, so nothing else can claim or shadow a name)."""
    manager = PluginManager(plugins=[distribution], disabled=[], autoload=False)
    names: set[str] = set()
    for kind in KINDS:
        for entry in manager.registry(kind).values():
            if entry.distribution and normalize_name(entry.distribution) == normalize_name(
                distribution
            ):
                names.add(entry.name)
                if entry.export_name:
                    names.add(entry.export_name)
    assert not manager.failures, [str(f) for f in manager.failures]
    return names


def provider_table_drift(table: Mapping[str, str], registered: Mapping[str, set[str]]) -> list[str]:
    """How ``table`` (name -> distribution) disagrees with what each installed distribution
    registers (``registered``: distribution -> names).  Rows of distributions not in
    ``registered`` (not installed) are not judged."""
    problems: list[str] = []
    table_keys = {normalize_name(name): dist for name, dist in table.items()}
    for dist, names in registered.items():
        for name in sorted(names):
            listed = table_keys.get(normalize_name(name))
            if listed != dist:
                problems.append(f"{dist} registers {name!r}, the table says {listed}")
        wanted = {normalize_name(n) for n in names}
        for name, listed in table.items():
            if listed == dist and normalize_name(name) not in wanted:
                problems.append(f"the table says {dist} provides {name!r}; it does not register it")
    return problems


def test_known_providers_match_what_the_first_party_plugins_register() -> None:
    installed = _installed_first_party()
    if not installed:
        pytest.skip("no first-party package is installed here")
    registered = {dist: _registered_names(dist) for dist in installed}
    assert all(registered.values()), registered
    assert provider_table_drift(KNOWN_PROVIDERS, registered) == []


def test_a_drifted_provider_table_is_caught() -> None:
    registered = {
        "sakura-adapters": {"lightning", "LightningAdapter", "hf-trainer", "SakuraTrainer"}
    }
    table = {
        "lightning": "sakura-adapters",
        "LightningAdapter": "sakura-adapters",
        "hf_trainer": "sakura-adapters",  # -/_ alike
        "SakuraTrainer": "sakura-adapters",
        "quant": "sakura-quant",  # not installed in this picture: not judged
    }
    assert provider_table_drift(table, registered) == []
    drifted = {k: v for k, v in table.items() if k != "SakuraTrainer"}
    drifted["ddp"] = "sakura-adapters"
    assert provider_table_drift(drifted, registered) == [
        "sakura-adapters registers 'SakuraTrainer', the table says None",
        "the table says sakura-adapters provides 'ddp'; it does not register it",
    ]


def test_every_known_spec_name_is_snake_case() -> None:
    spec_names = [name for name in KNOWN_PROVIDERS if name[0].islower()]
    assert spec_names and all(name == normalize_name(name) for name in spec_names), spec_names


def test_the_cores_own_spec_names_are_snake_case() -> None:
    manager = PluginManager(plugins=[], disabled=[], autoload=False)  # sakura-core's own only
    names = [name for kind in KINDS for name in manager.registry(kind).names()]
    assert names == ["telemetry"]
    assert all(re.fullmatch(r"[a-z][a-z0-9]*(_[a-z0-9]+)*", name) for name in names)
