"""sakura.registry: the named registry the core's services, dispatchers and adapters live in,
and that a package adding its own hookspecs reuses (through PluginManager.collect)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from sakura import PluginConflictError, SpecError, UnknownNameError
from sakura.plugins import get_plugin_manager
from sakura.registry import Entry, NamedRegistry, normalize_name


class Codec:
    """Compresses things."""

    def __init__(self, level: int = 3) -> None:
        if level < 1:
            raise ValueError(f"level must be >= 1, got {level}")
        self.level = level


class BenchLikeError(Exception):
    pass


def test_register_get_create_and_list() -> None:
    codecs: NamedRegistry[type[Codec]] = NamedRegistry("codec")
    entry = codecs.register("zstd", Codec, plugin="my-plugin", distribution="my-dist")
    assert isinstance(entry, Entry) and entry.description == "Compresses things."
    assert codecs.get("zstd") is entry and codecs["zstd"] is entry and "zstd" in codecs
    assert entry.provider == "my-dist" and entry.describe() == "'zstd' (from my-dist)"
    assert codecs.load("zstd") is Codec and entry.export_name == "Codec"
    assert codecs.create("zstd:7").level == 7
    assert codecs.create({"name": "zstd", "level": 2}).level == 2
    codecs.register("lz4", Codec, plugin="other")
    assert codecs.names() == ["lz4", "zstd"] and codecs.keys() == ["zstd", "lz4"]
    assert len(codecs) == 2 and [e.name for e in codecs.values()] == ["zstd", "lz4"]
    assert codecs.exports() == {"Codec": codecs.get("lz4")}  # the last one of that class
    with pytest.raises(SpecError, match=r"rejected by 'zstd' \(from my-dist\).*level must be"):
        codecs.create("zstd:level=0")
    with pytest.raises(SpecError, match="needs a 'name' key"):
        codecs.create({"level": 1})


def test_names_compare_with_dash_and_underscore_alike() -> None:
    registry: NamedRegistry[type[Codec]] = NamedRegistry("adapter")
    registry.register("hf-trainer", Codec, plugin="p")
    assert registry.get("hf_trainer").name == "hf-trainer" and "HF_Trainer" in registry
    assert normalize_name("Hf-Trainer.x") == "hf_trainer_x"
    with pytest.raises(PluginConflictError, match=r"'hf_trainer'.*dist-a.*dist-b"):
        second: NamedRegistry[type[Codec]] = NamedRegistry("adapter")
        second.register("hf-trainer", Codec, plugin="a", distribution="dist-a")
        second.register("hf_trainer", Codec, plugin="b", distribution="dist-b")


def test_conflict_names_both_distributions() -> None:
    registry: NamedRegistry[type[Codec]] = NamedRegistry("workload")
    registry.register("mnist", Codec, plugin="first", distribution="sakura-one")
    with pytest.raises(PluginConflictError) as info:
        registry.register("mnist", Codec, plugin="second", distribution="sakura-two")
    message = str(info.value)
    assert "sakura-one" in message and "sakura-two" in message and "'mnist'" in message
    assert registry.get("mnist").distribution == "sakura-one"  # the first one stays


def test_unknown_name_names_nearest_available_package_and_notes() -> None:
    registry: NamedRegistry[type[Codec]] = NamedRegistry(
        "workload",
        providers={"resnet50": "sakura-vision"},
        error=BenchLikeError,
        notes=lambda: ["Plugins that failed to load: x."],
    )
    registry.register("mnist_mlp", Codec, plugin="p")
    with pytest.raises(BenchLikeError) as info:
        registry.get("mnist_mpl")
    assert str(info.value) == (
        "unknown workload 'mnist_mpl'. Did you mean 'mnist_mlp'? Available workloads: "
        "mnist_mlp. Plugins that failed to load: x."
    )
    with pytest.raises(
        BenchLikeError,
        match="provided by sakura-vision, which is not installed: pip install sakura-vision",
    ):
        registry.get("resnet50")
    assert registry.find("resnet50") is None
    default: NamedRegistry[type[Codec]] = NamedRegistry("codec")
    with pytest.raises(UnknownNameError, match="Available codecs: none"):
        default.get("zstd")


def test_invalid_registrations() -> None:
    registry: NamedRegistry[type[Codec]] = NamedRegistry("codec")
    with pytest.raises(ValueError, match="invalid name ''"):
        registry.register("", Codec, plugin="p")
    with pytest.raises(TypeError, match=r"must be callable or a 'module.path:Name' string"):
        registry.register("x", "not a target", plugin="p")


def test_lazy_targets_import_on_first_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "sakura_registry_lazy_mod.py").write_text("class Thing:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    registry: NamedRegistry[type] = NamedRegistry("thing")
    entry = registry.register("thing", "sakura_registry_lazy_mod:Thing", plugin="p")
    ghost = registry.register("ghost", "sakura_registry_nowhere:Ghost", plugin="p")
    assert entry.export_name == "Thing" and "sakura_registry_lazy_mod" not in sys.modules
    assert registry.load("thing").__name__ == "Thing"
    with pytest.raises(ImportError, match=r"the thing 'ghost' from p could not be imported"):
        ghost.load()
    sys.modules.pop("sakura_registry_lazy_mod", None)


BENCHLIKE = """
from sakura import hookimpl, hookspec

class Specs:
    @hookspec
    def sakura_register_gadgets(self, register):
        '''Offer gadgets.'''

@hookimpl
def sakura_add_hookspecs(pluginmanager):
    pluginmanager.add_hookspecs(Specs)

class Lamp:
    '''A lamp.'''

@hookimpl
def sakura_register_gadgets(register):
    register("lamp", Lamp)
"""

THIRD = """
from sakura import hookimpl

@hookimpl(optionalhook=True)
def sakura_register_gadgets(register):
    register("lamp_2", "sakura_third_gadgets:Lamp2", description="a brighter lamp")
    register("broken", 42)
"""


def test_a_package_with_its_own_hookspecs_reuses_the_registry(
    make_distribution: Callable[..., Path],
) -> None:
    make_distribution("sakura-gadgets", "sakura_gadgets_plugin", BENCHLIKE)
    make_distribution("sakura-third-gadgets", "sakura_third_gadgets", THIRD)
    manager = get_plugin_manager(plugins=["sakura-gadgets", "sakura-third-gadgets"], disabled=[])
    with pytest.warns(RuntimeWarning, match="must be callable"):
        gadgets = manager.collect("gadget", "sakura_register_gadgets", error=BenchLikeError)
    assert manager.collect("gadget", "sakura_register_gadgets") is gadgets  # collected once
    assert gadgets.names() == ["lamp", "lamp_2"]
    assert gadgets.get("lamp").distribution == "sakura-gadgets"
    assert gadgets.get("lamp_2").provider == "sakura-third-gadgets"
    [failure] = manager.failures
    assert failure.distribution == "sakura-third-gadgets"
    with pytest.raises(BenchLikeError, match=r"Did you mean 'lamp'.*Plugins that failed to load"):
        gadgets.get("lamq")
    info = {p.name: p for p in manager.plugins()}
    assert info["sakura-gadgets"].provides == {"gadget": ["lamp"]}
    with pytest.raises(ValueError, match="no plugin hook 'sakura_register_gizmos'"):
        manager.collect("gizmo", "sakura_register_gizmos")
