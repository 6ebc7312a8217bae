"""DDPAdapter: the reference quickstart's raw loop, single process and 2 gloo ranks."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from sakura import OnOptimizerStep, SakuraRuntime, Service
from sakura.options import OptionError
from sakura.resume import ServiceStateError, ServiceStateWarning
from sakura.testing import RecordingService, launch_ranks
from sakura_adapters.ddp import DDPAdapter

EPOCHS, STEPS, BATCH = 2, 3, 8


def batches(rank: int = 0, world_size: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same global batches for every world size; each rank takes its contiguous shard."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        x, y = torch.randn(BATCH, 5, generator=g), torch.randn(BATCH, 1, generator=g)
        shard = BATCH // world_size
        out.append((x[rank * shard : (rank + 1) * shard], y[rank * shard : (rank + 1) * shard]))
    return out


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))


def train_one_step(
    model: torch.nn.Module, batch: Any, optimizer: torch.optim.Optimizer
) -> torch.Tensor:
    x, y = batch
    loss = torch.nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return loss.detach()


def reference_weights() -> list[torch.Tensor]:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(EPOCHS):
        for batch in batches():
            train_one_step(model, batch, optimizer)
    return [p.detach().clone() for p in model.parameters()]


def quickstart_loop(rt: SakuraRuntime, rank: int, world_size: int, model: torch.nn.Module) -> None:
    """The reference README's raw loop, verbatim apart from the data."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    train_loader = batches(rank, world_size)
    adapter = DDPAdapter(rt, rank=rank, world_size=world_size)
    adapter.on_train_begin(model, optimizer, train_loader)
    for epoch in range(EPOCHS):
        adapter.on_epoch_begin(epoch)
        for step, batch in enumerate(train_loader):
            adapter.on_train_step_begin(model, batch, step)
            loss = train_one_step(model, batch, optimizer)
            adapter.on_optimizer_step(optimizer)
        adapter.on_epoch_end(epoch, model, optimizer, metrics={"train_loss": loss})
    adapter.on_train_end(model)


QUICKSTART = [
    "OnTrainBegin",
    *(["OnEpochBegin", *["OnTrainStepBegin", "OnOptimizerStep"] * STEPS, "OnEpochEnd"] * EPOCHS),
    "OnTrainEnd",
]


def test_quickstart_flow_single_process() -> None:
    rec = RecordingService()
    with SakuraRuntime([rec], strict=True) as rt:
        quickstart_loop(rt, 0, 1, make_model())
    assert rec.names == QUICKSTART
    assert [e.step for e in rec.of(OnOptimizerStep)] == list(range(1, EPOCHS * STEPS + 1))
    assert [e.batch_idx for e in rec.events if type(e).__name__ == "OnTrainStepBegin"] == [
        0,
        1,
        2,
    ] * EPOCHS
    assert float(rec.events[-2].metrics["train_loss"]) > 0


def owned_loop(
    rt: SakuraRuntime, model: torch.nn.Module, rank: int = 0, world_size: int = 1
) -> DDPAdapter:
    """A raw loop that lets the runtime own backward and the step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = rt.prepare(model, optimizer)
    adapter = DDPAdapter(rt, rank=rank, world_size=world_size)
    adapter.on_train_begin(model, optimizer, None)
    for epoch in range(EPOCHS):
        adapter.on_epoch_begin(epoch)
        for step, (x, y) in enumerate(batches(rank, world_size)):
            adapter.on_train_step_begin(model, (x, y), step)
            with rt.autocast():
                loss = torch.nn.functional.mse_loss(model(x), y)
            adapter.backward(loss)
            adapter.step(optimizer)
            adapter.on_before_zero_grad(optimizer)
            optimizer.zero_grad(set_to_none=True)
            adapter.on_train_step_end(model, (x, y), step, loss=loss.detach())
        adapter.on_epoch_end(epoch)
    adapter.on_train_end()
    return adapter


def test_service_that_owns_the_step_matches_the_hand_written_loop(step_owner: Any) -> None:
    model = make_model()
    rec = RecordingService()
    with SakuraRuntime([step_owner, rec], strict=True) as rt:
        owned_loop(rt, model)
    for ours, ref in zip(model.parameters(), reference_weights(), strict=True):
        torch.testing.assert_close(ours.detach(), ref, rtol=0, atol=1e-6)
    assert step_owner.steps == EPOCHS * STEPS
    per_step = [
        "OnTrainStepBegin",
        "OnBeforeBackward",
        "OnAfterBackward",
        "OnBeforeOptimizerStep",
        "OnOptimizerStep",
        "OnBeforeZeroGrad",
        "OnTrainStepEnd",
    ]
    assert rec.names == [
        "OnTrainBegin",
        *(["OnEpochBegin", *per_step * STEPS, "OnEpochEnd"] * EPOCHS),
        "OnTrainEnd",
    ]


def test_checkpoint_round_trip_through_the_adapter(tmp_path: Path, step_counter: Any) -> None:
    with SakuraRuntime([step_counter], strict=True) as rt:
        adapter = owned_loop(rt, make_model())
        checkpoint = adapter.on_save_checkpoint(
            {"global_step": adapter.global_step}, path=tmp_path / "c.pt"
        )
        torch.save(checkpoint, tmp_path / "c.pt")
    fresh = type(step_counter)()
    with SakuraRuntime([fresh], strict=True) as rt:
        adapter = DDPAdapter(rt)
        adapter.on_load_checkpoint(
            torch.load(tmp_path / "c.pt", weights_only=True), path=str(tmp_path / "c.pt")
        )
    assert fresh.loaded == EPOCHS * STEPS and adapter.global_step == EPOCHS * STEPS


def test_resume_with_a_changed_service_list(
    tmp_path: Path, step_counter: Any, epoch_counter: Any
) -> None:
    with SakuraRuntime([step_counter, epoch_counter], strict=True) as rt:
        adapter = owned_loop(rt, make_model())
        checkpoint = adapter.on_save_checkpoint({"global_step": adapter.global_step})
    assert checkpoint is not None
    resumed = type(step_counter)()
    with SakuraRuntime([resumed], strict=True) as rt:
        with pytest.raises(ServiceStateError, match="epoch_counter"):
            DDPAdapter(rt, strict_resume=True).on_load_checkpoint(checkpoint)
        assert resumed.loaded is None
        adapter = DDPAdapter(rt)
        with pytest.warns(ServiceStateWarning, match=r"state for service\(s\) \['epoch_counter'\]"):
            adapter.on_load_checkpoint(checkpoint)
        assert resumed.loaded == EPOCHS * STEPS
        again = adapter.on_save_checkpoint({})
    assert again == {
        "sakura": {"step_counter": {"count": EPOCHS * STEPS}, "epoch_counter": {"epochs": EPOCHS}}
    }
    with (
        SakuraRuntime([type(step_counter)()], strict=True) as rt,
        pytest.raises(ServiceStateError, match="epoch_counter"),
    ):
        DDPAdapter(rt).on_load_checkpoint(checkpoint, strict=True)
    with pytest.raises(OptionError, match=r"DDPAdapter: strict_resume='on' is not accepted"):
        DDPAdapter(SakuraRuntime(), strict_resume="on")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"rank": -1, "world_size": 2},
            r"DDPAdapter: rank=-1 is not accepted; accepted: an int >= 0",
        ),
        ({"rank": 0, "world_size": 0}, r"DDPAdapter: world_size=0 is not accepted"),
        (
            {"rank": 2, "world_size": 2},
            r"DDPAdapter: rank=2 is not accepted; accepted: an int in \[0, world_size=2\)",
        ),
    ],
)
def test_bad_rank_and_world_size(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DDPAdapter(SakuraRuntime(), **kwargs)
    with pytest.raises(TypeError, match=r"rt must be a sakura\.SakuraRuntime"):
        DDPAdapter("runtime")  # type: ignore[arg-type]


def test_on_train_begin_publishes_the_accumulation_steps() -> None:
    from sakura import OnTrainBegin

    rec = RecordingService()
    with SakuraRuntime([rec], strict=True) as rt:
        adapter = DDPAdapter(rt)
        adapter.on_train_begin(make_model(), None, None)
        adapter.on_train_begin(make_model(), None, None, accumulation_steps=4)
        with pytest.raises(OptionError, match=r"on_train_begin: accumulation_steps=0 "):
            adapter.on_train_begin(make_model(), None, None, accumulation_steps=0)
    assert [e.accumulation_steps for e in rec.of(OnTrainBegin)] == [None, 4]


class RankFile(Service):
    """Writes the events it received, with their rank, to a per-rank JSON file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.seen: list[list[Any]] = []

    def on_event(self, event: Any) -> None:
        self.seen.append([type(event).__name__, event.rank, event.world_size, event.step])

    def teardown(self) -> None:
        Path(self.path).write_text(json.dumps(self.seen))


def _worker(rank: int, world_size: int, init_file: str, out_dir: str, mode: str) -> None:
    """One rank of the 2-process test; runs in its own interpreter (see ``__main__``)."""
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        torch.set_num_threads(1)
        model = torch.nn.parallel.DistributedDataParallel(make_model())
        services: list[Any] = [RankFile(os.path.join(out_dir, f"rank{rank}.json"))]
        if mode == "owned":
            sys.path.insert(0, str(Path(__file__).parent))
            from conftest import StepOwner

            services.insert(0, StepOwner())
        with SakuraRuntime(services, strict=True) as rt:
            if mode == "owned":
                owned_loop(rt, model, rank, world_size)
            else:
                quickstart_loop(rt, dist.get_rank(), dist.get_world_size(), model)
        weights = [p.detach() for p in model.module.parameters()]
        torch.save(weights, os.path.join(out_dir, f"weights{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["quickstart", "owned"])
def test_two_gloo_ranks(tmp_path: Path, mode: str) -> None:
    launch_ranks(__file__, 2, tmp_path, mode)
    reference = reference_weights()
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        names = [s[0] for s in seen]
        if mode == "quickstart":
            assert names == QUICKSTART
        assert {(s[1], s[2]) for s in seen} == {(rank, 2)}  # every event carries this rank
        steps = [s[3] for s in seen if s[0] == "OnOptimizerStep"]
        assert steps == list(range(1, EPOCHS * STEPS + 1))
        # DDP averages the shard gradients: the same weights as one process on the full batch
        weights = torch.load(tmp_path / f"weights{rank}.pt", weights_only=True)
        for ours, ref in zip(weights, reference, strict=True):
            torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)


if __name__ == "__main__":
    _rank, _world, _init, _out, _mode = sys.argv[1:6]
    _worker(int(_rank), int(_world), _init, _out, _mode)
