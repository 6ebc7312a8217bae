"""One rank of test_eval_sharded.py (run through sakura.testing.launch_ranks).

An FSDP2 model trains 2 epochs of 3 steps on every rank's own batches under a
SakuraRuntime with AsyncEval (task form, thread dispatcher, ranks="zero"); at each epoch
end the service gathers the full state and rank 0 evaluates it in the worker.  Rank 0
also trains an unsharded copy on the concatenation of all ranks' batches (what FSDP's
averaged gradients amount to) and evaluates it synchronously: the reference.
"""

from __future__ import annotations

import copy
import json
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from sakura import OnEpochEnd, SakuraRuntime
from sakura_async import AsyncEval
from sakura_async.eval import EvalTask

EPOCHS, STEPS = 2, 3


def make() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 30), nn.Tanh(), nn.Linear(30, 7), nn.Tanh(), nn.Linear(7, 3))


def batch(rank: int, epoch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * epoch + 10 * step + rank)
    return torch.randn(4, 8, generator=gen), torch.randn(4, 3, generator=gen)


VAL = batch(99, 99, 99)


def evaluate(model: nn.Module) -> dict[str, float]:
    with torch.no_grad():
        return {"val_loss": nn.functional.mse_loss(model(VAL[0]), VAL[1]).item()}


def eval_fn(epoch: int, task: EvalTask) -> dict[str, float]:
    return evaluate(task.load_into(task.payload["model"]))


def main() -> None:
    rank, world, init_file, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    plain = make()
    reference_model = copy.deepcopy(plain)
    model = make()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optimizer = torch.optim.SGD(reference_model.parameters(), lr=0.1)
    reference: list[dict[str, float]] = []
    ae = AsyncEval(eval_fn, {"model": plain}, dispatcher="thread", pass_task=True)
    with SakuraRuntime([ae], rank=rank, world_size=world, strict=True) as rt:
        for epoch in range(EPOCHS):
            for step in range(STEPS):
                x, y = batch(rank, epoch, step)
                nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad()
                xs, ys = zip(*(batch(r, epoch, step) for r in range(world)), strict=True)
                nn.functional.mse_loss(reference_model(torch.cat(xs)), torch.cat(ys)).backward()
                ref_optimizer.step()
                ref_optimizer.zero_grad()
            rt.emit(OnEpochEnd, epoch=epoch, step=(epoch + 1) * STEPS, model=model)
            reference.append(evaluate(reference_model))
    result: dict[str, Any] = {
        "async": [r.metrics for r in ae.history],
        "errors": [repr(r.error) for r in ae.errors],
        "reference": reference,
    }
    with open(f"{out}/rank{rank}.json", "w") as sink:
        json.dump(result, sink)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
