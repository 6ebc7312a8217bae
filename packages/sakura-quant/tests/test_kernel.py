"""The C++ NF4 kernels give the same bits as the pure-torch path."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch.utils.cpp_extension import get_cxx_compiler

from sakura_quant import _kernel
from sakura_quant.codec import dequantize_weight, quantize_weight
from sakura_quant.formats.nf4 import _midpoints

COMPILER = get_cxx_compiler()
"""The C++ compiler torch's cpp_extension builds the kernel with (``$CXX``, else ``c++``)."""

if _kernel.LIBRARY.disabled():
    pytest.skip(f"{_kernel.NO_KERNEL_ENV} asks for the pure-torch path", allow_module_level=True)
if shutil.which(COMPILER) is None:
    pytest.skip(f"no C++ compiler ({COMPILER}) on this machine", allow_module_level=True)


@pytest.fixture(scope="module", autouse=True)
def built_kernel() -> None:
    """Where a compiler is present a failed build fails every test here (with the build's
    error), instead of showing as skips: a compile break must not pass unseen."""
    if _kernel.LIBRARY.load() is None:
        pytest.fail(
            f"the C++ NF4 kernel did not build although {COMPILER} is present: "
            f"{_kernel.LIBRARY.failure} (the compiler's output is logged on "
            f"{_kernel.LIBRARY.logger.name})",
            pytrace=False,
        )


def _both(
    monkeypatch: pytest.MonkeyPatch, w: torch.Tensor, block_size: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    results = []
    for disabled in ("1", "0"):
        monkeypatch.setenv(_kernel.NO_KERNEL_ENV, disabled)
        q = quantize_weight(w, "nf4", block_size=block_size)
        results.append(
            [
                q.tensors["data"],
                q.tensors["scales"],
                dequantize_weight(q),
                dequantize_weight(q, torch.float32),
                dequantize_weight(q, torch.bfloat16),
            ]
        )
    return results[0], results[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("shape", "block_size"),
    # blocks of 32-value multiples (the AVX-512 path only), blocks with a scalar tail
    # (100 = 3 * 32 + 4), a ragged last block, and blocks too small for the vector path
    [((64, 64), 64), ((33, 51), 64), ((7, 9), 2), ((40, 96), 256), ((12, 100), 100)],
)
def test_kernel_equals_torch_path(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, shape: tuple[int, int], block_size: int
) -> None:
    w = (torch.randn(shape) * torch.rand(shape[0], 1) * 5).to(dtype)
    w[0, :3] = 0
    torch_path, kernel_path = _both(monkeypatch, w, block_size)
    for a, b in zip(torch_path, kernel_path, strict=True):
        assert a.dtype == b.dtype
        assert torch.equal(a, b)


def test_kernel_ties_and_neighbours(monkeypatch: pytest.MonkeyPatch) -> None:
    # One block of 64 whose absmax is 1.0: the scaled values are the values themselves,
    # so the midpoints and their neighbouring floats are exercised exactly.
    mid = _midpoints(torch.device("cpu"))
    up = torch.nextafter(mid, torch.full_like(mid, 2.0))
    down = torch.nextafter(mid, torch.full_like(mid, -2.0))
    values = torch.cat([mid, up, down, torch.tensor([1.0, -1.0, 0.0, -0.0])])
    values = torch.nn.functional.pad(values, (0, 64 - values.numel()))
    torch_path, kernel_path = _both(monkeypatch, values, 64)
    assert torch.equal(torch_path[0], kernel_path[0])
