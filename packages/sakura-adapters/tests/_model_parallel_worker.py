"""One rank of the ModelParallelStrategy test (run as a script by
``test_lightning_model_parallel.py``, started as torchrun would start it).

Every variant trains the same LightningModule on the same rows: rank ``r`` takes rows
``[8k + 4r, 8k + 4r + 4)`` of each global batch of 8 (``use_distributed_sampler=False``,
so nothing reshuffles them), which is what one process sees in batches of 8.  Variants:

* ``fsdp2-32``: ``ModelParallelStrategy`` (FSDP2 ``fully_shard`` per Linear and at the root
  in ``configure_model``) with the LightningAdapter and an event-recording service;
* ``fsdp2-bf16``: the same with sakura's ``MixedPrecision("bf16-mixed")``;
* ``ddp-bf16``: ``strategy="ddp"`` with ``MixedPrecision("bf16-mixed")`` (the reference
  for ``fsdp2-bf16``: each rank computes the same bf16 products on the same rows);
* ``policy-bf16``: ``configure_model`` shards with FSDP2's own bf16 policy
  (``mp_policy=fsdp_mp_policy("bf16-mixed")``) and sakura's ``MixedPrecision("bf16-mixed")``
  is installed too: it must see the policy and not autocast on top of it;
* ``policy-plain``: the same policy with no sakura precision service (the reference for
  ``policy-bf16``).

Every variant records whether autocast was on inside ``training_step``.

Rank 0 writes each variant's full (gathered) weights; every rank writes the events its
service saw.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, Subset, TensorDataset

from sakura import SakuraRuntime, Service
from sakura_adapters.lightning import LightningAdapter
from sakura_precision import MixedPrecision, fsdp_mp_policy

GLOBAL_BATCH = 8
ROWS = 32
EPOCHS = 2


class Module(pl.LightningModule):
    def __init__(self, shard: bool, policy: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shard = shard
        self.policy = policy
        self.autocast_seen: list[bool] = []
        self.net = nn.Sequential(
            nn.Linear(6, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 4)
        )

    def configure_model(self) -> None:
        if not self.shard:
            return
        mesh = self.device_mesh["data_parallel"]
        extra: dict[str, Any] = {"mp_policy": fsdp_mp_policy("bf16-mixed")} if self.policy else {}
        for layer in self.net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh, **extra)
        fully_shard(self.net, mesh=mesh, **extra)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.autocast_seen.append(torch.is_autocast_enabled("cpu"))
        return nn.functional.mse_loss(self.net(x).float(), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(ROWS, 6, generator=g), torch.randn(ROWS, 4, generator=g))


def rows_of(rank: int, world: int) -> list[int]:
    per = GLOBAL_BATCH // world
    return [
        i
        for start in range(0, ROWS, GLOBAL_BATCH)
        for i in range(start + rank * per, start + (rank + 1) * per)
    ]


class Events(Service):
    """Records (event, rank, world_size, step) of every event it receives."""

    name = "events"

    def __init__(self) -> None:
        self.seen: list[list[Any]] = []

    def on_event(self, event: Any) -> None:
        self.seen.append([type(event).__name__, event.rank, event.world_size, event.step])


def run(variant: str, rank: int, world: int, out: Path) -> None:
    events = Events()
    services: list[Any] = [events]
    precision = MixedPrecision("bf16-mixed") if variant.endswith("bf16") else None
    if precision is not None:
        services.insert(0, precision)
    policy = variant.startswith("policy")
    shard = variant.startswith("fsdp2") or policy
    strategy: Any = (
        ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1) if shard else "ddp"
    )
    rt = SakuraRuntime(services, strict=True)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_epochs=EPOCHS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        callbacks=[LightningAdapter(rt)],
    )
    module = Module(shard, policy)
    loader = DataLoader(Subset(dataset(), rows_of(rank, world)), batch_size=GLOBAL_BATCH // world)
    trainer.fit(module, loader)
    local = {name: type(p).__name__ for name, p in module.named_parameters()}  # DTensor under FSDP2
    full = {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in module.state_dict().items()
    }
    if rank == 0:
        torch.save(full, out / f"{variant}.weights.pt")
    info = {
        "events": events.seen,
        "param_types": local,
        "plugin": type(trainer.strategy.precision_plugin).__name__,
        "autocast_seen": sorted(set(module.autocast_seen)),
        "fsdp_reason": None if precision is None else precision.fsdp_reason,
    }
    (out / f"{variant}.rank{rank}.json").write_text(json.dumps(info))
    dist.barrier()


def main(rank: int, world: int, init_file: str, out_dir: str) -> None:
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.set_num_threads(1)
        for variant in ("fsdp2-32", "fsdp2-bf16", "ddp-bf16", "policy-bf16", "policy-plain"):
            run(variant, rank, world, Path(out_dir))
    finally:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    _rank, _world, _init, _out = sys.argv[1:5]
    main(int(_rank), int(_world), _init, _out)
