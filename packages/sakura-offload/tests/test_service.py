"""The offload_adamw service: a raw loop through SakuraRuntime, Lightning, the HF Trainer."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from _offload_models import batches, loss_of, max_diff, mlp

from sakura import SakuraRuntime
from sakura.errors import SpecError
from sakura_offload import OffloadAdamW, OffloadAdamWService

HYPER = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.05}


def test_raw_loop_through_the_runtime_matches_adamw() -> None:
    model = mlp()
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), **HYPER)  # type: ignore[arg-type]
    with SakuraRuntime(strict=True) as rt:
        service = rt.install("offload_adamw:float32,max_grad_norm=0.05")
        assert isinstance(service, OffloadAdamWService)
        model, optimizer = rt.prepare(model, torch.optim.AdamW(model.parameters(), **HYPER))  # type: ignore[arg-type]
        assert isinstance(optimizer, OffloadAdamW)
        assert optimizer.max_grad_norm == 0.05
        for batch in batches(10):
            optimizer.zero_grad()
            rt.backward(loss_of(model, batch))
            if not rt.optimizer_step(optimizer):
                optimizer.step()
            ref_opt.zero_grad()
            loss_of(reference, batch).backward()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
            ref_opt.step()
    assert max_diff(model, reference) <= 3e-7


def test_state_and_hyper_parameters_migrate() -> None:
    model = mlp()
    adamw = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.8, 0.95), weight_decay=0.1)
    for batch in batches(3):
        adamw.zero_grad()
        loss_of(model, batch).backward()
        adamw.step()
    moments = [adamw.state[p]["exp_avg"].clone() for p in model.parameters()]
    service = OffloadAdamWService("bf16")
    optimizer = service.wrap_optimizer(adamw)
    group = optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (3e-3, (0.8, 0.95), 0.1)
    for p, m in zip(model.parameters(), moments, strict=True):
        state = optimizer.state[p]
        assert state["exp_avg"].dtype == torch.bfloat16
        torch.testing.assert_close(state["exp_avg"].float(), m, rtol=1 / 128, atol=0)
        assert state["step"].item() == 3


def test_spec_options_are_validated() -> None:
    with pytest.raises(SpecError, match="moment_dtype='fp4'"):
        SakuraRuntime().install("offload_adamw:fp4")
    with pytest.raises(SpecError, match="accumulation_steps=0"):
        SakuraRuntime().install("offload_adamw:accumulation_steps=0")


def test_a_loop_that_keeps_its_own_optimizer_is_warned() -> None:
    from sakura.events import OnTrainBegin

    service = OffloadAdamWService()
    event = OnTrainBegin(rank=0, world_size=1, optimizer=torch.optim.AdamW(mlp().parameters()))
    with pytest.warns(RuntimeWarning, match="not an OffloadAdamW"):
        service.on_train_begin(event)


# --- Lightning ------------------------------------------------------------------------


def test_lightning_trainer_steps_offload_adamw(tmp_path: Path) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from torch.utils.data import DataLoader, TensorDataset

    from sakura_adapters.lightning import LightningAdapter

    data = batches(6)
    dataset = TensorDataset(torch.cat([x for x, _ in data]), torch.cat([y for _, y in data]))

    class Module(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return loss_of(self.net, batch)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), **HYPER)  # type: ignore[arg-type]
            return {
                "optimizer": opt,
                "lr_scheduler": {
                    "scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
                    "interval": "step",
                },
            }

    module = Module()
    reference = copy.deepcopy(module.net)
    with SakuraRuntime(strict=True) as rt:
        rt.install(OffloadAdamWService())
        trainer = pl.Trainer(
            max_epochs=1,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            default_root_dir=str(tmp_path),
            accelerator="cpu",
            devices=1,
            callbacks=[LightningAdapter(rt)],
        )
        trainer.fit(module, DataLoader(dataset, batch_size=16, shuffle=False))
    optimizer = trainer.optimizers[0]
    assert isinstance(optimizer, OffloadAdamW)
    assert optimizer.state[next(module.parameters())]["step"].item() == 6
    # the same run with torch's AdamW and the same schedule
    ref_opt = torch.optim.AdamW(reference.parameters(), **HYPER)  # type: ignore[arg-type]
    sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    for batch in data:
        ref_opt.zero_grad()
        loss_of(reference, batch).backward()
        ref_opt.step()
        sched.step()
    # the scheduler built on the loop's AdamW drove the OffloadAdamW that replaced it
    assert optimizer.param_groups[0]["lr"] == pytest.approx(HYPER["lr"] / 8)
    assert ref_opt.param_groups[0]["lr"] == pytest.approx(HYPER["lr"] / 8)
    assert max_diff(module.net, reference) <= 3e-7


# --- Hugging Face Trainer ---------------------------------------------------------------


def test_hf_sakura_trainer_steps_offload_adamw(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainingArguments

    from sakura_adapters.hf import SakuraTrainer

    class Regressor(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": loss_of(self.net, (x, labels))}

    data = batches(4)
    rows = [{"x": x[i], "labels": y[i]} for x, y in data for i in range(x.shape[0])]
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=16,
        num_train_epochs=1,
        learning_rate=HYPER["lr"],
        weight_decay=HYPER["weight_decay"],
        adam_beta1=0.9,
        adam_beta2=0.99,
        adam_epsilon=1e-8,
        lr_scheduler_type="linear",
        max_grad_norm=0.05,
        optim="adamw_torch",
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    # The reference: the stock Trainer with its own torch AdamW (same data order, the
    # same parameter groups without decay on biases, clipping, the linear schedule).
    reference = Regressor()
    Trainer(model=reference, args=args, train_dataset=rows).train()
    model = Regressor()
    rt = SakuraRuntime(strict=True)
    rt.install(OffloadAdamWService())
    trainer = SakuraTrainer(model=model, args=args, train_dataset=rows, runtime=rt)
    trainer.train()
    optimizer = trainer.optimizer
    while not isinstance(optimizer, OffloadAdamW):
        optimizer = optimizer.optimizer
    assert optimizer.state[model.net[0].weight]["step"].item() == 4
    assert len(optimizer.param_groups) == 2  # HF's decay / no-decay groups migrated
    assert max_diff(model.net, reference.net) <= 3e-7
    assert max_diff(model.net, mlp()) > 1e-3  # it trained
