"""Register sakura-quant with transformers' quantizer registry when, and only when, that
registry is imported.

``import sakura_quant`` must stay cheap (no torch, no transformers), yet a checkpoint saved
with ``quant_method: "sakura_quant"`` must load with a plain ``from_pretrained`` once
``sakura_quant`` has been imported. So: if ``transformers.quantizers.auto`` is already
imported, register now; otherwise put a one-shot finder on ``sys.meta_path`` that lets the
normal import of that module run and registers right after it (the pattern of wrapt's
post-import hooks). Nothing else is touched, and the finder removes itself on first use.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

__all__ = ["FINDER", "REGISTRY_MODULE", "PostImportFinder", "install"]

REGISTRY_MODULE = "transformers.quantizers.auto"
_lock = threading.Lock()


def _register() -> None:
    hf = sys.modules.get("sakura_quant.hf")
    if hf is not None and not hasattr(hf, "register"):
        return  # sakura_quant.hf is being imported (it imports the registry): it registers itself
    try:
        from sakura_quant.hf import register
    except ImportError as exc:  # e.g. transformers 4: its import must not fail because of us
        warnings.warn(
            f"sakura-quant is not in transformers' quantizer registry: {exc}", stacklevel=2
        )
        return
    register()


class _RunAfter(importlib.abc.Loader):
    """Runs the real loader, then ``callback`` (the freshly imported module is complete)."""

    def __init__(self, loader: importlib.abc.Loader, callback: Callable[[], None]) -> None:
        self._loader = loader
        self._callback = callback

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._callback()

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... of the real one
        return getattr(self._loader, name)


class PostImportFinder(importlib.abc.MetaPathFinder):
    """A one-shot ``sys.meta_path`` entry: when ``fullname`` is imported, it removes itself,
    lets the other finders find the module as usual, and runs ``callback`` once the module
    has executed."""

    def __init__(self, fullname: str, callback: Callable[[], None]) -> None:
        self.fullname = fullname
        self.callback = callback

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.fullname:
            return None
        self.remove()
        spec = importlib.util.find_spec(fullname)  # the finders after us, as usual
        if spec is not None and spec.loader is not None:
            spec.loader = _RunAfter(spec.loader, self.callback)
        return spec

    def install(self) -> None:
        """Run ``callback`` now if ``fullname`` is imported already, else after its import."""
        with _lock:
            if self.fullname not in sys.modules:
                if self not in sys.meta_path:
                    sys.meta_path.insert(0, self)
                return
        self.callback()

    def remove(self) -> None:
        with _lock:
            if self in sys.meta_path:
                sys.meta_path.remove(self)


FINDER = PostImportFinder(REGISTRY_MODULE, _register)


def install() -> None:
    """Register now if transformers' registry is imported, else when it is."""
    FINDER.install()
