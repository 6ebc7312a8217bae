from __future__ import annotations

import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from sakura.plugins import reset_plugin_managers

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _clean_plugin_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test starts with no SAKURA_* variables and no cached plugin manager."""
    for var in (
        "SAKURA_PLUGINS",
        "SAKURA_DISABLED_PLUGINS",
        "SAKURA_DISABLE_PLUGIN_AUTOLOAD",
        "SAKURA_CONFIG",
        "RANK",
        "WORLD_SIZE",
    ):
        monkeypatch.delenv(var, raising=False)
    reset_plugin_managers()
    yield
    reset_plugin_managers()


@pytest.fixture
def make_distribution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Path]:
    """Create an installed-looking distribution (a module plus a .dist-info with an
    entry point in the ``sakura`` group) on sys.path, as pip would lay it out."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    created: list[str] = []

    def make(
        dist: str, module: str, source: str, *, entry_name: str | None = None, version: str = "1.0"
    ) -> Path:
        (site / f"{module}.py").write_text(textwrap.dedent(source))
        info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        (info / "entry_points.txt").write_text(f"[sakura]\n{entry_name or dist} = {module}\n")
        created.append(module)
        import importlib

        importlib.invalidate_caches()
        return site

    yield make  # type: ignore[misc]
    for module in created:
        sys.modules.pop(module, None)
