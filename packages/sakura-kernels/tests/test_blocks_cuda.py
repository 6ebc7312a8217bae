"""The CUDA block kernels (csrc/blocks_cuda.cu): compiled with nvcc here (no GPU needed),
their exports and ABI checked, their arithmetic run on the host (the ``*_emulate`` exports,
the device's element functions and summation order) against the torch path; on a CUDA
device, the kernels themselves against the CPU."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest
import torch

from sakura_kernels.blocks import fused_glu, fused_rms_norm, fused_rotary
from sakura_kernels.blocks._native import BAD_ARGUMENTS, CUDA_LIBRARY, NO_KERNEL_ENV
from sakura_torch.native_cuda import find_nvcc

EXPORTS = {
    "sakura_kernels_blocks_cuda_abi_version",
    "sakura_kernels_blocks_cuda_probe",
    *(
        f"sakura_blocks_{op}_{kind}"
        for op in ("rmsnorm_forward", "rmsnorm_backward", "rope", "glu_forward", "glu_backward")
        for kind in ("cuda", "emulate")
    ),
}
CODES = {torch.float32: 0, torch.bfloat16: 1}
TOL = {torch.float32: 2e-6, torch.bfloat16: 1e-2}  # relative to the largest value


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ctypes.CDLL]:
    if find_nvcc() is None:
        pytest.skip("nvcc is not installed here: the CUDA source cannot be compiled")
    library = CUDA_LIBRARY.replace(arch="sm_90")  # the H200's architecture
    path = library.compile(tmp_path_factory.mktemp("blocks_cuda"))
    return path, library.open(path)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def test_compiles_with_the_exports_and_abi(built: tuple[Path, ctypes.CDLL]) -> None:
    path, lib = built
    listed = subprocess.run(
        ["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True
    ).stdout
    assert {line.split()[-1] for line in listed.splitlines() if line.strip()} >= EXPORTS
    assert lib.sakura_kernels_blocks_cuda_abi_version() == CUDA_LIBRARY.abi_version == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_device_arithmetic_matches_the_torch_path(
    built: tuple[Path, ctypes.CDLL], monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    monkeypatch.setenv(NO_KERNEL_ENV, "1")  # the reference: the torch path
    _, lib = built
    code = CODES[dtype]
    gen = torch.Generator().manual_seed(0)
    rows, h = 70, 300  # h > 256 threads: the strided partial sums and the tree both run
    x = (torch.randn(rows, h, generator=gen) * 2).to(dtype)
    w = (1 + 0.2 * torch.randn(h, generator=gen)).to(dtype)
    dy = torch.randn(rows, h, generator=gen).to(dtype)
    # RMSNorm forward and backward.
    y, rstd = torch.empty_like(x), torch.empty(rows)
    assert lib.sakura_blocks_rmsnorm_forward_emulate(
        code, x.data_ptr(), w.data_ptr(), y.data_ptr(), rstd.data_ptr(), rows, h, 1e-6
    ) == 0  # fmt: skip
    leaf_x, leaf_w = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = fused_rms_norm(leaf_x, leaf_w, 1e-6)
    ref.backward(dy)
    assert rel(y, ref.detach()) <= TOL[dtype]
    dx, dw = torch.empty_like(x), torch.empty(h)
    partial = torch.empty(-(-rows // 32), h)
    assert lib.sakura_blocks_rmsnorm_backward_emulate(
        code, dy.data_ptr(), x.data_ptr(), w.data_ptr(), rstd.data_ptr(), dx.data_ptr(),
        dw.data_ptr(), partial.data_ptr(), rows, h,
    ) == 0  # fmt: skip
    assert leaf_x.grad is not None and leaf_w.grad is not None
    assert rel(dx, leaf_x.grad) <= TOL[dtype]
    assert rel(dw.to(dtype), leaf_w.grad) <= TOL[dtype]
    # Rotary embedding, both directions.
    q = torch.randn(2, 3, 5, 16, generator=gen).to(dtype)
    ang = torch.rand(2, 5, 8, generator=gen) * 9
    cos, sin = torch.cat((ang, ang), -1).cos().to(dtype), torch.cat((ang, ang), -1).sin().to(dtype)
    for backward in (0, 1):
        out = torch.empty_like(q)
        assert lib.sakura_blocks_rope_emulate(
            code, q.data_ptr(), cos.data_ptr(), sin.data_ptr(), out.data_ptr(), 2, 3, 5, 16,
            backward,
        ) == 0  # fmt: skip
        leaf = q.clone().requires_grad_()
        fwd = fused_rotary(leaf, cos, sin)
        if backward:
            fwd.backward(q)  # the backward of the rotation applied to q
            assert leaf.grad is not None
            assert rel(out, leaf.grad) <= TOL[dtype]
        else:
            assert rel(out, fwd.detach()) <= TOL[dtype]
    # Gated activations.
    g, u = (
        (torch.randn(999, generator=gen) * 3).to(dtype),
        torch.randn(999, generator=gen).to(dtype),
    )
    d = torch.randn(999, generator=gen).to(dtype)
    for kind, name in enumerate(("silu", "gelu_tanh")):
        out, dg, du = torch.empty_like(g), torch.empty_like(g), torch.empty_like(g)
        assert lib.sakura_blocks_glu_forward_emulate(
            code, kind, g.data_ptr(), u.data_ptr(), out.data_ptr(), 999
        ) == 0  # fmt: skip
        assert lib.sakura_blocks_glu_backward_emulate(
            code, kind, d.data_ptr(), g.data_ptr(), u.data_ptr(), dg.data_ptr(), du.data_ptr(), 999
        ) == 0  # fmt: skip
        lg, lu = g.clone().requires_grad_(), u.clone().requires_grad_()
        ref = fused_glu(lg, lu, name)
        ref.backward(d)
        assert lg.grad is not None and lu.grad is not None
        assert rel(out, ref.detach()) <= TOL[dtype]
        assert rel(dg, lg.grad) <= TOL[dtype] and rel(du, lu.grad) <= TOL[dtype]


def test_the_kernels_refuse_bad_arguments(built: tuple[Path, ctypes.CDLL]) -> None:
    _, lib = built
    x = torch.zeros(4)
    assert lib.sakura_blocks_rope_emulate(0, 0, 0, 0, 0, 1, 1, 1, 3, 0) == BAD_ARGUMENTS
    assert lib.sakura_blocks_glu_forward_emulate(0, 2, 0, 0, 0, 1) == BAD_ARGUMENTS
    assert lib.sakura_blocks_rmsnorm_forward_emulate(2, 0, 0, 0, 0, 1, 1, 1e-6) == BAD_ARGUMENTS
    assert lib.sakura_blocks_rmsnorm_forward_emulate(
        0, x.data_ptr(), x.data_ptr(), x.data_ptr(), x.data_ptr(), 1, 0, 1e-6
    ) == BAD_ARGUMENTS  # fmt: skip


def test_without_a_device_the_cuda_path_steps_aside() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    assert CUDA_LIBRARY.load() is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_a_device_the_kernels_match_the_cpu(dtype: torch.dtype) -> None:
    assert CUDA_LIBRARY.load(required=True) is not None
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(300, 576, generator=gen) * 2).to(dtype)
    w = (1 + 0.2 * torch.randn(576, generator=gen)).to(dtype)
    q = torch.randn(2, 9, 64, 64, generator=gen).to(dtype)
    ang = torch.rand(2, 64, 32, generator=gen) * 9
    cos, sin = torch.cat((ang, ang), -1).cos().to(dtype), torch.cat((ang, ang), -1).sin().to(dtype)
    g, u = torch.randn(2, 64, 1536, generator=gen).to(dtype), torch.randn(2, 64, 1536).to(dtype)

    def run(device: str) -> list[torch.Tensor]:
        leaves = [t.to(device).requires_grad_() for t in (x, w, q, g, u)]
        xs, ws, qs, gs, us = leaves
        outs = [fused_rms_norm(xs, ws, 1e-6), fused_rotary(qs, cos.to(device), sin.to(device)),
                fused_glu(gs, us, "silu"), fused_glu(gs, us, "gelu_tanh")]  # fmt: skip
        sum((o.float() * 0.37).sum() + (o.float() ** 2).mean() for o in outs).backward()
        return [t.detach().cpu() for t in outs] + [t.grad.cpu() for t in leaves]  # type: ignore[union-attr]

    for a, b in zip(run("cuda"), run("cpu"), strict=True):
        assert rel(a, b) <= TOL[dtype]
    first, second = run("cuda")[6], run("cuda")[6]  # the RMSNorm weight gradient
    assert torch.equal(first, second)
