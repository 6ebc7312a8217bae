"""sakura_torch.native: a real C++ source compiled with torch's cpp_extension, cached,
loaded through ctypes; ABI checks, the disabling variable and the warned-once fallback."""

from __future__ import annotations

import ctypes
import shutil
import warnings
from pathlib import Path

import pytest

pytest.importorskip("torch")
if shutil.which("c++") is None and shutil.which("g++") is None:
    pytest.skip("no C++ compiler", allow_module_level=True)

from sakura_torch.native import NativeLibrary, cpu_tag

SOURCE = """
extern "C" int t_abi(void) { return 3; }
extern "C" long long t_sum(const int* values, long long n) {
    long long total = 0;
    for (long long i = 0; i < n; ++i) total += values[i];
    return total;
}
"""


def _declare(lib: ctypes.CDLL) -> None:
    lib.t_sum.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_longlong]
    lib.t_sum.restype = ctypes.c_longlong


def library(tmp_path: Path, name: str, *, source: str = SOURCE, abi: int = 3) -> NativeLibrary:
    path = tmp_path / f"{name}.cpp"
    path.write_text(source)
    return NativeLibrary(
        package="sakura-testpkg",
        name=name,
        sources=[path],
        abi_symbol="t_abi",
        abi_version=abi,
        declare=_declare,
        what="test kernel",
    )


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SAKURA_TESTPKG_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SAKURA_TESTPKG_NO_KERNEL", raising=False)
    return tmp_path / "cache"


def test_builds_caches_and_calls(tmp_path: Path, _cache: Path) -> None:
    native = library(tmp_path, "sakura_native_test_ok")
    lib = native.load()
    assert lib is not None and native.load() is lib  # built once
    values = (ctypes.c_int * 5)(1, 2, 3, 4, 5)
    assert lib.t_sum(values, 5) == 15
    directory = native.build_directory()
    assert directory.parent == _cache and f"cpu{cpu_tag()}" in directory.name
    assert any(directory.glob("sakura_native_test_ok*.so"))
    # A second object (a new process, in effect) reuses the cached build.
    again = library(tmp_path, "sakura_native_test_ok").load()
    assert again is not None and again.t_sum(values, 2) == 3


def test_a_stale_abi_falls_back_with_one_warning(tmp_path: Path) -> None:
    native = library(tmp_path, "sakura_native_test_abi", abi=4)
    with pytest.warns(RuntimeWarning, match="the test kernel could not be built") as caught:
        assert native.load() is None
        assert native.load() is None  # tried once, warned once
    assert len(caught) == 1
    assert native.failure is not None and "has ABI 3, this code expects 4" in native.failure
    with pytest.raises(RuntimeError, match="sakura-testpkg: the test kernel is not available"):
        native.load(required=True)


def test_a_compile_error_falls_back(tmp_path: Path) -> None:
    native = library(tmp_path, "sakura_native_test_broken", source="this is not C++")
    with pytest.warns(RuntimeWarning, match="pure-torch path"):
        assert native.load() is None
    assert native.failure is not None


def test_the_disabling_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    native = library(tmp_path, "sakura_native_test_disabled")
    assert (native.cache_env, native.disable_env) == (
        "SAKURA_TESTPKG_CACHE",
        "SAKURA_TESTPKG_NO_KERNEL",
    )
    monkeypatch.setenv("SAKURA_TESTPKG_NO_KERNEL", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.disabled() and native.load() is None
    assert native.load(required=True) is not None  # required ignores the variable


def test_replace_gives_a_fresh_library_and_open_checks_a_built_file(tmp_path: Path) -> None:
    native = library(tmp_path, "sakura_native_test_replace")
    lib = native.load()
    assert lib is not None and native.path is not None and native.path.exists()
    broken = tmp_path / "broken.cpp"
    broken.write_text("not C++ either")
    other = native.replace(sources=[broken], fallback="the slow path")
    assert type(other) is NativeLibrary and other.path is None and other.sources == [broken]
    with pytest.warns(RuntimeWarning, match="using the slow path"):
        assert other.load() is None
    assert native.load() is lib  # the original is untouched
    # open() loads, checks the ABI of and declares a file built elsewhere.
    again = native.replace(abi_version=3).open(native.path)
    assert again.t_sum((ctypes.c_int * 2)(4, 5), 2) == 9
    with pytest.raises(RuntimeError, match="has ABI 3, this code expects 9"):
        native.replace(abi_version=9).open(native.path)
