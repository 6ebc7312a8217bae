"""The fit-choices hook: choices found through sakura's plugin manager, clear errors for a
name two plugins register, an unknown name and an object that is no choice; sakura-quant's
``quantize_base`` sized exactly; listing plugins imports no torch."""

from __future__ import annotations

import subprocess
import sys
import types
from typing import Any

import pytest

from sakura.errors import PluginConflictError
from sakura.hookspecs import hookimpl
from sakura.plugins import PluginManager
from sakura_offload.fit import FitChoiceError, fit_choices
from sakura_offload.fit.choices import add_to
from sakura_offload.fit.wrap import measure


def manager_with(*targets: tuple[str, str, str]) -> PluginManager:
    """A plugin manager whose only plugins register ``(plugin, choice name, target)``."""
    manager = PluginManager(plugins=[], autoload=False)
    add_to(manager.pm)
    for plugin, name, target in targets:
        module = types.ModuleType(plugin)

        def hook(register: Any, name: str = name, target: str = target) -> None:
            register(name, target)

        module.sakura_register_fit_choices = hookimpl(hook)  # type: ignore[attr-defined]
        # (pluggy reads the hook's name from the attribute it is registered under)
        manager.pm.register(module, name=plugin)
    return manager


def test_the_installed_choices_are_found() -> None:
    pytest.importorskip("sakura_quant")
    found = fit_choices()
    assert type(found["quantize_base"]).__name__ == "QuantizeBase"
    assert list(fit_choices(["quantize_base"])) == ["quantize_base"]


def test_two_plugins_registering_one_name_is_an_error() -> None:
    manager = manager_with(
        ("one", "shrink", "sakura_offload.fit.choices:FitChoice"),
        ("two", "shrink", "sakura_offload.fit.choices:FitChoice"),
    )
    with pytest.raises(PluginConflictError, match="two plugins provide the fit choice 'shrink'"):
        fit_choices(manager=manager)


def test_unknown_and_malformed_choices_are_named() -> None:
    manager = manager_with(
        ("one", "shrink", "sakura_offload.fit.choices:FitChoice"),
        ("two", "not_a_choice", "collections:OrderedDict"),
    )
    assert fit_choices(["shrink"], manager=manager)["shrink"].name == "shrink"
    with pytest.raises(FitChoiceError, match="unknown fit choice 'grow'; known: "):
        fit_choices(["grow"], manager=manager)
    with pytest.raises(FitChoiceError, match=r"'not_a_choice' .* lacks applies, estimate, apply"):
        fit_choices(["not_a_choice"], manager=manager)


@pytest.mark.parametrize("fmt", ["int8", "nf4"])
def test_quantize_base_estimates_exactly(fmt: str) -> None:
    pytest.importorskip("peft")
    from test_fit import lora_llama

    from sakura_quant.fit_choice import QuantizeBase

    model = lora_llama()
    sizes = measure(model)
    choice = QuantizeBase()
    assert choice.applies(model)
    option = next(o for o in choice.estimate(model) if o.name == fmt)
    expected = sizes.shrunk(option)
    choice.apply(model, option)
    after = measure(model)
    assert after.block_frozen == expected.block_frozen
    assert after.outside_frozen_bytes == expected.outside_frozen_bytes
    assert after.frozen_bytes == option.frozen_bytes_after
    assert after.trainable_bytes == sizes.trainable_bytes  # the adapters are untouched
    assert not choice.applies(model)  # nothing left to quantize
    layer = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer
    assert layer.format == fmt


def test_listing_plugins_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "from sakura.plugins import get_plugin_manager\n"
        "get_plugin_manager().load()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
