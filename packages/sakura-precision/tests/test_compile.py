"""Compile: eager-equivalence, the on-disk cache, every mode on the CPU, in-place regional
compilation, and conflicts.

The Inductor tests compile bias-free Linear stacks: their graphs need no generated C++ kernel
(only extern matmuls), so a cold compile takes seconds instead of the tens of seconds a g++
build of fused kernels takes on these machines.  ``benchmarks/precision.py`` measures real
models with kernels, cold and warm, in separate fresh processes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from precision_helpers import loss_fn, make_batches, make_model
from torch import nn
from torch._dynamo.utils import counters

from sakura import SakuraRuntime
from sakura.events import OnTrainStepBegin
from sakura.testing import ServiceConformance
from sakura_precision import ActivationCheckpoint, Compile
from sakura_precision import compile as compile_module


def linear_stack() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32, bias=False), nn.Linear(32, 8, bias=False))


def _outputs_and_grads(
    model: nn.Module, x: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(x)
    out.square().sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Any:
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _compile_stack(cache: Path) -> dict[str, Any]:
    """Compile a fresh stack with nothing in memory: what the caches report."""
    torch._dynamo.reset()
    counters.clear()
    model = linear_stack()
    with SakuraRuntime([Compile(cache_dir=cache)], strict=True) as rt:
        rt.wrap_model(model)(torch.randn(4, 16)).square().sum().backward()
    return {k: dict(counters[k]) for k in ("inductor", "aot_autograd")}


def test_inductor_matches_eager_and_uses_the_cache_directory(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    x = torch.randn(4, 16)
    eager_out, eager_grads = _outputs_and_grads(linear_stack(), x)
    model = linear_stack()
    service = Compile(cache_dir=cache)
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with SakuraRuntime([service], strict=True) as rt:
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(cache.resolve())
        assert rt.wrap_model(model) is model  # in place
        out, grads = _outputs_and_grads(model, x)
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == before  # restored at teardown
    assert service.compiled == [""]
    # an nn.Sequential really compiled (nn.Module.compile() would have stayed eager)
    assert counters["stats"]["unique_graphs"] == 1
    assert counters["inductor"]["fxgraph_cache_miss"] == 2  # forward and backward graphs
    assert counters["aot_autograd"]["autograd_cache_saved"] == 1
    torch.testing.assert_close(out, eager_out, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert {"fxgraph", "aotautograd"} <= {p.name for p in cache.iterdir()}
    assert any(p.is_file() for p in (cache / "fxgraph").rglob("*"))  # compiled artifacts

    # With Dynamo's in-memory state dropped, another empty directory compiles from scratch,
    # and the first directory serves everything: the artifacts come from disk.
    elsewhere = _compile_stack(tmp_path / "empty")
    assert elsewhere["aot_autograd"].get("autograd_cache_miss") == 1
    assert elsewhere["inductor"].get("fxgraph_cache_miss") == 2
    again = _compile_stack(cache)
    assert again["aot_autograd"].get("autograd_cache_hit") == 1
    assert again["aot_autograd"].get("autograd_cache_miss", 0) == 0
    assert again["inductor"].get("fxgraph_cache_hit") == 2


def test_reduce_overhead_on_the_cpu_skips_cuda_graphs(tmp_path: Path) -> None:
    x = torch.randn(4, 16)
    eager_out, eager_grads = _outputs_and_grads(linear_stack(), x)
    model = linear_stack()
    with SakuraRuntime([Compile(mode="reduce-overhead", cache_dir=tmp_path)], strict=True) as rt:
        rt.wrap_model(model)
        for _ in range(2):
            out, grads = _outputs_and_grads(model, x)
    torch.testing.assert_close(out, eager_out, rtol=1e-5, atol=1e-6)
    for got, want in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    if not torch.cuda.is_available():
        assert counters["inductor"]["cudagraph_skips"] >= 1  # CPU graphs run without them


@pytest.mark.parametrize("mode", compile_module.MODES)
def test_every_mode_reaches_torch_compile(mode: str, monkeypatch: Any, tmp_path: Path) -> None:
    seen: list[dict[str, Any]] = []

    def fake_compile(fn: Any, **kwargs: Any) -> Any:
        seen.append(kwargs)
        return fn

    monkeypatch.setattr(compile_module.torch, "compile", fake_compile)
    model = linear_stack()
    Compile(mode, cache_dir=tmp_path, fullgraph=True, dynamic=False).wrap_model(model)
    assert seen == [{"backend": "inductor", "fullgraph": True, "dynamic": False, "mode": mode}]
    assert model(torch.randn(2, 16)).shape == (2, 8)
    # only the CUDA-graph modes mark step starts; the others handle no event at all
    marks = mode in ("reduce-overhead", "max-autotune")
    assert Compile(mode).event_types == (frozenset({OnTrainStepBegin}) if marks else frozenset())


def test_blocks_target_compiles_each_block_in_place(tmp_path: Path) -> None:
    x, y = make_batches(1)[0]
    eager = make_model(depth=4)
    loss_fn(eager(x), y).backward()
    model = make_model(depth=4)
    service = Compile(target="blocks", backend="aot_eager", cache_dir=tmp_path)
    with SakuraRuntime([service], strict=True) as rt:
        assert rt.wrap_model(model) is model
        loss = loss_fn(model(x), y)
        loss.backward()
    assert service.compiled == [f"blocks.{i}" for i in range(4)]
    # identical blocks share their compiled code: one graph for all four, not one each
    assert counters["stats"]["unique_graphs"] == 1
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_compile_and_activation_checkpoint_together(tmp_path: Path) -> None:
    x, y = make_batches(1)[0]
    eager = make_model()
    loss_fn(eager(x), y).backward()
    model = make_model()
    services = [
        ActivationCheckpoint(policy="save_matmuls"),
        Compile(backend="aot_eager", cache_dir=tmp_path),
    ]
    with SakuraRuntime(services, strict=True) as rt:
        model = rt.wrap_model(model)
        loss_fn(model(x), y).backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_one_compiler_at_a_time(tmp_path: Path) -> None:
    service = Compile(backend="aot_eager", cache_dir=tmp_path)
    with pytest.raises(ValueError, match=r"already compiled: it is a torch.compile\(\)'d module"):
        service.wrap_model(torch.compile(linear_stack(), backend="eager"))
    model = linear_stack()
    model.compile(backend="eager")
    with pytest.raises(ValueError, match=r"nn.Module.compile\(\) was called on it"):
        service.wrap_model(model)
    lightning_like = linear_stack()
    lightning_like._compiler_ctx = {"compiler": "dynamo"}
    with pytest.raises(ValueError, match=r"Lightning compiled it"):
        service.wrap_model(lightning_like)
    fresh = linear_stack()
    service.wrap_model(fresh)
    service.wrap_model(fresh)  # compiled by a Compile service already: left as it is
    assert service.compiled == [""]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"mode": "fastest"},
            r"mode='fastest' is not accepted; accepted: 'default', 'reduce-overhead'",
        ),
        ({"target": "layers"}, r"target='layers' is not accepted; accepted: 'model', 'blocks'"),
        ({"blocks": nn.Linear}, r"blocks= applies to target='blocks' only"),
        (
            {"backend": ""},
            r"Compile: backend='' is not accepted; accepted: a torch.compile backend",
        ),
        ({"backend": "aot_eager", "mode": "max-autotune"}, r"only mode='default' is accepted"),
        ({"fullgraph": 1}, r"Compile: fullgraph=1 is not accepted; accepted: True or False"),
        ({"dynamic": "auto"}, r"dynamic='auto' is not accepted; accepted: True or False"),
        (
            {"cache_dir": 3},
            r"cache_dir=3 is not accepted; accepted: a path \(str or os.PathLike\) or None",
        ),
    ],
)
def test_bad_options(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Compile(**kwargs)


def test_default_cache_dir(monkeypatch: Any, tmp_path: Path) -> None:
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert Compile().cache_dir == tmp_path / "sakura" / "torch-compile"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert Compile().cache_dir == tmp_path / "mine"  # the user's own setting is respected


class TestCompileConformance(ServiceConformance):
    def make_service(self) -> Any:
        return Compile(backend="aot_eager", cache_dir=self.tmp_path / "cache")
