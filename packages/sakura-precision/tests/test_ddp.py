"""The three services in a raw DistributedDataParallel loop (``DDPAdapter``): single process,
and 2 gloo ranks launched as separate processes, like torchrun."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from precision_helpers import grad_scaler_loop, loss_fn, make_batches, make_model, weights

from sakura import SakuraRuntime
from sakura.testing import launch_ranks
from sakura_precision import ActivationCheckpoint, Compile, MixedPrecision

pytest.importorskip("sakura_adapters")
from sakura_adapters.ddp import DDPAdapter

STEPS, BATCH, CLIP = 4, 8, 0.5
SCALER = {"init_scale": 2.0**30, "growth_interval": 2}
MODES = ("fp16", "checkpoint", "compile")


def services_for(mode: str, cache: str) -> list[Any]:
    if mode == "fp16":
        return [MixedPrecision("fp16", **SCALER)]
    if mode == "checkpoint":
        return [ActivationCheckpoint(policy="save_matmuls")]
    return [Compile(target="blocks", backend="aot_eager", cache_dir=cache)]


def ddp_loop(
    rt: SakuraRuntime, model: torch.nn.Module, rank: int, world_size: int, distributed: bool
) -> torch.nn.Module:
    """The raw loop: the runtime wraps the model first, then DDP wraps it (as torchrun
    scripts do); each rank trains on its contiguous shard of every global batch."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = rt.prepare(model, optimizer)
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(model)
    adapter = DDPAdapter(rt, rank=rank, world_size=world_size)
    adapter.on_train_begin(model, optimizer)
    shard = BATCH // world_size
    for step, (x, y) in enumerate(make_batches(STEPS, batch=BATCH)):
        x, y = x[rank * shard : (rank + 1) * shard], y[rank * shard : (rank + 1) * shard]
        adapter.on_train_step_begin(model, (x, y), step)
        with rt.autocast():
            loss = loss_fn(model(x), y)
        adapter.backward(loss)
        rt.clip_grad_norm_(optimizer, CLIP)
        adapter.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
    adapter.on_train_end(model)
    return model


def reference(mode: str) -> torch.nn.Module:
    model = make_model()
    if mode == "fp16":
        grad_scaler_loop(
            model,
            make_batches(STEPS, batch=BATCH),
            clip=CLIP,
            scaler=torch.amp.GradScaler("cpu", **SCALER),
        )
        return model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in make_batches(STEPS, batch=BATCH):
        loss_fn(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model


# DDP averages the ranks' gradients in another order than one process sums the full batch's:
# weights agree to 1e-6 (measured here: fp16 exactly, the others within 5e-8).
TOLERANCE = {"fp16": 1e-6, "checkpoint": 1e-6, "compile": 1e-6}


@pytest.mark.parametrize("mode", MODES)
def test_single_process_matches_the_reference(tmp_path: Path, mode: str) -> None:
    torch._dynamo.reset()
    model = make_model()
    with SakuraRuntime(services_for(mode, str(tmp_path)), strict=True) as rt:
        ddp_loop(rt, model, 0, 1, distributed=False)
    ref = weights(reference(mode))
    for key, value in weights(model).items():
        if mode == "fp16":  # one process: exactly the hand-written GradScaler loop
            assert torch.equal(value, ref[key]), key
        else:
            torch.testing.assert_close(value, ref[key], rtol=0, atol=TOLERANCE[mode], msg=key)


def _worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    """One rank of the 2-process test; runs in its own interpreter (see ``__main__``)."""
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        torch.set_num_threads(1)
        results = {}
        for mode in MODES:
            services = services_for(mode, os.path.join(out_dir, f"cache{rank}"))
            model = make_model()
            with SakuraRuntime(services, strict=True) as rt:
                ddp_loop(rt, model, rank, world_size, distributed=True)
                state = rt.state_dict()
            results[mode] = {"weights": weights(model), "state": state}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks(tmp_path: Path) -> None:
    launch_ranks(__file__, 2, tmp_path, timeout=240)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    for mode in MODES:
        ref = weights(reference(mode))
        zero, one = ranks[0][mode], ranks[1][mode]
        for key in ref:
            # DDP keeps the ranks in lockstep, and averaged shard gradients make the full
            # batch's update
            assert torch.equal(zero["weights"][key], one["weights"][key]), (mode, key)
            torch.testing.assert_close(
                zero["weights"][key], ref[key], rtol=0, atol=TOLERANCE[mode], msg=f"{mode} {key}"
            )
        assert zero["state"] == one["state"]
    scaler_state = ranks[0]["fp16"]["state"]["mixed_precision"]
    assert scaler_state["skipped_steps"] >= 1 and scaler_state["optimizer_steps"] == STEPS


if __name__ == "__main__":
    _rank, _world, _init, _out = sys.argv[1:5]
    _worker(int(_rank), int(_world), _init, _out)
