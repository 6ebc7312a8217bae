"""Options, spec strings and errors that need no process group (this module must run while
none is initialised; test_single_rank.py creates one and destroys it at its end)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.distributed as dist

import sakura
from sakura import SakuraRuntime, SpecError
from sakura_zero import ZeRO1, ZeRO2
from sakura_zero.service import STATE_FORMAT


@pytest.fixture(autouse=True)
def _no_process_group() -> None:
    assert not dist.is_initialized(), "a process group leaked from another test module"


@pytest.mark.parametrize("cls", [ZeRO1, ZeRO2])
@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"bucket_mb": 0}, ValueError, "bucket_mb must be a positive number"),
        ({"bucket_mb": "big"}, ValueError, r"bucket_mb must be a positive number .* got 'big'"),
        ({"bucket_mb": float("nan")}, ValueError, "bucket_mb must be a positive number"),
        ({"overlap_mb": -1}, ValueError, r"overlap_mb must be a number >= 0 .* got -1"),
        ({"overlap_mb": True}, ValueError, "overlap_mb must be a number >= 0"),
        (
            {"checkpoint": "sharded"},
            ValueError,
            r"checkpoint must be one of 'consolidated', 'none' \(or None\), got 'sharded'",
        ),
        ({"process_group": "world"}, TypeError, "process_group must be a torch.distributed"),
        (
            {"partition": "random"},
            ValueError,
            "partition must be one of 'greedy', 'contiguous', got 'random'",
        ),
        ({"priority": float("inf")}, ValueError, "priority must be a finite number"),
    ],
)
def test_options_are_validated(cls: Any, kwargs: dict[str, Any], error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        cls(**kwargs)


def test_zero2_gradient_bucket_is_validated() -> None:
    with pytest.raises(ValueError, match=r"grad_bucket_mb must be a positive number .* got -3"):
        ZeRO2(grad_bucket_mb=-3)


def test_spec_strings_and_facade() -> None:
    rt = SakuraRuntime(["zero1:bucket_mb=8,overlap_mb=0", "zero2:checkpoint=none,priority=5"])
    zero1, zero2 = rt.get("zero1"), rt.get("zero2")
    assert isinstance(zero1, ZeRO1) and zero1.bucket_mb == 8.0 and zero1.overlap_mb == 0.0
    assert isinstance(zero2, ZeRO2) and zero2.checkpoint == "none" and zero2.priority == 5
    with pytest.raises(SpecError, match="bucket_mb must be a positive number"):
        SakuraRuntime(["zero1:bucket_mb=-1"])
    from sakura.services import ZeRO1 as Facade1
    from sakura.services import ZeRO2 as Facade2

    assert Facade1 is ZeRO1 and Facade2 is ZeRO2
    assert sakura.services.ZeRO1 is ZeRO1


def model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


@pytest.mark.parametrize("cls", [ZeRO1, ZeRO2])
def test_no_process_group_is_a_clear_error(cls: Any) -> None:
    model, optimizer = model_and_optimizer()
    with (
        SakuraRuntime([cls()], strict=True) as rt,
        pytest.raises(RuntimeError, match=r"needs an initialised torch\.distributed process group"),
    ):
        rt.prepare(model, optimizer)


def test_no_process_group_in_the_quickstart_flow(caplog: pytest.LogCaptureFixture) -> None:
    """At OnTrainBegin the error follows the runtime's isolation rule: recorded, logged and
    reported as OnError (training goes on unsharded), or raised with strict=True."""
    from sakura_adapters.ddp import DDPAdapter

    model, optimizer = model_and_optimizer()
    with caplog.at_level(logging.ERROR, logger="sakura"), SakuraRuntime([ZeRO1()]) as rt:
        DDPAdapter(rt, rank=0, world_size=1).on_train_begin(model, optimizer, None)
    assert len(rt.errors) == 1 and "process group" in str(rt.errors[0].exception)
    assert "zero1" in caplog.text
    with (
        SakuraRuntime([ZeRO1()], strict=True) as rt,
        pytest.raises(RuntimeError, match="process group"),
    ):
        DDPAdapter(rt, rank=0, world_size=1).on_train_begin(model, optimizer, None)


def test_optimizers_that_cannot_be_sharded() -> None:
    model = torch.nn.Linear(4, 2)
    zero = ZeRO1()
    with pytest.raises(ValueError, match="cannot shard LBFGS: it keeps one state for all"):
        zero.shard(torch.optim.LBFGS(model.parameters()))
    with pytest.raises(TypeError, match=r"shards torch\.optim\.Optimizer instances; got dict"):
        zero.shard({"params": list(model.parameters())})
    already = torch.optim.SGD(model.parameters(), lr=0.1)
    already.consolidate_state_dict = lambda to=0: None  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="already a sharded optimizer"):
        zero.shard(already)


def test_service_state_without_optimizers_and_bad_states() -> None:
    zero = ZeRO1()
    state = zero.state_dict()
    assert state == {"format": STATE_FORMAT, "checkpoint": "consolidated", "optimizers": []}
    zero.load_state_dict(state)
    with pytest.raises(ValueError, match="not a sakura-zero service state"):
        zero.load_state_dict({"optimizers": []})
    with pytest.raises(ValueError, match="saved on a rank other than 0"):
        zero.load_state_dict({"format": STATE_FORMAT, "optimizers": [None]})
    assert "optimizers" not in ZeRO2(checkpoint="none").state_dict()
    with pytest.raises(KeyError, match="not sharded by this service"):
        zero.sharding(torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1))
