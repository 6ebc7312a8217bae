"""The native block kernels, declared once: the C++ ones (``csrc/blocks_cpu.cpp``) on
:class:`sakura_torch.native.NativeLibrary` and the CUDA ones (``csrc/blocks_cuda.cu``) on
:class:`sakura_torch.native_cuda.CudaLibrary`.  Each is built on first use and cached; None
when it cannot be built, there is no device, or ``SAKURA_KERNELS_NO_KERNEL=1`` (then the
torch paths run)."""

from __future__ import annotations

import ctypes
from pathlib import Path

from sakura_torch.native import DEFAULT_CFLAGS, NativeLibrary
from sakura_torch.native_cuda import CudaLibrary

__all__ = ["BAD_ARGUMENTS", "CPU_LIBRARY", "CUDA_LIBRARY", "NO_KERNEL_ENV"]

BAD_ARGUMENTS = -1
NO_KERNEL_ENV = "SAKURA_KERNELS_NO_KERNEL"

_P = ctypes.c_void_p
_I64 = ctypes.c_int64
_INT = ctypes.c_int


def _declare(lib: ctypes.CDLL) -> None:
    signatures = {
        "sakura_blocks_rmsnorm_forward": [_INT, _P, _P, _P, _P, _I64, _I64, ctypes.c_float],
        "sakura_blocks_rmsnorm_backward": [_INT, _P, _P, _P, _P, _P, _P, _I64, _I64],
        "sakura_blocks_rope": [_INT, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _INT],
        "sakura_blocks_rope_strided": [_INT, _P, *[_I64] * 3, _P, _P, _P, *[_I64] * 7, _INT],
        "sakura_blocks_glu_forward": [_INT, _INT, _P, _P, _P, _I64],
        "sakura_blocks_glu_backward": [_INT, _INT, _P, _P, _P, _P, _P, _I64],
        "sakura_xent_rows": [_INT, _P, _I64, _I64, _P, _P, _P, _INT],
        "sakura_attn_softmax_forward": [
            _INT,
            _P,
            _I64,
            _I64,
            _I64,
            _I64,
            _P,
            _I64,
            _I64,
            _INT,
            ctypes.c_float,
        ],
        "sakura_attn_softmax_backward": [_INT, _P, _P, _I64, _I64, ctypes.c_float],
        "sakura_attn_softmax_backward_causal": [_INT, _P, _P, _I64, _I64, _I64, ctypes.c_float],
    }
    for name, argtypes in signatures.items():
        function = getattr(lib, name)
        function.argtypes = argtypes
        function.restype = ctypes.c_int


CPU_LIBRARY = NativeLibrary(
    package="sakura-kernels",
    name="sakura_kernels_blocks_cpu",
    sources=[Path(__file__).parent.parent / "csrc" / "blocks_cpu.cpp"],
    abi_symbol="sakura_kernels_blocks_abi_version",
    abi_version=4,
    declare=_declare,
    what="C++ block kernels",
    # No fused multiply-add contraction: each product rounds as torch's does.
    cflags=(*DEFAULT_CFLAGS, "-ffp-contract=off", "-std=c++17"),
)


_S = ctypes.c_void_p  # cudaStream_t


def _declare_cuda(lib: ctypes.CDLL) -> None:
    signatures = {
        "sakura_blocks_rmsnorm_forward_cuda": [
            _INT,
            _P,
            _P,
            _P,
            _P,
            _I64,
            _I64,
            ctypes.c_float,
            _S,
        ],
        "sakura_blocks_rmsnorm_backward_cuda": [_INT, _P, _P, _P, _P, _P, _P, _P, _I64, _I64, _S],
        "sakura_blocks_rope_cuda": [_INT, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _INT, _S],
        "sakura_blocks_glu_forward_cuda": [_INT, _INT, _P, _P, _P, _I64, _S],
        "sakura_blocks_glu_backward_cuda": [_INT, _INT, _P, _P, _P, _P, _P, _I64, _S],
        "sakura_blocks_rmsnorm_forward_emulate": [_INT, _P, _P, _P, _P, _I64, _I64, ctypes.c_float],
        "sakura_blocks_rmsnorm_backward_emulate": [_INT, _P, _P, _P, _P, _P, _P, _P, _I64, _I64],
        "sakura_blocks_rope_emulate": [_INT, _P, _P, _P, _P, _I64, _I64, _I64, _I64, _INT],
        "sakura_blocks_glu_forward_emulate": [_INT, _INT, _P, _P, _P, _I64],
        "sakura_blocks_glu_backward_emulate": [_INT, _INT, _P, _P, _P, _P, _P, _I64],
    }
    for name, argtypes in signatures.items():
        function = getattr(lib, name)
        function.argtypes = argtypes
        function.restype = ctypes.c_int


CUDA_LIBRARY = CudaLibrary(
    package="sakura-kernels",
    name="sakura_kernels_blocks_cuda",
    sources=[Path(__file__).parent.parent / "csrc" / "blocks_cuda.cu"],
    abi_symbol="sakura_kernels_blocks_cuda_abi_version",
    abi_version=1,
    probe_symbol="sakura_kernels_blocks_cuda_probe",
    declare=_declare_cuda,
    what="CUDA block kernels",
)
