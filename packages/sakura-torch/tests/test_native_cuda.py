"""sakura_torch.native_cuda: a real .cu source compiled with nvcc (no GPU needed for that),
its ABI checked through ctypes; without a CUDA device load() is None quietly."""

from __future__ import annotations

import ctypes
import subprocess
import warnings
from pathlib import Path

import pytest

from sakura_torch.native_cuda import CudaLibrary, compile_cuda, find_nvcc, nvcc_version

torch = pytest.importorskip("torch")

NVCC = find_nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not installed here")

SOURCE = r"""
#include <cuda_runtime.h>
#include <stdint.h>
__global__ void scale(float* x, float k, int64_t n) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < n) x[i] *= k;
}
extern "C" int t_cuda_abi(void) { return 5; }
extern "C" int t_cuda_probe(void) { int n = 0; return (int)cudaGetDeviceCount(&n); }
extern "C" int t_cuda_scale(float* x, float k, int64_t n, cudaStream_t stream) {
    scale<<<(unsigned)((n + 255) / 256), 256, 0, stream>>>(x, k, n);
    return (int)cudaGetLastError();
}
"""


def _declare(lib: ctypes.CDLL) -> None:
    lib.t_cuda_scale.argtypes = [ctypes.c_void_p, ctypes.c_float, ctypes.c_int64, ctypes.c_void_p]
    lib.t_cuda_scale.restype = ctypes.c_int


def cuda_library(tmp_path: Path, **changes: object) -> CudaLibrary:
    path = tmp_path / "scale.cu"
    path.write_text(SOURCE)
    options: dict[str, object] = {
        "package": "sakura-testpkg",
        "name": "sakura_native_test_cuda",
        "sources": [path],
        "abi_symbol": "t_cuda_abi",
        "abi_version": 5,
        "declare": _declare,
        "probe_symbol": "t_cuda_probe",
        "what": "test CUDA kernel",
    }
    options.update(changes)
    return CudaLibrary(**options)  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SAKURA_TESTPKG_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("SAKURA_TESTPKG_NO_KERNEL", raising=False)


@needs_nvcc
def test_compiles_with_nvcc_and_checks_the_abi(tmp_path: Path) -> None:
    native = cuda_library(tmp_path, arch="sm_90")
    path = native.compile(tmp_path / "build")
    assert path.exists() and path.suffix == ".so"
    assert native.compile(tmp_path / "build") == path  # up to date: not rebuilt
    symbols = subprocess.run(
        ["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True
    ).stdout
    assert {"t_cuda_abi", "t_cuda_probe", "t_cuda_scale"} <= {
        line.split()[-1] for line in symbols.splitlines() if line.strip()
    }
    lib = native.open(path)  # loads without a GPU: the runtime is linked statically
    assert lib.t_cuda_abi() == 5 and native.path == path
    with pytest.raises(RuntimeError, match="has ABI 5, this code expects 6"):
        native.replace(abi_version=6).open(path)
    # An edited source gets a new file name (the sources' hash).
    (tmp_path / "scale.cu").write_text(SOURCE + "\n// edited\n")
    edited = native.compile(tmp_path / "build")
    assert edited != path
    (tmp_path / "scale.h").write_text("// a header beside the source counts too\n")
    assert native.compile(tmp_path / "build") not in (path, edited)


@needs_nvcc
def test_a_compile_error_names_nvcc(tmp_path: Path) -> None:
    broken = tmp_path / "broken.cu"
    broken.write_text("this is not CUDA")
    with pytest.raises(RuntimeError, match="nvcc failed"):
        compile_cuda([broken], tmp_path / "broken.so", arch="sm_90")
    assert not list(tmp_path.glob("*.tmp")) and not (tmp_path / "broken.so").exists()
    assert nvcc_version(NVCC or "nvcc").count(".") >= 1


def test_arch_spelling_is_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="arch='90' is not accepted; accepted: 'sm_XY'"):
        cuda_library(tmp_path, arch="90")
    native = cuda_library(tmp_path, arch="sm_80")
    other = native.replace(arch="sm_90")
    assert isinstance(other, CudaLibrary) and (other.arch, other.probe_symbol) == (
        "sm_90",
        "t_cuda_probe",
    )
    assert native.disable_env == "SAKURA_TESTPKG_NO_KERNEL"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_without_a_device_load_is_none_quietly(tmp_path: Path) -> None:
    native = cuda_library(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.load() is None
    assert native.unavailable() is not None and native.failure is None
    with pytest.raises(RuntimeError, match="test CUDA kernel is not available: no CUDA device"):
        native.load(required=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_device_builds_loads_and_launches_on_the_current_stream(tmp_path: Path) -> None:
    native = cuda_library(tmp_path)
    lib = native.load(required=True)
    assert lib is not None and native.path is not None
    assert f"-{native.target_arch()}-" in native.path.parent.name
    x = torch.arange(1000, dtype=torch.float32, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    assert lib.t_cuda_scale(x.data_ptr(), 2.0, x.numel(), stream) == 0
    torch.cuda.synchronize()
    assert torch.equal(x.cpu(), torch.arange(1000, dtype=torch.float32) * 2)
