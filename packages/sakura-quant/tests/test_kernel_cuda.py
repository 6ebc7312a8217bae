"""The CUDA NF4 kernel (csrc/nf4_cuda.cu): compiled with nvcc here (no GPU needed), its
exports and ABI checked, its element arithmetic run on the host (the ``*_emulate``
exports) against the torch path bit for bit; on a CUDA device, the kernel itself."""

from __future__ import annotations

import ctypes
import subprocess
from pathlib import Path

import pytest
import torch

from sakura_quant import _kernel
from sakura_quant.codec import dequantize_weight, quantize_weight
from sakura_quant.formats.nf4 import kernel_arguments
from sakura_torch.native_cuda import find_nvcc

EXPORTS = {
    "sakura_quant_cuda_abi_version",
    "sakura_quant_cuda_probe",
    "sakura_nf4_dequantize_cuda_f32",
    "sakura_nf4_dequantize_cuda_bf16",
    "sakura_nf4_dequantize_emulate_f32",
    "sakura_nf4_dequantize_emulate_bf16",
}
CASES = [
    ((64, 64), 64, False),
    ((33, 51), 64, True),
    ((7, 9), 2, False),
    ((40, 96), 256, True),
    ((64, 520), 64, True),  # 520 blocks: three 256-blocks of double-quantized scales
]


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The bit patterns (so -0.0 and 0.0, or two NaNs, are told apart)."""
    return x.view(torch.int16 if x.element_size() == 2 else torch.int32)


def _weight(shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    w = torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g) * 5
    w[0, :3] = 0
    return w.to(dtype)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ctypes.CDLL]:
    if find_nvcc() is None:
        pytest.skip("nvcc is not installed here: the CUDA source cannot be compiled")
    library = _kernel.CUDA_LIBRARY.replace(arch="sm_90")  # the H200's architecture
    path = library.compile(tmp_path_factory.mktemp("nf4_cuda"))
    return path, library.open(path)


def test_compiles_with_the_exports_and_abi(built: tuple[Path, ctypes.CDLL]) -> None:
    path, lib = built
    listed = subprocess.run(
        ["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True
    ).stdout
    assert {line.split()[-1] for line in listed.splitlines() if line.strip()} >= EXPORTS
    assert lib.sakura_quant_cuda_abi_version() == _kernel.CUDA_LIBRARY.abi_version == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("shape", "block_size", "dq"), CASES)
def test_the_kernel_arithmetic_equals_the_torch_path(
    built: tuple[Path, ctypes.CDLL],
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
    shape: tuple[int, int],
    block_size: int,
    dq: bool,
) -> None:
    monkeypatch.setenv(_kernel.NO_KERNEL_ENV, "1")  # the reference: pure torch
    _, lib = built
    q = quantize_weight(_weight(shape, dtype), "nf4", block_size=block_size, double_quant=dq)
    reference = dequantize_weight(q, dtype).reshape(-1)
    # The arguments exactly as the package marshals them for the launch.
    args, out, _alive = kernel_arguments(q.tensors, q.numel, block_size, dtype)
    suffix = "f32" if dtype == torch.float32 else "bf16"
    getattr(lib, f"sakura_nf4_dequantize_emulate_{suffix}")(*args)
    assert torch.equal(_bits(out), _bits(reference))


# Indexes into kernel_arguments' list: data_len, absmax_len, scale_codes_len,
# scale_absmax_len, block, out_len.
_LENGTHS = {"data": 1, "absmax": 3, "codes": 5, "code_absmax": 8, "block": 11, "out": 14}


@pytest.mark.parametrize(
    ("dq", "field", "value"),
    [(False, "data", 1), (True, "data", 4096), (False, "absmax", 1), (True, "codes", 1),
     (True, "code_absmax", 0), (False, "block", 0), (True, "block", 63), (False, "out", 16)],
)  # fmt: skip
def test_the_kernel_refuses_sizes_that_disagree(
    built: tuple[Path, ctypes.CDLL], dq: bool, field: str, value: int
) -> None:
    _, lib = built
    q = quantize_weight(_weight((64, 520), torch.float32), "nf4", double_quant=dq)
    args, out, _alive = kernel_arguments(q.tensors, q.numel, 64, torch.float32)
    out.fill_(7.0)
    args[_LENGTHS[field]] = value
    assert lib.sakura_nf4_dequantize_emulate_f32(*args) == _kernel.BAD_ARGUMENTS
    assert torch.all(out == 7.0)  # nothing read or written


def test_without_a_device_the_cuda_path_steps_aside() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    assert _kernel.CUDA_LIBRARY.load() is None
    q = quantize_weight(_weight((8, 8), torch.float32), "nf4")
    assert dequantize_weight(q).shape == (8, 8)  # the CPU paths, no warning


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("shape", "block_size", "dq"), [*CASES, ((1024, 4097), 64, True)])
def test_on_a_device_the_kernel_gives_the_cpu_bits(
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
    shape: tuple[int, int],
    block_size: int,
    dq: bool,
) -> None:
    q = quantize_weight(_weight(shape, dtype), "nf4", block_size=block_size, double_quant=dq)
    cpu = dequantize_weight(q, dtype)
    on_device = type(q)(
        format=q.format,
        shape=q.shape,
        dtype=q.dtype,
        block_size=q.block_size,
        tensors={k: v.cuda() for k, v in q.tensors.items()},
    )
    assert _kernel.CUDA_LIBRARY.load(required=True) is not None
    kernel = dequantize_weight(on_device, dtype)
    monkeypatch.setenv(_kernel.NO_KERNEL_ENV, "1")
    torch_on_device = dequantize_weight(on_device, dtype)
    torch.cuda.synchronize()
    assert kernel.device.type == "cuda" and kernel.dtype == dtype
    assert torch.equal(_bits(kernel.cpu()), _bits(cpu))
    assert torch.equal(_bits(torch_on_device.cpu()), _bits(cpu))
