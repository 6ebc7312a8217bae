"""The C++ block kernels (``csrc/blocks_cpu.cpp``), declared once on
:class:`sakura_torch.native.NativeLibrary`: built on first use, cached, None when they
cannot be built or ``SAKURA_KERNELS_NO_KERNEL=1`` (then the torch paths run)."""

from __future__ import annotations

import ctypes
from pathlib import Path

from sakura_torch.native import DEFAULT_CFLAGS, NativeLibrary

__all__ = ["BAD_ARGUMENTS", "CPU_LIBRARY", "NO_KERNEL_ENV"]

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
        "sakura_blocks_glu_forward": [_INT, _INT, _P, _P, _P, _I64],
        "sakura_blocks_glu_backward": [_INT, _INT, _P, _P, _P, _P, _P, _I64],
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
    abi_version=1,
    declare=_declare,
    what="C++ block kernels",
    # No fused multiply-add contraction: each product rounds as torch's does.
    cflags=(*DEFAULT_CFLAGS, "-ffp-contract=off", "-std=c++17"),
)
