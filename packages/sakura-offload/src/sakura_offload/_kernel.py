"""The C++ host kernel: built with :func:`torch.utils.cpp_extension.load` on first use,
cached on disk, called through ctypes.

The source (``csrc/host_adamw.cpp``) has a plain C ABI and no torch headers, so a build
takes seconds.  The build directory is keyed by the source hash (torch's own check), the
compiler flags and the CPU's feature flags (``-march=native`` code must not run on another
CPU sharing a home directory).  Where it lives:

* ``SAKURA_OFFLOAD_CACHE`` if set, else ``$XDG_CACHE_HOME/sakura-offload``, else
  ``~/.cache/sakura-offload``;
* ``SAKURA_OFFLOAD_NO_KERNEL=1`` skips the kernel: every optimizer uses the pure-torch
  path (``backend="auto"``), as when the build fails.

A failed build is logged with the compiler's output and warned about once; the optimizers
then use the pure-torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

from sakura.env import env_flag

__all__ = ["CACHE_ENV", "NO_KERNEL_ENV", "Kernel", "build_directory", "load_kernel"]

logger = logging.getLogger("sakura_offload.kernel")

NO_KERNEL_ENV = "SAKURA_OFFLOAD_NO_KERNEL"
CACHE_ENV = "SAKURA_OFFLOAD_CACHE"
ABI_VERSION = 2
SOURCE = Path(__file__).with_name("csrc") / "host_adamw.cpp"
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno")
LDFLAGS = ("-fopenmp",)

_c_float_p = ctypes.POINTER(ctypes.c_float)


@dataclass(frozen=True)
class Kernel:
    """The loaded library and where it was built."""

    library: ctypes.CDLL
    path: Path

    @property
    def fp32(self) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
        return self.library.sakura_adamw_fp32

    @property
    def bf16(self) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
        return self.library.sakura_adamw_bf16

    @property
    def int8(self) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
        return self.library.sakura_adamw_int8

    @property
    def decode_tables(self) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
        return self.library.sakura_decode_tables

    @property
    def triad(self) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
        return self.library.sakura_triad


_lock = threading.Lock()
_loaded: dict[str, Kernel | None] = {}
_failure: list[str] = []


def _cpu_tag() -> str:
    """A short hash of the CPU's feature flags (``-march=native`` code is per CPU)."""
    text = platform.machine() + platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith(("flags", "Features")):
                    text += line
                    break
    except OSError:
        pass
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def build_directory() -> Path:
    """Where the kernel is built and cached for this CPU, torch and Python."""
    import torch

    root = os.environ.get(CACHE_ENV)
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        root = str(Path(xdg) / "sakura-offload")
    flags = hashlib.sha256(" ".join(CFLAGS + LDFLAGS).encode()).hexdigest()[:8]
    tag = f"torch{torch.__version__.split('+')[0]}-py{platform.python_version()}"
    return Path(root) / f"{tag}-cpu{_cpu_tag()}-f{flags}"


def _declare(lib: ctypes.CDLL) -> None:
    f, i64, i32, u32, ptr = (
        ctypes.c_float,
        ctypes.c_int64,
        ctypes.c_int,
        ctypes.c_uint32,
        ctypes.c_void_p,
    )
    hyper = [f] * 8  # decay, w1, beta2, c2, eps, neg_step, bc2_sqrt, grad_scale
    lib.sakura_offload_abi_version.restype = i32
    lib.sakura_adamw_fp32.argtypes = [ptr, ptr, ptr, ptr, i64, *hyper, i32]
    lib.sakura_adamw_fp32.restype = None
    lib.sakura_adamw_bf16.argtypes = [ptr, ptr, ptr, ptr, i64, *hyper, u32, i32]
    lib.sakura_adamw_bf16.restype = None
    lib.sakura_adamw_int8.argtypes = [ptr] * 6 + [i64, *hyper, u32, i32]
    lib.sakura_decode_tables.argtypes = [ptr, ptr]
    lib.sakura_decode_tables.restype = None
    lib.sakura_adamw_int8.restype = None
    lib.sakura_triad.argtypes = [ptr, ptr, ptr, f, i64, i32]
    lib.sakura_triad.restype = None


def _build() -> Kernel:
    from torch.utils.cpp_extension import load

    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    logger.info("sakura-offload: building or loading the host AdamW kernel in %s", directory)
    path = load(
        name="sakura_offload_host_adamw",
        sources=[str(SOURCE)],
        extra_cflags=list(CFLAGS),
        extra_ldflags=list(LDFLAGS),
        build_directory=str(directory),
        is_python_module=False,
        verbose=False,
    )
    library = ctypes.CDLL(str(path))
    _declare(library)
    version = library.sakura_offload_abi_version()
    if version != ABI_VERSION:
        raise RuntimeError(f"kernel ABI {version}, expected {ABI_VERSION}")
    logger.info("sakura-offload: host AdamW kernel ready (%s)", path)
    return Kernel(library, Path(str(path)))


def kernel_disabled() -> bool:
    """True when ``SAKURA_OFFLOAD_NO_KERNEL`` asks for the pure-torch path."""
    return bool(env_flag(NO_KERNEL_ENV, False))


def load_kernel(*, required: bool = False) -> Kernel | None:
    """The C++ kernel, built on first use; None when it cannot be built (warned once) or
    ``SAKURA_OFFLOAD_NO_KERNEL`` is set.  ``required=True`` raises instead (and ignores the
    variable)."""
    if not required and kernel_disabled():
        return None
    with _lock:
        if "kernel" not in _loaded:
            try:
                _loaded["kernel"] = _build()
            except Exception as exc:  # any compiler or loader failure: fall back
                _loaded["kernel"] = None
                _failure.append(f"{type(exc).__name__}: {exc}")
                logger.exception("sakura-offload: building the host AdamW kernel failed")
                warnings.warn(
                    "sakura-offload: the C++ host AdamW kernel could not be built "
                    f"({type(exc).__name__}: {str(exc)[:300]}); using the pure-torch "
                    "path, which is slower",
                    RuntimeWarning,
                    stacklevel=3,
                )
        kernel = _loaded["kernel"]
    if kernel is None and required:
        raise RuntimeError(
            "sakura-offload: the C++ host AdamW kernel is not available: "
            + (_failure[-1] if _failure else "unknown error")
        )
    return kernel
