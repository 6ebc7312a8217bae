"""Plugin discovery through real entry points (dist-info on sys.path), filters, errors."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import sakura
from sakura import ConfigError, PluginConflictError, SakuraRuntime, SpecError, UnknownNameError
from sakura.config import load_config
from sakura.plugins import (
    KNOWN_PROVIDERS,
    PluginLoadWarning,
    get_plugin_manager,
    reset_plugin_managers,
)

GOOD = """
from sakura import hookimpl, Service

class Greeter(Service):
    '''Says hello at epoch end.'''
    name = "greeter"
    def __init__(self, greeting="hello", times=1):
        if not isinstance(times, int) or times < 1:
            raise ValueError(f"times must be a positive int, got {times!r}")
        self.greeting, self.times, self.heard = greeting, times, []
    def on_epoch_end(self, event):
        self.heard.append(self.greeting * self.times)

class ThreadPoolish:
    '''A dispatcher stand-in.'''
    def __init__(self, workers=1):
        self.workers = workers

@hookimpl
def sakura_register_services(register):
    register("greeter", Greeter)

@hookimpl
def sakura_register_dispatchers(register):
    register("pool", ThreadPoolish)
"""

BROKEN = "raise ImportError('needs a library that is missing')\n"

CLASHING = """
from sakura import hookimpl, Service
class Other(Service):
    name = "greeter"
@hookimpl
def sakura_register_services(register):
    register("greeter", Other)
"""


def test_entry_point_plugin_is_discovered_and_builds_from_specs(
    make_distribution: Callable[..., Path],
) -> None:
    make_distribution("sakura-greeter", "sakura_greeter_plugin", GOOD, version="2.3")
    manager = get_plugin_manager()
    greeter = manager.create("service", "greeter:hi,times=2")
    assert (greeter.greeting, greeter.times) == ("hi", 2)
    info = {p.name: p for p in manager.plugins()}["sakura-greeter"]
    assert (info.distribution, info.version) == ("sakura-greeter", "2.3")
    assert info.provides == {"service": ["greeter"], "dispatcher": ["pool"]}
    assert manager.resolve("service", "greeter").distribution == "sakura-greeter"
    assert manager.create("dispatcher", "pool:workers=4").workers == 4
    # facades
    from sakura.dispatch import ThreadPoolish  # type: ignore[attr-defined]
    from sakura.services import Greeter  # type: ignore[attr-defined]

    assert Greeter is type(greeter) and ThreadPoolish.__name__ == "ThreadPoolish"
    assert "Greeter" in dir(sakura.services)


def test_runtime_install_accepts_spec_strings(make_distribution: Callable[..., Path]) -> None:
    make_distribution("sakura-greeter", "sakura_greeter_plugin", GOOD)
    with SakuraRuntime() as rt:
        greeter = rt.install("greeter:yo")
        rt.emit(sakura.OnEpochEnd)
    assert greeter.heard == ["yo"]


def test_spec_arguments_rejected_by_the_service_name_it_and_the_signature(
    make_distribution: Callable[..., Path],
) -> None:
    make_distribution("sakura-greeter", "sakura_greeter_plugin", GOOD)
    manager = get_plugin_manager()
    with pytest.raises(
        SpecError,
        match=r"'greeter:times=0' was rejected by 'greeter' \(from sakura-greeter\)"
        r".*times must be a positive int.*accepted arguments: greeter\(greeting='hello', times=1\)",
    ):
        manager.create("service", "greeter:times=0")
    with pytest.raises(SpecError, match="unexpected keyword argument 'volume'"):
        manager.create("service", "greeter:volume=3")


def test_broken_plugin_is_reported_and_the_others_load(
    make_distribution: Callable[..., Path],
) -> None:
    make_distribution("sakura-broken", "sakura_broken_plugin", BROKEN)
    make_distribution("sakura-greeter", "sakura_greeter_plugin", GOOD)
    manager = get_plugin_manager()
    with pytest.warns(
        RuntimeWarning, match="plugin 'sakura-broken' from sakura-broken failed to load"
    ):
        available = manager.registry("service")
    assert "greeter" in available and "telemetry" in available
    [failure] = manager.failures
    assert failure.distribution == "sakura-broken"
    assert "needs a library that is missing" in str(failure.error)
    with pytest.raises(
        UnknownNameError, match="Plugins that failed to load: plugin 'sakura-broken'"
    ):
        manager.resolve("service", "nothing")


def test_two_plugins_claiming_one_name_is_an_error_naming_both(
    make_distribution: Callable[..., Path],
) -> None:
    make_distribution("sakura-greeter", "sakura_greeter_plugin", GOOD)
    make_distribution("sakura-clash", "sakura_clash_plugin", CLASHING)
    with pytest.raises(
        PluginConflictError, match=r"greeter.*sakura-(greeter|clash).*sakura-(clash|greeter)"
    ):
        get_plugin_manager().registry("service")


def test_disabled_and_only_filters(
    make_distribution: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    make_distribution("sakura-greeter", "sakura_greeter_plugin", GOOD)
    make_distribution("sakura-clash", "sakura_clash_plugin", CLASHING)
    monkeypatch.setenv("SAKURA_DISABLED_PLUGINS", "sakura-clash")
    assert get_plugin_manager().resolve("service", "greeter").distribution == "sakura-greeter"
    only = get_plugin_manager(plugins=["sakura-clash"], disabled=[])
    assert only.resolve("service", "greeter").distribution == "sakura-clash"
    no_autoload = get_plugin_manager(plugins=None, disabled=[], autoload=False)
    assert set(no_autoload.registry("service")) == {"telemetry"}  # the built-in plugin always loads


def test_env_autoload_switch_and_module_path_plugins(
    make_distribution: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    site = make_distribution("sakura-greeter", "sakura_greeter_plugin", GOOD)
    (site / "loose_plugin.py").write_text(
        GOOD.replace('"greeter"', '"loose"').replace('"pool"', '"pool2"')
    )
    monkeypatch.setenv("SAKURA_DISABLE_PLUGIN_AUTOLOAD", "1")
    assert "greeter" not in get_plugin_manager().registry("service")
    monkeypatch.setenv("SAKURA_PLUGINS", "loose_plugin")
    sakura.plugins.reset_plugin_managers()
    assert set(get_plugin_manager().registry("service")) == {"telemetry", "loose"}
    sys.modules.pop("loose_plugin", None)


def test_unknown_module_in_plugin_list_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SAKURA_PLUGINS", "no_such_plugin_module")
    with pytest.warns(
        RuntimeWarning, match="not an installed plugin, distribution or importable module"
    ):
        get_plugin_manager().registry("service")


def test_misnamed_plugin_hook_is_a_load_failure_naming_the_nearest(
    make_distribution: Callable[..., Path],
) -> None:
    make_distribution(
        "sakura-typo",
        "sakura_typo_plugin",
        GOOD.replace("def sakura_register_services", "def sakura_register_service"),
    )
    manager = get_plugin_manager()
    with pytest.warns(RuntimeWarning, match="did you mean 'sakura_register_services'"):
        assert "greeter" not in manager.registry("service")


def test_unknown_service_lists_available_and_names_missing_package(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a provider that is certainly not installed (the first-party ones may be)
    monkeypatch.setitem(KNOWN_PROVIDERS, "warp_drive", "sakura-warp")
    monkeypatch.setitem(KNOWN_PROVIDERS, "WarpDrive", "sakura-warp")
    manager = get_plugin_manager()
    with pytest.raises(UnknownNameError) as info:
        manager.create("service", "warp_drive:fast")
    message = str(info.value)
    assert "provided by sakura-warp, which is not installed: pip install sakura-warp" in message
    assert "Available services: " in message and "telemetry" in message
    with pytest.raises(UnknownNameError, match="Did you mean 'telemetry'"):
        manager.create("service", "telemetri")
    with pytest.raises(ImportError, match=r"provided by sakura-warp.*pip install sakura-warp"):
        from sakura.services import WarpDrive  # type: ignore[attr-defined]  # noqa: F401


def test_facades_raise_import_error_naming_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SAKURA_DISABLE_PLUGIN_AUTOLOAD", "1")  # only sakura-core's own plugin
    # installed or not, the error names the package and never offers nothing
    with pytest.raises(ImportError, match="provided by sakura-precision, which is"):
        from sakura.services import MixedPrecision  # type: ignore[attr-defined]  # noqa: F401
    with pytest.raises(ImportError, match="provided by sakura-adapters, which is"):
        from sakura.adapters import LightningAdapter  # type: ignore[attr-defined]  # noqa: F401
    with pytest.raises(ImportError, match="provided by sakura-async, which is"):
        from sakura.dispatch import LocalDispatcher  # type: ignore[attr-defined]  # noqa: F401
    with pytest.raises(AttributeError, match="available services: Telemetry"):
        sakura.services.NotAThing  # type: ignore[attr-defined]  # noqa: B018
    from sakura.services import Telemetry

    assert Telemetry is sakura.Telemetry


@pytest.mark.parametrize(
    ("env", "explanation"),
    [
        ({"SAKURA_DISABLED_PLUGINS": "sakura-greeter"}, "disabled by SAKURA_DISABLED_PLUGINS"),
        ({"SAKURA_PLUGINS": "sakura-other"}, "not named in SAKURA_PLUGINS"),
        ({"SAKURA_DISABLE_PLUGIN_AUTOLOAD": "on"}, "plugin autoload is off"),
    ],
)
def test_installed_but_disabled_provider_is_reported_as_disabled(
    make_distribution: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
    env: dict[str, str],
    explanation: str,
) -> None:
    make_distribution("sakura-greeter", "sakura_greeter_plugin", GOOD, version="2.3")
    make_distribution("sakura-other", "sakura_other_plugin", "")
    monkeypatch.setitem(KNOWN_PROVIDERS, "greeter", "sakura-greeter")
    monkeypatch.setitem(KNOWN_PROVIDERS, "Greeter", "sakura-greeter")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    manager = get_plugin_manager()
    with pytest.raises(UnknownNameError) as info:
        manager.create("service", "greeter")
    message = str(info.value)
    assert "provided by sakura-greeter, which is installed but disabled" in message
    assert explanation in message and "pip install" not in message
    with pytest.raises(ImportError) as facade:
        from sakura.services import Greeter  # type: ignore[attr-defined]  # noqa: F401
    assert "installed but disabled" in str(facade.value)
    assert "pip install" not in str(facade.value)
    [skipped] = [s for s in manager.skipped if s.distribution == "sakura-greeter"]
    assert (skipped.name, skipped.version) == ("sakura-greeter", "2.3")
    assert explanation in skipped.explain()


def test_a_provider_that_failed_to_load_is_reported_with_its_error(
    make_distribution: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    make_distribution("sakura-greeter", "sakura_greeter_plugin", BROKEN)
    monkeypatch.setitem(KNOWN_PROVIDERS, "greeter", "sakura-greeter")
    manager = get_plugin_manager()
    with pytest.warns(PluginLoadWarning), pytest.raises(UnknownNameError) as info:
        manager.create("service", "greeter")
    message = str(info.value)
    assert "provided by sakura-greeter, which failed to load" in message
    assert "needs a library that is missing" in message and "pip install" not in message


def test_misspelt_plugin_filters_are_reported_with_the_nearest_installed_name(
    make_distribution: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    make_distribution("sakura-greeter", "sakura_greeter_plugin", GOOD)
    monkeypatch.setenv("SAKURA_DISABLED_PLUGINS", "sakura-greter")
    manager = get_plugin_manager()
    with pytest.warns(
        PluginLoadWarning,
        match=r"disabled plugin 'sakura-greter'.*not an installed plugin; did you mean "
        r"'sakura-greeter'\?",
    ):
        assert "greeter" in manager.registry("service")  # the misspelling disabled nothing
    assert len(manager.problems) == 1 and not manager.failures
    monkeypatch.delenv("SAKURA_DISABLED_PLUGINS")
    monkeypatch.setenv("SAKURA_PLUGINS", "sakura_greter")
    reset_plugin_managers()
    selected = get_plugin_manager()
    with pytest.warns(PluginLoadWarning, match=r"did you mean 'sakura-greeter'\?"):
        assert "greeter" not in selected.registry("service")
    [failure] = selected.failures
    assert failure.name == "sakura_greter"


@pytest.mark.parametrize("word", ["1", "on", "ON", "yes", "true", "True", " on "])
def test_autoload_switch_words_mean_the_same_to_loader_and_config(
    make_distribution: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    word: str,
) -> None:
    make_distribution("sakura-greeter", "sakura_greeter_plugin", GOOD)
    monkeypatch.setenv("SAKURA_DISABLE_PLUGIN_AUTOLOAD", word)
    manager = get_plugin_manager()
    assert manager.autoload is False and "greeter" not in manager.registry("service")
    assert load_config(cwd=tmp_path).autoload is False
    monkeypatch.setenv("SAKURA_DISABLE_PLUGIN_AUTOLOAD", {"1": "0", "on": "off"}.get(word, "no"))
    reset_plugin_managers()
    assert get_plugin_manager().autoload is True and load_config(cwd=tmp_path).autoload is True


def test_an_autoload_word_neither_accepts_is_an_error_in_both(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("SAKURA_DISABLE_PLUGIN_AUTOLOAD", "maybe")
    accepted = r"SAKURA_DISABLE_PLUGIN_AUTOLOAD='maybe' is not accepted; accepted: 1/0"
    with pytest.raises(ConfigError, match=accepted):
        get_plugin_manager()
    with pytest.raises(ConfigError, match=accepted):
        load_config(cwd=tmp_path)


def test_config_table_specs(make_distribution: Callable[..., Path]) -> None:
    make_distribution("sakura-greeter", "sakura_greeter_plugin", GOOD)
    greeter = get_plugin_manager().create(
        "service", {"name": "greeter", "greeting": "hey", "times": 3}
    )
    assert (greeter.greeting, greeter.times) == ("hey", 3)
    with pytest.raises(SpecError, match="needs a 'name' key"):
        get_plugin_manager().create("service", {"greeting": "x"})


def test_sakura_add_hookspecs_lets_a_package_add_its_own_hooks(
    make_distribution: Callable[..., Path],
) -> None:
    make_distribution(
        "sakura-benchlike",
        "sakura_benchlike_plugin",
        """
from sakura import hookimpl, hookspec

class Specs:
    @hookspec
    def sakura_register_workloads(self, register):
        '''Offer workloads.'''

@hookimpl
def sakura_add_hookspecs(pluginmanager):
    pluginmanager.add_hookspecs(Specs)

@hookimpl
def sakura_register_workloads(register):
    register("mnist-mlp")
""",
    )
    make_distribution(
        "sakura-third",
        "sakura_third_plugin",
        """
from sakura import hookimpl

@hookimpl
def sakura_register_workloads(register):
    register("third-party-workload")

@hookimpl(optionalhook=True)
def sakura_register_gizmos(register):
    register("never called: no package declares this hook")
""",
    )
    # only these two: an installed sakura-bench implements the same hook
    manager = get_plugin_manager(plugins=["sakura-benchlike", "sakura-third"], disabled=[])
    manager.load()
    names: list[str] = []
    manager.pm.hook.sakura_register_workloads(register=names.append)
    assert sorted(names) == ["mnist-mlp", "third-party-workload"]
    assert not manager.failures


def test_plugin_discovery_is_lazy() -> None:
    code = (
        "import sys, sakura, sakura.services, sakura.plugins\n"
        "assert sakura.plugins._MANAGERS == {}, 'plugins loaded at import'\n"
        "assert 'torch' not in sys.modules, 'import sakura imported torch'\n"
        "from sakura.services import Telemetry\n"
        "assert sakura.plugins._MANAGERS\n"
        "print('lazy-ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "lazy-ok"


def test_lazy_targets_are_imported_on_first_use_only(
    make_distribution: Callable[..., Path],
) -> None:
    site = make_distribution(
        "sakura-lazy",
        "sakura_lazy_plugin",
        """
from sakura import hookimpl

@hookimpl
def sakura_register_services(register):
    register("heavy", "sakura_lazy_heavy:HeavyService", description="imports a big framework")
    register("missing", "sakura_lazy_nowhere:Ghost")
""",
    )
    (site / "sakura_lazy_heavy.py").write_text(
        "class HeavyService:\n    name = 'heavy'\n    def __init__(self, size=1):\n        self.size = size\n"
    )
    manager = get_plugin_manager()
    provided = manager.resolve("service", "heavy")
    assert (
        provided.export_name == "HeavyService" and provided.description == "imports a big framework"
    )
    assert "sakura_lazy_heavy" not in sys.modules  # listing did not import it
    assert manager.create("service", "heavy:size=3").size == 3
    from sakura.services import HeavyService  # type: ignore[attr-defined]

    assert HeavyService.__module__ == "sakura_lazy_heavy"
    with pytest.raises(
        ImportError,
        match=r"'missing' from sakura-lazy could not be imported \(sakura_lazy_nowhere:Ghost\)",
    ):
        manager.create("service", "missing")
    sys.modules.pop("sakura_lazy_heavy", None)


def test_invalid_registrations_are_reported(make_distribution: Callable[..., Path]) -> None:
    make_distribution(
        "sakura-badreg",
        "sakura_badreg_plugin",
        """
from sakura import hookimpl

@hookimpl
def sakura_register_services(register):
    register("bad", "not a target")
""",
    )
    with pytest.warns(RuntimeWarning, match="must be callable or a 'module.path:Name' string"):
        assert "bad" not in get_plugin_manager().registry("service")


def test_plugin_names_are_normalised_like_distribution_names(
    make_distribution: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    make_distribution("sakura-greeter", "sakura_greeter_plugin", GOOD)
    monkeypatch.setenv("SAKURA_DISABLED_PLUGINS", "Sakura_Greeter")
    assert "greeter" not in get_plugin_manager().registry("service")
    # enabled under one name, disabled under another: disabled wins, no bogus import error
    only = get_plugin_manager(plugins=["sakura.greeter"], disabled=["SAKURA-GREETER"])
    assert "greeter" not in only.registry("service") and not only.failures


def test_module_without_hooks_named_in_plugin_list_is_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SAKURA_PLUGINS", "json")
    with pytest.warns(RuntimeWarning, match="module 'json' implements no sakura_\\* hook"):
        get_plugin_manager().registry("service")
