"""The CUDA AdamW kernel (csrc/adamw_cuda.cu): compiled with nvcc here (no GPU needed), its
exports and ABI checked; its element arithmetic, run on the host through the ``*_emulate``
exports, held to torch.optim.AdamW and to the C++ kernel; on a CUDA device,
``backend="cuda"`` against the host update."""

from __future__ import annotations

import copy
import ctypes
import subprocess
from pathlib import Path

import pytest
import torch
from _offload_models import (
    NON_FINITE_TOLERANCE,
    assert_non_finite_stays_local,
    max_diff,
    train,
)

from sakura_offload import OffloadAdamW
from sakura_offload.host_optimizer import kernel as _kernel
from sakura_offload.host_optimizer import optimizer as optimizer_module
from sakura_offload.host_optimizer.backends import CudaBackend, TorchBackend
from sakura_torch.native_cuda import find_nvcc

HYPER = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.05}
EXPORTS = {
    "sakura_offload_cuda_abi_version",
    "sakura_offload_cuda_probe",
    "sakura_offload_cuda_reachable",
    *(f"sakura_adamw_{f}_{k}" for f in ("fp32", "bf16", "int8") for k in ("cuda", "emulate")),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ctypes.CDLL]:
    if find_nvcc() is None:
        pytest.skip("nvcc is not installed here: the CUDA source cannot be compiled")
    library = _kernel.CUDA_LIBRARY.replace(arch="sm_90")  # the H200's architecture
    path = library.compile(tmp_path_factory.mktemp("adamw_cuda"))
    return path, library.open(path)


def emulate(opt: OffloadAdamW, lib: ctypes.CDLL) -> OffloadAdamW:
    """``opt`` updating every parameter, host ones too, with the emulated CUDA arithmetic."""
    emulated = CudaBackend(lib, TorchBackend(), emulate=True)
    opt.backend = CudaBackend(lib, emulated, emulate=True)
    return opt


def test_compiles_with_the_exports_and_abi(built: tuple[Path, ctypes.CDLL]) -> None:
    path, lib = built
    listed = subprocess.run(
        ["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True
    ).stdout
    assert {line.split()[-1] for line in listed.splitlines() if line.strip()} >= EXPORTS
    assert lib.sakura_offload_cuda_abi_version() == _kernel.CUDA_LIBRARY.abi_version == 3


def test_the_kernel_arithmetic_matches_torch_adamw(built: tuple[Path, ctypes.CDLL]) -> None:
    def emulated(params: object) -> OffloadAdamW:
        return emulate(OffloadAdamW(params, **HYPER, backend="torch"), built[1])  # type: ignore[arg-type]

    model, _ = train(emulated)
    reference, _ = train(lambda p: torch.optim.AdamW(p, **HYPER))  # type: ignore[arg-type]
    assert max_diff(model, reference) <= 3e-7  # the bar the C++ kernel meets


@pytest.mark.parametrize("dtype", ["float32", "bf16", "int8"])
def test_the_kernel_arithmetic_agrees_with_the_cpp_kernel(
    built: tuple[Path, ctypes.CDLL], dtype: str
) -> None:
    # Five steps from the same start: same formats, same random streams.  The C++ kernel is
    # vectorised (and its compiler may fuse multiply-adds; nvcc here does not), so the last
    # bits of a value may differ and, now and then, a bf16 or int8 code they flip.
    g = torch.Generator().manual_seed(0)
    start = torch.randn(3000, generator=g)
    grads = [torch.randn(3000, generator=g) * torch.logspace(-4, 0, 3000) for _ in range(5)]
    results = []
    for backend in ("cpp", "emulated"):
        param = torch.nn.Parameter(start.clone())
        opt = OffloadAdamW([param], **HYPER, moment_dtype=dtype, backend="cpp")
        if backend == "emulated":
            emulate(opt, built[1])
        for grad in grads:
            param.grad = grad.clone()
            opt.step()
        results.append((param.detach().clone(), copy.deepcopy(opt.state[param])))
    (p_cpp, s_cpp), (p_emu, s_emu) = results
    assert 0 < (p_cpp - p_emu).abs().max().item() < 1e-6  # > 0: the emulation did run
    assert s_cpp.keys() == s_emu.keys()
    for key, value in s_cpp.items():
        if value.dtype in (torch.uint8, torch.bfloat16):
            assert (value == s_emu[key]).float().mean().item() > 0.99, key
        else:
            torch.testing.assert_close(value, s_emu[key], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dtype", ["float32", "bf16", "int8"])
def test_the_kernel_keeps_non_finite_gradients_local(
    built: tuple[Path, ctypes.CDLL], dtype: str
) -> None:
    assert_non_finite_stays_local(
        lambda p: emulate(OffloadAdamW(p, **HYPER, moment_dtype=dtype, backend="torch"), built[1]),
        HYPER,
        NON_FINITE_TOLERANCE[dtype],
    )


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_the_optimizer_device_branch_with_the_emulated_kernel(
    built: tuple[Path, ctypes.CDLL], monkeypatch: pytest.MonkeyPatch, param_dtype: torch.dtype
) -> None:
    # The optimizer's backend="cuda" branch (state allocation, masters, the update, the
    # copy back), run on the host: the device test is below, this one runs everywhere.
    monkeypatch.setattr(optimizer_module, "_pinned", lambda state: [])  # needs CUDA
    monkeypatch.setattr(OffloadAdamW, "_on_device", lambda self, p: True)
    monkeypatch.setattr(OffloadAdamW, "_wait_for_devices", lambda self: None)
    g = torch.Generator().manual_seed(2)
    start = torch.randn(1000, generator=g).to(param_dtype)
    grads = [torch.randn(1000, generator=g) for _ in range(3)]
    results = []
    for backend in ("cpp", "emulated"):
        param = torch.nn.Parameter(start.clone())
        opt = OffloadAdamW([param], **HYPER, moment_dtype="int8", backend="cpp")
        if backend == "emulated":
            opt.backend = CudaBackend(built[1], TorchBackend(), emulate=True)
        for grad in grads:
            param.grad = grad.to(param_dtype)
            opt.step()
        results.append((param.detach().float(), opt.state_dict()["state"][0]))
        assert ("master" in opt.state[param]) == (param_dtype != torch.float32)
    (p_cpp, s_cpp), (p_emu, s_emu) = results
    # The device branch called opt.backend (the emulated kernel), not the host one: the
    # fp32 weights (the master, for bf16 parameters) differ in their last bits.
    fp32 = (p_cpp, p_emu) if param_dtype == torch.float32 else (s_cpp["master"], s_emu["master"])
    assert 0 < (fp32[0] - fp32[1]).abs().max().item() < 1e-6
    # A bf16 parameter is its master rounded: at most one bf16 step apart.
    assert ((p_cpp - p_emu).abs() <= p_cpp.abs() * 2**-7).all()
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(s_emu[key], s_cpp[key], rtol=0.07, atol=1e-6)


def test_the_cuda_backend_needs_a_device() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(RuntimeError, match="CUDA AdamW kernel is not available: no CUDA device"):
        OffloadAdamW([torch.nn.Parameter(torch.zeros(4))], backend="cuda")
    with pytest.raises(ValueError, match=r"backend='gpu'.*'cuda'"):
        OffloadAdamW([torch.nn.Parameter(torch.zeros(4))], backend="gpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("moment_dtype", ["float32", "bf16", "int8"])
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_on_a_device_cuda_updates_match_the_host_update(
    moment_dtype: str, param_dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(1)
    start = torch.randn(70_000, generator=g).to(param_dtype)
    grads = [torch.randn(70_000, generator=g) * torch.logspace(-4, 0, 70_000) for _ in range(5)]
    results = {}
    for backend in ("cpp", "cuda"):
        param = torch.nn.Parameter(start.cuda())
        opt = OffloadAdamW([param], **HYPER, moment_dtype=moment_dtype, backend=backend)
        for grad in grads:
            param.grad = grad.to("cuda", param_dtype)
            opt.step()
        state = opt.state_dict()["state"][0]
        results[backend] = (param.detach().float().cpu(), state)
        if backend == "cuda":
            assert opt.backend.name == "cuda"
            assert all(t.is_pinned() for k, t in opt.state[param].items() if k != "step")
    (p_host, s_host), (p_cuda, s_cuda) = results["cpp"], results["cuda"]
    tolerance = {"float32": 1e-6, "bf16": 1e-5, "int8": 2e-4}[moment_dtype]
    if param_dtype == torch.bfloat16:  # a master weight rounded to bf16 may flip one ulp
        tolerance = max(tolerance, 2**-7 * p_host.abs().max().item())
    assert (p_host - p_cuda).abs().max().item() <= tolerance
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(s_cuda[key], s_host[key], rtol=0.07, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_device_pinned_host_memory_is_reachable_and_pageable_is_not() -> None:
    library = _kernel.CUDA_LIBRARY.load(required=True)
    assert library is not None
    backend = CudaBackend(library, TorchBackend())
    backend.check_reachable(torch.zeros(10).pin_memory())
    backend.check_reachable(torch.zeros(10, device="cuda"))
    with pytest.raises(RuntimeError, match="cannot reach a host tensor"):
        backend.check_reachable(torch.zeros(10))


def _mlp_on(device: str, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.GELU(), torch.nn.Linear(512, 64))
    return model.to(device, dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_on_a_device_host_updates_through_the_side_stream_pipeline(
    param_dtype: torch.dtype,
) -> None:
    """The default backend on CUDA parameters: gradients copied off on a side stream, the
    host kernel on a worker thread, the weights copied back; the same bits as the same host
    update of CPU copies of the parameters given the same gradients."""
    from sakura_offload.host_optimizer.device_stream import CudaTransfer

    device_model, host_model = _mlp_on("cuda", param_dtype), _mlp_on("cpu", param_dtype)
    device_opt = OffloadAdamW(device_model.parameters(), **HYPER)
    host_opt = OffloadAdamW(host_model.parameters(), **HYPER)
    assert isinstance(device_opt._transfer, CudaTransfer)
    g = torch.Generator().manual_seed(3)
    for _ in range(4):
        x = torch.randn(32, 64, generator=g).to(param_dtype)
        loss = host_model(x).float().square().mean()
        grads = torch.autograd.grad(loss, list(host_model.parameters()))
        for model, opt, where in (
            (device_model, device_opt, "cuda"),
            (host_model, host_opt, "cpu"),
        ):
            for p, grad in zip(model.parameters(), grads, strict=True):
                p.grad = grad.to(where)
            opt.step()
            opt.zero_grad()
    for p_dev, p_host in zip(device_model.parameters(), host_model.parameters(), strict=True):
        assert torch.equal(p_dev.detach().cpu(), p_host.detach())
        master = device_opt.state[p_dev]["master"]
        assert master.is_pinned() and torch.equal(master, host_opt.state[p_host]["master"])
    assert device_opt._pipeline is not None  # the updates went through the worker


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_device_eager_pipeline_updates_equal_the_stepped_ones() -> None:
    """eager=True starts each tensor's copy and host update during backward; the result is
    the one step() gives after backward."""
    results = []
    for eager in (False, True):
        model = _mlp_on("cuda", torch.float32)
        opt = OffloadAdamW(model.parameters(), **HYPER, eager=eager)
        g = torch.Generator().manual_seed(3)
        for _ in range(4):
            x = torch.randn(32, 64, generator=g).cuda()
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        results.append([p.detach().cpu() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
