"""The shared helpers every package uses: option validation, atomic writes, environment."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from sakura.env import env_flag, env_int, env_list
from sakura.errors import ConfigError
from sakura.fileio import atomic_directory, atomic_write_bytes, atomic_writer, fsync_dir
from sakura.options import (
    OptionError,
    check_bool,
    check_choice,
    check_int,
    check_number,
    option_error,
)

# --- options ---------------------------------------------------------------------------


def test_option_error_names_owner_option_value_and_accepted() -> None:
    err = option_error("moment_dtype", "fp4", "'float32', 'int8'", owner="OffloadAdamW")
    assert str(err) == (
        "OffloadAdamW: moment_dtype='fp4' is not accepted; accepted: 'float32', 'int8'"
    )
    assert isinstance(err, ValueError)
    assert (err.option, err.value, err.accepted) == ("moment_dtype", "fp4", "'float32', 'int8'")


def test_check_choice() -> None:
    assert check_choice("fmt", "nf4", ("int8", "nf4")) == "nf4"
    with pytest.raises(OptionError, match=r"fmt='fp4' is not accepted; accepted: 'int8', 'nf4'"):
        check_choice("fmt", "fp4", ("int8", "nf4"))
    # True == 1 in Python, but an option accepting 1 does not accept True (and vice versa).
    with pytest.raises(OptionError):
        check_choice("level", True, (1, 2))
    with pytest.raises(OptionError):
        check_choice("flag", 1, (True, False))
    assert check_choice("flag", False, (True, False)) is False


def test_check_bool() -> None:
    assert check_bool("eager", True) is True
    for bad in (1, 0, "true", None):
        with pytest.raises(OptionError, match="accepted: True or False"):
            check_bool("eager", bad)


def test_check_int() -> None:
    assert check_int("n", 3, minimum=1, maximum=3) == 3
    assert check_int("n", None, allow_none=True) is None
    for bad in (0, 4, 2.0, True, "2", None):
        with pytest.raises(OptionError, match=r"accepted: an int >= 1 and <= 3"):
            check_int("n", bad, minimum=1, maximum=3)
    with pytest.raises(OptionError, match=r"accepted: an int >= 2 or None"):
        check_int("n", 1, minimum=2, allow_none=True, owner="X")


def test_check_number() -> None:
    assert check_number("lr", 1) == 1.0
    assert isinstance(check_number("lr", 1), float)
    assert check_number("frac", 0.5, minimum=0, maximum=0.5) == 0.5
    for bad in (float("nan"), float("inf"), True, "1", 0.0):
        with pytest.raises(OptionError, match=r"accepted: a finite number > 0"):
            check_number("lr", bad, minimum=0, min_inclusive=False)
    with pytest.raises(OptionError, match=r"a finite number >= 0 and < 1 or None"):
        check_number("beta", 1.0, minimum=0, maximum=1, max_inclusive=False, allow_none=True)


# --- atomic writes ---------------------------------------------------------------------


def test_atomic_writer_replaces_and_leaves_no_temporary(tmp_path) -> None:
    target = tmp_path / "state.bin"
    target.write_bytes(b"old")
    with atomic_writer(target) as f:
        f.write(b"new")
        assert target.read_bytes() == b"old"  # not visible before the rename
    assert target.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.bin"]


def test_atomic_writer_text_mode(tmp_path) -> None:
    with atomic_writer(tmp_path / "a.json", "w") as f:
        f.write('{"ü": 1}')
    assert (tmp_path / "a.json").read_text(encoding="utf-8") == '{"ü": 1}'
    with pytest.raises(ValueError, match="mode='a'"), atomic_writer(tmp_path / "b", "a"):
        pass


def test_atomic_writer_failure_keeps_old_file(tmp_path) -> None:
    target = tmp_path / "state.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="boom"), atomic_writer(target) as f:
        f.write(b"partial")
        raise RuntimeError("boom")
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.bin"]


@pytest.mark.skipif(os.name == "nt" or os.geteuid() == 0, reason="root ignores permissions")
def test_atomic_writer_read_only_directory_names_the_path(tmp_path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        with pytest.raises(PermissionError) as info:
            atomic_write_bytes(ro / "x", b"1")
        assert str(ro) in "".join(getattr(info.value, "__notes__", []))
    finally:
        ro.chmod(stat.S_IRWXU)


def test_atomic_writer_missing_directory_names_the_path(tmp_path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        atomic_write_bytes(tmp_path / "missing" / "x", b"1")
    assert str(tmp_path / "missing") in "".join(getattr(info.value, "__notes__", []))


def test_atomic_directory(tmp_path) -> None:
    target = tmp_path / "ckpt-1"
    with atomic_directory(target) as tmp:
        (tmp / "state.pt").write_bytes(b"s")
        assert not target.exists()
    assert (target / "state.pt").read_bytes() == b"s"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-1"]
    with pytest.raises(FileExistsError), atomic_directory(target):
        pass
    with pytest.raises(RuntimeError), atomic_directory(tmp_path / "ckpt-2") as tmp:
        (tmp / "x").write_bytes(b"1")
        raise RuntimeError("crash")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-1"]
    fsync_dir(tmp_path)  # a directory can be fsynced on its own


# --- environment -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("1", True), ("on", True), ("TRUE", True), (" yes ", True), ("0", False), ("off", False),
     ("", False), ("No", False)],
)  # fmt: skip
def test_env_flag_words(raw: str, expected: bool) -> None:
    assert env_flag("X", environ={"X": raw}) is expected


def test_env_flag_unset_and_bad() -> None:
    assert env_flag("X", environ={}) is None
    assert env_flag("X", True, environ={}) is True
    with pytest.raises(ConfigError, match=r"X='maybe' is not accepted; accepted: 1/0"):
        env_flag("X", environ={"X": "maybe"})


def test_env_list_and_int() -> None:
    assert env_list("P", environ={"P": " a, ,b ,"}) == ["a", "b"]
    assert env_list("P", environ={}) is None
    assert env_int("N", 4, environ={}) == 4
    assert env_int("N", environ={"N": " 7 "}) == 7
    with pytest.raises(ConfigError, match=r"N='x' is not accepted; accepted: an integer >= 1"):
        env_int("N", minimum=1, environ={"N": "x"})


def test_env_choice() -> None:
    from sakura.env import env_choice

    modes = ("poll", "spin", "block")
    assert env_choice("M", modes, "poll", environ={}) == "poll"
    assert env_choice("M", modes, "poll", environ={"M": "  "}) == "poll"
    assert env_choice("M", modes, environ={"M": " SPIN "}) == "spin"
    with pytest.raises(ConfigError, match=r"M='wait' is not accepted; accepted: 'poll', 'spin'"):
        env_choice("M", modes, environ={"M": "wait"})


def test_cache_dir_order(tmp_path: Path) -> None:
    from sakura.env import cache_dir

    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    assert (
        cache_dir("sakura-x", override="SAKURA_X_CACHE", environ=env)
        == tmp_path / "xdg" / "sakura-x"
    )
    env["SAKURA_X_CACHE"] = str(tmp_path / "mine")
    assert cache_dir("sakura-x", override="SAKURA_X_CACHE", environ=env) == tmp_path / "mine"
    env["SAKURA_X_CACHE"] = ""  # empty is unset
    assert (
        cache_dir("a", "b", override="SAKURA_X_CACHE", environ=env) == tmp_path / "xdg" / "a" / "b"
    )
    assert cache_dir("a", environ={}) == Path.home() / ".cache" / "a"
