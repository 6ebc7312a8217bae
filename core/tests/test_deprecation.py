"""sakura.deprecation: an old public name resolves to the new object and warns once per use."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from types import ModuleType

import pytest

from sakura.deprecation import deprecated_aliases


class NewNameError(AssertionError):
    pass


@pytest.fixture
def module() -> Iterator[ModuleType]:
    mod = ModuleType("sakura_fake_renamed")
    mod.NewNameError = NewNameError  # type: ignore[attr-defined]
    mod.__getattr__ = deprecated_aliases(  # type: ignore[method-assign]
        "sakura_fake_renamed", {"OldName": NewNameError}, removed_in="0.3"
    )
    sys.modules[mod.__name__] = mod
    yield mod
    del sys.modules[mod.__name__]


def test_old_name_is_the_new_object_and_warns(module: ModuleType) -> None:
    with pytest.warns(DeprecationWarning) as record:
        from sakura_fake_renamed import OldName  # type: ignore[import-not-found]
    assert OldName is NewNameError
    [warning] = record
    assert str(warning.message) == (
        "sakura_fake_renamed.OldName is deprecated and will be removed in 0.3; use "
        f"{__name__}.NewNameError"
    )
    assert warning.filename == __file__  # points at the importing line, not the helper
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from sakura_fake_renamed import NewNameError as new  # type: ignore[import-not-found]
    assert new is NewNameError
    with pytest.raises(NewNameError), pytest.warns(DeprecationWarning):
        try:
            raise NewNameError("boom")
        except module.OldName:  # an except clause written with the old name still catches
            raise


def test_unknown_names_and_fallback(module: ModuleType) -> None:
    with pytest.raises(AttributeError, match="module 'sakura_fake_renamed' has no attribute 'X'"):
        module.X  # noqa: B018
    chained = deprecated_aliases("m", {"Old": int}, removed_in="0.3", fallback=lambda n: n * 2)
    assert chained("ab") == "abab"
