"""ZeRO in this process, over a real 1-rank gloo group (created here, destroyed at the end of
the module): sakura's conformance checks, device and optimizer errors, param groups added
later, closures, detaching, sharded files."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from sakura import OnTrainBegin, SakuraRuntime
from sakura.loop import LoopContext
from sakura.testing import ServiceConformance
from sakura_zero import ZeRO1, ZeRO2
from sakura_zero.checkpoint import find_shards, shard_path


@pytest.fixture(scope="module", autouse=True)
def one_rank_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    assert not dist.is_initialized(), "a process group leaked from another test module"
    previous = os.environ.get("GLOO_SOCKET_IFNAME")
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    init = tmp_path_factory.mktemp("pg") / "init"
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        if previous is None:
            os.environ.pop("GLOO_SOCKET_IFNAME", None)
        else:
            os.environ["GLOO_SOCKET_IFNAME"] = previous


class TestZeRO1Conformance(ServiceConformance):
    def make_service(self) -> Any:
        return ZeRO1()


class TestZeRO2Conformance(ServiceConformance):
    def make_service(self) -> Any:
        return ZeRO2()


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int = 2) -> None:
    for _ in range(steps):
        model(torch.randn(3, model.in_features)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_parameters_on_an_unexpected_device() -> None:
    model = torch.nn.Linear(4, 2, device="meta")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with (
        SakuraRuntime([ZeRO1()], strict=True) as rt,
        pytest.raises(
            ValueError,
            match=r"not on the expected device cpu \(the gloo backend .*\): weight on meta, "
            r"bias on meta; move the model there",
        ),
    ):
        rt.prepare(model, optimizer)


class ShadowState(torch.optim.SGD):
    """Keeps state under a tensor that is not one of its parameters."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, lr=0.1)
        self.shadow = torch.zeros(1)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = super().step(closure)
        self.state[self.shadow]["seen"] = True
        return loss


def test_optimizer_that_is_not_per_parameter_is_refused_at_its_first_step() -> None:
    model = torch.nn.Linear(4, 2)
    optimizer = ShadowState(model.parameters())
    with SakuraRuntime([ZeRO1()], strict=True) as rt:
        rt.prepare(model, optimizer)
        with pytest.raises(
            TypeError, match=r"ShadowState kept state for 1 entry .* not per-parameter"
        ):
            train(model, optimizer, steps=1)


def test_closure_runs_once_and_step_returns_its_loss() -> None:
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []

    def closure() -> torch.Tensor:
        calls.append(1)
        optimizer.zero_grad()
        loss = model(torch.ones(2, 4)).sum()
        loss.backward()
        return loss

    with SakuraRuntime([ZeRO1()], strict=True) as rt:
        rt.prepare(model, optimizer)
        loss = optimizer.step(closure)
        loss_kw = optimizer.step(closure=closure)
    assert len(calls) == 2 and isinstance(loss, torch.Tensor) and isinstance(loss_kw, torch.Tensor)


def test_param_group_added_after_sharding() -> None:
    model = torch.nn.Linear(4, 2)
    head = torch.nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    zero = ZeRO1()
    with SakuraRuntime([zero], strict=True) as rt:
        rt.prepare(model, optimizer)
        train(model, optimizer, 1)
        optimizer.add_param_group({"params": list(head.parameters()), "lr": 0.5})
        before = head.weight.detach().clone()
        head(model(torch.randn(3, 4))).sum().backward()
        optimizer.step()
        sharding = zero.sharding(optimizer)
        assert len(sharding.params) == 4 and sharding.steps == 2
        assert not torch.equal(head.weight, before)
        assert optimizer.param_groups[1]["lr"] == 0.5
        optimizer.param_groups[0]["params"].pop()
        with pytest.raises(RuntimeError, match="param groups changed after it was sharded"):
            optimizer.step()


def test_detach_gives_the_optimizer_back() -> None:
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    zero = ZeRO1()
    with SakuraRuntime([zero], strict=True) as rt:
        rt.prepare(model, optimizer)
        train(model, optimizer)
        sharding = zero.sharding(optimizer)
        sharding.detach()
        train(model, optimizer)
    assert sharding.steps == 2
    assert not hasattr(optimizer, "consolidate_state_dict")
    assert len(optimizer.state_dict()["state"]) == 2


def test_zero2_without_ddp_on_one_rank(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    zero = ZeRO2()
    with SakuraRuntime([zero], strict=True) as rt:
        rt.prepare(model, optimizer)
        sharding = zero.sharding(optimizer)
        assert sharding.grad_mode == "hooks"
        train(model, optimizer)
        with zero.no_sync():
            model(torch.randn(3, 4)).sum().backward()
            with pytest.raises(RuntimeError, match=r"inside `zero\.no_sync\(\)`"):
                optimizer.step()
        with pytest.raises(RuntimeError, match="every backward since the last step ran inside"):
            optimizer.step()


@pytest.mark.parametrize("clipping", [None, "TrainingArguments(max_grad_norm=1.0)"])
def test_zero2_refuses_the_loops_own_clipping_from_the_loop_context(clipping: str | None) -> None:
    """Whatever the framework: the adapter publishes its own clipping on
    ``OnTrainBegin.loop.gradient_clipping`` and ZeRO2 refuses the step, naming it."""
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    with SakuraRuntime([ZeRO2()], strict=True) as rt:
        rt.prepare(model, optimizer)
        rt.emit(
            OnTrainBegin,
            model=model,
            optimizer=optimizer,
            loop=LoopContext(framework="toy", gradient_clipping=clipping),
        )
        if clipping is None:
            train(model, optimizer)
            return
        model(torch.randn(3, 4)).sum().backward()
        with pytest.raises(RuntimeError) as caught:
            optimizer.step()
    message = str(caught.value)
    assert "TrainingArguments(max_grad_norm=1.0) clips by a norm over all gradients" in message
    assert "zero.clip_grad_norm_(optimizer, max_norm)" in message


def test_sharded_files_round_trip_and_errors(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    zero = ZeRO1()
    with SakuraRuntime([zero], strict=True) as rt:
        rt.prepare(model, optimizer)
        train(model, optimizer)
        (path,) = zero.save_sharded(tmp_path)
        assert Path(path).name == "optimizer0.rank00000-of-00001.pt"
        assert [p.name for p in tmp_path.iterdir()] == [Path(path).name]  # no temp file left
        saved = {k: v["exp_avg"].clone() for k, v in optimizer.state_dict()["state"].items()}
        train(model, optimizer)
        zero.load_sharded(tmp_path)
        restored = optimizer.state_dict()["state"]
        assert all(torch.equal(restored[k]["exp_avg"], v) for k, v in saved.items())

        other = torch.optim.SGD(torch.nn.Linear(4, 2).parameters(), lr=0.1)
        zero.shard(other)
        with pytest.raises(ValueError, match="saved from AdamW, this optimizer is SGD"):
            zero.sharding(other).load_sharded(tmp_path, name="optimizer0")
        with pytest.raises(
            FileNotFoundError, match="no sharded optimizer files named 'optimizer1'"
        ):
            zero.load_sharded(tmp_path)
    torch.save({}, shard_path(tmp_path, "optimizer0", 1, 3))
    with pytest.raises(ValueError, match="from several world sizes"):
        find_shards(tmp_path, "optimizer0")
    (tmp_path / "optimizer0.rank00000-of-00001.pt").unlink()
    with pytest.raises(ValueError, match=r"world size 3, missing rank\(s\) \[0, 2\]"):
        find_shards(tmp_path, "optimizer0")


def test_a_grad_scaler_steps_through_the_sharding() -> None:
    """torch.amp.GradScaler calls optimizer.step() itself: the shard is stepped and synced
    once per scaler step, with the same result as the unsharded optimizer."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    ref = torch.nn.Linear(4, 2)
    ref.load_state_dict(model.state_dict())
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    reference = torch.optim.AdamW(ref.parameters(), lr=0.1)
    scalers = (
        torch.amp.GradScaler("cpu", init_scale=1024.0),
        torch.amp.GradScaler("cpu", init_scale=1024.0),
    )
    zero = ZeRO1()
    with SakuraRuntime([zero], strict=True) as rt:
        rt.prepare(model, optimizer)
        for step in range(3):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
            for net, opt, scaler in ((model, optimizer, scalers[0]), (ref, reference, scalers[1])):
                scaler.scale(net(x).square().mean()).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
        assert zero.sharding(optimizer).steps == 3
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters(), strict=True))
