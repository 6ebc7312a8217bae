"""The native NF4 kernels, declared once on :class:`sakura_torch.native.NativeLibrary`
(which builds, caches, checks and falls back; see ``docs/helpers.md``).

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

from sakura_torch.native import NativeLibrary
from sakura_torch.native_cuda import CudaLibrary

__all__ = [
    "BAD_ARGUMENTS",
    "CACHE_ENV",
    "CUDA_LIBRARY",
    "LIBRARY",
    "NO_KERNEL_ENV",
]

CSRC = Path(__file__).with_name("csrc")


BAD_ARGUMENTS = -1
"""What a kernel entry point returns when the sizes it is given disagree (it reads nothing)."""


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for name in ("sakura_nf4_quantize_f32", "sakura_nf4_quantize_bf16"):
        fn = getattr(lib, name)
        # x, x_len, n, block, mid, absmax, absmax_len, out, out_len, threads
        fn.argtypes = [p, i64, i64, i64, p, p, i64, p, i64, i32]
        fn.restype = i64  # 0, BAD_ARGUMENTS, or the count of NaN / Inf inputs
    for name in ("sakura_nf4_dequantize_f32", "sakura_nf4_dequantize_bf16"):
        fn = getattr(lib, name)
        # data, data_len, absmax, absmax_len, n, block, code, out, out_len, threads
        fn.argtypes = [p, i64, p, i64, i64, i64, p, p, i64, i32]
        fn.restype = i32  # 0 or BAD_ARGUMENTS


# data, data_len, absmax, absmax_len, scale_codes, scale_codes_len, scale_code_values,
# scale_absmax, scale_absmax_len, scale_offset, n, block, code, out, out_len
_p, _i64 = ctypes.c_void_p, ctypes.c_int64
_DEQUANTIZE_ARGS = [_p, _i64, _p, _i64, _p, _i64, _p, _p, _i64, _p, _i64, _i64, _p, _p, _i64]


def _declare_cuda(lib: ctypes.CDLL) -> None:
    for suffix in ("f32", "bf16"):
        launch = getattr(lib, f"sakura_nf4_dequantize_cuda_{suffix}")
        launch.argtypes = [*_DEQUANTIZE_ARGS, ctypes.c_void_p]  # + cudaStream_t
        launch.restype = ctypes.c_int  # cudaError_t
        emulate = getattr(lib, f"sakura_nf4_dequantize_emulate_{suffix}")
        emulate.argtypes = list(_DEQUANTIZE_ARGS)
        emulate.restype = ctypes.c_int  # 0 or BAD_ARGUMENTS


LIBRARY = NativeLibrary(
    package="sakura-quant",
    name="sakura_quant_nf4_cpu",
    sources=[CSRC / "nf4_cpu.cpp"],
    abi_symbol="sakura_quant_abi_version",
    abi_version=2,
    declare=_declare,
    what="C++ NF4 kernel",
)

CUDA_LIBRARY = CudaLibrary(
    package="sakura-quant",
    name="sakura_quant_nf4_cuda",
    sources=[CSRC / "nf4_cuda.cu"],
    abi_symbol="sakura_quant_cuda_abi_version",
    abi_version=2,
    probe_symbol="sakura_quant_cuda_probe",
    declare=_declare_cuda,
    what="CUDA NF4 kernel",
    fallback="the pure-torch path (same bits, slower)",
)

NO_KERNEL_ENV = LIBRARY.disable_env
CACHE_ENV = LIBRARY.cache_env
