"""One rank of test_checkpoint_dcp.py (run through sakura.testing.launch_ranks).

``save`` (2 ranks): an FSDP2 model trains 3 steps with AdamW, saving a sharded checkpoint
after each; a 4th save fails on rank 1 (an exception injected into DCP's file writer) and
must be reported on every rank while step 3 stays published; the full (unsharded) state at
step 3 is written by rank 0 as the reference.  ``hang`` (2 ranks): rank 1 never comes to a
save; rank 0 must get CheckpointWriteError within the timeout.  ``load`` (any world size):
a fresh FSDP2 model loads the newest checkpoint and writes whether its full state equals
the reference, tensor by tensor.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from sakura_async.checkpoint.sharded import ShardedCheckpoint, find_sharded, load_sharded
from sakura_async.errors import CheckpointWriteError


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 30), nn.Tanh(), nn.Linear(30, 7), nn.Tanh(), nn.Linear(7, 3))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    gen = torch.Generator().manual_seed(100 * step + dist.get_rank())
    x = torch.randn(4, 8, generator=gen)
    model(x).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_sd, optim_sd = get_state_dict(model, [optimizer], options=options)
    return {"model": model_sd, "optim": optim_sd}


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{key}/"))
        return out
    if isinstance(tree, (list, tuple)):
        return flatten(dict(enumerate(tree)), prefix)
    return {prefix: tree}


def save(ckpt_dir: str, out: str) -> None:
    rank = dist.get_rank()
    model, optimizer = build()
    ckpt = ShardedCheckpoint(ckpt_dir, keep=2, timeout_s=60)
    for step in (1, 2, 3):
        train_step(model, optimizer, step)
        ckpt.save(step, model, optimizer)
    ckpt.wait()
    reference = full_state(model, optimizer)
    if rank == 0:
        torch.save(reference, f"{out}/reference.pt")
    train_step(model, optimizer, 4)
    if rank == 1:  # this rank's writer breaks mid-write

        def broken(self: Any, plan: Any, planner: Any) -> Any:
            raise OSError("injected: disk full")

        dcp.FileSystemWriter.write_data = broken  # type: ignore[method-assign]
    error = ""
    try:
        ckpt.save(4, model, optimizer)
        ckpt.wait()
    except CheckpointWriteError as exc:
        error = str(exc)
    ckpt.close()
    steps = [step for step, _ in find_sharded(ckpt_dir)]
    with open(f"{out}/save-rank{rank}.json", "w") as sink:
        json.dump({"error": error, "steps": steps}, sink)


def hang(ckpt_dir: str, out: str) -> None:
    rank = dist.get_rank()
    model, optimizer = build()
    ckpt = ShardedCheckpoint(ckpt_dir, timeout_s=3)
    error = ""
    if rank == 0:
        try:
            ckpt.save(1, model, optimizer)
            ckpt.wait()
        except CheckpointWriteError as exc:
            error = str(exc)
    with open(f"{out}/hang-rank{rank}.json", "w") as sink:
        json.dump({"error": error, "steps": [s for s, _ in find_sharded(ckpt_dir)]}, sink)
    sys.stdout.flush()
    import os

    os._exit(0)  # the side group saw a timeout: do not wait on its teardown


def load(ckpt_dir: str, out: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer = build()
    step = load_sharded(ckpt_dir, model, optimizer)
    loaded = flatten(full_state(model, optimizer))  # gathered on rank 0 only (cpu_offload)
    reference = flatten(torch.load(f"{out}/reference.pt", weights_only=True))
    unequal = [
        key
        for key, value in reference.items()
        if key not in loaded
        or (
            not torch.equal(loaded[key], value)
            if isinstance(value, torch.Tensor)
            else loaded[key] != value
        )
    ]
    shard = sum(p.to_local().numel() for p in model.parameters())  # type: ignore[operator]
    if rank != 0:
        unequal = ["(compared on rank 0)"] if loaded else []
    result = {"step": step, "unequal": unequal, "keys": len(reference), "local": shard}
    with open(f"{out}/load{world}-rank{rank}.json", "w") as sink:
        json.dump(result, sink)


def main() -> None:
    rank, world, init_file, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    mode, ckpt_dir = sys.argv[5], sys.argv[6]
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    {"save": save, "hang": hang, "load": load}[mode](ckpt_dir, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
