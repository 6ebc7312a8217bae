"""One rank of ``test_fsdp2.py``: OffloadAdamW over FSDP2 (``fully_shard``) shards on gloo.

Each variant trains the same model (``fully_shard`` per Linear and at the root) on the same
rows, 4 steps: ``torch`` with ``torch.optim.AdamW`` (the reference), ``offload-float32`` and
``offload-bfloat16`` with OffloadAdamW, and ``offload-reloaded``: OffloadAdamW for 2 steps,
its state dict loaded into a fresh OffloadAdamW, 2 more steps.  Rank 0 writes each
variant's gathered weights and exported state; every rank writes what it holds.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from sakura_offload import OffloadAdamW

STEPS = 4


def model() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    for layer in net:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(net)
    return net


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 4, generator=g)
    per = 8 // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def optimizer(variant: str, params: Any) -> Any:
    if variant == "torch":
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
    dtype = "bfloat16" if variant == "offload-bfloat16" else "float32"
    return OffloadAdamW(params, lr=0.01, weight_decay=0.1, moment_dtype=dtype)


def gathered(state: dict[str, Any]) -> dict[str, Any]:
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in state.items()
    }


def run(variant: str, rank: int, world: int, out: Path) -> None:
    net = model()
    opt = optimizer(
        "offload-float32" if variant == "offload-reloaded" else variant, net.parameters()
    )
    for step in range(STEPS):
        if variant == "offload-reloaded" and step == STEPS // 2:
            saved = opt.state_dict()
            opt = OffloadAdamW(net.parameters(), lr=0.01, weight_decay=0.1)
            opt.load_state_dict(saved)
        x, y = batch(step, rank, world)
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad()
    exported = opt.state_dict()["state"]
    kinds = sorted(
        {type(v).__name__ for s in exported.values() for k, v in s.items() if k != "step"}
    )
    state = {f"{i}.{k}": v for i, s in exported.items() for k, v in s.items() if k != "step"}
    weights, state = gathered(net.state_dict()), gathered(state)
    if rank == 0:
        torch.save({"weights": weights, "state": state}, out / f"{variant}.pt")
    held: dict[str, Any] = {"state_types": kinds}
    if isinstance(opt, OffloadAdamW):
        held["moment_bytes"] = int(opt.stats()["moment_bytes"])
        held["local_numel"] = sum(p.to_local().numel() for p in net.parameters())
        held["numel"] = sum(p.numel() for p in net.parameters())
    (out / f"{variant}.rank{rank}.json").write_text(json.dumps(held))
    dist.barrier()


def main(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        for variant in ("torch", "offload-float32", "offload-bfloat16", "offload-reloaded"):
            run(variant, rank, world, Path(out_dir))
    finally:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    _rank, _world, _init, _out = sys.argv[1:5]
    main(int(_rank), int(_world), _init, _out)
