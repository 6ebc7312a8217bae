"""Building, caching and falling back from the C++ kernel; the plugin's import cost."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sakura_offload import OffloadAdamW
from sakura_offload.host_optimizer import kernel as _kernel


@pytest.fixture
def fresh_kernel(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A kernel loader with nothing loaded yet and its cache in tmp_path."""
    monkeypatch.setattr(_kernel, "LIBRARY", _kernel.LIBRARY.replace())
    monkeypatch.setenv(_kernel.CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(_kernel.NO_KERNEL_ENV, raising=False)
    return tmp_path


def test_build_is_logged_and_cached(fresh_kernel: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="sakura_offload.kernel"):
        kernel = _kernel.load_kernel(required=True)
    assert kernel is not None
    assert kernel.path.is_relative_to(fresh_kernel) and kernel.path.exists()
    assert any("building or loading" in r.getMessage() for r in caplog.records)
    assert _kernel.load_kernel() is kernel  # built once per process


def test_failed_build_warns_and_falls_back(
    fresh_kernel: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = fresh_kernel / "broken.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(_kernel, "LIBRARY", _kernel.LIBRARY.replace(sources=[broken]))
    with pytest.warns(RuntimeWarning, match="could not be built"):
        optimizer = OffloadAdamW([torch.nn.Parameter(torch.zeros(4))])
    assert optimizer.backend.name == "torch"
    with pytest.raises(RuntimeError, match="kernel is not available"):
        OffloadAdamW([torch.nn.Parameter(torch.zeros(4))], backend="cpp")


def test_environment_forces_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_kernel.NO_KERNEL_ENV, "1")
    assert OffloadAdamW([torch.nn.Parameter(torch.zeros(4))]).backend.name == "torch"
    monkeypatch.setenv(_kernel.NO_KERNEL_ENV, "0")
    assert OffloadAdamW([torch.nn.Parameter(torch.zeros(4))]).backend.name == "cpp"
    monkeypatch.setenv(_kernel.NO_KERNEL_ENV, "maybe")
    with pytest.raises(Exception, match="SAKURA_OFFLOAD_NO_KERNEL='maybe'"):
        OffloadAdamW([torch.nn.Parameter(torch.zeros(4))])


def test_results_do_not_depend_on_the_thread_count() -> None:
    g = torch.Generator().manual_seed(0)
    start = torch.randn(200_000, generator=g)
    grad = torch.randn(200_000, generator=g)
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        p = torch.nn.Parameter(start.clone())
        opt = OffloadAdamW([p], moment_dtype="int8", backend="cpp")
        for _ in range(2):
            p.grad = grad.clone()
            opt.step()
        results.append(p.detach().clone())
    torch.set_num_threads(1)
    assert torch.equal(results[0], results[1])


def test_plugin_and_package_import_without_torch() -> None:
    code = (
        "import sys, sakura_offload, sakura_offload.plugin\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
