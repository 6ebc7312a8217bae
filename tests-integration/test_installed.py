"""What runs here is the built wheels, installed as a user would install them."""

from __future__ import annotations

import importlib.metadata as md
import json
import subprocess
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path

Run = Callable[..., subprocess.CompletedProcess[str]]  # the `run` fixture of conftest.py

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
EXAMPLE_PLUGIN = HERE / "sakura-example-plugin"
SITE_PACKAGES = Path(sysconfig.get_paths()["purelib"]).resolve()


def test_sakura_is_imported_from_site_packages() -> None:
    import sakura

    location = Path(sakura.__file__).resolve()
    assert SITE_PACKAGES in location.parents, f"sakura imported from {location}"
    assert (REPO / "core" / "src") not in location.parents
    assert md.version("sakura-core") == sakura.__version__


def test_example_plugin_is_imported_from_site_packages() -> None:
    import sakura_example_plugin

    location = Path(sakura_example_plugin.__file__).resolve()
    assert SITE_PACKAGES in location.parents, f"sakura_example_plugin imported from {location}"
    assert EXAMPLE_PLUGIN not in location.parents
    assert md.version("sakura-example-plugin") == "0.1.0"


def test_installed_from_wheels_not_editable() -> None:
    for name in ("sakura-core", "sakura-example-plugin"):
        direct_url = md.distribution(name).read_text("direct_url.json")
        if direct_url is not None:  # only present for installs from a path or URL
            info = json.loads(direct_url)
            assert not info.get("dir_info", {}).get("editable", False), f"{name} is editable"
            assert info["url"].endswith(".whl"), f"{name} was not installed from a wheel: {info}"


def test_example_plugin_does_not_depend_on_torch() -> None:
    requires = md.requires("sakura-example-plugin") or []
    runtime = [r for r in requires if "extra ==" not in r]
    assert any(r.startswith("sakura-core") for r in runtime), requires
    assert not [r for r in runtime if r.startswith("torch")], runtime


def test_entry_point_is_registered() -> None:
    (ep,) = [ep for ep in md.entry_points(group="sakura") if ep.name == "example"]
    assert ep.value == "sakura_example_plugin.plugin"
    assert ep.dist is not None and ep.dist.name == "sakura-example-plugin"


def test_import_sakura_does_not_import_torch(run: Run) -> None:
    # Importing the core, its test helpers, the example plugin, and loading every plugin
    # (what `sakura services` does) must leave torch unimported.
    code = (
        "import json, sys\n"
        "import sakura, sakura.testing, sakura.plugins, sakura.config\n"
        "import sakura_example_plugin, sakura_example_plugin.plugin\n"
        "sakura.plugins.get_plugin_manager().registry('service')\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')))\n"
    )
    result = run([sys.executable, "-c", code])
    assert json.loads(result.stdout) == []
