"""The C++ NF4 kernels: built with :func:`torch.utils.cpp_extension.load` on first use,
cached on disk, called through ctypes.

The source (``csrc/nf4_cpu.cpp``) has a plain C ABI and no torch headers, so a build takes
seconds.  The build directory is keyed by torch's and Python's versions, the compiler flags
and the CPU's feature flags (``-march=native`` code must not run on another CPU sharing a
home directory).  Where it lives: ``SAKURA_QUANT_CACHE`` if set, else
``$XDG_CACHE_HOME/sakura-quant``, else ``~/.cache/sakura-quant``.
``SAKURA_QUANT_NO_KERNEL=1`` skips it: the pure-torch path (same bits, slower) is used, as
when the build fails (logged with the compiler's output and warned about once).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import threading
import warnings
from pathlib import Path

from sakura.env import env_flag

__all__ = ["CACHE_ENV", "NO_KERNEL_ENV", "load_kernel"]

logger = logging.getLogger("sakura_quant.kernel")

NO_KERNEL_ENV = "SAKURA_QUANT_NO_KERNEL"
CACHE_ENV = "SAKURA_QUANT_CACHE"
ABI_VERSION = 1
SOURCE = Path(__file__).with_name("csrc") / "nf4_cpu.cpp"
# No -ffast-math: the kernels must round exactly as the torch path does.
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno")
LDFLAGS = ("-fopenmp",)

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def _cpu_tag() -> str:
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
    """Where the kernels are built and cached for this CPU, torch and Python."""
    import torch

    root = os.environ.get(CACHE_ENV)
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        root = str(Path(xdg) / "sakura-quant")
    flags = hashlib.sha256(" ".join(CFLAGS + LDFLAGS).encode()).hexdigest()[:8]
    tag = f"torch{torch.__version__.split('+')[0]}-py{platform.python_version()}"
    return Path(root) / f"{tag}-cpu{_cpu_tag()}-f{flags}"


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.sakura_quant_abi_version.restype = i32
    for name in ("sakura_nf4_quantize_f32", "sakura_nf4_quantize_bf16"):
        fn = getattr(lib, name)
        fn.argtypes = [p, i64, i64, p, p, p, i32]
        fn.restype = None
    for name in ("sakura_nf4_dequantize_f32", "sakura_nf4_dequantize_bf16"):
        fn = getattr(lib, name)
        fn.argtypes = [p, p, i64, i64, p, p, i32]
        fn.restype = None


def _build() -> ctypes.CDLL:
    from torch.utils.cpp_extension import load

    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    logger.info("sakura-quant: building or loading the NF4 kernels in %s", directory)
    path = load(
        name="sakura_quant_nf4_cpu",
        sources=[str(SOURCE)],
        extra_cflags=list(CFLAGS),
        extra_ldflags=list(LDFLAGS),
        build_directory=str(directory),
        is_python_module=False,
        verbose=False,
    )
    library = ctypes.CDLL(str(path))
    _declare(library)
    version = library.sakura_quant_abi_version()
    if version != ABI_VERSION:
        raise RuntimeError(f"kernel ABI {version}, expected {ABI_VERSION}")
    return library


def kernel_disabled() -> bool:
    """True when ``SAKURA_QUANT_NO_KERNEL`` asks for the pure-torch path."""
    return bool(env_flag(NO_KERNEL_ENV, False))


def load_kernel() -> ctypes.CDLL | None:
    """The C++ kernels, built on first use; None when disabled or not buildable."""
    if kernel_disabled():
        return None
    with _lock:
        if "kernel" not in _loaded:
            try:
                _loaded["kernel"] = _build()
            except Exception as exc:  # any compiler or loader failure: fall back
                _loaded["kernel"] = None
                logger.exception("sakura-quant: building the NF4 kernels failed")
                warnings.warn(
                    "sakura-quant: the C++ NF4 kernels could not be built "
                    f"({type(exc).__name__}: {str(exc)[:300]}); using the pure-torch path "
                    "(same results, slower)",
                    RuntimeWarning,
                    stacklevel=3,
                )
        return _loaded["kernel"]
