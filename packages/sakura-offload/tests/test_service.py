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
from sakura.options import OptionError
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


class _Regressor(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": loss_of(self.net, (x, labels))}


def _hf_args(tmp_path: Path, **extra: Any) -> Any:
    from transformers import TrainingArguments

    options: dict[str, Any] = {
        "output_dir": str(tmp_path / "out"),
        "per_device_train_batch_size": 16,
        "num_train_epochs": 1,
        "learning_rate": HYPER["lr"],
        "weight_decay": HYPER["weight_decay"],
        "adam_beta1": 0.9,
        "adam_beta2": 0.99,
        "adam_epsilon": 1e-8,
        "optim": "adamw_torch",
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
        **extra,
    }
    return TrainingArguments(**options)


def _rows(n: int) -> list[dict[str, torch.Tensor]]:
    return [{"x": x[i], "labels": y[i]} for x, y in batches(n) for i in range(x.shape[0])]


def _inner_offload(optimizer: Any) -> OffloadAdamW:
    while not isinstance(optimizer, OffloadAdamW):
        optimizer = optimizer.optimizer
    return optimizer


def test_hf_sakura_trainer_fp16_survives_an_overflow_at_step_one(tmp_path: Path) -> None:
    # The first step's gradients overflow (a scale of 2**100) and the scaler skips it; the
    # next backward used to raise "backward pass 2 reached a parameter since the last
    # step()", as the Trainer zeroes gradients with model.zero_grad(), not the optimizer.
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from sakura_adapters.hf import SakuraTrainer
    from sakura_precision import MixedPrecision

    def run(offload: bool) -> tuple[_Regressor, Any, Any]:
        model = _Regressor()
        rt = SakuraRuntime(strict=True)
        scaler = rt.install(
            MixedPrecision("fp16", device="cpu", init_scale=2.0**100, backoff_factor=2.0**-90)
        )
        if offload:
            rt.install(OffloadAdamWService())
        trainer = SakuraTrainer(
            model=model, args=_hf_args(tmp_path), train_dataset=_rows(4), runtime=rt
        )
        trainer.train()
        return model, scaler, trainer

    reference, ref_scaler, _ = run(offload=False)  # the same loop with torch's AdamW
    model, scaler, trainer = run(offload=True)
    assert scaler.skipped_steps == ref_scaler.skipped_steps == 1
    optimizer = _inner_offload(trainer.optimizer)
    assert optimizer.state[model.net[0].weight]["step"].item() == 3  # 4 batches, 1 skipped
    assert max_diff(model.net, reference.net) <= 3e-7
    assert max_diff(model.net, mlp()) > 1e-3  # it trained


def test_hf_trainer_accumulation_is_read_from_the_trainer(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import Trainer

    from sakura_adapters.hf import SakuraTrainer

    args = _hf_args(tmp_path, gradient_accumulation_steps=2, max_grad_norm=0.05)
    reference = _Regressor()
    Trainer(model=reference, args=args, train_dataset=_rows(8)).train()
    model = _Regressor()
    rt = SakuraRuntime(strict=True)
    rt.install(OffloadAdamWService())  # gradient_accumulation_steps is not repeated
    trainer = SakuraTrainer(model=model, args=args, train_dataset=_rows(8), runtime=rt)
    trainer.train()
    optimizer = _inner_offload(trainer.optimizer)
    assert optimizer.accumulation_steps == 2
    assert optimizer.state[model.net[0].weight]["step"].item() == 4  # 8 batches
    assert max_diff(model.net, reference.net) <= 3e-7
    assert max_diff(model.net, mlp()) > 1e-3


def test_lightning_accumulation_is_read_from_the_trainer(tmp_path: Path) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from torch.utils.data import DataLoader, TensorDataset

    from sakura_adapters.lightning import LightningAdapter

    data = batches(8)
    dataset = TensorDataset(torch.cat([x for x, _ in data]), torch.cat([y for _, y in data]))

    class Module(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return loss_of(self.net, batch)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), **HYPER)  # type: ignore[arg-type]

    module = Module()
    reference = copy.deepcopy(module.net)
    with SakuraRuntime(strict=True) as rt:
        rt.install(OffloadAdamWService())  # accumulate_grad_batches is not repeated
        trainer = pl.Trainer(
            max_epochs=1,
            accumulate_grad_batches=2,
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
    assert isinstance(optimizer, OffloadAdamW) and optimizer.accumulation_steps == 2
    assert optimizer.state[next(module.parameters())]["step"].item() == 4
    ref_opt = torch.optim.AdamW(reference.parameters(), **HYPER)  # type: ignore[arg-type]
    for i in range(0, 8, 2):  # Lightning divides each micro-batch's loss by 2
        ref_opt.zero_grad()
        for batch in data[i : i + 2]:
            (loss_of(reference, batch) / 2).backward()
        ref_opt.step()
    assert max_diff(module.net, reference) <= 3e-7


def test_a_loop_that_says_nothing_gets_advice_for_the_service() -> None:
    from sakura.events import OnTrainBegin

    model = mlp()
    with SakuraRuntime(strict=True) as rt:
        rt.install(OffloadAdamWService())
        model, optimizer = rt.prepare(model, torch.optim.AdamW(model.parameters(), **HYPER))  # type: ignore[arg-type]
        loss_of(model, batches(1)[0]).backward()
        with pytest.raises(RuntimeError, match="accumulation_steps=1") as info:
            loss_of(model, batches(1)[0]).backward()
        # A service user never creates the optimizer: the advice is the service's.
        assert "create the optimizer" not in str(info.value)
        assert "OffloadAdamWService(accumulation_steps=" in str(info.value)
        assert "DDPAdapter.on_train_begin(..., accumulation_steps=N)" in str(info.value)
        optimizer.zero_grad()
        rt.emit(OnTrainBegin, optimizer=optimizer, accumulation_steps=2)  # a loop that says
        assert optimizer.accumulation_steps == 2
        loss_of(model, batches(1)[0]).backward()
        loss_of(model, batches(1)[0]).backward()
        optimizer.step()


def test_a_given_accumulation_that_contradicts_the_loop_is_an_error() -> None:
    from sakura.events import OnTrainBegin

    service = OffloadAdamWService(accumulation_steps=4)
    optimizer = service.wrap_optimizer(torch.optim.AdamW(mlp().parameters()))
    service.on_train_begin(OnTrainBegin(optimizer=optimizer, accumulation_steps=4))  # agrees
    with pytest.raises(OptionError, match=r"OffloadAdamWService: accumulation_steps=4 .*loop's 2"):
        service.on_train_begin(OnTrainBegin(optimizer=optimizer, accumulation_steps=2))
    assert optimizer.accumulation_steps == 4
