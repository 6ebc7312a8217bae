"""The implementations of one AdamW update: the C++ kernel and pure torch on the host, and
the CUDA kernel.

The host ones take flat, contiguous float32 host tensors for the weights and gradients and
the moment storage of one of the three formats (:mod:`sakura_offload.host_optimizer.moments`), and update
them in place with the same operations in the same order.  :class:`CudaBackend` does the
same on a CUDA device; each tensor it is given is either on the device or in page-locked
host RAM, which the kernel reads and writes in place (zero-copy).  :func:`resolve_backend`
picks one from the ``backend`` option.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, cast

import torch

from sakura_offload.host_optimizer import moments as fmt
from sakura_offload.host_optimizer.kernel import (
    FORMATS,
    Job,
    Kernel,
    load_cuda_kernel,
    load_kernel,
)

__all__ = [
    "Backend",
    "CudaBackend",
    "Hyper",
    "KernelBackend",
    "TorchBackend",
    "Update",
    "resolve_backend",
    "run_each",
]


@dataclass(slots=True)  # not frozen: built per tensor per step, a frozen __init__ costs more
class Hyper:
    """The scalars of one tensor's update at one step (see ``csrc/host_adamw.cpp``)."""

    decay: float  # 1 - lr * weight_decay
    w1: float  # 1 - beta1
    beta2: float
    c2: float  # 1 - beta2
    eps: float
    neg_step: float  # -lr / (1 - beta1**t)
    bc2_sqrt: float  # sqrt(1 - beta2**t)
    grad_scale: float  # clipping coefficient, 1.0 without clipping
    key: int  # 32-bit key of the stochastic-rounding stream

    def floats(self) -> tuple[float, ...]:
        return (
            self.decay,
            self.w1,
            self.beta2,
            self.c2,
            self.eps,
            self.neg_step,
            self.bc2_sqrt,
            self.grad_scale,
        )


@dataclass(slots=True)  # not frozen: built per tensor per step, a frozen __init__ costs more
class Update:
    """One tensor's update for :meth:`Backend.batch`: flat float32 weights ``p`` and
    gradient ``g``; ``m`` / ``v`` the moments (fp32 or bf16), or for int8 the codes of
    ``exp_avg`` / ``sqrt(exp_avg_sq)`` with ``m_absmax`` / ``v_absmax``."""

    p: torch.Tensor
    g: torch.Tensor
    m: torch.Tensor
    v: torch.Tensor
    h: Hyper
    m_absmax: torch.Tensor | None = None
    v_absmax: torch.Tensor | None = None


def run_each(backend: Backend, moment_dtype: str, updates: Sequence[Update]) -> None:
    """``updates`` one call per tensor (what :meth:`Backend.batch` does without a batched
    kernel)."""
    for u in updates:
        if moment_dtype == "float32":
            backend.fp32(u.p, u.g, u.m, u.v, u.h)
        elif moment_dtype == "bfloat16":
            backend.bf16(u.p, u.g, u.m, u.v, u.h)
        else:
            m_absmax, v_absmax = cast(torch.Tensor, u.m_absmax), cast(torch.Tensor, u.v_absmax)
            backend.int8(u.p, u.g, u.m, m_absmax, u.v, v_absmax, u.h)


class Backend(Protocol):
    name: str

    def batch(self, moment_dtype: str, updates: Sequence[Update]) -> None:
        """Every update of ``updates`` (``moment_dtype``: ``"float32"``, ``"bfloat16"`` or
        ``"int8"``), as the per-tensor methods would do them one by one."""
        ...

    def fp32(
        self, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, h: Hyper
    ) -> None: ...

    def bf16(
        self, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, h: Hyper
    ) -> None: ...

    def int8(
        self,
        p: torch.Tensor,
        g: torch.Tensor,
        m_codes: torch.Tensor,
        m_absmax: torch.Tensor,
        s_codes: torch.Tensor,
        s_absmax: torch.Tensor,
        h: Hyper,
    ) -> None: ...


_JOB = struct.Struct("@6Pq8fII")  # kernel.Job's layout (native sizes and alignment)
if _JOB.size != ctypes.sizeof(Job):  # pragma: no cover (a layout mismatch is a bug here)
    raise ImportError(f"sakura-offload: Job is {ctypes.sizeof(Job)} bytes, its pack {_JOB.size}")


class KernelBackend:
    """Calls the C++ kernel (vectorised, OpenMP threads = ``torch.get_num_threads()``)."""

    name = "cpp"

    def __init__(self, kernel: Kernel) -> None:
        self.kernel = kernel

    def batch(self, moment_dtype: str, updates: Sequence[Update]) -> None:
        """One kernel call for all ``updates``: their work items (16384 values each) shared
        by the threads in one parallel region, the same results as one call per tensor."""
        jobs = (Job * len(updates))()
        buffer = memoryview(jobs).cast("B")
        for k, u in enumerate(updates):  # one pack per job (setting Job's fields is slower)
            h = u.h
            _JOB.pack_into(
                buffer,
                k * _JOB.size,
                u.p.data_ptr(),
                u.g.data_ptr(),
                u.m.data_ptr(),
                u.v.data_ptr(),
                0 if u.m_absmax is None else u.m_absmax.data_ptr(),
                0 if u.v_absmax is None else u.v_absmax.data_ptr(),
                u.p.numel(),
                h.decay,
                h.w1,
                h.beta2,
                h.c2,
                h.eps,
                h.neg_step,
                h.bc2_sqrt,
                h.grad_scale,
                h.key,
                0,
            )
        self.kernel.batch(FORMATS[moment_dtype], jobs, len(updates), torch.get_num_threads())

    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed flat host tensor on transparent huge pages where the OS grants them
        (the optimizer's moments and masters: fewer TLB misses in the update)."""
        tensor = torch.empty(numel, dtype=dtype)
        self.kernel.advise_huge(tensor)
        return tensor.zero_()

    def fp32(
        self, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, h: Hyper
    ) -> None:
        self.kernel.fp32(
            p.data_ptr(),
            g.data_ptr(),
            m.data_ptr(),
            v.data_ptr(),
            p.numel(),
            *h.floats(),
            torch.get_num_threads(),
        )

    def bf16(
        self, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, h: Hyper
    ) -> None:
        self.kernel.bf16(
            p.data_ptr(),
            g.data_ptr(),
            m.data_ptr(),
            v.data_ptr(),
            p.numel(),
            *h.floats(),
            h.key,
            torch.get_num_threads(),
        )

    def int8(
        self,
        p: torch.Tensor,
        g: torch.Tensor,
        m_codes: torch.Tensor,
        m_absmax: torch.Tensor,
        s_codes: torch.Tensor,
        s_absmax: torch.Tensor,
        h: Hyper,
    ) -> None:
        self.kernel.int8(
            p.data_ptr(),
            g.data_ptr(),
            m_codes.data_ptr(),
            m_absmax.data_ptr(),
            s_codes.data_ptr(),
            s_absmax.data_ptr(),
            p.numel(),
            *h.floats(),
            h.key,
            torch.get_num_threads(),
        )


def _adam(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, h: Hyper
) -> torch.Tensor:
    """torch.optim.AdamW's single-tensor arithmetic on float32 ``m`` / ``v`` (in place);
    returns ``sqrt(v)``."""
    if h.grad_scale != 1.0:
        g = g * h.grad_scale
    p.mul_(h.decay)
    m.lerp_(g, h.w1)
    v.mul_(h.beta2).addcmul_(g, g, value=h.c2)
    root = v.sqrt()
    p.addcdiv_(m, (root / h.bc2_sqrt).add_(h.eps), value=h.neg_step)
    return root


class TorchBackend:
    """Pure torch: the fallback when the kernel cannot be built, and the reference the
    kernel is tested against."""

    name = "torch"

    def batch(self, moment_dtype: str, updates: Sequence[Update]) -> None:
        run_each(self, moment_dtype, updates)

    def fp32(
        self, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, h: Hyper
    ) -> None:
        _adam(p, g, m, v, h)

    def bf16(
        self, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, h: Hyper
    ) -> None:
        m32, v32 = m.float(), v.float()
        _adam(p, g, m32, v32, h)
        bits = fmt.element_bits(h.key, p.numel())
        m.copy_(fmt.bf16_stochastic(m32, bits & 0xFFFF))
        v.copy_(fmt.bf16_stochastic(v32, bits >> 16))

    def int8(
        self,
        p: torch.Tensor,
        g: torch.Tensor,
        m_codes: torch.Tensor,
        m_absmax: torch.Tensor,
        s_codes: torch.Tensor,
        s_absmax: torch.Tensor,
        h: Hyper,
    ) -> None:
        n = p.numel()
        m = fmt.decode_signed(m_codes, m_absmax, n).clone()
        s_old = fmt.decode_unsigned(s_codes, s_absmax, n)
        v = s_old * s_old
        root = _adam(p, g, m, v, h)
        codes, absmax = fmt.quantize_blocks(m, signed=True)
        m_codes.copy_(codes)
        m_absmax.copy_(absmax)
        bits = fmt.pair_bits(h.key, s_absmax.numel())
        codes, absmax = fmt.quantize_blocks(root, signed=False, bits=bits)
        s_codes.copy_(codes)
        s_absmax.copy_(absmax)


class CudaBackend:
    """Calls the CUDA kernel (``csrc/adamw_cuda.cu``) on the current stream of the
    gradient's device; ``host`` updates the parameters that are not on a CUDA device.
    Untested on a GPU so far (see the README).

    ``emulate=True`` calls the library's ``*_emulate`` exports instead: the same element
    arithmetic, run sequentially on host memory, so a machine without a GPU tests this
    class and the kernel's arithmetic."""

    name = "cuda"

    def __init__(self, library: ctypes.CDLL, host: Backend, *, emulate: bool = False) -> None:
        self.library = library
        self.host = host
        self.emulate = emulate

    def batch(self, moment_dtype: str, updates: Sequence[Update]) -> None:
        run_each(self, moment_dtype, updates)

    def check_reachable(self, tensor: torch.Tensor) -> None:
        """Raise unless the kernel can address ``tensor`` in place: device memory, or
        page-locked host memory mapped for the device (unified addressing)."""
        if self.emulate:
            return
        status = self.library.sakura_offload_cuda_reachable(tensor.data_ptr())
        if status != 0:
            raise RuntimeError(
                "sakura-offload: backend='cuda' cannot reach a host tensor of the optimizer "
                f"state from the GPU (cudaError {status}; it needs page-locked memory under "
                "unified addressing); use backend='auto'"
            )

    def _launch(self, name: str, device: torch.device, *args: object) -> None:
        if self.emulate:
            getattr(self.library, f"sakura_adamw_{name}_emulate")(*args)
            return
        with torch.cuda.device(device):
            stream = torch.cuda.current_stream(device).cuda_stream
            status = getattr(self.library, f"sakura_adamw_{name}_cuda")(*args, stream)
        if status != 0:
            raise RuntimeError(
                f"sakura-offload: the CUDA AdamW kernel failed to launch (cudaError {status})"
            )

    def fp32(
        self, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, h: Hyper
    ) -> None:
        ptrs = (p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr())
        self._launch("fp32", g.device, *ptrs, p.numel(), *h.floats())

    def bf16(
        self, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, h: Hyper
    ) -> None:
        ptrs = (p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr())
        self._launch("bf16", g.device, *ptrs, p.numel(), *h.floats(), h.key)

    def int8(
        self,
        p: torch.Tensor,
        g: torch.Tensor,
        m_codes: torch.Tensor,
        m_absmax: torch.Tensor,
        s_codes: torch.Tensor,
        s_absmax: torch.Tensor,
        h: Hyper,
    ) -> None:
        ptrs = (t.data_ptr() for t in (p, g, m_codes, m_absmax, s_codes, s_absmax))
        self._launch("int8", g.device, *ptrs, p.numel(), *h.floats(), h.key)


def resolve_backend(name: str) -> Backend:
    """``"cpp"``: the C++ kernel (raises when it cannot be built); ``"torch"``: pure
    torch; ``"auto"``: the kernel when it builds (and ``SAKURA_OFFLOAD_NO_KERNEL`` is not
    set), else pure torch; ``"cuda"``: the CUDA kernel for parameters on a CUDA device
    (raises when it cannot be loaded), ``"auto"`` for the others."""
    if name == "torch":
        return TorchBackend()
    if name == "cuda":
        library = cast(ctypes.CDLL, load_cuda_kernel(required=True))  # required: never None
        return CudaBackend(library, resolve_backend("auto"))
    kernel = load_kernel(required=name == "cpp")
    return KernelBackend(kernel) if kernel is not None else TorchBackend()
