"""The fused block operations as autograd functions: RMSNorm, rotary embedding and the gated
MLP activations (SwiGLU, GeGLU with gelu's tanh approximation).

Each computes in fp32 and rounds once to the input's dtype.  On the CPU, fp32 and bf16
contiguous tensors go through the C++ kernels (:mod:`sakura_kernels.blocks._native`); any
other case (fp16, a device without the CUDA kernels, the kernels disabled with ``SAKURA_KERNELS_NO_KERNEL=1``
or not buildable) runs the torch path below, which computes the same formulas.

* RMSNorm keeps its input and the per-row ``1/rms`` (fp32) for backward; its weight
  gradient is summed in a fixed order (rows in blocks of 32 in row order, then the blocks in
  order, in double), so it has the same bits every run, whatever the thread count.
* The rotary embedding keeps ``cos`` and ``sin`` only (its gradient is the inverse
  rotation); it gives no gradient to ``cos`` / ``sin`` (Hugging Face computes them under
  ``no_grad``; the patch checks they need none).
* The gated activation keeps only its two inputs.

On a CUDA device the same operations run as the CUDA kernels of ``csrc/blocks_cuda.cu``
(same formulas, fixed-order sums), when they can be built there.
"""

from __future__ import annotations

from typing import Any

import torch

from sakura_kernels.blocks._native import BAD_ARGUMENTS, CPU_LIBRARY, CUDA_LIBRARY

__all__ = [
    "ACTIVATIONS",
    "FusedGLU",
    "FusedRMSNorm",
    "FusedRotary",
    "fused_glu",
    "fused_rms_norm",
    "fused_rotary",
]

ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
"""The gated activations and their kernel codes."""

RMS_BLOCK = 32  # rows per block of the weight gradient's fixed-order sum (as in the C++)
_CODES = {torch.float32: 0, torch.bfloat16: 1}


def _native(*tensors: torch.Tensor) -> Any:
    """The C++ library when every tensor suits it (CPU, fp32 or bf16, all one dtype), else
    None."""
    first = tensors[0]
    if first.dtype not in _CODES:
        return None
    # is_cpu, not device.type: this runs twice per fused call, and building a torch.device
    # per tensor cost more than the rest of the check.
    if not all(t.is_cpu and t.dtype == first.dtype for t in tensors):
        return None
    return CPU_LIBRARY.load()


def _cuda(*tensors: torch.Tensor) -> tuple[Any, int]:
    """The CUDA library and the current stream when every tensor suits it (one CUDA device,
    fp32 or bf16, all one dtype), else (None, 0)."""
    first = tensors[0]
    if not first.is_cuda or first.dtype not in _CODES:
        return None, 0
    if any(t.device != first.device or t.dtype != first.dtype for t in tensors):
        return None, 0
    lib = CUDA_LIBRARY.load()
    if lib is None:
        return None, 0
    return lib, int(torch.cuda.current_stream(first.device).cuda_stream)


def _check_cuda(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"sakura-kernels: the CUDA {what} kernel failed (status {status})")


def _check(status: int, what: str) -> None:
    if status == BAD_ARGUMENTS:
        raise RuntimeError(f"sakura-kernels: the C++ {what} kernel refused its arguments")


def _fixed_order_row_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum a (rows, h) fp32 tensor over rows in the kernel's fixed order (blocks of
    RMS_BLOCK rows in row order, then blocks in order in double); cumsum is sequential, so
    the order never depends on threads."""
    rows, h = values.shape
    blocks = max(1, -(-rows // RMS_BLOCK))
    padded = values.new_zeros(blocks * RMS_BLOCK, h)
    padded[:rows] = values
    partial = padded.view(blocks, RMS_BLOCK, h).cumsum(1)[:, -1]
    return partial.double().cumsum(0)[-1].float()


class FusedRMSNorm(torch.autograd.Function):
    """``weight * x / sqrt(mean(x**2) + eps)`` over the last dimension."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        shape = x.shape
        if weight.dim() != 1 or weight.shape[0] != shape[-1]:  # the kernels read hidden weights
            raise ValueError(
                f"fused RMSNorm: weight of shape {tuple(weight.shape)} for inputs whose last "
                f"dimension is {shape[-1]} (expected ({shape[-1]},))"
            )
        x2 = x.reshape(-1, shape[-1]).contiguous()
        w = weight.to(x.dtype).contiguous() if weight.dtype != x.dtype else weight.contiguous()
        lib = _native(x2, w)
        cuda, stream = _cuda(x2, w)
        if cuda is not None:
            y = torch.empty_like(x2)
            rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x2.device)
            _check_cuda(
                cuda.sakura_blocks_rmsnorm_forward_cuda(
                    _CODES[x.dtype], x2.data_ptr(), w.data_ptr(), y.data_ptr(),
                    rstd.data_ptr(), x2.shape[0], x2.shape[1], float(eps), stream,
                ),
                "RMSNorm forward",
            )  # fmt: skip
        elif lib is not None:
            y = torch.empty_like(x2)
            rstd = torch.empty(x2.shape[0], dtype=torch.float32)
            _check(
                lib.sakura_blocks_rmsnorm_forward(
                    _CODES[x.dtype], x2.data_ptr(), w.data_ptr(), y.data_ptr(),
                    rstd.data_ptr(), x2.shape[0], x2.shape[1], float(eps),
                ),
                "RMSNorm forward",
            )  # fmt: skip
        else:
            xf = x2.float()
            rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
            y = (w.float() * (xf * rstd[:, None])).to(x.dtype)
        ctx.save_for_backward(x2, w, rstd)
        ctx.shape = shape
        ctx.weight_dtype = weight.dtype
        return y.view(shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x2, w, rstd = ctx.saved_tensors
        g = grad.reshape(-1, x2.shape[1]).to(x2.dtype).contiguous()
        lib = _native(g, x2, w)
        cuda, stream = _cuda(g, x2, w)
        if cuda is not None:
            dx = torch.empty_like(x2)
            dw = torch.empty(x2.shape[1], dtype=torch.float32, device=x2.device)
            blocks = max(1, -(-x2.shape[0] // RMS_BLOCK))
            partial = torch.empty(blocks, x2.shape[1], dtype=torch.float32, device=x2.device)
            _check_cuda(
                cuda.sakura_blocks_rmsnorm_backward_cuda(
                    _CODES[x2.dtype], g.data_ptr(), x2.data_ptr(), w.data_ptr(),
                    rstd.data_ptr(), dx.data_ptr(), dw.data_ptr(), partial.data_ptr(),
                    x2.shape[0], x2.shape[1], stream,
                ),
                "RMSNorm backward",
            )  # fmt: skip
        elif lib is not None:
            dx = torch.empty_like(x2)
            dw = torch.empty(x2.shape[1], dtype=torch.float32)
            _check(
                lib.sakura_blocks_rmsnorm_backward(
                    _CODES[x2.dtype], g.data_ptr(), x2.data_ptr(), w.data_ptr(),
                    rstd.data_ptr(), dx.data_ptr(), dw.data_ptr(), x2.shape[0], x2.shape[1],
                ),
                "RMSNorm backward",
            )  # fmt: skip
        else:
            xhat = x2.float() * rstd[:, None]
            gf = g.float()
            dxhat = gf * w.float()
            mean = (dxhat * xhat).double().sum(-1, keepdim=True).div(x2.shape[1]).float()
            dx = (rstd[:, None] * (dxhat - xhat * mean)).to(x2.dtype)
            dw = _fixed_order_row_sum(gf * xhat).to(w.device)
        return dx.view(ctx.shape), dw.to(ctx.weight_dtype), None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(
    q: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    backward: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: (batch, heads, seq, dim); cos/sin: (batch, seq, dim), q's dtype, contiguous.  The
    result goes to ``out`` (same shape; a fresh contiguous tensor when None).  On the CPU
    kernel q and ``out`` may have any row strides with a contiguous last dimension (the
    projections' ``(batch, seq, heads, dim)`` layout seen through a transpose): no copy in
    or out."""
    lib = _native(q, cos, sin)
    cuda, stream = _cuda(q, cos, sin)
    result = torch.empty_like(q, memory_format=torch.contiguous_format) if out is None else out
    b, h, s, d = q.shape
    if cuda is not None:
        q = q.contiguous()
        target = result if result.is_contiguous() else torch.empty_like(q)
        _check_cuda(
            cuda.sakura_blocks_rope_cuda(
                _CODES[q.dtype], q.data_ptr(), cos.data_ptr(), sin.data_ptr(), target.data_ptr(),
                b, h, s, d, int(backward), stream,
            ),
            "rotary embedding",
        )  # fmt: skip
        return target if target is result else result.copy_(target)
    if lib is not None:
        if q.stride(-1) != 1:
            q = q.contiguous()
        if result.stride(-1) != 1:
            raise ValueError("rotary embedding: out's last dimension must be contiguous")
        qs, os_ = q.stride(), result.stride()
        _check(
            lib.sakura_blocks_rope_strided(
                _CODES[q.dtype], q.data_ptr(), qs[0], qs[1], qs[2], cos.data_ptr(),
                sin.data_ptr(), result.data_ptr(), os_[0], os_[1], os_[2], b, h, s, d,
                int(backward),
            ),
            "rotary embedding",
        )  # fmt: skip
        return result
    qf, c, s_ = q.float(), cos.float().unsqueeze(1), sin.float().unsqueeze(1)
    if not backward:
        return result.copy_(qf * c + _rotate_half(qf) * s_)
    # The transpose of the rotation: rotate_half's adjoint is minus itself.
    return result.copy_(qf * c - _rotate_half(qf * s_))


class FusedRotary(torch.autograd.Function):
    """``q * cos + rotate_half(q) * sin`` with ``cos``/``sin`` broadcast over heads (q is
    ``(batch, heads, seq, head_dim)``, ``cos``/``sin`` ``(batch or 1, seq, head_dim)``).

    The output is contiguous, as the attention after it wants it.  q is read where it lies
    (Hugging Face's ``proj(x).view(b, s, heads, d).transpose(1, 2)``, no copy), and its
    gradient is written in q's own layout, so the transpose and the view before it take it
    back without a copy either."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, _, s, d = q.shape
        cos = cos.to(q.dtype).expand(b, s, d).contiguous()
        sin = sin.to(q.dtype).expand(b, s, d).contiguous()
        ctx.save_for_backward(cos, sin)
        ctx.q_layout = (q.shape, q.stride()) if q.stride(-1) == 1 else None
        return _rope(q, cos, sin, backward=False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        cos, sin = ctx.saved_tensors
        grad = grad.to(cos.dtype)
        out = None
        layout = ctx.q_layout
        if layout is not None and grad.device.type == "cpu":
            shape, stride = layout
            out = _empty_like_layout(shape, stride, grad)
        return _rope(grad, cos, sin, backward=True, out=out), None, None


def _empty_like_layout(
    shape: torch.Size, stride: tuple[int, ...], like: torch.Tensor
) -> torch.Tensor | None:
    """An empty tensor of ``shape`` laid out as a dense tensor of ``stride`` is (its
    dimensions in the order of decreasing stride), or None when ``stride`` is not dense."""
    order = sorted(range(len(shape)), key=lambda i: -stride[i])
    dense = 1
    for i in reversed(order):
        if shape[i] != 1 and stride[i] != dense:
            return None
        dense *= shape[i]
    storage = like.new_empty([shape[i] for i in order])
    inverse = [order.index(i) for i in range(len(shape))]
    return storage.permute(inverse)


def _act(g: torch.Tensor, kind: int) -> torch.Tensor:
    if kind == 0:
        return torch.nn.functional.silu(g)
    return torch.nn.functional.gelu(g, approximate="tanh")


class FusedGLU(torch.autograd.Function):
    """``act(gate) * up``, ``act`` silu (SwiGLU) or gelu-tanh (GeGLU); keeps only gate and
    up for backward."""

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor, kind: int) -> torch.Tensor:
        if gate.shape != up.shape:  # the kernels read gate.numel() elements of each
            raise ValueError(
                f"fused GLU: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ in shape"
            )
        gate, up = gate.contiguous(), up.to(gate.dtype).contiguous()
        lib = _native(gate, up)
        cuda, stream = _cuda(gate, up)
        if cuda is not None:
            out = torch.empty_like(gate)
            _check_cuda(
                cuda.sakura_blocks_glu_forward_cuda(
                    _CODES[gate.dtype], kind, gate.data_ptr(), up.data_ptr(), out.data_ptr(),
                    gate.numel(), stream,
                ),
                "gated activation forward",
            )  # fmt: skip
        elif lib is not None:
            out = torch.empty_like(gate)
            _check(
                lib.sakura_blocks_glu_forward(
                    _CODES[gate.dtype], kind, gate.data_ptr(), up.data_ptr(), out.data_ptr(),
                    gate.numel(),
                ),
                "gated activation forward",
            )  # fmt: skip
        else:
            out = (_act(gate.float(), kind) * up.float()).to(gate.dtype)
        ctx.save_for_backward(gate, up)
        ctx.kind = kind
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        gate, up = ctx.saved_tensors
        kind = ctx.kind
        g = grad.to(gate.dtype).contiguous()
        lib = _native(g, gate, up)
        cuda, stream = _cuda(g, gate, up)
        if cuda is not None:
            dgate, dup = torch.empty_like(gate), torch.empty_like(up)
            _check_cuda(
                cuda.sakura_blocks_glu_backward_cuda(
                    _CODES[gate.dtype], kind, g.data_ptr(), gate.data_ptr(), up.data_ptr(),
                    dgate.data_ptr(), dup.data_ptr(), gate.numel(), stream,
                ),
                "gated activation backward",
            )  # fmt: skip
            return dgate, dup, None
        if lib is not None:
            dgate, dup = torch.empty_like(gate), torch.empty_like(up)
            _check(
                lib.sakura_blocks_glu_backward(
                    _CODES[gate.dtype], kind, g.data_ptr(), gate.data_ptr(), up.data_ptr(),
                    dgate.data_ptr(), dup.data_ptr(), gate.numel(),
                ),
                "gated activation backward",
            )  # fmt: skip
            return dgate, dup, None
        gf, uf, df = gate.float(), up.float(), g.float()
        with torch.enable_grad():
            leaf = gf.detach().requires_grad_(True)
            (slope,) = torch.autograd.grad(_act(leaf, kind).sum(), leaf)
        return (df * uf * slope).to(gate.dtype), (df * _act(gf, kind)).to(up.dtype), None


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x`` over its last dimension (see :class:`FusedRMSNorm`)."""
    out: torch.Tensor = FusedRMSNorm.apply(x, weight, eps)  # type: ignore[no-untyped-call]
    return out


def fused_rotary(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of ``q`` (see :class:`FusedRotary`)."""
    out: torch.Tensor = FusedRotary.apply(q, cos, sin)  # type: ignore[no-untyped-call]
    return out


def fused_glu(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` for ``activation`` in :data:`ACTIVATIONS`."""
    if activation not in ACTIVATIONS:
        raise ValueError(
            f"activation={activation!r} is not accepted; accepted: {sorted(ACTIVATIONS)}"
        )
    out: torch.Tensor = FusedGLU.apply(  # type: ignore[no-untyped-call]
        gate, up, ACTIVATIONS[activation]
    )
    return out
