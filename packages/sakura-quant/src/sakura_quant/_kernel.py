"""The native NF4 kernels, declared once on :class:`sakura.native.NativeLibrary` (which
builds, caches, checks and falls back; see ``docs/helpers.md``).

* ``csrc/nf4_cpu.cpp``: quantize and dequantize on the CPU, built with
  ``torch.utils.cpp_extension`` on first use.
* ``csrc/nf4_cuda.cu``: dequantize on a CUDA device (fp32 or double-quantized scales),
  compiled with nvcc on first use, only where ``torch.cuda.is_available()``.

Both are cached under ``SAKURA_QUANT_CACHE`` if set, else ``$XDG_CACHE_HOME/sakura-quant``,
else ``~/.cache/sakura-quant``.  ``SAKURA_QUANT_NO_KERNEL=1`` skips both: the pure-torch
path (same bits, slower) is used, as when a build fails (logged with the compiler's output
and warned about once).  Callers use ``LIBRARY.load()`` / ``CUDA_LIBRARY.load()``.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from sakura.native import NativeLibrary
from sakura.native_cuda import CudaLibrary

__all__ = [
    "CACHE_ENV",
    "CUDA_LIBRARY",
    "LIBRARY",
    "NO_KERNEL_ENV",
]

CSRC = Path(__file__).with_name("csrc")


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for name in ("sakura_nf4_quantize_f32", "sakura_nf4_quantize_bf16"):
        fn = getattr(lib, name)
        fn.argtypes = [p, i64, i64, p, p, p, i32]
        fn.restype = None
    for name in ("sakura_nf4_dequantize_f32", "sakura_nf4_dequantize_bf16"):
        fn = getattr(lib, name)
        fn.argtypes = [p, p, i64, i64, p, p, i32]
        fn.restype = None


# data, absmax, scale_codes, scale_code_values, scale_absmax, scale_offset, n, block, code, out
_DEQUANTIZE_ARGS = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 2


def _declare_cuda(lib: ctypes.CDLL) -> None:
    for suffix in ("f32", "bf16"):
        launch = getattr(lib, f"sakura_nf4_dequantize_cuda_{suffix}")
        launch.argtypes = [*_DEQUANTIZE_ARGS, ctypes.c_void_p]  # + cudaStream_t
        launch.restype = ctypes.c_int  # cudaError_t
        emulate = getattr(lib, f"sakura_nf4_dequantize_emulate_{suffix}")
        emulate.argtypes = list(_DEQUANTIZE_ARGS)
        emulate.restype = None


LIBRARY = NativeLibrary(
    package="sakura-quant",
    name="sakura_quant_nf4_cpu",
    sources=[CSRC / "nf4_cpu.cpp"],
    abi_symbol="sakura_quant_abi_version",
    abi_version=1,
    declare=_declare,
    what="C++ NF4 kernel",
)

CUDA_LIBRARY = CudaLibrary(
    package="sakura-quant",
    name="sakura_quant_nf4_cuda",
    sources=[CSRC / "nf4_cuda.cu"],
    abi_symbol="sakura_quant_cuda_abi_version",
    abi_version=1,
    probe_symbol="sakura_quant_cuda_probe",
    declare=_declare_cuda,
    what="CUDA NF4 kernel",
    fallback="the pure-torch path (same bits, slower)",
)

NO_KERNEL_ENV = LIBRARY.disable_env
CACHE_ENV = LIBRARY.cache_env
