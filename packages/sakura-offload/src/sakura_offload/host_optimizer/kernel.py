"""The native AdamW kernels, declared once on :class:`sakura_torch.native.NativeLibrary` (which
builds, caches, checks and falls back; see ``docs/helpers.md``).

* ``csrc/host_adamw.cpp``: the host update, multi-threaded, with AVX-512 loops where the
  CPU has them and portable (auto-vectorised) ones elsewhere, which round identically
  (built with ``-ffp-contract=off``: :data:`CFLAGS`); built with
  ``torch.utils.cpp_extension`` on first use.  :attr:`Kernel.batch` updates several
  tensors in one call; :meth:`Kernel.advise_huge` puts the optimizer's state on
  transparent huge pages.
* ``csrc/adamw_cuda.cu``: the same update and moment formats on a CUDA device, compiled
  with nvcc on first use, only where ``torch.cuda.is_available()``.

Both are cached under ``SAKURA_OFFLOAD_CACHE`` if set, else
``$XDG_CACHE_HOME/sakura-offload``, else ``~/.cache/sakura-offload``.
``SAKURA_OFFLOAD_NO_KERNEL=1`` skips both: every optimizer uses the pure-torch path
(``backend="auto"``), as when a build fails (logged with the compiler's output and warned
about once).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sakura_torch.native import DEFAULT_CFLAGS, NativeLibrary
from sakura_torch.native_cuda import CudaLibrary

if TYPE_CHECKING:
    import torch

__all__ = [
    "CACHE_ENV",
    "CFLAGS",
    "CUDA_LIBRARY",
    "FORMATS",
    "LIBRARY",
    "NO_KERNEL_ENV",
    "Job",
    "Kernel",
    "kernel_disabled",
    "load_cuda_kernel",
    "load_kernel",
]

CSRC = Path(__file__).parent.parent / "csrc"


@dataclass(frozen=True)
class Kernel:
    """The loaded host library and where it was built."""

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
    def batch(self) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
        """``batch(format, jobs, count, threads)``: several tensors' updates in one call
        (``format`` from :data:`FORMATS`, ``jobs`` an array of :class:`Job`)."""
        return self.library.sakura_adamw_batch

    @property
    def vector_width(self) -> int:
        """16 where the AVX-512 loops are compiled in, 1 for the portable ones."""
        return int(self.library.sakura_offload_vector_width())

    def advise_huge(self, tensor: torch.Tensor) -> int:
        """Ask for transparent huge pages under ``tensor``'s storage (before it is first
        written); the bytes advised (0 where the OS declines)."""
        nbytes = tensor.numel() * tensor.element_size()
        return int(self.library.sakura_offload_advise_huge(tensor.data_ptr(), nbytes))

    @property
    def decode_tables(self) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
        return self.library.sakura_decode_tables

    @property
    def triad(self) -> ctypes._CFuncPtr:  # type: ignore[name-defined]
        return self.library.sakura_triad


class Job(ctypes.Structure):
    """One tensor's update in a :attr:`Kernel.batch` call (``Job`` in host_adamw.cpp): the
    weights, gradient and moments (``m``/``v``: fp32 or bf16 moments, or the int8 codes of
    ``exp_avg`` and of ``sqrt(exp_avg_sq)`` with their absmaxes), the value count, the
    eight scalars of :class:`~.backends.Hyper` in its order and the random stream's key."""

    _fields_ = [
        ("p", ctypes.c_void_p),
        ("g", ctypes.c_void_p),
        ("m", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("m_absmax", ctypes.c_void_p),
        ("v_absmax", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("hyper", ctypes.c_float * 8),
        ("key", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
    ]


FORMATS = {"float32": 0, "bfloat16": 1, "int8": 2}
"""The ``format`` argument of :attr:`Kernel.batch` for each moment format."""

_F, _I64, _I32, _U32, _P = (
    ctypes.c_float,
    ctypes.c_int64,
    ctypes.c_int,
    ctypes.c_uint32,
    ctypes.c_void_p,
)
_HYPER = [_F] * 8  # decay, w1, beta2, c2, eps, neg_step, bc2_sqrt, grad_scale
# The arguments of each update before the last one (threads on the host, a cudaStream_t on
# the device).
_FP32_ARGS = [_P, _P, _P, _P, _I64, *_HYPER]
_BF16_ARGS = [_P, _P, _P, _P, _I64, *_HYPER, _U32]
_INT8_ARGS = [_P] * 6 + [_I64, *_HYPER, _U32]


def _declare(lib: ctypes.CDLL) -> None:
    for name, args in (("fp32", _FP32_ARGS), ("bf16", _BF16_ARGS), ("int8", _INT8_ARGS)):
        fn = getattr(lib, f"sakura_adamw_{name}")
        fn.argtypes = [*args, _I32]
        fn.restype = None
    lib.sakura_decode_tables.argtypes = [_P, _P]
    lib.sakura_decode_tables.restype = None
    lib.sakura_triad.argtypes = [_P, _P, _P, _F, _I64, _I32]
    lib.sakura_triad.restype = None
    lib.sakura_adamw_batch.argtypes = [_I32, ctypes.POINTER(Job), _I64, _I32]
    lib.sakura_adamw_batch.restype = None
    lib.sakura_offload_vector_width.argtypes = []
    lib.sakura_offload_vector_width.restype = _I32
    lib.sakura_offload_advise_huge.argtypes = [_P, _I64]
    lib.sakura_offload_advise_huge.restype = _I64


def _declare_cuda(lib: ctypes.CDLL) -> None:
    for name, args in (("fp32", _FP32_ARGS), ("bf16", _BF16_ARGS), ("int8", _INT8_ARGS)):
        launch = getattr(lib, f"sakura_adamw_{name}_cuda")
        launch.argtypes = [*args, _P]  # + cudaStream_t
        launch.restype = _I32  # cudaError_t
        emulate = getattr(lib, f"sakura_adamw_{name}_emulate")
        emulate.argtypes = list(args)
        emulate.restype = None
    lib.sakura_offload_cuda_reachable.argtypes = [_P]
    lib.sakura_offload_cuda_reachable.restype = _I32


CFLAGS = (*DEFAULT_CFLAGS, "-ffp-contract=off")
"""The host kernel's compiler flags: no multiply-add fused unless the source writes one, so
its AVX-512 and portable loops round alike."""

LIBRARY = NativeLibrary(
    package="sakura-offload",
    name="sakura_offload_host_adamw",
    sources=[CSRC / "host_adamw.cpp"],
    abi_symbol="sakura_offload_abi_version",
    abi_version=5,
    cflags=CFLAGS,
    declare=_declare,
    what="C++ host AdamW kernel",
    fallback="the pure-torch path, which is slower",
)

CUDA_LIBRARY = CudaLibrary(
    package="sakura-offload",
    name="sakura_offload_adamw_cuda",
    sources=[CSRC / "adamw_cuda.cu"],
    abi_symbol="sakura_offload_cuda_abi_version",
    abi_version=3,
    probe_symbol="sakura_offload_cuda_probe",
    declare=_declare_cuda,
    what="CUDA AdamW kernel",
)

NO_KERNEL_ENV = LIBRARY.disable_env
CACHE_ENV = LIBRARY.cache_env

_wrapped: dict[int, Kernel] = {}


def kernel_disabled() -> bool:
    """True when ``SAKURA_OFFLOAD_NO_KERNEL`` asks for the pure-torch path."""
    return LIBRARY.disabled()


def load_kernel(*, required: bool = False) -> Kernel | None:
    """The C++ kernel, built on first use; None when it cannot be built (warned once) or
    ``SAKURA_OFFLOAD_NO_KERNEL`` is set.  ``required=True`` raises instead (and ignores the
    variable)."""
    library = LIBRARY.load(required=required)
    if library is None or LIBRARY.path is None:
        return None
    kernel = _wrapped.get(id(library))
    if kernel is None:
        kernel = _wrapped.setdefault(id(library), Kernel(library, LIBRARY.path))
    return kernel


def load_cuda_kernel(*, required: bool = False) -> ctypes.CDLL | None:
    """The CUDA kernel, built on first use; None without a CUDA device, when disabled or
    not buildable (warned once).  ``required=True`` raises instead."""
    return CUDA_LIBRARY.load(required=required)
