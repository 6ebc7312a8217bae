"""The fused rotary embedding reads q where Hugging Face's attention leaves it (the
projection's ``(batch, seq, heads, dim)`` output seen through ``transpose(1, 2)``) and writes
q's gradient in that same layout: the same values, bit for bit, as from a contiguous copy,
without the copies into and out of the kernel."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from sakura_kernels.blocks import fused_rotary
from sakura_kernels.blocks._native import CPU_LIBRARY
from sakura_kernels.blocks.functions import _empty_like_layout

needs_kernel = pytest.mark.skipif(CPU_LIBRARY.load() is None, reason="no C++ kernel here")


def _projected(dtype: torch.dtype, seed: int) -> torch.Tensor:
    """q as Hugging Face's attention has it: proj(x).view(b, s, heads, d).transpose(1, 2)."""
    gen = torch.Generator().manual_seed(seed)
    flat = torch.randn(2, 7, 3 * 40, generator=gen).to(dtype).requires_grad_()
    return flat


def _angles(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(9)
    half = torch.rand(2, 7, 20, generator=gen) * 6  # per batch row, as HF gives it
    angles = torch.cat((half, half), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _copies(fn) -> int:  # type: ignore[no-untyped-def]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == "aten::copy_")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_q_gives_the_contiguous_values_and_gradient_without_copies(
    dtype: torch.dtype,
) -> None:
    cos, sin = _angles(dtype)
    flat = _projected(dtype, 0)
    q = flat.view(2, 7, 3, 40).transpose(1, 2)
    assert not q.is_contiguous()
    out = fused_rotary(q, cos, sin)
    assert out.is_contiguous() and out.shape == (2, 3, 7, 40)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    (flat_grad,) = torch.autograd.grad(out, flat, grad)

    reference_flat = flat.detach().clone().requires_grad_()
    reference_q = reference_flat.view(2, 7, 3, 40).transpose(1, 2).contiguous()
    reference = fused_rotary(reference_q, cos, sin)
    (reference_grad,) = torch.autograd.grad(reference, reference_flat, grad)
    assert torch.equal(out, reference)
    assert torch.equal(flat_grad, reference_grad)

    # no copy of q into the kernel, none of its gradient back into the projection's layout
    # (the contiguous path makes one each way)
    assert _copies(lambda: fused_rotary(q, cos, sin)) == 0

    def backward() -> None:
        torch.autograd.grad(fused_rotary(q, cos, sin), flat, grad)

    def backward_from_copy() -> None:
        q_copy = flat.view(2, 7, 3, 40).transpose(1, 2).contiguous()
        torch.autograd.grad(fused_rotary(q_copy, cos, sin), flat, grad)

    assert _copies(backward) < _copies(backward_from_copy)


@pytest.mark.parametrize(
    ("shape", "stride", "dense"),
    [
        ((2, 3, 7, 40), (840, 40, 120, 1), True),  # the projections' layout, transposed
        ((2, 3, 7, 40), (840, 280, 40, 1), True),  # contiguous
        ((2, 1, 7, 40), (280, 5, 40, 1), True),  # a size-1 dimension's stride is free
        ((2, 3, 7, 40), (1680, 40, 120, 1), False),  # a gap: a slice of something wider
    ],
)
def test_empty_like_layout(shape: tuple[int, ...], stride: tuple[int, ...], dense: bool) -> None:
    made = _empty_like_layout(torch.Size(shape), stride, torch.empty(0))
    if not dense:
        assert made is None
        return
    assert made is not None and tuple(made.shape) == shape
    assert all(made.stride(i) == stride[i] for i in range(len(shape)) if shape[i] != 1)
