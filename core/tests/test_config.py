"""Configuration sources and their precedence: arguments > env > sakura.toml > pyproject."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from sakura import ConfigError, SakuraRuntime, Telemetry
from sakura.config import load_config
from sakura.plugins import KNOWN_PROVIDERS


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_defaults_without_any_file(tmp_path: Path) -> None:
    config = load_config(cwd=tmp_path, environ={})
    assert (config.plugins, config.disabled_plugins, config.autoload) == (None, [], True)
    assert (config.services, config.strict, config.history, config.source) == (
        [],
        False,
        True,
        None,
    )


def test_pyproject_tool_table_is_read(tmp_path: Path) -> None:
    write(
        tmp_path / "pyproject.toml",
        '[project]\nname="x"\n[tool.sakura]\nservices=["telemetry"]\nstrict=true\n',
    )
    config = load_config(cwd=tmp_path, environ={})
    assert config.services == ["telemetry"] and config.strict is True
    assert config.source == str(tmp_path / "pyproject.toml")


def test_sakura_toml_wins_over_pyproject(tmp_path: Path) -> None:
    write(tmp_path / "pyproject.toml", '[tool.sakura]\nservices=["from-pyproject"]\n')
    write(tmp_path / "sakura.toml", 'services=["from-sakura-toml"]\nhistory=false\n')
    config = load_config(cwd=tmp_path, environ={})
    assert config.services == ["from-sakura-toml"] and config.history is False


def test_sakura_config_env_wins_over_local_files(tmp_path: Path) -> None:
    write(tmp_path / "sakura.toml", 'services=["local"]\n')
    other = write(tmp_path / "other.toml", 'services=["from-env-file"]\n')
    config = load_config(cwd=tmp_path, environ={"SAKURA_CONFIG": str(other)})
    assert config.services == ["from-env-file"]
    with pytest.raises(ConfigError, match=r"SAKURA_CONFIG='/nope\.toml': no such file"):
        load_config(cwd=tmp_path, environ={"SAKURA_CONFIG": "/nope.toml"})


def test_environment_overrides_file_and_arguments_override_environment(tmp_path: Path) -> None:
    write(
        tmp_path / "sakura.toml", 'plugins=["file-plugin"]\ndisabled_plugins=["x"]\nautoload=true\n'
    )
    env = {
        "SAKURA_PLUGINS": "env-a, env-b",
        "SAKURA_DISABLED_PLUGINS": "",
        "SAKURA_DISABLE_PLUGIN_AUTOLOAD": "1",
    }
    config = load_config(cwd=tmp_path, environ=env)
    assert (config.plugins, config.disabled_plugins, config.autoload) == (
        ["env-a", "env-b"],
        [],
        False,
    )
    config = load_config(
        cwd=tmp_path, environ=env, plugins=["arg"], disabled_plugins=["d"], strict=True
    )
    assert (config.plugins, config.disabled_plugins, config.strict) == (["arg"], ["d"], True)


def test_explicit_path_is_used_and_must_exist(tmp_path: Path) -> None:
    config_file = write(tmp_path / "custom.toml", 'services=[{name="telemetry", path="x.jsonl"}]\n')
    assert load_config(config_file, cwd=tmp_path, environ={}).services == [
        {"name": "telemetry", "path": "x.jsonl"}
    ]
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml", environ={})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("servces=[]", "unknown key 'servces'; did you mean 'services'"),
        ("plugins='one'", "plugins must be a list of plugin names"),
        ("strict='yes'", "strict must be true or false"),
        ("services=[1]", "each service must be a spec string"),
        ("services=[{path='x'}]", "each service must be a spec string"),
        ("services='telemetry'", "services must be a list"),
        ("= broken", "invalid TOML"),
    ],
)
def test_invalid_files_name_the_key_and_what_is_accepted(
    tmp_path: Path, text: str, message: str
) -> None:
    write(tmp_path / "sakura.toml", text + "\n")
    with pytest.raises(ConfigError, match=message) as info:
        load_config(cwd=tmp_path, environ={})
    assert "sakura.toml" in str(info.value)


def test_invalid_environment_flag(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="SAKURA_DISABLE_PLUGIN_AUTOLOAD='maybe'"):
        load_config(cwd=tmp_path, environ={"SAKURA_DISABLE_PLUGIN_AUTOLOAD": "maybe"})
    with pytest.raises(ConfigError, match="plugins must be a list of names"):
        load_config(cwd=tmp_path, environ={}, plugins="one")


def test_from_config_installs_services_from_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make_distribution: Callable[..., Path]
) -> None:
    out = tmp_path / "events.jsonl"
    write(tmp_path / "sakura.toml", f'services=["telemetry:path={out}"]\nstrict=true\n')
    monkeypatch.chdir(tmp_path)
    rt = SakuraRuntime.from_config()
    assert rt.strict is True
    [telemetry] = rt.services
    assert isinstance(telemetry, Telemetry) and telemetry.path_template == str(out)
    # arguments replace the file's services
    rt2 = SakuraRuntime.from_config(services=[Telemetry(tmp_path / "b.jsonl")], strict=False)
    assert rt2.services[0].path_template == str(tmp_path / "b.jsonl") and rt2.strict is False


def test_from_config_unknown_service_names_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(KNOWN_PROVIDERS, "warp_drive", "sakura-warp")  # certainly not installed
    write(tmp_path / "sakura.toml", 'services=["warp_drive"]\n')
    monkeypatch.chdir(tmp_path)
    with pytest.raises(LookupError, match="pip install sakura-warp"):
        SakuraRuntime.from_config()
    # an installed first-party package that the config keeps from loading is "disabled"
    write(tmp_path / "sakura.toml", 'autoload = false\nservices=["zero1"]\n')
    with pytest.raises(LookupError, match="provided by sakura-zero, which is"):
        SakuraRuntime.from_config()
