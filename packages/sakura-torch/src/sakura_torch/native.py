"""Native kernels for plugin packages: a C or C++ source with a plain C ABI, compiled with
:func:`torch.utils.cpp_extension.load` the first time it is needed, cached on disk, and
called through :mod:`ctypes`.

A package that ships a kernel declares it once::

    HOST_ADAMW = NativeLibrary(
        package="sakura-offload",
        name="sakura_offload_host_adamw",
        sources=[Path(__file__).with_name("csrc") / "host_adamw.cpp"],
        abi_symbol="sakura_offload_abi_version",
        abi_version=2,
        declare=_declare,  # sets argtypes/restype of the exported functions
        what="host AdamW kernel",
    )
    lib = HOST_ADAMW.load()  # a ctypes.CDLL, or None: use the pure-torch path

Why this shape: no torch headers in the source means a build takes seconds rather than a
minute, and one loader means every package gets the same cache layout, environment
variables, logging and fallback.

* The build directory is keyed by torch's and Python's versions, the compiler flags and the
  CPU's feature flags (``-march=native`` code must not run on another CPU that shares the
  home directory); torch's own source hash decides whether to rebuild inside it. It lives
  under ``$SAKURA_<PACKAGE>_CACHE`` if set, else ``$XDG_CACHE_HOME/<package>``, else
  ``~/.cache/<package>``.
* ``SAKURA_<PACKAGE>_NO_KERNEL=1`` skips the kernel (:meth:`NativeLibrary.load` returns
  None), for comparisons and for machines without a compiler.
* A failed build is logged on the ``<package_module>.kernel`` logger with the compiler's
  output and warned about once (``RuntimeWarning``); ``load()`` then returns None and the
  package runs its pure-torch path.  ``load(required=True)`` raises instead.

CUDA sources (``.cu``, same plain C ABI) go through the sibling
:class:`sakura_torch.native_cuda.CudaLibrary`, which runs ``nvcc`` into the same cache
root and shares this class's loading, ABI check, disabling variable and warned-once
fallback.

torch is imported only when a kernel is built: a plugin module that declares a kernel stays
torch-free at import (``sakura`` lists plugins without importing torch).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import threading
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from sakura.env import cache_dir, env_flag

__all__ = ["DEFAULT_CFLAGS", "DEFAULT_LDFLAGS", "NativeLibrary", "cpu_tag"]

# No -ffast-math: kernels must round exactly as their torch reference paths do.
DEFAULT_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno")
DEFAULT_LDFLAGS = ("-fopenmp",)


@functools.cache
def cpu_tag() -> str:
    """A short hash of this CPU's architecture and feature flags.

    On Linux the flags come from ``/proc/cpuinfo``. ``platform.processor()`` is asked only
    where that file does not exist: on Linux it runs ``uname -p`` in a child process, and a
    child forked from a large training process shows that process's whole resident memory
    in peak-RSS figures of its children.
    """
    text = platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith(("flags", "Features")):
                    text += line
                    break
    except OSError:
        text += platform.processor()
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def _env_prefix(package: str) -> str:
    return package.upper().replace("-", "_")


class NativeLibrary:
    """One native library of a package (see the module docstring).

    Args:
        package: the distribution name (``"sakura-offload"``): names the cache folder, the
            environment variables (``SAKURA_OFFLOAD_CACHE``, ``SAKURA_OFFLOAD_NO_KERNEL``)
            and the messages.
        name: the library's file name stem (unique per package).
        sources: its source files.
        abi_symbol / abi_version: an exported ``int fn(void)`` and the value this Python
            code expects, so that a stale cached build is never called with new arguments.
        declare: sets ``argtypes`` / ``restype`` of the exported functions.
        what: how messages name it (``"host AdamW kernel"``).
        cflags / ldflags: compiler and linker flags.
        fallback: what the failed-build warning says runs instead.
    """

    def __init__(
        self,
        *,
        package: str,
        name: str,
        sources: Sequence[str | os.PathLike[str]],
        abi_symbol: str,
        abi_version: int,
        declare: Callable[[ctypes.CDLL], None],
        what: str = "C++ kernel",
        cflags: Sequence[str] = DEFAULT_CFLAGS,
        ldflags: Sequence[str] = DEFAULT_LDFLAGS,
        fallback: str = "the pure-torch path (same results, slower)",
    ) -> None:
        self.package = package
        self.name = name
        self.sources = [Path(s) for s in sources]
        self.abi_symbol = abi_symbol
        self.abi_version = abi_version
        self.declare = declare
        self.what = what
        self.cflags = tuple(cflags)
        self.ldflags = tuple(ldflags)
        self.fallback = fallback
        prefix = _env_prefix(package)
        self.cache_env = f"{prefix}_CACHE"
        self.disable_env = f"{prefix}_NO_KERNEL"
        self.logger = logging.getLogger(f"{package.replace('-', '_')}.kernel")
        self.failure: str | None = None
        """Why the last build failed (``Type: message``), or None."""
        self.path: Path | None = None
        """The built library file once loaded, else None."""
        self._lock = threading.Lock()
        self._tried = False
        self._library: ctypes.CDLL | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.package}:{self.name})"

    def _arguments(self) -> dict[str, Any]:
        return {
            "package": self.package,
            "name": self.name,
            "sources": self.sources,
            "abi_symbol": self.abi_symbol,
            "abi_version": self.abi_version,
            "declare": self.declare,
            "what": self.what,
            "cflags": self.cflags,
            "ldflags": self.ldflags,
            "fallback": self.fallback,
        }

    def replace(self, **changes: Any) -> NativeLibrary:
        """A new, not yet loaded library of the same class with the same arguments except
        ``changes`` (e.g. other ``sources``): a package's tests use it to try a broken
        source or a fresh build without touching the shared instance."""
        return type(self)(**{**self._arguments(), **changes})

    def disabled(self) -> bool:
        """True when ``SAKURA_<PACKAGE>_NO_KERNEL`` asks for the pure-torch path."""
        return bool(env_flag(self.disable_env, False))

    def unavailable(self) -> str | None:
        """Why this library cannot run on this machine at all (then :meth:`load` returns
        None without building or warning), or None.  Always None for CPU code;
        :class:`~sakura_torch.native_cuda.CudaLibrary` says so when there is no CUDA device."""
        return None

    def build_directory(self) -> Path:
        """Where the library is built and cached for this CPU, torch and Python."""
        import torch

        root = cache_dir(self.package, override=self.cache_env)
        flags = hashlib.sha256(" ".join(self.cflags + self.ldflags).encode()).hexdigest()[:8]
        tag = f"torch{torch.__version__.split('+')[0]}-py{platform.python_version()}"
        return root / f"{tag}-cpu{cpu_tag()}-f{flags}"

    def load(self, *, required: bool = False) -> ctypes.CDLL | None:
        """The library, built on first use; None when it cannot be built (warned once) or
        is disabled.  ``required=True`` raises RuntimeError instead (and ignores the
        disabling variable)."""
        if not required and self.disabled():
            return None
        missing = self.unavailable()
        if missing is not None:
            if required:
                raise RuntimeError(f"{self.package}: the {self.what} is not available: {missing}")
            return None
        with self._lock:
            if not self._tried:
                self._tried = True
                try:
                    self._library = self._build()
                except Exception as exc:  # any compiler or loader failure: fall back
                    self.failure = f"{type(exc).__name__}: {exc}"
                    self.logger.exception("%s: building the %s failed", self.package, self.what)
                    warnings.warn(
                        f"{self.package}: the {self.what} could not be built "
                        f"({type(exc).__name__}: {str(exc)[:300]}); using {self.fallback}",
                        RuntimeWarning,
                        stacklevel=3,
                    )
            library = self._library
        if library is None and required:
            raise RuntimeError(
                f"{self.package}: the {self.what} is not available: "
                + (self.failure or "unknown error")
            )
        return library

    def _build(self) -> ctypes.CDLL:
        directory = self.build_directory()
        directory.mkdir(parents=True, exist_ok=True)
        self.logger.info("%s: building or loading the %s in %s", self.package, self.what, directory)
        library = self.open(self._compile(directory))
        self.logger.info("%s: %s ready (%s)", self.package, self.what, self.path)
        return library

    def open(self, path: str | os.PathLike[str]) -> ctypes.CDLL:
        """Load a built library file, check its ABI version and declare its functions (an
        exported function that ``declare`` names but the file lacks raises
        AttributeError).  :meth:`load` calls it; a test may call it on a file it built."""
        library = ctypes.CDLL(str(path))
        abi = getattr(library, self.abi_symbol)
        abi.restype = ctypes.c_int
        abi.argtypes = []
        version = abi()
        if version != self.abi_version:
            raise RuntimeError(
                f"{self.name}: the built library has ABI {version}, this code expects "
                f"{self.abi_version} (a stale cache? remove {Path(path).parent})"
            )
        self.declare(library)
        self.path = Path(path)
        return library

    def _compile(self, directory: Path) -> Path:
        """Build (or find up to date) the shared library in ``directory``; its path."""
        from torch.utils.cpp_extension import load

        path = load(
            name=self.name,
            sources=[str(s) for s in self.sources],
            extra_cflags=list(self.cflags),
            extra_ldflags=list(self.ldflags),
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )
        return Path(str(path))
