"""What each adapter publishes on ``OnTrainBegin.loop`` (a ``sakura.loop.LoopContext``), the
optimizer proxies each registers, and the HF modules' one-way imports."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from sakura import SakuraRuntime, Service
from sakura.loop import LoopContext
from sakura.options import OptionError
from sakura.proxies import registered_optimizer_proxies, unwrap_optimizer
from sakura_adapters.ddp import DDPAdapter


class LoopReader(Service):
    """Keeps the LoopContext and what its callables return at train begin, and reports
    metrics through it at the first epoch end (as AsyncEval does)."""

    name = "loop_reader"

    def __init__(self, report: dict[str, float] | None = None) -> None:
        self.loop: LoopContext | None = None
        self.trainer: Any = None
        self.checkpoint: dict[str, Any] | None = None
        self.wrapped: Any = None
        self.report = report

    def on_train_begin(self, event: Any) -> None:
        self.loop, self.trainer = event.loop, event.trainer
        assert self.loop is not None
        if self.loop.checkpoint_state is not None:
            self.checkpoint = self.loop.checkpoint_state()
        if self.loop.wrapped_model is not None:
            self.wrapped = self.loop.wrapped_model()

    def on_epoch_end(self, event: Any) -> None:
        loop = self.loop
        if self.report and loop is not None and loop.report_metrics is not None:
            loop.report_metrics(self.report, event.epoch, event.step)
            self.report = None


# --- raw loops ------------------------------------------------------------------------------


def test_ddp_adapter_publishes_output_dir_and_reporter(tmp_path: Path) -> None:
    seen: list[tuple[dict[str, Any], int, int]] = []
    reader = LoopReader(report={"val_loss": 0.5})
    model = nn.Linear(2, 1)
    with SakuraRuntime([reader], strict=True) as rt:
        adapter = DDPAdapter(
            rt,
            rank=0,
            world_size=1,
            output_dir=tmp_path / "run",
            report_metrics=lambda m, e, s: seen.append((dict(m), e, s)),
        )
        adapter.on_train_begin(model, None, None)  # the reference spelling
        adapter.on_epoch_begin(0)
        adapter.on_epoch_end(0, model)
    assert reader.loop is not None
    assert reader.loop.framework == "raw"
    assert reader.loop.output_dir == str(tmp_path / "run")
    assert reader.loop.checkpoint_state is None and reader.loop.wrapped_model is None
    assert seen == [({"val_loss": 0.5}, 0, 0)]


def test_ddp_adapter_without_options_offers_nothing_and_validates_them() -> None:
    reader = LoopReader()
    with SakuraRuntime([reader], strict=True) as rt:
        DDPAdapter(rt, rank=0, world_size=1).on_train_begin(nn.Linear(2, 1))
        with pytest.raises(OptionError, match=r"DDPAdapter: output_dir=3 is not accepted"):
            DDPAdapter(rt, output_dir=3)  # type: ignore[arg-type]
        with pytest.raises(OptionError, match=r"DDPAdapter: report_metrics='log' is not"):
            DDPAdapter(rt, report_metrics="log")  # type: ignore[arg-type]
    assert reader.loop == LoopContext(framework="raw")


# --- Lightning ------------------------------------------------------------------------------


def test_lightning_publishes_its_root_dir_checkpoint_and_loggers(tmp_path: Path) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from lightning.pytorch.loggers import CSVLogger

    from sakura_adapters.lightning import LightningAdapter

    class Module(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(3, 1)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8, 3, generator=g), torch.randn(8, 1, generator=g))
    reader = LoopReader(report={"async_val": 0.25})
    logger = CSVLogger(str(tmp_path / "logs"))
    with SakuraRuntime([reader], strict=True) as rt:
        trainer = pl.Trainer(
            max_epochs=1,
            logger=logger,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            default_root_dir=str(tmp_path / "root"),
            gradient_clip_val=0.5,
            accelerator="cpu",
            devices=1,
            callbacks=[LightningAdapter(rt)],
        )
        trainer.fit(Module(), DataLoader(data, batch_size=4))
    loop = reader.loop
    assert loop is not None and loop.framework == "lightning"
    assert loop.gradient_clipping == "Trainer(gradient_clip_val=0.5)"
    assert loop.output_dir == str(tmp_path / "root")
    assert loop.checkpoint_format == "lightning"
    # Lightning's own checkpoint dict, as Trainer.save_checkpoint writes it.
    assert reader.checkpoint is not None
    assert {"state_dict", "optimizer_states", "epoch", "global_step"} <= set(reader.checkpoint)
    assert set(reader.checkpoint["state_dict"]) == {"net.weight", "net.bias"}
    assert reader.wrapped is trainer.model
    assert float(trainer.callback_metrics["async_val"]) == 0.25
    assert float(trainer.logged_metrics["async_val"]) == 0.25
    logger.save()
    lines = Path(logger.log_dir, "metrics.csv").read_text().splitlines()
    assert (
        lines[0].split(",") == ["async_val", "step"] and lines[1] == "0.25,2"
    )  # step: 2 optimizer steps


# --- Hugging Face ---------------------------------------------------------------------------


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
        pred = self.net(x).squeeze(-1)
        return {"loss": F.mse_loss(pred, labels), "logits": pred}


def _hf_run(tmp_path: Path, sakura_trainer: bool) -> tuple[LoopReader, Any, list[Any]]:
    transformers = pytest.importorskip("transformers")
    from sakura_adapters.hf import HFAdapter, SakuraTrainer

    logged: list[Any] = []

    class LogSpy(transformers.TrainerCallback):  # type: ignore[misc]
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            logged.append(dict(logs or {}))

    g = torch.Generator().manual_seed(0)
    data = [
        {"x": torch.randn(4, generator=g), "labels": torch.randn((), generator=g)} for _ in range(8)
    ]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf-out"),
        per_device_train_batch_size=4,
        num_train_epochs=1,
        save_strategy="no",
        eval_strategy="no",
        logging_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    reader = LoopReader(report={"async_val": 0.75})
    rt = SakuraRuntime([reader], strict=True)
    cls = SakuraTrainer if sakura_trainer else transformers.Trainer
    trainer = cls(
        model=Regressor(), args=args, train_dataset=data, callbacks=[HFAdapter(rt), LogSpy()]
    )
    with rt:
        trainer.train()
    return reader, trainer, logged


@pytest.mark.parametrize("sakura_trainer", [False, True], ids=["stock", "SakuraTrainer"])
def test_hf_publishes_output_dir_and_reports_into_the_log_history(
    tmp_path: Path, sakura_trainer: bool
) -> None:
    reader, trainer, logged = _hf_run(tmp_path, sakura_trainer)
    loop = reader.loop
    assert loop is not None and loop.framework == "transformers"
    assert loop.output_dir == str(tmp_path / "hf-out")
    assert loop.checkpoint_state is None
    entry = {"async_val": 0.75, "epoch": 1.0, "step": 2}
    assert entry in trainer.state.log_history
    if sakura_trainer:  # the Trainer is known: report_to integrations get on_log too
        assert {"async_val": 0.75} in logged
        assert reader.wrapped is trainer.model_wrapped
    else:  # a callback on the stock Trainer only holds its state
        assert {"async_val": 0.75} not in logged
        assert loop.wrapped_model is None


# --- proxies and imports ----------------------------------------------------------------------


def test_framework_optimizer_proxies_are_registered_when_the_adapters_are_imported() -> None:
    pytest.importorskip("lightning.pytorch")
    pytest.importorskip("transformers")
    from accelerate.optimizer import AcceleratedOptimizer
    from lightning.pytorch.core.optimizer import LightningOptimizer

    import sakura_adapters.hf
    import sakura_adapters.lightning
    from sakura_adapters.hf.optimizer import _RuntimeStepOptimizer

    registered = registered_optimizer_proxies()
    assert {LightningOptimizer, AcceleratedOptimizer, _RuntimeStepOptimizer} <= set(registered)
    assert not hasattr(sakura_adapters.hf, "_RuntimeStepOptimizer")  # no private re-export
    sgd = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    rt = SakuraRuntime()
    proxy = AcceleratedOptimizer(_RuntimeStepOptimizer(sgd, rt), device_placement=False)
    assert unwrap_optimizer(proxy) is sgd
    assert unwrap_optimizer(LightningOptimizer(sgd)) is sgd


def _imported_modules(module: Any) -> set[str]:
    tree = ast.parse(inspect.getsource(module))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_hf_callback_does_not_import_the_trainer_module() -> None:
    """trainer.py imports callback.py (SakuraTrainer adds an HFAdapter); never the other way."""
    pytest.importorskip("transformers")
    from sakura_adapters.hf import callback, trainer

    assert "sakura_adapters.hf.callback" in _imported_modules(trainer)
    assert "sakura_adapters.hf.trainer" not in _imported_modules(callback)
