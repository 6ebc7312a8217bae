"""One rank of the Lightning test (run as a script by ``test_lightning_ddp.py``).

The test starts both processes itself, as torchrun would (``TORCHELASTIC_RUN_ID``,
``RANK``, ``LOCAL_RANK``... in the environment), so ``Trainer(strategy="ddp")`` creates
no processes of its own; the gloo process group is initialised here with a file
rendezvous on loopback before ``fit``, and Lightning uses it.

Every run trains the same LightningModule (AdamW, two param groups, a per-step LR
scheduler) on the same data; the plain runs have no ZeRO service.  Weights, checkpoints
and messages go to ``<out>``; the test compares them.
"""

from __future__ import annotations

import json
import logging
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from sakura import SakuraRuntime
from sakura_adapters.lightning import LightningAdapter
from sakura_zero import ZeRO1, ZeRO2


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Linear(6, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 4)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        params = list(self.net.parameters())
        optimizer = torch.optim.AdamW(
            [{"params": params[:2], "lr": 0.02}, {"params": params[2:], "weight_decay": 0.1}],
            lr=0.01,
            weight_decay=0.05,
        )
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


def loader() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(32, 6, generator=g), torch.randn(32, 4, generator=g))
    return DataLoader(data, batch_size=4, shuffle=False)


def services(kind: str) -> list[Any]:
    if kind.startswith("zero1"):
        return [ZeRO1(overlap_mb=1e-4)]
    if kind.startswith("zero2"):
        return [ZeRO2(overlap_mb=1e-4)]
    return []


def fit(
    out: Path, name: str, *, clip: float | None, epochs: int = 2, resume: str | None = None
) -> None:
    kind = name.split("-")[0]
    module = Module()
    with SakuraRuntime(services(kind), strict=True) as rt:
        trainer = pl.Trainer(
            strategy="ddp",
            accelerator="cpu",
            devices=2,
            max_epochs=epochs,
            gradient_clip_val=clip,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            default_root_dir=str(out),
            callbacks=[LightningAdapter(rt)],
        )
        trainer.fit(module, loader(), ckpt_path=None if resume is None else str(out / resume))
        trainer.save_checkpoint(out / f"{name}.ckpt")
        if trainer.global_rank == 0:
            torch.save([p.detach() for p in module.parameters()], out / f"{name}.weights.pt")
        if rt.services:
            zero = rt.services[0]
            sharding = zero.shardings[0]
            info = {
                "steps": sharding.steps,
                "grad_mode": sharding.grad_mode,
                "same_optimizer": trainer.optimizers[0] is sharding.optimizer,
                "state_only_owned": all(
                    sharding.owner(p) == sharding.info.rank for p in sharding.optimizer.state
                ),
            }
            Path(out, f"{name}.rank{trainer.global_rank}.json").write_text(json.dumps(info))


def refused(out: Path, rank: int) -> None:
    """ZeRO2 with Lightning's own gradient clipping must fail loudly, not clip wrongly."""
    try:
        fit(out, "zero2-clip", clip=0.5)
        message = None
    except RuntimeError as exc:
        message = str(exc)
    Path(out, f"zero2-clip.rank{rank}.error.json").write_text(json.dumps(message))


def main() -> None:
    rank, world, init, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    logging.getLogger("sakura").setLevel(logging.CRITICAL)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        fit(out, "plain-clip", clip=0.5)
        fit(out, "zero1-clip", clip=0.5)
        fit(out, "plain", clip=None)
        fit(out, "zero2", clip=None)
        fit(out, "plain-resume", clip=0.5, epochs=3, resume="plain-clip.ckpt")
        fit(out, "zero1-resume", clip=0.5, epochs=3, resume="zero1-clip.ckpt")
        refused(out, rank)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
